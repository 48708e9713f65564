"""Checkpoints: what one is on disk (layout), writing one (write, with the RNG states of rng and the
disk errors of disk), reading and verifying (read, and whether it fits a run: resume), sharded files
(shards) and when to save and what to keep (policy). Which checkpoint a run resumes from is
training's decision (training/resume.py)."""
