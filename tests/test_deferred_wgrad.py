"""The routed experts' delayed weight gradients (`parallel.split_wgrad`, models/moe/deferred_wgrad.py) in one
process: the experts' backward with the queue gives the input gradients at once and no weight gradient until the
queue runs, and then every gradient of the plain backward, bit for bit, on each of the experts' three kernels
(grouped GEMM, the per-expert loop, the padded batched GEMM; the first two in fp8 rowwise too, keeping
their inputs in bf16 or in fp8) and through the weights' autograd paths (a stacked
parameter viewed per expert). A queue its backward never ran raises. The multi-rank equality and the order
(the queue runs inside the dispatch's backward collective) are tests/test_ep_overlap.py's."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import run_cli

from moe_train.models.fp8.gemm import Fp8Gemm, count_fp8_gemms
from moe_train.models.moe.deferred_wgrad import DeferredWeightGrads
from moe_train.models.moe.experts import GroupedExperts


def _experts(seed: int = 0) -> tuple[GroupedExperts, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    experts = GroupedExperts(num_experts=4, hidden_size=16, ffn_hidden_size=8)
    for weight in (experts.gate_proj, experts.up_proj, experts.down_proj):
        torch.nn.init.normal_(weight)
    counts = torch.tensor([5, 0, 7, 3])
    rows = torch.randn(int(counts.sum()), 16, requires_grad=True)
    probs = torch.rand(int(counts.sum()), requires_grad=True)
    return experts, rows, counts, probs


def _run(kind: str, queue: DeferredWeightGrads | None, saved: str | None = None):
    experts, rows, counts, probs = _experts()
    experts.deferred_wgrad = queue
    if saved is not None:  # the routed experts in fp8 rowwise, keeping their inputs in bf16 or in fp8
        experts.fp8 = Fp8Gemm(recipe="rowwise", saved_inputs=saved)
    if kind == "loop":
        experts.use_grouped_mm = False
    if kind == "padded":
        out = experts._padded(rows, counts, probs.unsqueeze(-1), capacity=8)
    else:
        out = experts(rows, counts, probs=probs)
    grad = torch.randn_like(out)
    return experts, rows, probs, out, grad


@pytest.mark.parametrize(("kind", "saved"), [("grouped", None), ("loop", None), ("padded", None),
                                             ("grouped", "bf16"), ("grouped", "fp8"), ("loop", "fp8")])
def test_the_delayed_weight_gradients_equal_the_plain_backward_bit_for_bit(kind: str, saved: str | None) -> None:
    experts, rows, probs, out, grad = _run(kind, None, saved)
    out.backward(grad)
    plain = [t.grad for t in (rows, probs, experts.gate_proj, experts.up_proj, experts.down_proj)]

    queue = DeferredWeightGrads()
    experts, rows, probs, out, grad = _run(kind, queue, saved)
    weights = (experts.gate_proj, experts.up_proj, experts.down_proj)
    seen = {}

    def run_queue(_grad: torch.Tensor) -> None:  # where the dispatch's backward would: after the inputs' gradients
        seen["before"] = [w.grad for w in weights]
        queue.run()

    rows.register_hook(run_queue)
    with count_fp8_gemms() as fp8_gemms:
        out.backward(grad)
    if saved is not None:  # the queue ran the fp8 weight gradients (3 stacks; the loop: 3 per expert)
        assert sum(n for (_, product, _), n in fp8_gemms.items() if product == "weight_grad") >= 3, fp8_gemms
    assert seen["before"] == [None, None, None]  # nothing reached the weights before the queue ran
    delayed = [t.grad for t in (rows, probs, *weights)]
    for got, want in zip(delayed, plain, strict=True):
        assert torch.equal(got, want)
    assert not queue.hold(lambda: None)  # drained


def test_a_queue_its_backward_never_ran_raises() -> None:
    experts, rows, probs, out, grad = _run("grouped", DeferredWeightGrads())
    with pytest.raises(RuntimeError, match="split_wgrad.*never run"):
        out.backward(grad)


def test_hold_waits_for_the_queue_and_runs_after_it() -> None:
    queue = DeferredWeightGrads()
    experts, rows, probs, out, grad = _run("grouped", queue)
    order = []
    experts.gate_proj.register_post_accumulate_grad_hook(lambda _: order.append("gate accumulated"))

    def hold(_grad: torch.Tensor) -> None:
        assert queue.hold(lambda: order.append("held"))
        queue.run()

    rows.register_hook(hold)
    out.backward(grad)
    assert order == ["gate accumulated", "held"]


@pytest.mark.slow
def test_measure_counts_the_same_step_with_split_wgrad(no_process_group) -> None:
    """`measure --fake` at EP2: split_wgrad moves work, it adds none: the same FLOPs by phase, collective bytes
    and activation bytes per layer (its GEMMs save what the plain GEMMs' nodes save: the input, the weight as a
    weight, the offsets)."""
    sets = ["parallel.ep=2", "launch.gpus_per_node=2", "train.precision=fp32"]
    reports = []
    for split in ("false", "true"):
        args = [arg for item in [*sets, f"parallel.split_wgrad={split}"] for arg in ("--set", item)]
        result = run_cli("measure", "qwen3-moe-tiny", *args, "--fake", "--json")
        assert result.code == 0, (result.stdout, result.stderr)
        reports.append(json.loads(result.stdout))
    plain, split = reports
    for key in ("flops", "comm_bytes", "comm_calls", "activation_bytes_per_layer", "activation_bytes_peak"):
        assert split[key] == plain[key], key
