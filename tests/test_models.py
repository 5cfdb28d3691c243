"""The model zoo on its own: name-seeded init, document restarts, the MTP loss by hand, attached balancing losses."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from moe_train.config.schema import ModelConfig, MoEConfig, RopeConfig, RouterConfig, YarnScaling
from moe_train.models import build_model
from moe_train.models.attention import attend, attention_mask, document_mask
from moe_train.models.moe.aux_loss import seq_aux_loss
from moe_train.models.norm import RMSNorm

QWEN3 = ModelConfig(family="qwen3", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    head_dim=16, ffn_hidden_size=96, vocab_size=100, init_std=0.1)
QWEN3_MOE = QWEN3.model_copy(update={
    "family": "qwen3_moe",
    "moe": MoEConfig(num_experts=8, top_k=2, ffn_hidden_size=32, router=RouterConfig(aux_loss_coeff=0.01)),
})
DEEPSEEK = ModelConfig(
    family="deepseek_v3", num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, vocab_size=100,
    qk_norm=False, init_std=0.1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, first_k_dense=1, mtp_layers=1, mtp_loss_weight=0.3,
    rope=RopeConfig(scaling=YarnScaling(factor=4.0, original_max_position_embeddings=16, mscale_all_dim=1.0)),
    moe=MoEConfig(num_experts=8, top_k=2, ffn_hidden_size=32, shared_expert_ffn_hidden_size=32,
                  router=RouterConfig(score_function="sigmoid", num_groups=4, group_top_k=2, topk_scaling_factor=2.5,
                                      expert_bias=True, load_balancing="seq_aux_loss", aux_loss_coeff=1e-2)),
)


def ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 100, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------------ init


def test_init_depends_only_on_seed_and_name():
    small = build_model(QWEN3, seed=7)
    deeper = build_model(QWEN3.model_copy(update={"num_layers": 4}), seed=7)  # other build order, more tensors
    other_seed = build_model(QWEN3, seed=8)
    deep_params = dict(deeper.named_parameters())
    for name, param in small.named_parameters():
        assert torch.equal(param, deep_params[name]), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(param, dict(other_seed.named_parameters())[name]), name
    # Same shape, other name: other values. Norms are ones; matrices N(0, init_std).
    assert not torch.equal(small.layers["0"].ffn.up_proj.weight, small.layers["1"].ffn.up_proj.weight)
    assert torch.equal(small.layers["1"].self_attn.q_norm.weight, torch.ones(16))
    std = small.embed_tokens.weight.std().item()
    assert abs(std - QWEN3.init_std) < 0.1 * QWEN3.init_std


@pytest.mark.slow
def test_init_is_stable_across_processes():
    """No Python hash() anywhere: another interpreter with another hash seed draws the same weights."""
    code = (
        "from moe_train.config.schema import ModelConfig;from moe_train.models import build_model;"
        "import sys;cfg=ModelConfig.model_validate_json(sys.argv[1]);m=build_model(cfg, seed=5);"
        "print(repr(sum(float(p.double().sum()) for p in m.parameters())))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "123", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code, QWEN3_MOE.model_dump_json()], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.strip()
    here = sum(float(p.detach().double().sum()) for p in build_model(QWEN3_MOE, seed=5).parameters())
    assert float(out) == here


def test_meta_build_tied_head_and_buffers():
    meta = build_model(DEEPSEEK, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    model = build_model(DEEPSEEK)
    assert torch.equal(model.layers["1"].ffn.router.expert_bias, torch.zeros(8))
    assert model.layers["1"].ffn.router.expert_bias.dtype == torch.float32
    assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)  # untied
    tied = build_model(QWEN3.model_copy(update={"tie_embeddings": True}))
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert {"lm_head.weight", "embed_tokens.weight"} <= set(tied.state_dict())


def test_padded_vocab_never_reaches_logits_or_gradients():
    model = build_model(QWEN3)
    assert model.embed_tokens.weight.shape[0] == QWEN3.padded_vocab_size() == 128
    logits = model(ids(2, 8))
    assert logits.shape == (2, 8, 100)
    logits.logsumexp(-1).sum().backward()
    assert model.lm_head.weight.grad[100:].abs().sum() == 0
    assert model.lm_head.weight.grad[:100].abs().sum() > 0


# ------------------------------------------------------------------------------------------------------ norms


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rms_norm_backward_equals_the_derivative_of_its_formula(dtype, tolerance):
    """RMSNorm's written-out backward against autograd through w * x / sqrt(mean x^2 + eps) in fp64: the output
    and both gradients, in the input's dtype. The input is a strided view (MLA normalises a slice of kv_a_proj's
    output), whose gradient must land in its slice only."""
    generator = torch.Generator().manual_seed(0)
    whole = torch.randn(3, 5, 24, dtype=torch.float64, generator=generator)
    weight = torch.randn(16, dtype=torch.float64, generator=generator)
    grad = torch.randn(3, 5, 16, dtype=torch.float64, generator=generator)

    exact_x, exact_w = whole[..., :16].clone().requires_grad_(), weight.clone().requires_grad_()
    exact = exact_w * exact_x / (exact_x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    exact_grads = torch.autograd.grad(exact, (exact_x, exact_w), grad)

    norm = RMSNorm(16, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    source = whole.to(dtype).requires_grad_()
    out = norm(source[..., :16])
    out.backward(grad.to(dtype))
    assert out.dtype == source.grad.dtype == norm.weight.grad.dtype == dtype
    torch.testing.assert_close(out.double(), exact, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(source.grad[..., :16].double(), exact_grads[0], rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(norm.weight.grad.double(), exact_grads[1], rtol=tolerance, atol=tolerance)
    assert not source.grad[..., 16:].any()


# ------------------------------------------------------------------------------------------- document restarts


@pytest.mark.parametrize("cfg", [QWEN3, QWEN3_MOE, DEEPSEEK], ids=["qwen3", "qwen3_moe", "deepseek_v3"])
def test_position_restarts_equal_separate_documents(cfg):
    model = build_model(cfg, seed=1)
    lengths = [7, 10, 7]
    docs = [ids(1, n, seed=i) for i, n in enumerate(lengths)]
    packed = torch.cat(docs, dim=1)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        together = model(packed, positions)
        separate = torch.cat([model(doc) for doc in docs], dim=1)
        plain = model(packed)
    assert (together - separate).abs().max().item() < 1e-5
    assert (plain[:, 7:] - separate[:, 7:]).abs().max().item() > 1e-3  # without restarts documents see each other

    # Rows restart independently: a packed row next to a row that is one document.
    other = ids(1, sum(lengths), seed=9)
    with torch.no_grad():
        both = model(torch.cat((packed, other)), torch.cat((positions, torch.arange(sum(lengths)).unsqueeze(0))))
        alone = model(other)
    assert (both[:1] - separate).abs().max().item() < 1e-5
    assert (both[1:] - alone).abs().max().item() < 1e-5


def test_document_mask_only_when_a_restart_exists():
    assert document_mask(torch.arange(6).unsqueeze(0)) is None
    mask = document_mask(torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]]))
    assert mask.shape == (2, 1, 6, 6)
    assert torch.equal(mask[1, 0], torch.ones(6, 6, dtype=torch.bool).tril())
    assert not mask[0, 0, 3, 2] and mask[0, 0, 4, 3] and mask[0, 0, 2, 0] and not mask[0, 0, 0, 1]


# --------------------------------------------------------------------------------------------------------- MTP


def main_hidden(model, tokens):
    """The main model's final-normed hidden states, recomputed from the modules."""
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    cos, sin = model.rope(positions)
    hidden = model.embed_tokens(tokens)
    for layer in model.layers.values():
        hidden = layer(hidden, cos, sin, None)
    return model.norm(hidden)


