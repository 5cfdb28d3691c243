"""The analytic model: parameters, FLOPs, memory, communication, time (no torch)."""
