"""`moe-train convert`: a transformers checkpoint -> init_from -> training -> back to transformers."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402  (the test extra installs it: a missing one is an error, never a silent skip)
from cli_helpers import assert_bad_input, run_cli  # noqa: E402

from moe_train.config import load_recipe  # noqa: E402
from moe_train.train.loop import Trainer  # noqa: E402


def tiny_hf_moe(path: Path) -> torch.nn.Module:
    """A random Qwen3-MoE saved with save_pretrained; weights scaled so that logits are O(1), not ~0."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0, 1 / param.shape[-1] ** 0.5)
    model.save_pretrained(path)
    return model.eval()


def test_from_hf_init_from_train_to_hf(tmp_path: Path) -> None:
    hf = tiny_hf_moe(tmp_path / "hf")
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1))
    result = run_cli("convert", "from-hf", str(tmp_path / "hf"), "-o", str(tmp_path / "conv"))
    assert result.code == 0, result.stderr
    ckpt = tmp_path / "conv" / "checkpoint"
    assert f"checkpoint {ckpt}" in result.stdout

    run_dir = tmp_path / "run"
    recipe = load_recipe(tmp_path / "conv" / "recipe.yaml", [
        "train.seq_length=16", "train.global_batch_size=2", "train.micro_batch_size=2", "train.steps=2",
        "train.warmup_steps=0", "train.precision=fp32", f"run_dir={run_dir}", "logging.interval=1"])
    assert recipe.model.family == "qwen3_moe" and recipe.model.moe.num_experts == 4
    assert recipe.checkpoint.init_from == str(ckpt)
    trainer = Trainer(recipe)
    assert trainer.started_from == ckpt and trainer.progress.step == 0
    with torch.no_grad():
        expected = hf(tokens).logits
        ours = trainer.chunks[0](tokens)
    assert expected.abs().mean() > 0.1  # O(1) logits: the comparison below means something
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)

    summary = trainer.train()
    assert summary.status == "complete"
    result = run_cli("convert", "to-hf", str(run_dir / "checkpoints"), "-o", str(tmp_path / "out"))
    assert result.code == 0, result.stderr
    assert "step-0000002" in result.stdout
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        trained = trainer.chunks[0](tokens)
        torch.testing.assert_close(exported(tokens).logits, trained, atol=1e-4, rtol=1e-4)
    assert (trained - expected).abs().max() > 1e-3  # the exported model is the trained one, not the original


def test_convert_bad_inputs_exit_2(tmp_path: Path) -> None:
    assert_bad_input(run_cli("convert", "from-hf", str(tmp_path), "-o", str(tmp_path / "o")), "config.json")
    assert_bad_input(run_cli("convert", "to-hf", str(tmp_path / "none"), "-o", str(tmp_path / "o")),
                     "CKPT: ", "is not a complete checkpoint")
