"""The trainer loop, optimizer and LR schedules, metrics and preemption."""