def capture_routing(model) -> dict[int, list]:
    """{layer index: [Routing of each forward]} of every MoE layer, MTP blocks included (observed, not changed)."""
    seen: dict[int, list] = {}
    for module in model.modules():
        if getattr(module, "is_moe", False):
            module.ffn.router.register_forward_hook(
                lambda mod, args, out, index=module.layer_index: seen.setdefault(index, []).append(out))
    return seen


def moe_layers(model) -> dict:
    return {m.layer_index: m.ffn for m in model.modules() if getattr(m, "is_moe", False)}


@pytest.mark.parametrize("depths", [1, 2])
def test_mtp_loss_by_hand(depths):
    """Depth k at position i sees h_i and token i+k and predicts token i+k+1; positions without a target drop out.

    Computed here on truncated sequences (no shifting with fill values, as the model does) and with a manual
    log-softmax."""
    cfg = DEEPSEEK.model_copy(update={"mtp_layers": depths})
    model = build_model(cfg, seed=2)
    tokens = ids(2, 12, seed=3)
    labels = torch.cat((tokens[:, 1:], torch.full((2, 1), -100)), dim=1)
    terms = model(tokens, labels=labels)

    seq = tokens.shape[1]
    weight = model.lm_head.weight[: cfg.vocab_size]
    hidden = main_hidden(model, tokens)
    losses = []
    for k, module in enumerate(model.mtp.values(), start=1):
        n = seq - k  # positions 0..seq-k-1 have a token i+k
        cos, sin = model.rope(torch.arange(n).unsqueeze(0))
        next_embeds = model.embed_tokens(tokens[:, k:])
        x = module.eh_proj(torch.cat((module.enorm(next_embeds), module.hnorm(hidden[:, :n])), dim=-1))
        hidden = module.norm(module.block(x, cos, sin, None))
        logprobs = (hidden[:, : n - 1] @ weight.T).log_softmax(-1)  # position n-1 would predict token seq
        targets = tokens[:, k + 1 :]
        losses.append(-logprobs.gather(-1, targets.unsqueeze(-1)).mean())
    expected = cfg.mtp_loss_weight * sum(losses) / depths
    assert abs(terms.mtp.item() - expected.item()) < 1e-5
    assert terms.mtp.item() > 0.5  # a real cross-entropy, not an empty mean

    terms.mtp.backward()
    assert model.mtp["0"].eh_proj.weight.grad.abs().sum() > 0
    assert model.embed_tokens.weight.grad.abs().sum() > 0


