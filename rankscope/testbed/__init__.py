"""Real hosts on one machine, and faults applied to them from outside the job.

``hosts`` makes simulated hosts (network namespaces on a switch, each with its own address, host
name and cgroups), ``job`` runs one torchrun agent per host, ``faults`` throttles, freezes, kills
and slows them from outside the training processes, ``relay`` delays a host's link, and
``scenarios`` scores the diagnosis on each fault. ``rankscope testbed`` is the command line.
"""
