"""A simulated 3D-parallel training job of thousands of ranks, sent through the agent's real Transport.

MegaScale ran 12,288 GPUs; one machine cannot run that many trainers, so ``rankscope simulate``
plays them: a few spawned worker processes (``worker``), each owning a contiguous slice of whole
hosts and ONE ``agent.transport.Transport`` that sends for all of its ranks (``submit(payload,
rank=r)``), against a real collector. Every simulated rank registers like an agent (host
``node-{rank//8}``, coordinates and groups from the trainer's own ``Layout``), then follows the
steps in real time: the live diagnosis works on wall-clock time (hang-after, silence).

What is simulated (``model``): per-stage forward/backward compute with noise, the 1F1B pipeline
with point-to-point transfers, tensor-parallel all-reduces after every chunk (the straggler
arrives last and its peers wait), the data-parallel gradient all-reduce (the replicas wait for the
slowest), the optimizer; per-group sequence numbers identical on every member, per-(group, sender,
receiver) sequence numbers for point-to-point. Faults use the trainer's grammar: a straggler's
compute is stretched; a hang or crash stops its rank before its next operation and ``hang``
plays the step through until nothing can move, so every other rank ends up waiting where a real
job would (tp peers in the all-reduce, pipeline neighbours in receives, other replicas in the dp
all-reduce).

How much is sent (``rows``, ``plan``). A collector pays about a millisecond of CPU per batch
whatever its size, and a batch carries one rank (the wire contract's envelope), so at scale the
limit is batches per second, not rows:

- every step, per rank: one summary span per segment (data, forward, backward, grad_sync,
  optimizer; microbatch -1, the totals that ``step_segments`` rolls up and the straggler detector
  compares) and two collective records (the step's first tp all-reduce and its dp all-reduce, with
  their real sequence numbers and arrival times): about 6 rows;
- every ``sample_every``-th step (and the first), the full timeline instead: every microbatch's
  spans, the pipeline waits, every tp all-reduce, every send and receive: about 80 rows per rank
  (8 microbatches);
- the step scalars (loss, grad_norm, step_time_s, tokens_per_s) from one rank per replica;
- a heartbeat per rank every ``heartbeat_s``, plus one at once from a rank without progress for
  ``report_after_s`` (its in-flight operations, so a hang's wait graph reaches the collector in
  seconds whatever the heartbeat interval); earliest blocked first (the root's replica, whose
  chain leads to the root) and no faster than the collector acknowledges, so that thousands of
  them never queue up in front of the periodic heartbeats.

A rank's recorded steps travel together every ``flush_s`` (one span batch, one collective batch),
and flushes are postponed while the collector is behind (fewer, larger batches). The intervals
come from a budget of batches per second (``--batches-per-s``): at 12,288 ranks and 300 batches/s
a rank beats every 82 s and flushes every 164 s; with 2-second steps that is about 85,000 rows/s
(6 rows per rank-step, 80 every tenth step), far below what one collector can insert, while the
batches stay within what it can acknowledge.
"""