def test_mtp_targets_stay_inside_documents_and_run_only_in_training():
    model = build_model(DEEPSEEK, seed=2)
    tokens = ids(1, 12, seed=4)
    labels = torch.cat((tokens[:, 1:], torch.full((1, 1), -100)), dim=1)
    positions = torch.cat((torch.arange(6), torch.arange(6))).unsqueeze(0)
    packed = model(tokens, positions, labels=labels).mtp
    # The same two documents alone: per-document mean losses, weighted by their 4 valid positions each.
    alone = [model(doc, labels=torch.cat((doc[:, 1:], torch.full((1, 1), -100)), dim=1)).mtp
             for doc in (tokens[:, :6], tokens[:, 6:])]
    assert abs(packed.item() - (alone[0].item() + alone[1].item()) / 2) < 1e-5

    layers = moe_layers(model)
    for layer in layers.values():
        layer.reset_telemetry()
    model(tokens)  # no labels: logits, no MTP
    assert [int(layers[i].tokens_per_expert.sum()) for i in (1, 2)] == [12 * 2, 0]
    model.eval()  # evaluation: the language-model loss only
    assert model(tokens, labels=labels).mtp.item() == 0.0
    assert int(layers[2].tokens_per_expert.sum()) == 0  # the MTP block (layer num_layers + k) never ran


# --------------------------------------------------------------------------------- balancing losses attached


def aux_gradients(model, tokens, labels=None) -> dict[str, torch.Tensor]:
    """Gradients of the attached balancing losses alone: the training loss terms times 0, then backward."""
    model.zero_grad()
    out = model(tokens, labels=labels if labels is not None else tokens)
    (out.lm_sum * 0 + out.mtp * 0).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def reference_routing(model, batches, labels=None) -> dict[int, list]:
    """Routing of each batch's forward with attached gradients scaled to 0, so that differentiating a loss
    written out on the captured scores is not mixed with the attached losses of the layers it passes through."""
    model.balancing.start_step(scale=0.0)
    routing = capture_routing(model)
    for tokens in batches:
        model(tokens, labels=labels if labels is not None else tokens)
    model.balancing.start_step(scale=1.0)
    for module in moe_layers(model).values():
        module.router._forward_hooks.clear()
        module.reset_telemetry()
    model.aux_loss_value.zero_()
    return routing


