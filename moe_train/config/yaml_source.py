"""Reading one YAML recipe file strictly, remembering where every value came from.

PyYAML's safe loader accepts duplicate keys silently and loses positions once values are constructed; a user
who mistyped a field needs both caught and the file:line:column of the mistake. So we compose the node tree
ourselves, reject duplicate keys, record the position of every key, and only then construct plain values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

Path_ = tuple[str | int, ...]


@dataclass(frozen=True)
class Origin:
    """Where a value was written: a file position, or a --set override."""

    source: str
    line: int = 0
    column: int = 0

    def __str__(self) -> str:
        return f"{self.source}:{self.line}:{self.column}" if self.line else self.source


class SourceError(Exception):
    """A file that cannot be read as a recipe mapping; `problems` are one-line messages."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


class RecipeLoader(yaml.SafeLoader):
    """The safe loader without YAML 1.1's base-60 numbers, so `time: 4:00:00` stays the string SLURM expects."""


RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, regex) for tag, regex in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)"
        r"|\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def load_value(text: str) -> Any:
    """YAML text read as recipe files are (--set values, cluster profiles): safe, no base-60 numbers."""
    return yaml.load(text, Loader=RecipeLoader)


def _origin(display: str, mark: yaml.Mark | None) -> Origin:
    if mark is None:
        return Origin(display)
    return Origin(display, mark.line + 1, mark.column + 1)


def _walk(node: yaml.Node, path: Path_, display: str, positions: dict[Path_, Origin], problems: list[str]) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, yaml.Node] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is None:
                problems.append(f"{_origin(display, key_node.start_mark)}: {_dotted(path)}: keys must be plain names")
                continue
            if key in seen:
                first = _origin(display, seen[key].start_mark)
                problems.append(
                    f"{_origin(display, key_node.start_mark)}: {_dotted(path + (key,))}: duplicate key "
                    f"(first set at line {first.line}); keep one"
                )
                continue
            seen[key] = key_node
            positions[path + (key,)] = _origin(display, key_node.start_mark)
            _walk(value_node, path + (key,), display, positions, problems)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            positions[path + (index,)] = _origin(display, item.start_mark)
            _walk(item, path + (index,), display, positions, problems)


def _dotted(path: Path_) -> str:
    return ".".join(str(part) for part in path) or "(top level)"


def read_yaml_mapping(path: Path, display: str) -> tuple[dict[str, Any], dict[Path_, Origin]]:
    """The mapping in `path` and the origin of each key; SourceError with one-line problems otherwise."""
    if path.is_dir():
        raise SourceError([f"{display}: is a directory, not a recipe file"])
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise SourceError([f"{display}: no such file"]) from None
    except OSError as error:
        raise SourceError([f"{display}: cannot read ({error.strerror})"]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise SourceError([f"{display}: not UTF-8 text (byte {error.start})"]) from None
    if not text.strip() or all(line.lstrip().startswith("#") or not line.strip() for line in text.splitlines()):
        raise SourceError([f"{display}: the file is empty; a recipe is a mapping with at least name, model, train"])

    loader = RecipeLoader(text)
    try:
        node = loader.get_single_node()
        positions: dict[Path_, Origin] = {}
        problems: list[str] = []
        if node is not None:
            _walk(node, (), display, positions, problems)
        if problems:
            raise SourceError(problems)
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        what = " ".join(part for part in (error.context, error.problem) if part)
        if "\t" in text and "\\t" in what:
            what += " (tabs are not allowed for indentation; use spaces)"
        if "could not determine a constructor" in what:
            what = f"unsupported YAML tag: {what} (only plain YAML values are allowed)"
        raise SourceError([f"{_origin(display, mark)}: YAML error: {what}"]) from None
    except yaml.YAMLError as error:
        raise SourceError([f"{display}: YAML error: {error}"]) from None
    finally:
        loader.dispose()

    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else f"a {type(data).__name__} value"
        raise SourceError([f"{display}:1:1: a recipe is a mapping of sections (name, model, train, ...), not {kind}"])
    return data, positions
