"""The moe-train command line (installed as moe_train.cli): one module per command."""
