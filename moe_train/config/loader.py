"""From a recipe file or built-in name to a frozen, fully checked `Recipe`.

The steps: read the file (and its `extends:` parents) with positions, deep-merge parents under children,
apply `--set` overrides, fill launch defaults from a cluster profile, validate the schema, then run the
cross-field rules. Every problem found is collected and raised together as one `RecipeError`, each a single
line with file:line:column and the dotted field path, because a user fixing a recipe wants all of them at once.
"""

from __future__ import annotations

import copy
import difflib
import importlib.resources
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from .cluster import ClusterProfileError, cluster_profile
from .schema import Recipe
from .yaml_source import Origin, Path_, SourceError, load_value, read_yaml_mapping


class RecipeError(Exception):
    """An invalid recipe; `problems` holds one line per problem, ready to print."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


# ------------------------------------------------------------------------------------------ built-in recipes


def _builtin_folder() -> Path:
    return Path(str(importlib.resources.files("moe_train.recipes")))


def builtin_recipes() -> list[str]:
    """Names of the recipes shipped with moe-train."""
    return sorted(path.stem for path in _builtin_folder().glob("*.yaml"))


def _locate(reference: str, relative_to: Path | None) -> Path | None:
    """A recipe reference is a path (absolute, or relative to the including file or cwd) or a built-in name."""
    candidate = Path(reference).expanduser()
    if not candidate.is_absolute() and relative_to is not None:
        candidate = relative_to / candidate
    if candidate.exists():
        return candidate
    builtin = _builtin_folder() / f"{reference}.yaml"
    if "/" not in reference and builtin.is_file():
        return builtin
    return None


def _display(path: Path) -> str:
    builtin = _builtin_folder()
    if path.parent.resolve() == builtin.resolve():
        return f"{path.stem} (built-in)"
    return str(path)


# ---------------------------------------------------------------------------------------- extends and merge


def deep_merge(base: dict, override: dict) -> dict:
    """Deep merge: mappings merge key by key, anything else (lists included) replaces."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def apply_cluster_profile(raw_launch: dict, base_dir: Path) -> dict:
    """The recipe's raw `launch` mapping with the defaults of its `cluster` profile filled in.

    The result has no `cluster` key: the resolved recipe written into a run directory carries the merged values
    themselves, so the ranks never look for a profile file (compute nodes may not see ~/.config). Replacement
    rather than concatenation for lists (setup, extra_sbatch) keeps this idempotent and lets a recipe drop a
    profile's line. Raises ClusterProfileError (a ValueError) with a one-line message.
    """
    launch = dict(raw_launch)
    reference = launch.pop("cluster", None)
    if reference is None:
        return launch
    return deep_merge(cluster_profile(reference, base_dir), launch)


def _read_with_parents(path: Path, chain: tuple[Path, ...]) -> tuple[dict, dict[Path_, Origin]]:
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(_display(p) for p in (*chain, resolved))
        raise SourceError([f"{_display(path)}: extends: cycle {cycle}"])
    data, positions = read_yaml_mapping(path, _display(path))
    parent_ref = data.get("extends")
    if parent_ref is None:
        return data, positions
    where = positions.get(("extends",), Origin(_display(path)))
    if not isinstance(parent_ref, str) or not parent_ref:
        raise SourceError([f"{where}: extends: must be a built-in recipe name or a relative path"])
    parent_path = _locate(parent_ref, path.parent)
    if parent_path is None:
        close = difflib.get_close_matches(parent_ref, builtin_recipes(), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else f" (built-ins: {', '.join(builtin_recipes())})"
        raise SourceError([f"{where}: extends: no recipe file or built-in named '{parent_ref}'{hint}"])
    parent_data, parent_positions = _read_with_parents(parent_path, (*chain, resolved))
    child_positions = dict(positions)
    # A child value that replaces a parent subtree hides the parent's positions under it.
    for key_path in list(parent_positions):
        for depth in range(1, len(key_path)):
            prefix = key_path[:depth]
            if prefix in child_positions and not isinstance(_get(data, prefix), dict):
                del parent_positions[key_path]
                break
    return deep_merge(parent_data, data), {**parent_positions, **child_positions}


def _get(data: Any, path: Path_) -> Any:
    for part in path:
        in_mapping = isinstance(data, dict) and part in data
        in_list = isinstance(data, list) and isinstance(part, int) and part < len(data)
        if not (in_mapping or in_list):
            return None
        data = data[part]
    return data


# ------------------------------------------------------------------------------------------------ overrides


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """`dotted.path=value` with a YAML-typed value (numbers, booleans, null, [lists], {maps})."""
    if "=" not in text:
        raise ValueError(f"--set {text}: expected dotted.path=value")
    key, _, raw = text.partition("=")
    parts = tuple(key.strip().split("."))
    if not all(part.isidentifier() for part in parts):
        raise ValueError(f"--set {text}: '{key}' is not a dotted field path")
    try:
        value = load_value(raw) if raw.strip() else ""
    except yaml.YAMLError:
        raise ValueError(f"--set {text}: the value is not valid YAML") from None
    return parts, value


def _apply_overrides(data: dict, positions: dict[Path_, Origin], overrides: Iterable[str]) -> list[str]:
    problems = []
    for text in overrides:
        try:
            parts, value = parse_override(text)
        except ValueError as error:
            problems.append(str(error))
            continue
        node = data
        for part in parts[:-1]:  # copy each mapping on the path: the rest stays shared with the source, unchanged
            child = node.get(part)
            node[part] = dict(child) if isinstance(child, dict) else {}
            node = node[part]
        node[parts[-1]] = value
        origin = Origin(f"--set {text}")
        for key_path in [p for p in positions if p[: len(parts)] == parts]:
            del positions[key_path]
        for depth in range(1, len(parts) + 1):
            positions.setdefault(parts[:depth], origin)
        positions[parts] = origin
    return problems


# --------------------------------------------------------------------------------------- schema error lines


def _model_at(path: Path_) -> type[BaseModel] | None:
    """The pydantic model class that a (validated) path points into, for did-you-mean suggestions."""
    model: type[BaseModel] | None = Recipe
    for part in path:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        model = _as_model(model.model_fields[part].annotation)
    return model


def _as_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) is not None:
        for arg in get_args(annotation):
            found = _as_model(arg)
            if found is not None:
                return found
    return None


