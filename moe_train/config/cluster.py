"""Cluster profiles: launch defaults (partition, account, GPUs per node, setup, ...) kept out of recipes.

A recipe names its cluster with `launch.cluster: NAME|PATH`, so the same recipe runs on several clusters by
changing one line (or `--set launch.cluster=other`). The profile is a YAML mapping of `launch` fields; the
recipe's own launch values override it. This module finds and reads a profile; the loader merges it into the
raw launch mapping before schema validation (config.loader.apply_cluster_profile), so a profile gets the same
checks as a recipe, and merging follows the one rule `extends:` uses.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from .schema import LaunchConfig
from .yaml_source import load_value

ENV_VAR = "MOE_TRAIN_CLUSTERS"
USER_FOLDER = Path("~/.config/moe-train/clusters")
PROFILE_FIELDS = frozenset(LaunchConfig.model_fields) - {"cluster"}


class ClusterProfileError(ValueError):
    """A cluster profile that is missing or invalid; the message is one line."""


def profile_search_path() -> list[Path]:
    """Folders searched for `NAME.yaml`, in order: each entry of $MOE_TRAIN_CLUSTERS, then the user folder."""
    folders = [Path(p).expanduser() for p in os.environ.get(ENV_VAR, "").split(os.pathsep) if p]
    return [*folders, USER_FOLDER.expanduser()]


def find_profile(reference: str, base_dir: Path) -> Path:
    """A profile reference is a path (relative to the recipe's folder) when it has a '/' or a YAML suffix,
    else a name looked up in `profile_search_path()`."""
    if "/" in reference or reference.endswith((".yaml", ".yml")):
        path = Path(reference).expanduser()
        if not path.is_absolute():
            path = base_dir / path
        if not path.is_file():
            raise ClusterProfileError(f"cluster profile file {path} does not exist")
        return path
    folders = profile_search_path()
    for folder in folders:
        path = folder / f"{reference}.yaml"
        if path.is_file():
            return path
    searched = ", ".join(str(f) for f in folders)
    raise ClusterProfileError(f"no cluster profile '{reference}' ({reference}.yaml not in {searched}; set ${ENV_VAR})")


def load_profile(path: Path) -> dict[str, Any]:
    """Read a profile: a mapping whose keys are launch fields (anything but `cluster`)."""
    try:
        data = load_value(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        reason = str(error).replace("\n", " ")
        raise ClusterProfileError(f"cluster profile {path}: cannot be read: {reason}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ClusterProfileError(f"cluster profile {path}: expected a mapping of launch fields")
    unknown = sorted(str(key) for key in data if key not in PROFILE_FIELDS)
    if unknown:
        allowed = ", ".join(sorted(PROFILE_FIELDS))
        raise ClusterProfileError(f"cluster profile {path}: unknown launch field(s) {', '.join(unknown)}; allowed: "
                                  f"{allowed}")
    for key in ("env", "slurm"):
        if key in data and not isinstance(data[key], dict):
            raise ClusterProfileError(f"cluster profile {path}: {key} must be a mapping")
    return data


def cluster_profile(reference: str, base_dir: Path) -> dict[str, Any]:
    """The launch defaults a recipe's `launch.cluster: reference` names (ClusterProfileError when it cannot)."""
    if not isinstance(reference, str) or not reference.strip():
        raise ClusterProfileError("launch.cluster must be a profile name or a path to a YAML file")
    return load_profile(find_profile(reference.strip(), Path(base_dir)))
