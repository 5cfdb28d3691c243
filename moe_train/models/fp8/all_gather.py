"""FSDP2's fp8 all-gather (`train.fp8.fp8_all_gather`, recipe tensorwise): the fp8-marked Linear weights travel
in fp8, one byte per element and one fp32 scale, instead of bf16, and their GEMMs use the gathered fp8 data
and scale as they are (gemm.py), without quantising the weight again.

Two tensor subclasses, through FSDP2's all-gather extension (`fsdp_pre_all_gather` / `fsdp_post_all_gather`,
torch/distributed/fsdp/_fully_shard/_fsdp_param.py), as torchao's WeightWithDynamicFloat8CastTensor does:
- `Fp8ShardedWeight` wraps a rank's fp32 master shard (the optimizer's parameter, what checkpoints hold:
  `state_dict` sees the plain shard, `wrap_fp8_weights`' hook). Before each gather it casts the shard to the
  parameter dtype (bf16) as FSDP2 would, takes the WHOLE weight's amax (the shard's, all-reduced with max over
  the shard group: one fp32 all-reduce per weight and gather) and quantises the shard with that scale. So the
  gathered fp8 weight is elementwise the quantisation of the gathered bf16 weight, and a run with the fp8
  gather equals the run without it bit for bit. torchao's own subclass is not used: it quantises the fp32
  master shard directly (one rounding fewer than the bf16 gather), which differs, and it is tied to its
  Float8Linear module, which the tensor-parallel styles would bypass (select.py).
- `Fp8GatheredWeight` is the unsharded parameter FSDP2 builds from the gathered bytes: fp8 data and the
  scale, presenting the parameter dtype to autograd (its gradient is an ordinary bf16 tensor, reduced as
  before). Views keep the fp8 data; any other op sees the dequantised weight.

Under tensor parallelism the shard is the local tensor of the weight's DTensor and the amax is the tensor-
parallel shard's (what its GEMM quantises without the fp8 gather); under HSDP the shard group is the shard
dimension (the replicas hold the same shard). The routed experts' grouped weights stay bf16 in the gather:
their GEMMs are emulated and scale each expert's matrix on its own. A tied head (the embedding's weight)
stays bf16 too: the lookup reads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor

from moe_train.models.fp8.scaling import Quantised, block_amax, quantise

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

_aten = torch.ops.aten
# What FSDP2 does to a sharded parameter (pad, cut, copy in, view, move) keeps the subclass; the rest (the
# optimizer's arithmetic, norms, DTensor's collectives) runs on the plain shard.
_SHARD_PRESERVING = {
    _aten.empty_like.default, _aten.new_zeros.default, _aten.new_empty.default, _aten.slice.Tensor,
    _aten.copy_.default, _aten.view.default, _aten.as_strided.default, _aten._to_copy.default,
    _aten._pin_memory.default, _aten.split.Tensor, _aten.clone.default, _aten.alias.default,
}
_GATHERED_VIEWS = {_aten.detach.default, _aten.as_strided.default, _aten.view.default, _aten._unsafe_view.default,
                   _aten.alias.default}


class Fp8ShardedWeight(torch.Tensor):
    """A rank's shard of an fp8-marked Linear weight (fp32), which FSDP2 gathers in fp8 (module docstring)."""

    _tensor: torch.Tensor

    @staticmethod
    def __new__(cls, tensor: torch.Tensor) -> Fp8ShardedWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
            layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def __repr__(self) -> str:
        return f"Fp8ShardedWeight({self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is _aten.detach.default:
            return cls(args[0]._tensor)
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _SHARD_PRESERVING:
            return out
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride) -> Fp8ShardedWeight:
        return Fp8ShardedWeight(inner["_tensor"])

    def fsdp_pre_all_gather(self, mesh: DeviceMesh, outer_size: torch.Size, outer_stride: tuple[int, ...],
                            module: nn.Module, mp_policy: MixedPrecisionPolicy):
        """The shard in fp8 with the whole weight's scale, padded to FSDP2's chunk (ceil(rows / shards) rows)."""
        shard = self._tensor.to(mp_policy.param_dtype or self._tensor.dtype)
        rows = -(-outer_size[0] // mesh.size())
        shard = F.pad(shard, (0, 0, 0, rows - shard.shape[0]))  # zeros: they move neither the amax nor the sum
        amax = block_amax(shard, *shard.shape)
        if mesh.size() > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
        quantised = quantise(shard, recipe="tensorwise", role="weight", amax=amax)
        return (quantised.data,), (quantised.scale,)

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *,
                             out: torch.Tensor | None = None):
        (data,), (scale,) = outputs, metadata
        if out is not None:  # FSDP2 refilled the data in place: only the scale is new
            (out._local_tensor if isinstance(out, DTensor) else out)._scale = scale
            return None
        return Fp8GatheredWeight(data, scale, param_dtype), (data,)