def test_seq_aux_loss_is_attached_per_layer_including_mtp():
    model = build_model(DEEPSEEK, seed=2)
    tokens = ids(3, 10, seed=5)
    labels = torch.cat((tokens[:, 1:], torch.full((3, 1), -100)), dim=1)
    routing = reference_routing(model, [tokens], labels)
    assert sorted(routing) == [1, 2]
    losses = [1e-2 * seq_aux_loss(r.scores.view(3, 10, -1), r.topk_indices.view(3, 10, -1), 2)
              for r in (routing[i][0] for i in (1, 2))]
    routers = {"layers.1.ffn.router.weight": model.layers["1"].ffn.router.weight,
               "mtp.0.block.ffn.router.weight": model.mtp["0"].block.ffn.router.weight}
    expected = dict(zip(routers, torch.autograd.grad(sum(losses), list(routers.values())), strict=True))
    grads = aux_gradients(model, tokens, labels)
    recorded = sum(layer.aux_loss_value.item() for layer in moe_layers(model).values())
    assert abs(recorded - sum(loss.item() for loss in losses)) < 1e-7 and recorded > 0
    for name, want in expected.items():
        assert want.abs().sum() > 0 and torch.allclose(grads[name], want, atol=1e-9), name


def test_dense_model_has_no_balancing_loss():
    model = build_model(QWEN3)
    grads = aux_gradients(model, ids(1, 4))
    assert all(g.abs().sum() == 0 for g in grads.values())
    assert model.aux_loss_value.item() == 0.0


@pytest.mark.parametrize("kind", ["aux_loss", "global_aux_loss", "all_layers_aux_loss"])
def test_switch_losses_over_their_token_sets(kind):
    """aux_loss: each layer over its micro-batch; global_aux_loss: each layer over the step's micro-batches so
    far (one rank here); all_layers_aux_loss: all layers' rows together. Values and router gradients against
    the loss written out directly on the captured router scores."""
    cfg = QWEN3_MOE.model_copy(update={"moe": QWEN3_MOE.moe.model_copy(update={
        "router": RouterConfig(load_balancing=kind, aux_loss_coeff=0.1)})})
    model = build_model(cfg, seed=4)
    batches = [ids(2, 9, seed=6), ids(2, 9, seed=7)]  # two micro-batches of one step
    routing = reference_routing(model, batches)
    grads = [aux_gradients(model, tokens) for tokens in batches]
    layers = moe_layers(model)
    total_value = sum(layer.aux_loss_value.item() for layer in layers.values()) + model.aux_loss_value.item()

    def switch(scores, counts, rows):
        return 0.1 * 8 * ((counts.float() / rows) * scores.mean(0)).sum()

    def counts_of(r):
        return F.one_hot(r.topk_indices, 8).sum((0, 1))

    expected_value = 0.0
    for micro in range(2):
        if kind == "all_layers_aux_loss":
            scores = torch.cat([routing[i][micro].scores for i in (0, 1)])
            counts = sum(counts_of(routing[i][micro]) for i in (0, 1))
            losses = [switch(scores, counts, scores.shape[0])]
        else:
            losses = []
            for i in (0, 1):
                counts = counts_of(routing[i][micro])
                rows = 18
                if kind == "global_aux_loss":  # loads over micro-batches 0..micro
                    counts = sum(counts_of(routing[i][m]) for m in range(micro + 1))
                    rows = 18 * (micro + 1)
                losses.append(switch(routing[i][micro].scores, counts, rows))
        loss = sum(losses)
        expected_value += loss.item()
        routers = [layers[i].router.weight for i in (0, 1)]
        for index, want in zip((0, 1), torch.autograd.grad(loss, routers), strict=True):
            got = grads[micro][f"layers.{index}.ffn.router.weight"]
            assert want.abs().sum() > 0 and torch.allclose(got, want, atol=1e-8), (micro, index)
    # The two steps' values accumulated in the telemetry buffers (the trainer resets them per step).
    assert abs(total_value - expected_value) < 1e-6


# ---------------------------------------------------------------------------------------- sharded parameters


