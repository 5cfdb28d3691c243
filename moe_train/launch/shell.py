"""Quoting for the three places recipe values land in a rendered job: the shell, #SBATCH lines, file patterns.

Recipes come from users, sweeps and `--set`; a run_dir or an env value holding `$(...)` must reach the job as
text, never run. Shell words go through shlex.quote. #SBATCH lines are not read by a shell but by sbatch's own
tokenizer (double quotes group, backslash escapes) and cannot span lines, so values with newlines are refused.
`launch.setup` lines are the one exception: trusted shell by design, written as they are.
"""

from __future__ import annotations

import re
import shlex

IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SBATCH_PLAIN = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")


class LaunchError(ValueError):
    """Launch input that cannot be rendered safely; `problems` holds one line per problem (exit code 2)."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def sh(value: object) -> str:
    """One shell word that the shell reads back as exactly `value`."""
    return shlex.quote(str(value))


def sh_join(words: list[object]) -> str:
    return " ".join(sh(word) for word in words)


def one_line(field: str, value: str) -> list[str]:
    """A problem when `value` would break out of its line (newline, carriage return, NUL)."""
    if any(c in value for c in "\n\r\0"):
        return [f"{field}: must be one line (a newline would break out of the job script's line)"]
    return []


def sbatch_value(value: str) -> str:
    """A value as sbatch's #SBATCH tokenizer reads it back: bare when plain, else double-quoted with escapes."""
    if SBATCH_PLAIN.match(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def slurm_filename(path: str) -> str:
    """A literal path for --output: SLURM expands `%j`-style patterns, `%%` is a literal percent sign."""
    return path.replace("%", "%%")


def env_name_problems(env: dict[str, str], field: str = "launch.env") -> list[str]:
    """Env names become `export NAME=...`: anything but an identifier would be shell syntax."""
    return [f"{field}: {name!r} is not a valid environment variable name" for name in env
            if not IDENTIFIER.match(name)]
