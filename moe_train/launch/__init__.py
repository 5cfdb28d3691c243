"""Torchrun and SLURM rendering, run directories, submit and sweep expansion (no torch at import)."""
