"""Crash-safe files: atomic writes, model checkpoints, the round journal, model export."""
