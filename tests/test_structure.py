"""The package's shape: which half may import which, and the one way a file is replaced atomically.

The layering (docs/architecture.md), each rule a test below:
- the login half (cli, config, launch, plan) never imports torch or the compute half (models, parallel, train,
  measure, checkpoint, data): config, launch and plan nowhere, function bodies included; cli not at module
  level (a command that trains, measures or converts imports the compute half inside its function), except
  the torch-free checkpoint modules `moe-train run` reads the resume policy with (LOGIN_MAY_IMPORT);
- train/ never imports launch/; models/ never imports parallel/;
- in models/, torch.distributed only where a model meets its process groups: DTensor-aware init, the
  dispatcher extension point and the balancing-loss collectives (MODELS_MAY_USE_DISTRIBUTED);
- the mesh dimension names are written down once (config/mesh_shape.py);
- the project points only at itself: no tracked file names a document outside the repository (the
  engineers' shared notes it was built from), only docs/.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import moe_train
from moe_train.atomic import atomic_path, write_atomic

PACKAGE = Path(moe_train.__file__).parent


ROOT = PACKAGE.parent
LOGIN_HALF = ("cli", "moe_train/config", "moe_train/launch", "moe_train/plan", "moe_train/models/declarations")
COMPUTE_HALF = ("torch", "moe_train.models", "moe_train.parallel", "moe_train.train", "moe_train.measure",
                "moe_train.checkpoint", "moe_train.data")
# Compute-half modules the login half may import at module level: torch-free (test_login_half_loads_no_torch
# imports them), read by `moe-train run` to check the resume policy before anything trains.
LOGIN_MAY_IMPORT = frozenset({"moe_train.checkpoint.layout", "moe_train.checkpoint.manifest",
                              "moe_train.checkpoint.resume"})
# The module declarations (models/declarations): torch-free data beside the modules, which the planner computes
# from (importing it loads models/__init__.py, which loads no torch either: test_login_half_loads_no_torch).
DECLARATIONS = frozenset({"moe_train.models.declarations"})
# models/ files that may import torch.distributed, by why.
MODELS_MAY_USE_DISTRIBUTED = frozenset({
    "models/init.py",  # DTensor-aware initialisation: each rank fills its shard of the full tensor
    "models/fp8/all_gather.py",  # FSDP2's fp8 all-gather: the amax all-reduce over the shard group, DTensor shards
    "models/moe/dispatcher.py",  # the dispatcher extension point that parallelize replaces
    "models/moe/dispatch_alltoall.py",
    "models/moe/dispatch_hierarchical.py",
    "models/moe/dispatch_allgather.py",
    "models/moe/dispatch_collectives.py",  # the dispatchers' autograd collectives
    "models/moe/collective_turns.py",  # ep_overlap's turn-taking: the dispatch collectives issued async, waited in turn
    "models/moe/expert_group.py",  # the dispatchers' process group and its rank
    "models/moe/aux_loss.py",  # balancing-loss collectives: token counts over the sequence's ranks
    "models/moe/layer.py",  # global_aux_loss's token counts over tp and dp
    # Today's exception, removed by the `models` helper (issue 20 item 6): the experts unwrap DTensor weights.
    "models/moe/experts.py",
    # The same exception for gpt-oss's attention sinks: under tp a DTensor sharded with the heads, unwrapped.
    "models/attention.py",
})
MESH_DIMS = {"pp", "dp", "cp", "tp", "edp", "ep", "etp"}


def _imported_modules(path: Path, *, module_level_only: bool = False) -> set[str]:
    """Absolute names of every module a source file imports, relative imports resolved, function bodies included
    (or only the imports that run when the module loads: not those inside a function)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names = set()
    tree = ast.parse(path.read_text())
    nodes = _module_level(tree) if module_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _module_level(node: ast.AST):
    """Every node that runs when a module loads: all of it but function bodies (class bodies and `if` blocks run;
    `if TYPE_CHECKING:` blocks are left out too, since they never run)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            continue
        yield child
        yield from _module_level(child)


def _sources(*folders: str) -> list[Path]:
    return sorted(path for folder in folders for path in (ROOT / folder).rglob("*.py"))


def _offenders(paths: list[Path], forbidden: tuple[str, ...], *, module_level_only: bool = False,
               allowed: frozenset[str] = frozenset()) -> dict[str, list[str]]:
    """{file: the forbidden modules it imports} (a module counts with everything under it)."""
    def under(name: str, modules) -> bool:
        return any(name == module or name.startswith(module + ".") for module in modules)

    out = {}
    for path in paths:
        found = sorted(name for name in _imported_modules(path, module_level_only=module_level_only)
                       if under(name, forbidden) and not under(name, allowed))
        if found:
            out[str(path.relative_to(ROOT))] = found
    return out


def _module_name(path: Path) -> str:
    """The import name of a source file (cli/ is installed as moe_train.cli)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = ("moe_train", *parts) if parts[0] == "cli" else parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_config_launch_and_plan_never_import_torch_or_the_compute_half():
    """Function bodies included: these run on login nodes, whatever the command; the module declarations are
    the one part of models/ they read."""
    login = _sources("moe_train/config", "moe_train/launch", "moe_train/plan", "moe_train/models/declarations")
    assert _offenders(login, COMPUTE_HALF, allowed=DECLARATIONS) == {}


