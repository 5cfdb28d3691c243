"""The distribution: every package installed under moe_train, built-ins found after a plain install, README and CI
in agreement."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = {folder: name for name, folder in config["package-dir"].items()}
    found = set()
    for init in ROOT.glob("**/__init__.py"):
        folder = init.parent.relative_to(ROOT)
        top = folder.parts[0]
        if top not in mapping:
            continue
        found.add(".".join([mapping[top], *folder.parts[1:]]))
    assert found == listed, f"missing: {found - listed}, stale: {listed - found}"


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.+?)\n```", readme.split("## Set up on a fresh machine")[1].split("\n## ")[0])
    assert len(commands) == 2
    assert all(command.startswith("pip install torch==2.13.0 && ") for command in commands)
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


@pytest.mark.slow
def test_ci_runs_the_tests_in_a_new_environment(tmp_path):
    """.ci/run's lines before the test command, run as CI runs them: the interpreter that then installs and runs
    the tests lives in a new folder and sees none of this machine's packages (an older pytest left by an earlier
    install must not decide the result)."""
    script = (ROOT / ".ci" / "run").read_text()
    setup = script[script.index("venv="):script.index("pip install torch==2.13.0")]
    probe = 'python -c "import sys, importlib.util as u; print(sys.prefix); print(u.find_spec(\'pytest\') is None)"'
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", setup + probe], cwd=ROOT, capture_output=True, text=True,
                         env={"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path)}, timeout=120)
    assert out.returncode == 0, out.stderr
    prefix, fresh = out.stdout.split()
    assert Path(prefix).parent == tmp_path and fresh == "True", out.stdout
    assert list(tmp_path.iterdir()) == [], "the environment is removed when the run ends"


@pytest.mark.slow
def test_plain_install_resolves_builtins_outside_the_repository(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target),
         str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )
    assert not (target / "cli").exists(), "no top-level module named cli on users' sys.path"
    code = textwrap.dedent(
        """
        import importlib.resources, moe_train
        from moe_train.config import load_recipe
        from moe_train.cli.main import app
        assert moe_train.__file__.startswith(SITE), moe_train.__file__
        assert load_recipe("deepseek-v3-tiny").model.family == "deepseek_v3"
        assert importlib.resources.files("moe_train.slurm").joinpath("job.sbatch.j2").is_file()
        print(sorted(p.name for p in importlib.resources.files("moe_train.recipes").iterdir() if p.suffix == ".yaml"))
        """
    ).replace("SITE", repr(str(target)))
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "qwen3-moe-tiny.yaml" in out.stdout
