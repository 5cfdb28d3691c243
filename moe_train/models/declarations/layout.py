"""What shapes one rank's activations (micro-batch, sequence, precision, the layer's sharding): the layout the
saved-tensor declarations are functions of (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from moe_train.kernels import kernels_for


@dataclass(frozen=True)
class ActivationLayout:
    """What shapes one rank's activations: micro-batch, sequence, precision and the sharding of the layer.

    `tokens` is micro_batch * seq_length / cp: the tokens of one micro-batch on this rank.
    """

    micro_batch: int
    seq_length: int
    act_bytes: int = 2
    tp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    ep: int = 1
    etp: int = 1
    moe_imbalance: float = 1.0
    ep_nodes: int = 1  # nodes the ep group spans under the hierarchical dispatcher (`PlanLayout.ep_split`)
    position_batch: int = 1  # rows of position ids: 1 unless documents restart (data.reset_at_eod)
    loss_chunk_tokens: int = 0  # the chunked head + loss (config/loss_chunks.py); 0: unchunked
    documents: bool = False  # data.reset_at_eod: attention restarts at each document (a mask every layer shares)
    device: str = "cpu"  # launch.device: the kernel table's row (MLA's value padding, the document mask's form)
    fp8_kept: str | None = None  # train.fp8.saved_inputs fp8: the recipe whose fp8 inputs the fp8 GEMMs keep
    fp8_modules: tuple[str, ...] = ()  # train.fp8.modules: the GEMM kinds in fp8
    fp8_gemms: tuple[str, ...] = ()  # the GEMM kinds in fp8 whatever they keep (train.fp8.modules under fp8)

    def kept_fp8(self, kind: str) -> str | None:
        """The recipe in which GEMMs of `kind` (train.fp8.modules' names) keep their input, None: as it came."""
        return self.fp8_kept if kind in self.fp8_modules else None

    @property
    def gathers_shards(self) -> bool:
        """Column-parallel GEMMs keep their sequence shard (in bf16) and gather it again in backward."""
        return self.sequence_parallel and self.tp > 1

    @property
    def mla_value_padded(self) -> bool:
        """Whether MLA zero-pads v (or q and k) to one head width: where the device's SDPA kernel needs one."""
        return kernels_for(self.device).mla_value == "padded"

    @property
    def tokens(self) -> float:
        return self.micro_batch * self.seq_length / self.cp

    @property
    def seq_tokens(self) -> float:
        """Tokens a rank holds in the sequence region (norms, residual stream): sharded only under SP."""
        return self.tokens / self.tp if self.sequence_parallel else self.tokens

    @property
    def moe_tokens(self) -> float:
        """Tokens a rank routes: its sequence shard (Megatron-Core requires SP for MoE with tp > 1; without SP
        the tp ranks split the tokens before dispatch)."""
        return self.tokens / self.tp