class Fp8GatheredWeight(torch.Tensor):
    """The gathered weight: fp8 `_data` [out, in] and its tensorwise `_scale` [1, 1] (dequantised: data /
    scale), seen by autograd as a tensor of the parameter dtype."""

    _data: torch.Tensor
    _scale: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> Fp8GatheredWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=dtype,
            layout=data.layout, device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self._data, self._scale = data, scale

    def __repr__(self) -> str:
        return f"Fp8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype})"

    def quantised(self, *, transposed: bool) -> Quantised:
        """The weight [out, in] (or its transpose, for the input gradient) as the GEMM's fp8 operand."""
        data = self._data.t().contiguous() if transposed else self._data
        return Quantised(data=data, scale=self._scale.reshape(1, 1), block_rows=data.shape[0],
                         block_cols=data.shape[1])

    def dequantised(self) -> torch.Tensor:
        return (self._data.to(torch.float32) / self._scale).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _GATHERED_VIEWS:
            weight = args[0]
            return cls(func(weight._data, *args[1:], **(kwargs or {})), weight._scale, weight.dtype)
        args, kwargs = pytree.tree_map_only(cls, cls.dequantised, (args, kwargs or {}))
        return func(*args, **kwargs)

    def __tensor_flatten__(self):
        return ["_data", "_scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride) -> Fp8GatheredWeight:
        return Fp8GatheredWeight(inner["_data"], inner["_scale"], dtype)


def gathered_in_fp8(weight: torch.Tensor) -> bool:
    """Whether FSDP2 gathers this parameter in fp8 (its local shard is an Fp8ShardedWeight)."""
    return isinstance(weight._local_tensor if isinstance(weight, DTensor) else weight, Fp8ShardedWeight)


def _plain_shard(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """state_dict hook: the fp32 master shard itself (the same storage), never the subclass, so checkpoints,
    exports and loads see what a bf16 run's do."""
    key = prefix + "weight"
    value = state_dict.get(key)
    if isinstance(value, DTensor) and isinstance(value._local_tensor, Fp8ShardedWeight):
        state_dict[key] = DTensor.from_local(value._local_tensor._tensor, value.device_mesh, value.placements,
                                             run_check=False, shape=value.shape, stride=value.stride())
    elif isinstance(value, Fp8ShardedWeight):
        state_dict[key] = value._tensor


@torch.no_grad()
def wrap_fp8_weights(model: nn.Module) -> int:
    """Before fully_shard: make every fp8-marked Linear's weight an Fp8ShardedWeight (a DTensor's local tensor
    under tensor parallelism), except a weight another module shares (the tied head); returns how many."""
    from moe_train.models.linear import Linear

    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    count = 0
    for module in model.modules():
        if not isinstance(module, Linear) or module.fp8 is None or uses[id(module.weight)] > 1:
            continue
        weight = module.weight
        if isinstance(weight, DTensor):
            local = DTensor.from_local(Fp8ShardedWeight(weight.to_local().detach()), weight.device_mesh,
                                       weight.placements, run_check=False, shape=weight.shape,
                                       stride=weight.stride())
        else:
            local = Fp8ShardedWeight(weight.detach())
        module.weight = nn.Parameter(local, requires_grad=weight.requires_grad)
        module.register_state_dict_post_hook(_plain_shard)
        count += 1
    return count
