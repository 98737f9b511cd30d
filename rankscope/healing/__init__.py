"""Self-healing runs: from an incident to a restarted job without the faulty host.

``selfcheck`` tests a host against its peers (``probes`` run on the host, ``verdict`` judges its
figures); ``record`` stores what was checked, decided and done; ``policy`` says which incidents
evict a host; ``driver`` watches a running job's incidents and acts (``rankscope launch``).
"""
