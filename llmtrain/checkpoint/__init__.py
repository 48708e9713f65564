"""Checkpoints: the on-disk format, when to save, sharded files, and which one a run resumes from."""
