"""Models: norms, rope, attention (GQA + QK-norm, MLA), MLP, MoE, decoder and MTP; one builder per family."""
