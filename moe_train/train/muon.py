"""Muon: orthogonalised momentum for the hidden matrices, AdamW for everything else, in one optimizer per chunk.

Muon (Keller Jordan, 2024; Moonlight, Kimi K2) keeps one momentum buffer per matrix and applies, instead of the
momentum itself, the nearest semi-orthogonal matrix to it (U V^T of its SVD, approximated by a few Newton-Schulz
iterations): every singular direction of the update gets the same step. It serves 2-D hidden matrices: the
attention projections, the dense MLP, the shared experts, and each routed expert's own [out, in] matrices (the
expert stacks are [E, out, in]: orthogonalised expert by expert). Embeddings, the head, norms, biases, the router
and MTP's projection (`train.muon.exclude`, module names) train with AdamW, as every Muon recipe does.

Both kinds live in one torch.optim.Optimizer (param groups tagged `muon`), so the trainer keeps one optimizer per
model chunk and DCP's get_state_dict/set_state_dict store and reshard its state by parameter name: Muon
parameters hold `momentum_buffer`, AdamW parameters `step`, `exp_avg`, `exp_avg_sq`.

Distributed: a matrix sharded over FSDP2's dp (or edp), tp or etp is orthogonalised whole, so every layout
computes what one process computes. Each rank gathers the matrices it holds shards of (DTensor redistribute to
Replicate over every mesh dimension but ep), runs Newton-Schulz on them and keeps its own shard of the result.
Expert stacks stay sharded over ep (dim 0, whole experts): each rank orthogonalises only its own experts. This is
the "gather every matrix" design, chosen over giving each matrix to one rank of the group (Megatron-Core's
layer-wise distributed optimizer) because it needs no ownership table and no second collective, and is exactly
the single process's arithmetic; its price is that each rank of a dp group repeats the Newton-Schulz products of
every matrix it holds a shard of (plan/ and measure count both: docs/optimizer.md).

torch 2.13 ships torch.optim.Muon; it is not used: it takes 2-D plain tensors only (no expert stacks, no DTensor
gathering), always iterates in bf16 (fp32 layouts could not match to 1e-5), and is a second optimizer beside
AdamW rather than one per chunk.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.optim.adamw import adamw

from moe_train.config.schema import TrainConfig

# Newton-Schulz quintic coefficients (a, b, c) of X <- a X + b (X X^T) X + c (X X^T)^2 X, from Keller Jordan's
# Muon (github.com/KellerJordan/Muon, muon.py zeropower_via_newtonschulz5; the same in torch.optim.Muon and
# Moonlight): chosen to maximise the slope at zero, so 5 steps bring every singular value of a Frobenius-normalised
# matrix into roughly [0.7, 1.2] rather than exactly to 1 (which costs more steps and does not train better).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7  # added to the Frobenius norm: a zero momentum stays zero


def newton_schulz(matrix: torch.Tensor, *, steps: int) -> torch.Tensor:
    """An approximation of U V^T for matrix = U S V^T, over the last two dimensions (a leading dimension:
    experts, each orthogonalised alone); computed in fp32.

    Orientation rule (written here once): the iteration runs on the wide orientation (rows <= cols; a tall matrix
    is transposed in and out), so the Gram matrix X X^T is the small min(m, n)^2 one: 2 products of m^2 n and one
    of m^3 per step, m = min, n = max (plan/muon_cost.py `newton_schulz_flops`, what plan and measure count)."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.float()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + NS_EPS)  # spectral norm <= Frobenius norm = 1
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x.mT if tall else x


def update_scale(rows: int, cols: int, *, adjust_lr: bool) -> float:
    """The factor on lr of an orthogonalised [rows, cols] update. adjust_lr: 0.2 * sqrt(max(rows, cols))
    (Moonlight, "Muon is Scalable for LLM Training" sec. 2.2): an orthogonal update's RMS is 1/sqrt(max), AdamW's
    is about 0.2, so AdamW's learning rate and weight decay carry over. Otherwise Keller Jordan's
    sqrt(max(1, rows / cols))."""
    if adjust_lr:
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


def excluded(name: str, exclude: tuple[str, ...]) -> bool:
    """Whether parameter `name` belongs to a module `exclude` names (any component of its dotted path)."""
    return any(part in exclude for part in name.split(".")[:-1])


def is_vector(name: str, param: torch.Tensor) -> bool:
    """Norms, biases and the routed experts' bias stacks ([E, width], `<stack>_bias`: one vector an expert, gpt-oss):
    never orthogonalised nor decayed, whatever their number of dimensions."""
    return param.ndim < 2 or name.endswith("_bias")


