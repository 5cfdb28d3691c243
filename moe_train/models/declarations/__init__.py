"""Each module of the models described once, in plain torch-free data, beside the module it describes.

For every module kind (the pre-norms, GQA attention with its sinks and windows, MLA, the dense MLP, the router,
the routed experts with their dispatch, the shared experts, embedding / final norm / head, the MTP module's own
parts) a file here declares, as functions of the model section (and, for what a layout changes, of an
`ActivationLayout`):
- its parameters (`Param`: shape in config terms and tensor-parallel placement),
- its weight GEMMs (`Gemm`: [in -> out] per token, the FLOPs region each belongs to) and attention's
  activation products (`CoreAttention`),
- the storages its forward saves for backward (`Saved`, named and tagged with the region a recompute or
  offload policy names).
`layer.py` assembles a decoder layer from them. plan/ (params, flop_count, saved_tensors) computes from these
declarations instead of restating the modules; nothing here imports torch (the login half imports it).
"""
