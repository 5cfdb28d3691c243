"""FP8 training (`train.precision: fp8`): the recipes' scaling (scaling.py), the fp8 half of the GEMM site
(gemm.py), which GEMMs run in it (select.py), and the start-up check of the torchao/torch pair (runtime.py)."""
