"""Tokenizers: `byte` (no files needed) and any Hugging Face tokenizer.json, behind one small protocol.

Pretraining only needs text -> ids and the id that ends a document (EOD), which `data prepare` appends after
each document and `data.reset_at_eod` restarts positions after.
"""

from __future__ import annotations

import json
import os
from typing import Protocol

from moe_train.config.data_files import DataError


class Tokenizer(Protocol):
    name: str
    eod: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 and EOD = 256: vocab 257, lossless on any text, no files to ship."""

    name = "byte"
    eod = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="surrogatepass"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]


# Names that end a document in common tokenizers, in order of preference: GPT-2/Qwen's <|endoftext|> is the
# pretraining document separator even where the chat eos (e.g. <|im_end|>) differs.
_EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


class JsonTokenizer:
    """A Hugging Face tokenizer.json (the `tokenizers` package). EOD: <|endoftext|> when the vocabulary has it,
    else the eos_token of a tokenizer_config.json beside it, else another common end-of-text token."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        if not os.path.isfile(path):
            raise DataError(f"{path}: tokenizer file not found (data.tokenizer is 'byte' or a tokenizer.json path)")
        try:
            self._tokenizer = HFTokenizer.from_file(path)
        except Exception as error:  # the Rust side raises plain Exception subclasses with multi-line text
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise DataError(f"{path}: not a readable tokenizer.json ({reason})") from None
        self.name = path
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        eod = self._find_eod(path)
        if eod is None:
            raise DataError(f"{path}: no end-of-document token (looked for {', '.join(_EOD_NAMES)} and eos_token)")
        self.eod = eod

    def _find_eod(self, path: str) -> int | None:
        names = [_EOD_NAMES[0]]
        config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        if os.path.isfile(config):
            with open(config) as f:
                eos = json.load(f).get("eos_token")
            if isinstance(eos, dict):  # older configs store an AddedToken object
                eos = eos.get("content")
            if isinstance(eos, str):
                names.append(eos)
        names.extend(_EOD_NAMES[1:])
        for name in names:
            token_id = self._tokenizer.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]


def load_tokenizer(spec: str) -> Tokenizer:
    """`byte` or a path to a tokenizer.json (the recipe's data.tokenizer, or prepare's --tokenizer)."""
    return ByteTokenizer() if spec == "byte" else JsonTokenizer(spec)
