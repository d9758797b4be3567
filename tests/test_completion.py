"""Shell completion: typer's --install-completion / --show-completion, and the names that
complete (demo and break names, --model presets). Each case runs `kvcache` as the shell's
completion hook runs it: in a fresh process with _KVCACHE_COMPLETE set."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvcache_cli.cli import app

# As the installed script runs it; the program's name, kvcache, picks the variable it reads.
KVCACHE = [sys.executable, "-c",
           "import sys; sys.argv[0] = 'kvcache'; from kvcache_cli.cli import main; main()"]


def complete(words: str) -> list[str]:
    """What bash would be offered after WORDS (the last word is the one being completed)."""
    env = {**os.environ, "_KVCACHE_COMPLETE": "complete_bash", "COMP_WORDS": words,
           "COMP_CWORD": str(len(words.split()) - 1)}
    done = subprocess.run(KVCACHE, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_help_offers_install_and_show_completion():
    from typer.testing import CliRunner

    out = CliRunner().invoke(app, ["--help"]).stdout
    assert "--install-completion" in out and "--show-completion" in out


@pytest.mark.parametrize("words, expected", [
    ("kvcache si", ["size"]),
    ("kvcache size --mo", ["--model"]),
    ("kvcache size --model llama-3", ["llama-3-8b", "llama-3-70b", "llama-3.1-405b"]),
    ("kvcache demo m", ["macs", "mask", "memory"]),
    ("kvcache break st", ["stale-cache"]),
    # the Llama ones and Gemma 3's, from the registry
    ("kvcache break rope", ["rope-decode", "rope-twice", "rope-bases-swapped"]),
])
def test_names_complete(words, expected):
    assert complete(words) == expected
