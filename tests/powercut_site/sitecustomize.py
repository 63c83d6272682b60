"""Started with ``powercut.child_env()``: record what a power cut would leave, before the
process touches its state (see tests/powercut.py)."""

import powercut

powercut.installed_from_env()
