"""Every class of bad recipe input: one line per problem with file:line:column and field path, exit 2."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from cli_helpers import assert_bad_input, run_cli

from moe_train.config import load_recipe


def write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_empty_and_comment_only_files(tmp_path):
    assert_bad_input(run_cli("validate", write(tmp_path, "")), "the file is empty")
    assert_bad_input(run_cli("validate", write(tmp_path, "# nothing\n\n")), "the file is empty")


def test_yaml_syntax_error_has_position(tmp_path):
    path = write(tmp_path, "name: x\nmodel: [1, 2\ntrain: {}\n")
    assert_bad_input(run_cli("validate", path), f"{path}:", "YAML error")


def test_tabs_are_explained(tmp_path):
    path = write(tmp_path, "name: x\nmodel:\n\tfamily: qwen3\n")
    result = run_cli("validate", path)
    assert_bad_input(result, f"{path}:3:1", "tabs are not allowed")


def test_duplicate_keys_are_rejected_with_both_lines(tmp_path):
    path = write(
        tmp_path,
        """\
        extends: qwen3-tiny
        train:
          lr: 1.0e-3
          lr: 2.0e-3
        """,
    )
    assert_bad_input(run_cli("validate", path), f"{path}:4:3: train.lr: duplicate key (first set at line 3)")


def test_wrong_types_unknown_fields_and_sections_all_at_once(tmp_path):
    path = write(
        tmp_path,
        """\
        extends: qwen3-tiny
        modle: {}
        model:
          hidden_size: big
          num_layer: 4
        train:
          precision: fp16
        """,
    )
    result = run_cli("validate", path)
    assert_bad_input(
        result,
        f"{path}:2:1: modle: unknown field in the top level; did you mean 'model'?",
        f"{path}:4:3: model.hidden_size: Input should be a valid integer",
        f"{path}:5:3: model.num_layer: unknown field in model; did you mean 'num_layers'?",
        f"{path}:7:3: train.precision: Input should be 'fp32', 'bf16' or 'fp8'",
    )
    assert len(result.stderr.strip().splitlines()) == 4


def test_missing_required_field(tmp_path):
    path = write(tmp_path, "name: x\nmodel:\n  family: qwen3\ntrain: {seq_length: 8, global_batch_size: 8}\n")
    assert_bad_input(run_cli("validate", path), "model.num_layers: required field is missing", "train.steps")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("- 1\n- 2\n", "a recipe is a mapping of sections (name, model, train, ...), not a list"),
        ("just text\n", "not a str value"),
        ("extends: qwen3-tiny\nmodel: [1, 2]\n", "model: expected a mapping of fields"),
        ("name: a\n---\nname: b\n", "expected a single document"),
        ("name: !!python/object:os.system x\n", "unsupported YAML tag"),
    ],
)
def test_wrong_shapes(tmp_path, text, expected):
    assert_bad_input(run_cli("validate", write(tmp_path, text)), expected)


def test_extends_missing_parent_and_cycle(tmp_path):
    typo = write(tmp_path, "extends: qwen3-tinny\n")
    assert_bad_input(run_cli("validate", typo), "extends: no recipe", "did you mean 'qwen3-tiny'")
    write(tmp_path, "extends: b.yaml\n", "a.yaml")
    write(tmp_path, "extends: a.yaml\n", "b.yaml")
    assert_bad_input(run_cli("validate", str(tmp_path / "a.yaml")), "extends: cycle")


def test_unreadable_inputs(tmp_path):
    assert_bad_input(run_cli("validate", str(tmp_path / "missing.yaml")), "missing.yaml: no such file")
    assert_bad_input(run_cli("validate", str(tmp_path)), "is a directory")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"name: \xff\xfe\n")
    assert_bad_input(run_cli("validate", str(binary)), "not UTF-8")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_bad_input(run_cli("validate", str(blocker / "recipe.yaml")), "recipe.yaml")
    assert_bad_input(run_cli("validate", "no-such-builtin"), "no recipe file or built-in")


def test_bad_overrides():
    assert_bad_input(run_cli("validate", "qwen3-tiny", "--set", "train.lr"), "expected dotted.path=value")
    assert_bad_input(run_cli("validate", "qwen3-tiny", "--set", "train.lr=[1"), "the value is not valid YAML")
    assert_bad_input(
        run_cli("validate", "qwen3-tiny", "--set", "train.lr=abc"),
        "--set train.lr=abc: train.lr: Input should be a valid number",
    )


# --------------------------------------------------------------------------------------------- cross-field


RULES = [
    ("qwen3-tiny", ["launch.gpus_per_node=3", "parallel.tp=2"], "launch.gpus_per_node: world size 3"),
    ("qwen3-tiny", ["launch.gpus_per_node=4", "parallel.dp=2"], "parallel.dp: pp*dp*cp*tp = 2 but the world size is 4"),
    ("qwen3-moe-tiny", ["launch.gpus_per_node=2", "parallel.ep=4"], "parallel.ep: the expert mesh must fold"),
    ("qwen3-moe-tiny", ["launch.gpus_per_node=3", "parallel.ep=3"], "parallel.ep: 3 must divide model.moe.num_experts"),
    ("qwen3-tiny", ["launch.gpus_per_node=3", "parallel.tp=3"], "parallel.tp: 3 must divide model.num_attention_heads"),
    ("qwen3-tiny", ["model.num_query_groups=2", "launch.gpus_per_node=4", "parallel.tp=4"], "model.num_query_groups 2"),
    ("qwen3-tiny", ["parallel.ep=2", "launch.gpus_per_node=2"], "parallel.ep: expert parallelism needs a MoE model"),
    ("deepseek-v3-tiny", ["model.moe.router.num_groups=3"], "model.moe.router.num_groups: 3 must divide num_experts"),
    ("deepseek-v3-tiny", ["model.moe.router.group_top_k=5"], "group_top_k: 5 exceeds num_groups 4"),
    ("deepseek-v3-tiny", ["model.moe.router.group_top_k=null"], "set num_groups and group_top_k together"),
    ("qwen3-moe-tiny", ["model.moe.top_k=9"], "model.moe.top_k: 9 exceeds num_experts 8"),
    ("deepseek-v3-tiny", ["model.moe.top_k=12", "model.moe.router.group_top_k=2"], "exceeds the 8 experts"),
    ("qwen3-tiny", ["train.global_batch_size=11"], "train.global_batch_size: 11 must be divisible"),
    ("qwen3-tiny", ["parallel.sequence_parallel=true"], "parallel.sequence_parallel: needs tp > 1"),
    (
        "qwen3-tiny",
        ["parallel.sequence_parallel=true", "parallel.tp=4", "launch.gpus_per_node=4", "train.seq_length=126"],
        "train.seq_length: 126 must be divisible by tp*cp = 4",
    ),
    (
        "qwen3-tiny",
        ["model.make_vocab_size_divisible_by=1", "parallel.tp=2", "launch.gpus_per_node=2"],
        "parallel.tp: 2 must divide the padded vocabulary 257",
    ),
    (
        "qwen3-moe-tiny",
        ["parallel.tp=4", "launch.gpus_per_node=4", "train.seq_length=126"],
        "train.seq_length: 126 must be divisible by tp = 4: MoE layers route",
    ),
    ("qwen3-tiny", ["model.q_lora_rank=64"], "model.q_lora_rank: only for family deepseek_v3"),
    ("glm4-moe-tiny", ["model.q_lora_rank=64"], "model.q_lora_rank: only for family deepseek_v3 (this recipe is glm4"),
    ("qwen3-moe-tiny", ["model.first_k_dense=1"], "model.first_k_dense: only for family deepseek_v3 or glm4_moe"),
    ("glm4-moe-tiny", ["model.first_k_dense=9"], "model.first_k_dense: 9 exceeds num_layers 8"),
    ("glm4-moe-tiny", ["model.moe=null"], "model.moe: required for family glm4_moe"),
    ("deepseek-v3-tiny", ["model.attention_bias=true"], "model.attention_bias: is for grouped-query attention"),
    ("deepseek-v3-tiny", ["model.rope.partial_rotary_factor=0.5"],
     "model.rope.partial_rotary_factor: must be 1 for MLA"),
    ("glm4-moe-tiny", ["model.rope.partial_rotary_factor=0.2"],  # int(16 x 0.2): 3 features, no pairs
     "model.rope.partial_rotary_factor: rotates 3 of head_dim 16 features: must be an even number"),
    ("glm4-moe-tiny", ["model.qk_norm=false", "train.optimizer=muon", "train.muon.qk_clip=100"],
     "train.muon.qk_clip: scales the q/k weights but not their biases"),
    ("deepseek-v3-tiny", ["model.kv_lora_rank=null"], "model.kv_lora_rank: required for family deepseek_v3"),
    ("glm4-moe-tiny", ["model.attention_sinks=true"], "model.attention_sinks: only for family gpt_oss"),
    ("qwen3-moe-tiny", ["model.moe.expert_biases=true"], "model.moe.expert_biases: only for family gpt_oss"),
    ("qwen3-moe-tiny", ["model.moe.router.learned_bias=true"], "model.moe.router.learned_bias: only for family"),
    ("qwen3-moe-tiny", ["model.moe.clamped_swiglu={limit: 7.0}"], "model.moe.clamped_swiglu: only for family"),
    ("gpt-oss-tiny", ["model.layer_types=[full_attention]"], "model.layer_types: has 1 entries, but num_layers is 8"),
    ("gpt-oss-tiny", ["model.sliding_window=null"], "model.sliding_window: required: layer_types has sliding"),
    ("gpt-oss-tiny", ["model.qk_norm=true"], "model.qk_norm: gpt_oss has no QK-norm"),
    ("gpt-oss-tiny", ["data.reset_at_eod=true", "launch.device=cuda", "launch.gpu=h100"],
     "data.reset_at_eod: gpt_oss's sinks and sliding windows on CUDA"),
    ("qwen3-tiny", ["model.moe={num_experts: 8, top_k: 2, ffn_hidden_size: 8}"], "model.moe: family qwen3 is dense"),
    ("qwen3-moe-tiny", ["model.moe=null"], "model.moe: required for family qwen3_moe"),
    (
        "qwen3-tiny",
        ["parallel.recompute={granularity: selective, modules: [mla_up_proj, moe_act]}"],
        "mla_up_proj needs multi-head latent attention",
    ),
    ("qwen3-tiny", ["parallel.pp=3", "launch.gpus_per_node=3"], "parallel.pp_layout: num_layers 8 does not split"),
    (
        "qwen3-tiny",
        ["parallel.pp=2", "launch.gpus_per_node=2", "parallel.pp_layout=Et*3|t*4L"],
        "parallel.pp_layout: places 7 decoder layers",
    ),
    ("qwen3-tiny", ["parallel.pp=2", "launch.gpus_per_node=2", "parallel.pp_layout=Et*4|x"], "unexpected 'x'"),
    ("deepseek-v3-tiny", ["parallel.pp=2", "launch.gpus_per_node=2", "parallel.pp_layout=Et*4|t*4L"], "MTP modules"),
    ("qwen3-tiny", ["parallel.vpp=2", "parallel.pp=2", "launch.gpus_per_node=2"], "parallel.pp_schedule: vpp 2"),
    (  # fp8 on CUDA: a 40-wide MLA down projection of the tiny proxy (32 + 8) breaks the 16-multiples of fp8 GEMMs
        "deepseek-v3-tiny", ["train.precision=fp8", "launch.device=cuda", "launch.gpu=h100"],
        "train.fp8.modules: attention: kv_a_proj_with_mqa is 40 x 128 on a rank, and CUDA fp8 GEMMs need every "
        "dimension a multiple of 16 (recipe deepseek-v3-tiny)",
    ),
    ("qwen3-moe-tiny", ["train.precision=fp8", "train.fp8.recipe=rowwise", "train.fp8.fp8_all_gather=true"],
     "train.fp8.fp8_all_gather: torchao gathers fp8 weights for recipe tensorwise only, not rowwise"),
    ("qwen3-moe-tiny", ["train.precision=fp8", "train.fp8.recipe=mxfp8", "launch.device=cuda", "launch.gpu=h100"],
     "train.fp8.recipe: mxfp8 needs compute capability 10.0 (Blackwell, sm100); NVIDIA H100 80GB SXM is 9.0"),
    ("qwen3-moe-tiny", ["train.precision=fp8", "train.fp8.backend=te"],
     "train.fp8.backend: te (transformer-engine) runs on launch.device cuda only"),
    ("qwen3-moe-tiny", ["train.precision=fp8", "train.fp8.backend=te", "train.fp8.modules=[attention,head]",
                        "train.loss_chunk_tokens=16"],
     "train.fp8.modules: head with backend te and the chunked loss (train.loss_chunk_tokens)"),
    ("qwen3-tiny", ["launch.gpu=h900"], "launch.gpu: unknown 'h900'; allowed: a100-80gb, h100"),
    ("qwen3-tiny", ["launch.device=cuda"], "launch.gpu: name the GPU"),
    ("qwen3-tiny", ["launch.device=cuda", "launch.gpu=gb200", "launch.gpus_per_node=8", "parallel.dp=8"], "4 GPUs"),
    ("qwen3-tiny", ["launch.env={1BAD: x}"], "launch.env: '1BAD' is not a valid environment variable name"),
    ("qwen3-tiny", ['launch.slurm.partition="a\\nb"'], "launch.slurm.partition: must be one line"),
    ("qwen3-tiny", ['launch.slurm.extra_sbatch=["--mem=0\\n#SBATCH -x"]'], "launch.slurm.extra_sbatch.0"),
    ("qwen3-tiny", ["train.exit_at_step=500"], "train.exit_at_step: 500 is after the last step 200"),
    ("qwen3-tiny", ["data.valid_fraction=0"], "train.eval_interval: evaluation needs held-out data"),
    ("qwen3-tiny", ["model.vocab_size=200"], "model.vocab_size: 200 cannot hold the byte tokenizer"),
    ("qwen3-tiny", ["train.seq_length=1024"], "train.seq_length: 1024 exceeds model.max_position_embeddings 512"),
    ("qwen3-tiny", ["name=my/run"], "name: 'my/run' must be letters"),
    ("qwen3-tiny", ["data.source=indexed"], "data.paths: source indexed needs at least one"),
    ("qwen3-tiny", ["data.paths=[/nonexistent/corpus]"], "data.paths: only for source indexed"),
    (
        "qwen3-tiny",
        ["data.source=indexed", "data.paths=[/nonexistent/corpus]", "data.weights=[1, 2]"],
        "data.paths.0: /nonexistent/corpus.bin does not exist",
    ),
    ("qwen3-tiny", ["checkpoint.resume=/nonexistent/ckpt"], "checkpoint.resume: auto, required, never or an existing"),
    ("qwen3-tiny", ["data.tokenizer=/nonexistent/tokenizer.json"], "data.tokenizer: 'byte' or a tokenizer.json"),
]


@pytest.mark.parametrize(("recipe", "sets", "expected"), RULES, ids=[r[2][:40] for r in RULES])
def test_cross_field_rule(recipe, sets, expected):
    args = ["validate", recipe]
    for item in sets:
        args += ["--set", item]
    result = run_cli(*args)
    assert_bad_input(result, expected)
    for line in result.stderr.splitlines():  # each problem starts at a file position or at the override
        assert re.match(r"error: ([a-z0-9-]+ \(built-in\):\d+:\d+|--set [^:]+): ", line), line


# Layouts wrong in several ways at once: every problem is reported, and none is made up from a dp that a world size
# which does not divide cannot define (floor division gave dp 3 for 7 ranks at tp 2, then a batch "problem").
ALL_AT_ONCE = [
    (
        ["launch.gpus_per_node=7", "parallel.tp=3"],
        ["launch.gpus_per_node: world size 7", "parallel.tp: 3 must divide model.num_attention_heads 8",
         "parallel.tp: 3 must divide model.num_query_groups 4", "train.seq_length: 128 must be divisible by tp = 3"],
    ),
    (["launch.gpus_per_node=7", "parallel.tp=2"], ["launch.gpus_per_node: world size 7"]),
    (
        ["launch.gpus_per_node=7", "parallel.tp=2", "parallel.ep=3", "parallel.etp=5",
         "model.moe.dispatcher=allgather"],
        ["launch.gpus_per_node: world size 7", "parallel.ep: 3 must divide model.moe.num_experts 8",
         "parallel.etp: 5 must divide model.moe.ffn_hidden_size 96"],
    ),
    (
        ["launch.gpus_per_node=4", "parallel.dp=2", "parallel.tp=3"],
        ["parallel.dp: pp*dp*cp*tp = 6 but the world size is 4", "parallel.tp: 3 must divide model.num_attention_heads",
         "parallel.tp: 3 must divide model.num_query_groups", "train.seq_length: 128 must be divisible by tp = 3"],
    ),
    (  # a dp the user wrote is theirs: its batch consequence is a real problem, reported with the world size
        ["launch.gpus_per_node=4", "parallel.dp=3", "parallel.pp=3"],
        ["parallel.dp: pp*dp*cp*tp = 9 but the world size is 4", "parallel.pp_layout: num_layers 8 does not split",
         "train.global_batch_size: 16 must be divisible by micro_batch_size * dp = 2 * 3"],
    ),
    (
        ["launch.gpus_per_node=6", "parallel.tp=2", "parallel.ep=2", "parallel.etp=2",
         "model.moe.dispatcher=allgather"],
        ["parallel.ep: the expert mesh must fold onto the dense one: dp*cp*tp = 6",
         "train.global_batch_size: 16 must be divisible by micro_batch_size * dp = 2 * 3"],
    ),
]


@pytest.mark.parametrize(("sets", "expected"), ALL_AT_ONCE, ids=[" ".join(case[0]) for case in ALL_AT_ONCE])
def test_layout_problems_are_all_reported_and_none_is_spurious(sets, expected):
    # Micro-batches of 2, so the batch messages do not depend on the recipe's own micro_batch_size.
    sets = ["train.micro_batch_size=2", *sets]
    result = run_cli("validate", "qwen3-moe-tiny", *[arg for item in sets for arg in ("--set", item)])
    assert_bad_input(result, *expected)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == len(expected), lines


def test_derived_sizes_are_undefined_rather_than_guessed():
    recipe = load_recipe("qwen3-moe-tiny")
    assert (recipe.layout_dp(), recipe.layout_edp(), recipe.dp, recipe.edp) == (1, 1, 1, 1)
    odd = recipe.model_copy(update={
        "launch": recipe.launch.model_copy(update={"gpus_per_node": 7}),
        "parallel": recipe.parallel.model_copy(update={"tp": 2}),
    })
    assert (odd.layout_dp(), odd.layout_edp()) == (None, None)
    with pytest.raises(ValueError, match="world size 7 is not divisible by pp\\*cp\\*tp = 2"):
        _ = odd.dp
    unfolded = recipe.model_copy(update={
        "launch": recipe.launch.model_copy(update={"gpus_per_node": 6}),
        "parallel": recipe.parallel.model_copy(update={"ep": 4}),
    })
    assert (unfolded.layout_dp(), unfolded.layout_edp()) == (6, None)
    with pytest.raises(ValueError, match="dp\\*cp\\*tp = 6 is not divisible by ep\\*etp = 4"):
        _ = unfolded.edp


def test_rule_position_points_into_the_file(tmp_path):
    path = write(
        tmp_path,
        """\
        extends: qwen3-moe-tiny
        model:
          moe:
            top_k: 9
        """,
    )
    assert_bad_input(run_cli("validate", path), f"{path}:4:5: model.moe.top_k: 9 exceeds num_experts 8")


def test_corrupt_index_header_is_reported(tmp_path):
    (tmp_path / "corpus.bin").write_bytes(b"\0" * 16)
    (tmp_path / "corpus.idx").write_bytes(b"NOTANIDX" + b"\0" * 40)
    result = run_cli(
        "validate", "qwen3-tiny", "--set", "data.source=indexed", "--set", f"data.paths=[{tmp_path}/corpus]"
    )
    assert_bad_input(result, "data.paths.0:", "corpus.idx")
