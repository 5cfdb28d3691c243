"""`moe-train report`: pictures and a short summary of what a run's metrics.jsonl holds.

Torch-free, so it runs on a login node or a laptop beside a copy of the run folder. Reading and summarising
(`history`, `summary`) need only the standard library; the plots (`curves`, `expert_load`, `write`) need
matplotlib (the `report` extra), imported by the command only when it draws.
"""
