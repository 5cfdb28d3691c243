"""Running the CLI in-process for tests, with the checks every bad-input test shares."""

from __future__ import annotations

from dataclasses import dataclass

from typer.testing import CliRunner

from moe_train.cli.main import app


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str


def run_cli(*args: str) -> CliResult:
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"moe-train {' '.join(args)} raised {result.exception!r}") from result.exception
    return CliResult(result.exit_code, result.stdout, result.stderr)


def assert_bad_input(result: CliResult, *fragments: str) -> None:
    """Exit code 2, every fragment in the error output, one line per problem, no traceback."""
    assert result.code == 2, (result.code, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, result.stderr)
    for line in result.stderr.strip().splitlines():
        assert line.startswith("error: "), line
