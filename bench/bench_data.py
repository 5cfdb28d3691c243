"""Data throughput: `data prepare` tokens/s (byte and a BPE tokenizer.json) and sample fetch rates (builtin,
indexed blend, mock), side by side in one run.

    PYTHONPATH=. python bench/bench_data.py [--megabytes 8] [--seq-length 4096]

The input is the builtin corpus's stdlib sources written as .jsonl (one file per line); the BPE tokenizer is
trained here on a slice of it, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time

import yaml

from moe_train.config.schema import Recipe
from moe_train.data import build_datasets, global_batch
from moe_train.data.builtin import corpus_files
from moe_train.data.prepare import prepare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_jsonl(path: str, megabytes: float) -> int:
    written = 0
    with open(path, "w") as f:
        for source in corpus_files():
            with open(source, encoding="utf-8", errors="replace") as g:
                text = g.read()
            f.write(json.dumps({"text": text}) + "\n")
            written += len(text)
            if written >= megabytes * 1e6:
                break
    return written


def train_bpe(path: str, jsonl: str) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    with open(jsonl) as f:
        texts = [json.loads(line)["text"] for line in itertools.islice(f, 50)]
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(path)
    return path


def fetch_rate(recipe: Recipe, cache: str, steps: int) -> tuple[float, float]:
    """(samples/s, tokens/s) of global_batch on the recipe's train source, after one warm-up batch."""
    source = build_datasets(recipe, cache_dir=cache).train
    size = recipe.train.global_batch_size
    global_batch(source, step=0, global_batch_size=size)
    started = time.perf_counter()
    for step in range(1, steps + 1):
        global_batch(source, step=step, global_batch_size=size)
    seconds = time.perf_counter() - started
    samples = steps * size
    return samples / seconds, samples * (recipe.train.seq_length + 1) / seconds


def make_recipe(data: dict, seq_length: int) -> Recipe:
    with open(os.path.join(ROOT, "recipes", "qwen3-tiny.yaml")) as f:
        raw = yaml.safe_load(f)
    raw["data"] = data
    raw["model"]["vocab_size"] = 8192
    raw["train"].update(seq_length=seq_length, global_batch_size=64)
    return Recipe.model_validate(raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=8.0)
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(tmp, "stdlib.jsonl")
        characters = write_jsonl(jsonl, args.megabytes)
        tokenizer = train_bpe(os.path.join(tmp, "tokenizer.json"), jsonl)
        print(f"prepare: {characters / 1e6:.1f}M characters of stdlib sources as .jsonl")
        rates = {}
        for name, spec in (("byte", "byte"), ("bpe-8k", tokenizer)):
            summary = prepare([jsonl], os.path.join(tmp, name), tokenizer=spec)
            rates[name] = summary.tokens_per_s
            print(
                f"  {name:7s} {summary.documents} documents, {summary.tokens / 1e6:.2f}M tokens, "
                f"{summary.seconds:.2f} s: {summary.tokens_per_s / 1e6:.2f}M tokens/s, "
                f"{summary.input_bytes / summary.seconds / 1e6:.1f} MB/s of input"
            )
        print(f"  byte / bpe tokens/s: {rates['byte'] / rates['bpe-8k']:.1f}x")

        seq = args.seq_length
        print(f"sample fetch: global batches of 64 x {seq + 1} tokens, {args.steps} steps")
        sources = {
            "builtin": {"source": "builtin", "valid_fraction": 0.01},
            "indexed": {"source": "indexed", "paths": [os.path.join(tmp, "byte")]},
            "indexed, blend of 2": {
                "source": "indexed",
                "paths": [os.path.join(tmp, "byte"), os.path.join(tmp, "byte")],
                "weights": [0.7, 0.3],
            },
            "mock": {"source": "mock"},
        }
        for name, data in sources.items():
            samples_per_s, tokens_per_s = fetch_rate(make_recipe(data, seq), tmp, args.steps)
            print(f"  {name:26s} {samples_per_s:9.0f} samples/s  {tokens_per_s / 1e6:7.1f}M tokens/s")


if __name__ == "__main__":
    main()
