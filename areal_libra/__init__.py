"""areal_libra: Libra's resource management (planner, C-MLFQ, elastic hybrid pool) on AReaL 1.0.4."""

__version__ = "0.1.0"
