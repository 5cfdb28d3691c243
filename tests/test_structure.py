"""The package's shape: which half may import which, and the one way a file is replaced atomically."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import moe_train
from moe_train.atomic import atomic_path, write_atomic

PACKAGE = Path(moe_train.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of every module a source file imports, relative imports resolved, function bodies included."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


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
