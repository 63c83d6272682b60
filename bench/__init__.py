"""fedagent's benchmark suite; the entry command is ``bench/run.py``."""