def _fsdp_init_rank(rank: int, world: int) -> None:
    """FSDP2-shard a meta model, materialise it: every shard equals the plain build's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from moe_train.models.init import init_weights, materialize

    mesh = init_device_mesh("cpu", (world,))
    plain = build_model(DEEPSEEK, seed=9)
    sharded = build_model(DEEPSEEK, device="meta")
    for block in sharded.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    materialize(sharded, device="cpu")
    init_weights(sharded, seed=9, init_std=DEEPSEEK.init_std)
    expected = dict(plain.named_parameters())
    for name, param in sharded.named_parameters():
        if not torch.equal(param.full_tensor(), expected[name]):
            raise AssertionError(f"rank {rank}: {name} differs from the single-process init")


def _tensor_parallel_rank(rank: int, world: int) -> None:
    """Attention heads split over ranks (column-parallel q/k/v, row-parallel o): the same logits."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from moe_train.models.init import init_weights, materialize

    mesh = init_device_mesh("cpu", (world,))
    for cfg in (QWEN3, DEEPSEEK.model_copy(update={"q_lora_rank": None})):
        plain = build_model(cfg, seed=4)
        model = build_model(cfg, device="meta")
        colwise = ("q_proj", "k_proj", "v_proj", "kv_b_proj") if cfg.family == "qwen3" else ("q_proj", "kv_b_proj")
        plan = {**{name: ColwiseParallel() for name in colwise}, "o_proj": RowwiseParallel()}
        for block in model.layers.values():
            parallelize_module(block.self_attn, mesh, plan)
        materialize(model, device="cpu")
        init_weights(model, seed=4, init_std=cfg.init_std)
        tokens = ids(2, 10, seed=1)
        positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]] * 2)
        with torch.no_grad():
            difference = (model(tokens, positions) - plain(tokens, positions)).abs().max().item()
        if difference > 1e-5:
            raise AssertionError(f"rank {rank}: {cfg.family} tensor-parallel logits differ by {difference}")


def _run_rank(rank: int, world: int, store: str, target, errors) -> None:
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        target(rank, world)
        dist.barrier()  # neither rank tears gloo down while the other still talks to it
        dist.destroy_process_group()
    except BaseException as error:  # reported to the parent, which fails the test
        errors.put(f"{type(error).__name__}: {error}")
        code = 1
    # Interpreter finalisation after FSDP2 + gloo aborted ~1 run in 10 ("terminate called without an active
    # exception", a C++ thread destroyed while joinable) after every check had passed; leave without it.
    errors.close()
    errors.join_thread()
    os._exit(code)


@pytest.mark.slow
@pytest.mark.parametrize("target", [_fsdp_init_rank, _tensor_parallel_rank], ids=["fsdp-init", "tp-heads"])
def test_two_gloo_ranks_reproduce_the_single_process_model(target, tmp_path):
    import multiprocessing

    # A file store rather than a TCP port: no race with other processes picking free ports.
    store = str(tmp_path / "store")
    context = multiprocessing.get_context("spawn")
    errors = context.Queue()
    ranks = [context.Process(target=_run_rank, args=(rank, 2, store, target, errors)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    for process in ranks:
        if process.is_alive():
            process.kill()
            pytest.fail("a rank hung (timeout 120 s)")
    problems = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not problems, problems
    assert [p.exitcode for p in ranks] == [0, 0], "a rank crashed (exit codes above)"


def test_sinks_and_window_with_packed_documents_equal_the_softmax_written_out():
    """gpt-oss's attention over packed documents: each query attends to the keys of its own document among its
    last `window` positions, itself included, plus its head's sink (a logit with no value), in fp64 against
    softmax([scores, sink]) over exactly those keys, written out here; the sinks' gradient too."""
    generator = torch.Generator().manual_seed(0)
    b, heads, kv_heads, s, d, window = 2, 4, 2, 12, 8, 3
    q, k, v = (torch.randn(b, n, s, d, generator=generator, dtype=torch.float64) for n in (heads, kv_heads, kv_heads))
    sinks = torch.randn(heads, generator=generator, dtype=torch.float64, requires_grad=True)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8]])
    out = attend(q, k, v, attention_mask(positions), window=window, sinks=sinks, enable_gqa=True)
    docs = (positions == 0).cumsum(-1)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (docs[:, :, None] == docs[:, None, :]) & (j <= i) & (j > i - window)  # [b, s, s]
    scores = q @ k.repeat_interleave(heads // kv_heads, dim=1).mT * d**-0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    joined = torch.cat((scores, sinks.view(1, heads, 1, 1).expand(b, heads, s, 1)), dim=-1).softmax(-1)
    expected = joined[..., :-1] @ v.repeat_interleave(heads // kv_heads, dim=1)
    assert (out - expected).abs().max().item() < 1e-12
    (grad,) = torch.autograd.grad(out.square().sum(), sinks)
    (want,) = torch.autograd.grad(expected.square().sum(), sinks)
    assert (grad - want).abs().max().item() < 1e-12 and want.abs().max().item() > 0
