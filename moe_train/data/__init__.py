"""Megatron-format indexed datasets, sampling, blending, tokenizers and prepare."""