def _where(path: Path_, positions: dict[Path_, Origin], default: Origin) -> Origin:
    for depth in range(len(path), 0, -1):
        if path[:depth] in positions:
            return positions[path[:depth]]
    return default


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _schema_problem(error: dict, positions: dict[Path_, Origin], default: Origin) -> str:
    loc: Path_ = tuple(part for part in error["loc"] if not (isinstance(part, str) and part[:1].isupper()))
    dotted = ".".join(str(part) for part in loc)
    where = _where(loc, positions, default)
    kind = error["type"]
    if kind == "extra_forbidden":
        field = str(loc[-1])
        parent = _model_at(loc[:-1])
        allowed = sorted(parent.model_fields) if parent else []
        close = difflib.get_close_matches(field, allowed, n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else f"allowed: {', '.join(allowed)}"
        section = ".".join(str(part) for part in loc[:-1]) or "the top level"
        return f"{where}: {dotted}: unknown field in {section}; {hint}"
    if kind == "missing":
        return f"{where}: {dotted}: required field is missing"
    message = error["msg"]
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        message = "expected a mapping of fields"
    return f"{where}: {dotted}: {message} (got {_describe(error.get('input'))})"


# ---------------------------------------------------------------------------------------------- the loader


@dataclass(frozen=True)
class RecipeSource:
    """A recipe file read with its `extends:` parents, before overrides: the merged mapping and where each of its
    keys was written. `resolve_recipe` never changes it, so one read serves many overrides (a sweep's points,
    the bad-input walk of tests/test_bad_input.py)."""

    path: Path
    data: dict
    positions: dict[Path_, Origin]
    origin: Origin  # where a problem with no position of its own is reported: the file (or built-in) itself


def read_recipe(path_or_name: str | Path) -> RecipeSource:
    """Find and read a recipe file or built-in with its parents; raise RecipeError naming the file."""
    reference = str(path_or_name)
    path = _locate(reference, None)
    if path is None:
        if reference.endswith((".yaml", ".yml")) or "/" in reference:
            raise RecipeError([f"{reference}: no such file"])
        close = difflib.get_close_matches(reference, builtin_recipes(), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise RecipeError(
            [f"{reference}: no recipe file or built-in named so{hint} (built-ins: {', '.join(builtin_recipes())})"]
        )
    try:
        data, positions = _read_with_parents(path, ())
    except SourceError as error:
        raise RecipeError(error.problems) from None
    return RecipeSource(path, data, positions, Origin(_display(path)))


def resolve_recipe(source: RecipeSource, overrides: Iterable[str] = (), *, check_files: bool = True) -> Recipe:
    """Apply `--set` overrides and the cluster profile to a read recipe, validate the schema, then run the rules;
    raise RecipeError listing every problem. `check_files`: as load_recipe's."""
    from .rules import check_recipe

    # Shallow copies: _apply_overrides copies each mapping it changes, and nothing after it changes one in place.
    path, data, positions = source.path, dict(source.data), dict(source.positions)
    problems = _apply_overrides(data, positions, overrides)
    data["extends"] = None
    default = source.origin

    launch = data.get("launch")
    if isinstance(launch, dict) and isinstance(launch.get("cluster"), str):
        try:
            data["launch"] = apply_cluster_profile(launch, path.parent)
        except ClusterProfileError as error:
            problems.append(f"{_where(('launch', 'cluster'), positions, default)}: launch.cluster: {error}")

    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as error:
        problems.extend(_schema_problem(e, positions, default) for e in error.errors())
        raise RecipeError(problems) from None
    if problems:
        raise RecipeError(problems)

    # Relative paths inside a recipe (data, tokenizer, checkpoints, run_dir) are relative to the working
    # directory, as run_dir is: the launcher and every rank start there.
    rule_problems = check_recipe(recipe, check_files=check_files)
    if rule_problems:
        raise RecipeError([f"{_where(p.path, positions, default)}: {p}" for p in rule_problems])
    return recipe


def load_recipe(path_or_name: str | Path, overrides: Iterable[str] = (), *, check_files: bool = True) -> Recipe:
    """Load, merge, override and validate a recipe; raise RecipeError listing every problem.

    `check_files=False` skips the checks that look at the filesystem (data paths, checkpoints), for tools that
    only transform recipes.
    """
    return resolve_recipe(read_recipe(path_or_name), overrides, check_files=check_files)


def dump_recipe(recipe: Recipe) -> str:
    """The resolved recipe as YAML: every default filled, loadable again with the same result."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, width=120)
