"""Issue 21, the GPU path, as far as the CPU can check it: the start-up API probe, collective buffers on the
training device, the two process-group timeouts. CUDA-only cases are skipped with their reason."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from cli_helpers import assert_bad_input, run_cli
from helpers import read_metrics, shrink
from host_reads import HostReads
from multirank import run_ranks

from moe_train import kernels
from moe_train.config import load_recipe
from moe_train.config.hardware import HARDWARE_ENV, hardware_table
from moe_train.launch.render import render_sbatch, render_torchrun, sbatch_directives
from moe_train.launch.rundir import recipe_differences
from moe_train.launch.shell import LaunchError
from moe_train.measure.activations import SavedTensorTracker
from moe_train.measure.driver import Target, measure
from moe_train.measure.layers import LayerTracker
from moe_train.models import attention, build_model
from moe_train.models import model as model_module
from moe_train.models.attention import attend, attention_mask, document_mask
from moe_train.models.model import Transformer
from moe_train.parallel.bootstrap import LauncherEnv, launcher_problems
from moe_train.runtime import TESTED_TORCH, torch_problems
from moe_train.train import grad_norm
from moe_train.train.device_stats import device_mismatch, enable_tf32, memory_figures, start_interval
from moe_train.train.loop import Trainer
from moe_train.train.peak import peak_flops

# The recipe's own warm-up and evaluation interval (the runs are shorter than both).
SHRINK = shrink(without=("train.warmup_steps", "train.eval_interval"))


def test_torch_probe_names_the_version_and_the_missing_api(monkeypatch: pytest.MonkeyPatch) -> None:
    assert torch_problems() == []
    monkeypatch.delattr(dist, "reduce_scatter_single")
    (line,) = torch_problems()
    assert line == (f"torch {torch.__version__} lacks torch.distributed.reduce_scatter_single "
                    f"(moe-train is tested with torch {TESTED_TORCH})")
    recipe = load_recipe("qwen3-tiny")
    assert line in launcher_problems(recipe, LauncherEnv({}))  # so the entry stops with it, before a collective


def test_pyproject_states_the_tested_range() -> None:
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert f'"torch{TESTED_TORCH}"' in text


class _Reduced(Exception):
    pass


def test_gradient_norm_sum_lives_on_the_training_device_without_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipeline rank with no counted gradient still all-reduces its (zero) sum: on ctx.device, never the CPU
    (NCCL takes no CPU tensor). meta stands in for cuda: any device that is not the CPU shows the rule."""
    seen = []

    def all_reduce(tensor, group=None):
        seen.append(tensor.device)
        raise _Reduced

    monkeypatch.setattr(grad_norm.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(grad_norm.dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(_Reduced):
        grad_norm.clip_grad_norm([torch.nn.Parameter(torch.ones(2))], 1.0, stage_group=object(),
                                 device=torch.device("meta"))
    assert seen == [torch.device("meta")]


def _timeout() -> timedelta:
    return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout


def test_startup_timeout_until_the_first_step_then_the_step_timeout(tmp_path: Path) -> None:
    if dist.is_initialized():  # an earlier test's group: bootstrap would reuse it and its timeout
        dist.destroy_process_group()
    t = Trainer(load_recipe("qwen3-tiny", [*SHRINK, "train.steps=2", f"run_dir={tmp_path}",
                                           "launch.startup_timeout_minutes=7", "launch.timeout_minutes=3"]))
    try:
        assert _timeout() == timedelta(minutes=7)
        t.train()
        assert _timeout() == timedelta(minutes=3)
        for mesh in (t.ctx.dense, t.ctx.expert):
            for name in mesh.mesh_dim_names:
                group = mesh.get_group(name)
                assert group._get_backend(torch.device("cpu")).options._timeout == timedelta(minutes=3), name
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------ the cuda batch script


def cuda_recipe(tmp_path: Path, *sets: str):
    return load_recipe("qwen3-moe-tiny", ["launch.device=cuda", "launch.gpu=h100", "launch.gpus_per_node=8",
                                          "parallel.ep=8", "train.micro_batch_size=2", f"run_dir={tmp_path / 'run'}",
                                          *sets])


def test_cuda_job_asks_for_the_cores_of_every_rank_also_when_not_exclusive(tmp_path: Path) -> None:
    shared = sbatch_directives(cuda_recipe(tmp_path, "launch.slurm.exclusive=false"), "/o")
    assert "--cpus-per-task=112" in shared and "--exclusive" not in shared  # 8 ranks x h100's 14 cores
    assert "--ntasks-per-node=1" in shared and "--gpus-per-node=8" in shared
    own = sbatch_directives(cuda_recipe(tmp_path, "launch.slurm.cpus_per_gpu=4"), "/o")
    assert "--cpus-per-task=32" in own and "--exclusive" in own
    script = render_sbatch(cuda_recipe(tmp_path, "launch.slurm.exclusive=false"), tmp_path / "run")
    assert 'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --cpus-per-task=112 ' in script  # not inherited


def test_cuda_job_without_a_core_count_is_refused_naming_the_field(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    table = tmp_path / "hardware.yaml"
    table.write_text("mygpu: {extends: h100}\nbare: {name: x, memory_bytes: 1, bf16_flops: 1, fp8_flops: 0, "
                     "hbm_bytes_per_s: 1, nvlink_bytes_per_s: 1, network_bytes_per_s: 1, gpus_per_node: 8, "
                     "nvlink_domain: 8}\n")
    monkeypatch.setenv(HARDWARE_ENV, str(table))
    assert hardware_table()["mygpu"].cpus_per_gpu == 14  # extends keeps the column
    assert hardware_table()["bare"].cpus_per_gpu is None
    with pytest.raises(LaunchError) as error:
        sbatch_directives(cuda_recipe(tmp_path, "launch.gpu=bare", "launch.slurm.exclusive=false"), "/o")
    (line,) = error.value.problems
    assert line.startswith("launch.slurm.cpus_per_gpu: needed for a cuda job (the hardware table's 'bare'")


def test_cuda_environment_defaults_are_rendered_and_launch_env_overrides_them(tmp_path: Path) -> None:
    recipe = cuda_recipe(tmp_path, "launch.env={PYTORCH_CUDA_ALLOC_CONF: 'expandable_segments:False', X: '1'}")
    script = render_sbatch(recipe, tmp_path / "run")
    exports = [line for line in script.splitlines() if line.startswith("export ") and "MOE_TRAIN" not in line]
    assert exports == ["export TORCH_NCCL_DUMP_ON_TIMEOUT=1", "export TORCH_NCCL_TRACE_BUFFER_SIZE=2000",
                       "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False", "export X=1"]
    snippet = render_torchrun(recipe, tmp_path / "run")
    assert snippet.splitlines()[:4] == exports
    cpu = render_sbatch(load_recipe("qwen3-moe-tiny", [f"run_dir={tmp_path / 'cpu'}"]), tmp_path / "cpu")
    assert "TORCH_NCCL" not in cpu and "PYTORCH_CUDA_ALLOC_CONF" not in cpu


def test_render_cli_refuses_a_cuda_job_without_cores_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = tmp_path / "hardware.yaml"
    table.write_text("bare: {name: x, memory_bytes: 1, bf16_flops: 1, fp8_flops: 0, hbm_bytes_per_s: 1, "
                     "nvlink_bytes_per_s: 1, network_bytes_per_s: 1, gpus_per_node: 8, nvlink_domain: 8}\n")
    monkeypatch.setenv(HARDWARE_ENV, str(table))
    result = run_cli("render", "qwen3-moe-tiny", "--set", "launch.device=cuda", "--set", "launch.gpu=bare",
                     "--set", "launch.gpus_per_node=8", "--set", "parallel.ep=8", "--set", "train.micro_batch_size=2",
                     "--set", f"run_dir={tmp_path / 'run'}")
    assert_bad_input(result, "launch.slurm.cpus_per_gpu")


# ---------------------------------------------------------------------------------------- train.deterministic


def test_deterministic_changes_no_cpu_number_and_continues_the_same_run(tmp_path: Path) -> None:
    """On the CPU the deterministic kernels are the ones that run anyway: equal losses and parameters, bit for
    bit; so toggling the field continues the run (it is one of the run folder's ignored fields)."""
    results = {}
    for flag in (False, True):
        t = Trainer(load_recipe("qwen3-moe-tiny", [*SHRINK, "train.steps=2", f"train.deterministic={flag}",
                                                   f"run_dir={tmp_path / str(flag)}"]))
        try:
            assert torch.are_deterministic_algorithms_enabled() is flag
            t.train()
            state = {k: v.detach().clone() for k, v in t.chunks[0].state_dict().items()}
            results[flag] = ([r for r in read_metrics(tmp_path / str(flag)) if r["kind"] == "train"], state)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            torch.use_deterministic_algorithms(False)
    (plain, plain_state), (exact, exact_state) = results[False], results[True]
    assert [r["loss"] for r in plain] == [r["loss"] for r in exact]
    assert all(torch.equal(plain_state[k], exact_state[k]) for k in plain_state)
    base = load_recipe("qwen3-moe-tiny", [f"run_dir={tmp_path / 'same'}"])
    assert recipe_differences(base, load_recipe("qwen3-moe-tiny", [f"run_dir={tmp_path / 'same'}",
                                                                "train.deterministic=true"])) == []


def test_deterministic_job_exports_the_cublas_workspace(tmp_path: Path) -> None:
    script = render_sbatch(cuda_recipe(tmp_path, "train.deterministic=true"), tmp_path / "run")
    assert "export CUBLAS_WORKSPACE_CONFIG=:4096:8" in script
    assert "CUBLAS_WORKSPACE_CONFIG" not in render_sbatch(cuda_recipe(tmp_path), tmp_path / "run")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: cuBLAS reads its workspace when CUDA starts")
def test_deterministic_cuda_matmul_repeats_bit_for_bit() -> None:
    from moe_train.train.determinism import apply_determinism

    apply_determinism(True)
    try:
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        index = torch.randint(0, 64, (4096,), device="cuda")
        first = [(a @ b).sum(0), torch.zeros(64, 4096, device="cuda").index_add_(0, index, a.float())]
        second = [(a @ b).sum(0), torch.zeros(64, 4096, device="cuda").index_add_(0, index, a.float())]
        assert all(torch.equal(x, y) for x, y in zip(first, second, strict=True))
    finally:
        apply_determinism(False)


# ------------------------------------------------------------------------------------------ packed documents


def _saved_per_layer(cfg, positions: torch.Tensor | None, seq: int) -> dict[str, int]:
    """measure's saved-tensor tracker around one forward and backward of the whole model."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = torch.randint(cfg.vocab_size, (1, seq))
    layers = LayerTracker([model])
    tracker = SavedTensorTracker([model], layers)
    with tracker:
        model(tokens, positions, labels=tokens)[0].backward()  # the summed language-model loss
    layers.close()
    return tracker.per_layer()


@pytest.mark.slow
def test_two_packed_documents_save_what_one_document_saves() -> None:
    """qwen3-tiny at s = 2,048: every layer saves the same bytes with two packed documents as with one; the one
    additive mask, shared by all layers, is the only addition (the boolean mask cost 1.62x: SDPA converted it to
    float and saved a copy in every layer)."""
    cfg = load_recipe("qwen3-tiny").model
    s = 2048
    one = _saved_per_layer(cfg, None, s)  # one document: no positions, plain causal attention
    two = _saved_per_layer(cfg, torch.cat([torch.arange(s // 2), torch.arange(s - s // 2)]).unsqueeze(0), s)
    assert {k: v for k, v in one.items() if k != "other"} == {k: v for k, v in two.items() if k != "other"}
    assert two["other"] - one["other"] == s * s * 4  # one fp32 [1, 1, s, s] mask


def test_additive_mask_gives_the_boolean_masks_outputs_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    positions = torch.tensor([[*range(10), *range(14)], [*range(5), *range(12), *range(7)]])
    q, k, v = (torch.randn(2, 4, 24, 8, dtype=torch.float64) for _ in range(3))
    additive, boolean = attention_mask(positions), document_mask(positions)
    assert additive.dtype == torch.float32 and torch.equal(additive == 0, boolean)
    assert torch.equal(attend(q, k, v, additive.double()), attend(q, k, v, boolean))
    for name in ("qwen3-tiny", "deepseek-v3-tiny"):  # GQA and MLA
        cfg = load_recipe(name, ["model.num_layers=2"]).model
        model = build_model(cfg).double()
        tokens = torch.randint(cfg.vocab_size, (2, 24))
        logits = model(tokens, positions)
        with monkeypatch.context() as patch:
            patch.setattr(model_module, "attention_mask", document_mask)  # the boolean mask of before
            assert torch.equal(logits, model(tokens, positions)), name


@pytest.mark.slow
def test_measure_fake_feeds_packed_positions_when_reset_at_eod() -> None:
    sets = ["model.num_layers=2", "train.seq_length=256", "train.global_batch_size=2", "train.micro_batch_size=1"]
    plain = measure(load_recipe("qwen3-tiny", sets), Target(fake=True))
    packed = measure(load_recipe("qwen3-tiny", [*sets, "data.reset_at_eod=true"]), Target(fake=True))
    layers = [str(i) for i in range(2)]
    assert [plain["activation_bytes_per_layer"][i] for i in layers] == \
        [packed["activation_bytes_per_layer"][i] for i in layers]
    other = packed["activation_bytes_per_layer"]["other"] - plain["activation_bytes_per_layer"]["other"]
    assert other == 256 * 256 * 4  # the step measured attends through the document mask


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: FlexAttention's block mask is the cuda row "
                    "of the kernel table (no CPU backward in torch 2.13)")
def test_cuda_block_mask_attention_equals_the_dense_mask() -> None:
    positions = torch.tensor([[*range(300), *range(212)]], device="cuda")
    mask = attention_mask(positions)
    assert type(mask).__name__ == "BlockMask"
    q = torch.randn(1, 8, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 2, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flex = attend(q, k, v, mask, enable_gqa=True)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1),
        attn_mask=document_mask(positions))
    assert (flex.float() - dense).abs().max().item() < 2e-2
    flex.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


# ------------------------------------------------------------------------------------------- SDPA backends


@pytest.fixture
def kernel_row(monkeypatch: pytest.MonkeyPatch):
    """Replace fields of a device kind's kernel-table row for one test (attend's backend list is cached)."""

    def change(device: str, **fields) -> None:
        monkeypatch.setitem(kernels.KERNELS, device, dataclasses.replace(kernels.KERNELS[device], **fields))
        attention.sdpa_backends.cache_clear()

    yield change
    attention.sdpa_backends.cache_clear()


def test_sdpa_runs_the_kernel_tables_backends(kernel_row) -> None:
    """attend hands SDPA the table's backends: the CPU row's flash kernel (its backward node), and a row that
    lists only the math kernel gets math, with the same output."""
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    flash = attend(q, k, v, None)
    assert flash.grad_fn.name() == "ScaledDotProductFlashAttentionForCpuBackward0"
    kernel_row("cpu", sdpa_backends=("MATH",))
    math = attend(q, k, v, None)
    assert "Flash" not in math.grad_fn.name()
    assert torch.allclose(flash, math, atol=1e-12)


def test_mla_value_at_its_own_width_equals_the_padded_one(kernel_row) -> None:
    """The cuda row's MLA (v at v_head_dim, no padding), run on the CPU's math kernel, which takes it: outputs and
    gradients equal the padded flash path's (fp64); the CPU's flash kernel itself refuses unequal head dims, so
    the cpu row pads (models/mla.py)."""
    cfg = load_recipe("deepseek-v3-tiny", ["model.num_layers=1", "model.mtp_layers=0"]).model  # one dense layer
    assert cfg.qk_nope_head_dim + cfg.qk_rope_head_dim != cfg.v_head_dim
    torch.manual_seed(0)
    model = build_model(cfg).double()
    tokens = torch.randint(cfg.vocab_size, (2, 24))

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        logits = model(tokens)
        logits.square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    padded, padded_grads = run()
    kernel_row("cpu", sdpa_backends=("MATH",), mla_value="own")
    own, own_grads = run()
    assert torch.allclose(padded, own, atol=1e-10)
    assert all(torch.allclose(a, b, atol=1e-10) for a, b in zip(padded_grads, own_grads, strict=True))
    q, k = torch.randn(1, 2, 8, 24), torch.randn(1, 2, 8, 24)
    with pytest.raises(RuntimeError), torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION]):
        torch.nn.functional.scaled_dot_product_attention(q, k, torch.randn(1, 2, 8, 16), is_causal=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the cuda row's SDPA backends (cuDNN, flash)")
def test_cuda_sdpa_runs_a_fused_kernel_for_gqa_and_unpadded_mla() -> None:
    for heads, kv_heads, qk, v in ((16, 4, 128, 128), (16, 16, 192, 128)):
        q = torch.randn(1, heads, 1024, qk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, kv_heads, 1024, qk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        value = torch.randn(1, kv_heads, 1024, v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = attend(q, k, value, None, enable_gqa=heads != kv_heads)
        assert "Math" not in out.grad_fn.name() and "UnsafeView" not in out.grad_fn.name(), out.grad_fn.name()
        reference = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float().repeat_interleave(heads // kv_heads, 1),
            value.float().repeat_interleave(heads // kv_heads, 1), is_causal=True)
        assert (out.float() - reference).abs().max().item() < 2e-2


# ------------------------------------------------------------------------------------------------ host reads

# One packed read of the step's figures: loss sums, MoE counts and the gradient norm together (Trainer._figures).
STEP_READS = 1


def _under(reads: dict[str, int], prefix: str) -> int:
    return sum(n for where, n in reads.items() if where.startswith(prefix))


@pytest.mark.parametrize("packed", [False, True])
def test_host_reads_of_one_step_on_one_rank(tmp_path: Path, packed: bool) -> None:
    """World size 1: the MoE layers read nothing from the device (no all-to-all splits to read), nor does the
    document mask of packed documents; the step reads its figures packed."""
    t = Trainer(load_recipe("qwen3-moe-tiny", [*SHRINK, "train.steps=2", f"run_dir={tmp_path}",
                                               f"data.reset_at_eod={packed}"]))
    try:
        t.train_step(1)
        reads = HostReads()
        with reads.counting():
            t.train_step(2)
        counted = dict(reads.by_line)
        assert _under(counted, "models/") == 0, counted
        assert 1 <= _under(counted, "train/") <= STEP_READS, counted
        assert sum(counted.values()) == _under(counted, "train/"), counted
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_host_reads_of_one_step_under_expert_parallelism(tmp_path: Path) -> None:
    """EP2 on two gloo ranks: at most one read per MoE dispatch (the all-to-all splits, with the kept count of a
    capacity's keep-mask, or the all-gathered token counts), with and without a capacity, padded or not; none
    for the all-to-all dispatcher padded to capacity (every split follows from the capacity)."""
    capacity = ["model.moe.capacity_factor=1.0"]
    variants = {"": [], "-capacity": capacity, "-padded": [*capacity, "model.moe.pad_to_capacity=true"]}
    cases = [{"id": d + v, "recipe": "qwen3-moe-tiny", "overrides": [*SHRINK, "parallel.ep=2",
                                                                      f"model.moe.dispatcher={d}", *sets]}
             for d in ("alltoall", "allgather") for v, sets in variants.items()]
    result = run_ranks("host_reads_step", 2, {"cases": cases, "run_root": str(tmp_path / "runs")}, tmp_path,
                       timeout=240)
    dispatches = 2 * 1  # layers x micro-batches of this rank (global batch 4 over dp 2, micro-batch 2)
    for case in cases:
        counted = result[case["id"]]
        if case["id"] == "alltoall-padded":
            assert _under(counted, "models/") == 0, counted
        else:
            assert 1 <= _under(counted, "models/") <= dispatches, (case["id"], counted)
        assert _under(counted, "train/") <= STEP_READS, (case["id"], counted)


# -------------------------------------------------------------------------------------- MFU, memory, TF32


def test_mfu_peak_is_launch_gpus_and_another_gpu_is_named_once() -> None:
    assert peak_flops(device="cuda", gpu="h200", precision="bf16") == 989e12
    assert device_mismatch("h200", "NVIDIA H200") is None
    assert device_mismatch("h100", "NVIDIA H100 80GB HBM3") is None
    assert device_mismatch("a100-80gb", "NVIDIA A100-SXM4-80GB") is None
    warning = device_mismatch("h100", "NVIDIA H200")
    assert warning.startswith("launch.gpu is h100 (NVIDIA H100 80GB SXM) but this job runs on NVIDIA H200")


def test_cpu_memory_figures_have_no_reserved_bytes() -> None:
    figures = memory_figures(torch.device("cpu"))
    assert set(figures) == {"memory_bytes"} and figures["memory_bytes"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the allocator's peak and reserved bytes")
def test_cuda_memory_peak_is_per_interval_and_reports_reserved_bytes() -> None:
    device = torch.device("cuda")
    big = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    first = memory_figures(device)
    del big
    start_interval(device)
    second = memory_figures(device)
    assert first["memory_bytes"] >= 256 * 2**20 > second["memory_bytes"]
    assert second["memory_reserved_bytes"] >= second["memory_bytes"]
    enable_tf32()
    assert torch.backends.cuda.matmul.allow_tf32
