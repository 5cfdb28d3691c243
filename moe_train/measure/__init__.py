"""`moe-train measure`: what one training step of one rank actually does, counted while it runs.

FLOPs by phase (flops.py), activation bytes per layer (activations.py), communication bytes per
`<group>/<op>` (comm.py), parameter, gradient, optimizer and peak bytes (memory.py), for the step in step.py,
run by driver.py in this process, on every rank of a torchrun job (rank.py), or on fake tensors and a fake
process group at full size (fake.py). docs/measure.md explains every figure.
"""