def test_the_cli_imports_the_compute_half_only_inside_commands():
    """At module level only the listed torch-free checkpoint modules: `moe-train --help`, validate, plan and
    submit never load torch."""
    assert _offenders(_sources("cli"), COMPUTE_HALF, module_level_only=True, allowed=LOGIN_MAY_IMPORT) == {}


def test_login_half_loads_no_torch():
    """Every login-half module imported in one fresh interpreter: torch stays unloaded (this also holds the
    modules of LOGIN_MAY_IMPORT to being torch-free)."""
    modules = sorted(_module_name(path) for path in _sources(*LOGIN_HALF))
    code = textwrap.dedent(
        f"""
        import importlib, sys
        for name in {modules!r}:
            importlib.import_module(name)
            if "torch" in sys.modules:
                print("torch loaded by", name)
                break
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_train_never_imports_launch():
    """The ranks read the run folder's names from moe_train/run_files.py, not from the launcher."""
    assert _offenders(_sources("moe_train/train"), ("moe_train.launch",)) == {}


def test_models_never_import_parallel():
    """A model is written for one device; parallelize (parallel/) reaches into it through its extension points."""
    assert _offenders(_sources("moe_train/models"), ("moe_train.parallel",)) == {}


def test_models_use_torch_distributed_only_where_listed():
    users = {name for name in _offenders(_sources("moe_train/models"), ("torch.distributed",))}
    assert sorted(users - {f"moe_train/{name}" for name in MODELS_MAY_USE_DISTRIBUTED}) == []


def test_the_mesh_dimensions_are_written_down_once():
    """No tuple, list or set of three or more mesh dimension names outside config/mesh_shape.py: a new dimension
    (or a reordering) is one change there, and everything else reads DENSE_DIMS and EXPERT_DIMS."""
    found = []
    for path in _sources("moe_train", "cli"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                names = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                if len(names) >= 3 and len(names) == len(node.elts) and set(names) <= MESH_DIMS:
                    found.append(str(path.relative_to(ROOT)))
    assert found == ["moe_train/config/mesh_shape.py"] * 2  # DENSE_DIMS, EXPERT_DIMS


def test_config_never_imports_launch():
    """Cluster profiles are merged by the config half; launch builds on config, never the other way round."""
    offenders = {}
    for path in sorted((PACKAGE / "config").glob("*.py")):
        launch = sorted(m for m in _imported_modules(path) if m.startswith("moe_train.launch"))
        if launch:
            offenders[path.name] = launch
    assert offenders == {}
    # The scan resolves relative imports: launch/rundir.py's `from .shell import LaunchError` is launch.shell.
    assert "moe_train.launch.shell" in _imported_modules(PACKAGE / "launch" / "rundir.py")


def test_atomic_module_imports_neither_torch_nor_a_half():
    code = textwrap.dedent(
        """
        import sys
        import moe_train.atomic
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy") or
                     m.startswith(("moe_train.config", "moe_train.launch"))))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "sub" / "pointer"
    write_atomic(target, "step-0000001\n")
    write_atomic(target, "step-0000002\n")
    assert target.read_text() == "step-0000002\n"
    write_atomic(target, b"\x00\xff")
    assert target.read_bytes() == b"\x00\xff"
    assert sorted(p.name for p in target.parent.iterdir()) == ["pointer"]


def test_a_failed_write_keeps_the_old_content(tmp_path):
    target = tmp_path / "config.json"
    write_atomic(target, "old")
    with pytest.raises(RuntimeError, match="writer died"), atomic_path(target) as tmp:
        tmp.write_text("half of the new")
        raise RuntimeError("writer died")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


# Documents outside the repository that files once cited; their content lives in docs/ (decisions.md,
# architecture.md, interfaces.md, testing.md).
OUTSIDE = ("../shared", "DECISIONS.md", "HELPERS.md", "INTERFACES.md", "ARCHITECTURE.md", "SCENARIOS.md")


def test_no_tracked_file_names_a_document_outside_the_repository():
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    this = Path(__file__).resolve().relative_to(ROOT).as_posix()
    files = [name for name in listed.decode().split("\0") if name and name != this]
    assert len(files) > 100 and "docs/decisions.md" in files  # the listing is the repository's
    cited = [f"{name}: {outside}" for name in files if (ROOT / name).is_file()
             for outside in OUTSIDE if outside in (ROOT / name).read_text(errors="replace")]
    assert cited == []


# A merge's conflict markers, committed by mistake, once sat in docs/interfaces.md for a whole stop.
CONFLICT_MARKER = re.compile(r"^(<{7} |={7}$|>{7} )", re.MULTILINE)


def test_no_tracked_file_holds_a_merge_conflict_marker():
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = [name for name in listed.decode().split("\0") if name and (ROOT / name).is_file()]
    assert len(files) > 100
    marked = [name for name in files if CONFLICT_MARKER.search((ROOT / name).read_text(errors="replace"))]
    assert marked == []
