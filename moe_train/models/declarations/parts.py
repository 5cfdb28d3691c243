"""The plain data a module declaration is made of: parameters, weight GEMMs, attention's products (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

# Tensor-parallel placements of a parameter (parallel/tensor.py's plan, parallel/expert.py's expert shards):
# column: dim 0 cut over tp (a column-parallel Linear, or a vector sharded with its rows: biases, sinks);
# row: dim 1 cut over tp (a row-parallel Linear);
# sequence: whole on every tp rank, read on the sequence region: its gradient is partial under sequence
#   parallelism (pre-norms, MLA's latent projections and norms, a row-parallel bias added after the reduce);
# replicated: whole on every tp rank, read on a tp rank's own share whatever SP: partial whenever tp > 1
#   (QK-norm weights, the router);
# expert: a routed-expert stack [E, ...]: dim 0 over ep, `etp_dim` over etp.
PLACEMENTS = ("column", "row", "sequence", "replicated", "expert")


@dataclass(frozen=True)
class Param:
    """One parameter tensor of a module, unsharded. `fp8`: the `train.fp8.modules` kind of the Linear it is the
    weight of ("" for the rest). `active`: the elements one token passes through (a routed-expert stack: top_k
    experts' worth), None: all of them."""

    name: str
    shape: tuple[int, ...]
    placement: str
    fp8: str = ""
    etp_dim: int | None = None
    active: int | None = None

    @property
    def numel(self) -> int:
        out = 1
        for size in self.shape:
            out *= size
        return out

    def count(self, *, active: bool) -> int:
        return self.active if active and self.active is not None else self.numel


@dataclass(frozen=True)
class Gemm:
    """One weight GEMM of a module: a [tokens, inp] input times an [inp, out] weight, `tokens` times per token
    (top_k for the routed experts), over `stack` weight matrices (a routed-expert stack's experts; 1 for a
    Linear). `region`: the part of the module's FLOPs a recompute policy names (MLA's `mla_up_proj`,
    `mla_down_proj`), or the module's own name."""

    name: str
    out: int
    inp: int
    region: str
    tokens: int = 1
    stack: int = 1

    @property
    def weights(self) -> int:
        """Weights one token multiplies (multiply-adds per token)."""
        return self.out * self.inp * self.tokens

    @property
    def matrices(self) -> int:
        """Weights the GEMM holds (every expert of a stack)."""
        return self.out * self.inp * self.stack


CORE_REGION = "core_attn"  # the region attention's products (and SDPA's saves) count under


@dataclass(frozen=True)
class CoreAttention:
    """Attention's products of activations, QK^T and AV: `heads` query heads of `qk_dim` and `v_dim` and
    `key_heads` key/value heads (what context parallelism exchanges), over the sequence's keys (gpt-oss's sinks
    join the softmax's normaliser through its log-sum-exp, no key). `padded_dim`: the one head width the device's
    fused kernel runs both at where it needs one (MLA on the CPU row of the kernel table). `rerun_by`: the
    recompute regions that run it again."""

    heads: int
    key_heads: int
    qk_dim: int
    v_dim: int
    rerun_by: tuple[str, ...] = (CORE_REGION,)

    @property
    def padded_dim(self) -> int:
        return max(self.qk_dim, self.v_dim)


@dataclass(frozen=True)
class RegionEntry:
    """Where tensor parallelism enters a module's column-parallel region (parallel/tensor.py): an input of `width`
    features per token that `gemms` column-parallel GEMMs read (under SP each keeps the sequence shard and gathers
    it again in backward); `rerun_by`: the recompute region that runs the entry again, "" where none does. Each
    such module leaves its region through one row-parallel GEMM of the hidden size."""

    width: int
    gemms: int
    rerun_by: str = ""


@dataclass(frozen=True)
class Module:
    """One module kind's declaration: `name` is the region its FLOPs count under; `tp_entries`: its
    tensor-parallel regions' entries (none: the module runs whole on every tp rank or on its own share)."""

    name: str
    params: tuple[Param, ...]
    gemms: tuple[Gemm, ...] = ()
    core: CoreAttention | None = None
    tp_entries: tuple[RegionEntry, ...] = ()


def linear(name: str, out: int, inp: int, placement: str, *, region: str, fp8: str = "",
           bias: str | None = None) -> tuple[tuple[Param, ...], Gemm]:
    """A Linear's weight [out, inp] (and its bias [out], placed as `bias` says) with its GEMM."""
    params = [Param(f"{name}.weight", (out, inp), placement, fp8)]
    if bias is not None:
        params.append(Param(f"{name}.bias", (out,), bias))
    return tuple(params), Gemm(name, out, inp, region)