def muon_param_groups(model: nn.Module, *, train: TrainConfig) -> list[dict]:
    """Three groups: Muon (matrices of >= 2 dimensions outside `exclude`), AdamW decayed (the excluded matrices)
    and AdamW undecayed (`is_vector`: norms, biases), as optimizer.param_groups splits them for AdamW alone."""
    muon, decay, no_decay = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if is_vector(name, param):
            no_decay.append(param)
        elif excluded(name, train.muon.exclude):
            decay.append(param)
        else:
            muon.append(param)
    muon_decay = train.weight_decay if train.muon.weight_decay is None else train.muon.weight_decay
    return [
        {"params": muon, "muon": True, "weight_decay": muon_decay},
        {"params": decay, "muon": False, "weight_decay": train.weight_decay},
        {"params": no_decay, "muon": False, "weight_decay": 0.0},
    ]


def _gathered_placements(tensor: DTensor) -> list:
    """Replicate over every mesh dimension but ep: whole matrices, with ep's whole experts left where they are."""
    return [
        placement if name == "ep" else Replicate()
        for name, placement in zip(tensor.device_mesh.mesh_dim_names, tensor.placements, strict=True)
    ]


def orthogonalised(update: torch.Tensor, *, steps: int) -> torch.Tensor:
    """Newton-Schulz of each whole matrix `update` holds a shard of, returned in `update`'s own sharding (the
    gathers: one redistribute per matrix; the way back is a local slice)."""
    if not isinstance(update, DTensor):
        return newton_schulz(update, steps=steps)
    mesh, placements = update.device_mesh, _gathered_placements(update)
    whole = update.redistribute(mesh, placements).to_local()
    result = DTensor.from_local(newton_schulz(whole, steps=steps), mesh, placements, run_check=False)
    return result.redistribute(mesh, update.placements)


class Muon(torch.optim.Optimizer):
    """Muon for the groups tagged `muon`, AdamW (fused, the recipe's betas and eps) for the others."""

    def __init__(self, groups: list[dict], *, train: TrainConfig) -> None:
        cfg = train.muon
        super().__init__(
            groups,
            dict(
                lr=train.lr,
                betas=(train.adam_beta1, train.adam_beta2),
                eps=train.adam_eps,
                momentum=cfg.momentum,
                nesterov=cfg.nesterov,
                ns_steps=cfg.ns_steps,
                adjust_lr=cfg.adjust_lr,
            ),
        )
        self.moment_dtype = torch.bfloat16 if train.adam_moment_dtype == "bf16" else torch.float32

    def _moment(self, state: dict, key: str, like: torch.Tensor) -> torch.Tensor:
        """state[key] in the moment dtype (created as zeros; load_state_dict casts state to the parameter's
        dtype, and bf16 values held in fp32 round back exactly)."""
        if key not in state:
            state[key] = torch.zeros_like(like, dtype=self.moment_dtype)
        elif state[key].dtype != self.moment_dtype:
            state[key] = state[key].to(self.moment_dtype)
        return state[key]

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("Muon takes no closure")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"]:
                self._muon_step(group, params)
            else:
                self._adamw_step(group, params)
        return None

    def _muon_step(self, group: dict, params: list[torch.Tensor]) -> None:
        lr, mu = group["lr"], group["momentum"]
        for param in params:
            state = self.state[param]
            stored = self._moment(state, "momentum_buffer", param)
            grad = param.grad.float()
            buffer = stored.float().mul_(mu).add_(grad)  # a copy in fp32 (bf16 storage), the tensor itself in fp32
            stored.copy_(buffer)
            update = grad.add(buffer, alpha=mu) if group["nesterov"] else buffer
            rows, cols = param.shape[-2:]
            scale = update_scale(rows, cols, adjust_lr=group["adjust_lr"])
            param.mul_(1.0 - lr * group["weight_decay"])  # decoupled: the decay does not pass through the momentum
            param.add_(orthogonalised(update, steps=group["ns_steps"]), alpha=-lr * scale)

    def _adamw_step(self, group: dict, params: list[torch.Tensor]) -> None:
        """torch's fused AdamW over the group, on fp32 copies of bf16-stored moments (optimizer.py's)."""
        if not params:
            return
        beta1, beta2 = group["betas"]
        states = [self.state[p] for p in params]
        for param, state in zip(params, states, strict=True):
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
        stored = [
            (self._moment(s, "exp_avg", p), self._moment(s, "exp_avg_sq", p))
            for p, s in zip(params, states, strict=True)
        ]
        exp_avgs = [m.float() for m, _ in stored]
        exp_avg_sqs = [v.float() for _, v in stored]
        adamw(
            params,
            [p.grad for p in params],
            exp_avgs,
            exp_avg_sqs,
            [],
            [s["step"] for s in states],
            fused=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
        if self.moment_dtype != torch.float32:
            for (m, v), m32, v32 in zip(stored, exp_avgs, exp_avg_sqs, strict=True):
                m.copy_(m32)
                v.copy_(v32)
