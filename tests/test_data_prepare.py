"""`moe-train data prepare` end to end through the CLI: outputs, tokenizers, streaming, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import assert_bad_input, run_cli
from helpers import write_tokenizer

import moe_train.data.prepare
from moe_train.data.indexed import IndexedDataset
from moe_train.data.tokenizer import JsonTokenizer

EOD = 256

TEXTS = ["Hello, world.", "Zweites Dokument: äöü ß", "", "line one\nline two\n", "emoji \U0001f600 end"]


@pytest.fixture
def inputs(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    with open(jsonl, "w") as f:
        for i, text in enumerate(TEXTS):
            f.write(json.dumps({"id": i, "text": text, "body": text.upper()}) + "\n")
        f.write("\n")  # a trailing blank line is skipped
    txt = tmp_path / "book.txt"
    txt.write_text("Chapter 1\n\nIt was a dark night.\n\nChapter 2\n")
    return str(jsonl), str(txt)


def test_prepare_jsonl_and_txt(tmp_path, inputs):
    jsonl, txt = inputs
    prefix = str(tmp_path / "out" / "corpus")
    result = run_cli("data", "prepare", jsonl, txt, "-o", prefix)
    assert result.code == 0, result.stderr
    expected = [list(t.encode()) + [EOD] for t in TEXTS if t]
    expected.append(list(Path(txt).read_bytes()) + [EOD])  # the .txt file is one document
    assert f"{len(expected)} documents, 1 empty skipped, {sum(map(len, expected))} tokens" in result.stdout
    assert "tokens/s" in result.stdout
    dataset = IndexedDataset(prefix)
    assert [dataset[i].tolist() for i in range(len(dataset))] == expected
    assert sorted(os.listdir(tmp_path / "out")) == ["corpus.bin", "corpus.idx"]  # no temporary files left

    # Megatron-Core reads the result as well
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronDataset
    theirs = MegatronDataset(prefix)  # kept alive: it unmaps the .bin when collected
    assert [theirs[i].tolist() for i in range(len(theirs))] == expected


def test_prepare_options(tmp_path, inputs):
    jsonl, _ = inputs
    prefix = str(tmp_path / "upper")
    result = run_cli("data", "prepare", jsonl, "-o", prefix, "--text-field", "body", "--no-append-eod")
    assert result.code == 0, result.stderr
    dataset = IndexedDataset(prefix)
    assert [dataset[i].tolist() for i in range(len(dataset))] == [list(t.upper().encode()) for t in TEXTS if t]


def test_prepare_with_tokenizer_json(tmp_path, inputs):
    jsonl, _ = inputs
    path = write_tokenizer(tmp_path)
    tokenizer = JsonTokenizer(path)
    prefix = str(tmp_path / "bpe")
    result = run_cli("data", "prepare", jsonl, "-o", prefix, "--tokenizer", path)
    assert result.code == 0, result.stderr
    dataset = IndexedDataset(prefix)
    assert dataset.dtype == np.uint16
    assert [dataset[i].tolist() for i in range(len(dataset))] == [
        tokenizer.encode(t) + [tokenizer.eod] for t in TEXTS if t
    ]


def test_prepare_streams_long_text_in_pieces(tmp_path, monkeypatch):
    """A .txt larger than a batch is read in pieces of lines and still lands as one exact document."""
    monkeypatch.setattr(moe_train.data.prepare, "BATCH_BYTES", 1000)
    lines = [f"{i}: {'x' * (i % 70)}\n" for i in range(2000)]
    path = tmp_path / "long.txt"
    path.write_text("".join(lines))
    seen = []
    summary = moe_train.data.prepare.prepare([str(path)], str(tmp_path / "long"), on_progress=seen.append)
    assert len(seen) > 50 and seen == sorted(seen) and seen[-1] == path.stat().st_size  # progress in steps
    assert summary.documents == 1 and summary.tokens == path.stat().st_size + 1
    assert IndexedDataset(str(tmp_path / "long"))[0].tolist() == list(path.read_bytes()) + [EOD]


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": oops}\n')
    prefix = tmp_path / "out"
    assert_bad_input(run_cli("data", "prepare", str(path), "-o", str(prefix)), "bad.jsonl:2: invalid JSON")
    assert os.listdir(tmp_path) == ["bad.jsonl"]  # nothing written, no temporary files


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"content": "x"}', 'rows.jsonl:1: no "text" field (choose it with --text-field)'),
        ('["text"]', 'rows.jsonl:1: no "text" field'),
        ('{"text": 3}', 'rows.jsonl:1: field "text" is int, not a string'),
    ],
)
def test_bad_records(tmp_path, line, message):
    path = tmp_path / "rows.jsonl"
    path.write_text(line + "\n")
    assert_bad_input(run_cli("data", "prepare", str(path), "-o", str(tmp_path / "out")), message)


def test_bad_inputs_and_tokenizer(tmp_path, inputs):
    jsonl, _ = inputs
    out = str(tmp_path / "out")
    assert_bad_input(run_cli("data", "prepare", str(tmp_path / "missing.txt"), "-o", out), "missing.txt: input file")
    (tmp_path / "table.csv").write_text("a,b\n")
    assert_bad_input(run_cli("data", "prepare", str(tmp_path / "table.csv"), "-o", out), "table.csv: unsupported")
    bad_tokenizer = tmp_path / "tokenizer.json"
    bad_tokenizer.write_text("{not json")
    assert_bad_input(
        run_cli("data", "prepare", jsonl, "-o", out, "--tokenizer", str(bad_tokenizer)),
        "tokenizer.json: not a readable tokenizer.json",
    )
    (tmp_path / "latin1.txt").write_bytes(b"ok\ncaf\xe9\n")
    assert_bad_input(run_cli("data", "prepare", str(tmp_path / "latin1.txt"), "-o", out), "latin1.txt:2: not UTF-8")


def test_prepare_as_a_process_without_torch(tmp_path, inputs):
    """The real console entry point: exit codes, the summary on stdout, and no torch import (login-node side)."""
    jsonl, _ = inputs
    code = (
        "import sys\nfrom moe_train.cli.main import main\nsys.argv = ['moe-train', *sys.argv[1:]]\n"
        "try:\n    main()\nfinally:\n    print('torch' in sys.modules, file=sys.stderr)"
    )

    def moe_train(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)

    ok = moe_train("data", "prepare", jsonl, "-o", str(tmp_path / "p"))
    assert ok.returncode == 0 and "4 documents" in ok.stdout and ok.stderr.strip() == "False", ok.stderr
    bad = moe_train("data", "prepare", str(tmp_path / "x.txt"), "-o", str(tmp_path / "p"))
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.splitlines() == [f"error: {tmp_path / 'x.txt'}: input file not found", "False"]
