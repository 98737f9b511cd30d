"""rankscope: find what slows down or breaks a large distributed training job, and where.

Modelled on the observability side of MegaScale (NSDI 2024): an in-process agent times the
critical segments and records every collective on every rank, a collector stores the streams in
ClickHouse (embedded chDB or a server) and diagnoses stragglers, hangs, crashes and faults, and a
Streamlit dashboard shows them. The parts live in the top-level folders of the repository and
are installed as ``rankscope.<folder>`` (see ``setup.py`` for the mapping).
"""

__version__ = "0.1.0"
