"""Running the `kvcache` app in-process for tests, and what its refusals must look like."""

from __future__ import annotations

from typer.testing import CliRunner

from kvcache_cli.cli import app

runner = CliRunner()


def refusal(*args: str) -> str:
    """The one line `kvcache ARGS` refuses with (exit 2), asserted to be one line."""
    result = runner.invoke(app, list(args), env={"COLUMNS": "100"})
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]
