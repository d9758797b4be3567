"""`kvcache size --model ORG/NAME`: a Hub repository's config.json, read through a Hub cache
laid out on disk in a temp dir. The network is never used: HF_HUB_OFFLINE=1, or an endpoint
on a closed local port. Each case runs the CLI in a fresh process, because huggingface_hub
reads HF_HUB_CACHE and HF_HUB_OFFLINE once, when it is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hubcache import QWEN_INSTRUCT, QWEN_INSTRUCT_COMMIT, add_snapshot

MAIN_COMMIT = QWEN_INSTRUCT_COMMIT
OLD_COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path) -> Path:
    cache = tmp_path / "hub"
    add_snapshot(cache, "Qwen/Qwen2.5-7B-Instruct", MAIN_COMMIT, QWEN_INSTRUCT, "main")
    # An older revision, tagged v0, with half the layers: a different answer to tell apart.
    add_snapshot(cache, "Qwen/Qwen2.5-7B-Instruct", OLD_COMMIT,
                 {**QWEN_INSTRUCT, "num_hidden_layers": 14}, "v0")
    return cache


def kvcache(cache: Path, *args: str, offline: bool = True, **env: str):
    """Run `kvcache ARGS` in a fresh process against CACHE, with no token and no network."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    clean |= {"HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent / "hf-home"),
              "COLUMNS": "100", **env}
    if offline:
        clean["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([sys.executable, "-m", "kvcache_cli", "size", *args],
                          capture_output=True, text=True, env=clean, timeout=60)


def test_hub_id_from_the_cache_offline_gives_qwen_instruct_figures(hub_cache):
    done = kvcache(hub_cache, "--model", "Qwen/Qwen2.5-7B-Instruct")
    assert done.returncode == 0, done.stderr
    # 2 (K and V) × 28 layers × 4 KV heads × 128 (3584 / 28) × 2 bytes (bf16) = 57,344 a token;
    # the default --seq is the config's 32,768-token window: 1,879,048,192 bytes = 1.75 GiB.
    assert "1.75 GiB (1.88 GB)  for 32,768 tokens" in done.stdout
    assert "per token: 57,344 bytes (56.00 KiB)" in done.stdout
    assert "= 2 × 28 × 4 × 128 × 32,768 × 2 × 1" in done.stdout
    assert "KV cache · Qwen/Qwen2.5-7B-Instruct: 28 layers, 28 heads, GQA-4" in done.stdout
    assert f"Qwen/Qwen2.5-7B-Instruct @ main ({MAIN_COMMIT[:7]})" in done.stdout


def test_hub_id_json_has_the_exact_bytes(hub_cache):
    done = kvcache(hub_cache, "-m", "Qwen/Qwen2.5-7B-Instruct", "--dtype", "bf16", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["bytes_per_token"] == 2 * 28 * 4 * 128 * 2
    assert data["total_bytes"] == 1_879_048_192


def test_revision_picks_that_snapshot(hub_cache):
    done = kvcache(hub_cache, "-m", "Qwen/Qwen2.5-7B-Instruct", "--revision", "v0", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["bytes_per_token"] == 2 * 14 * 4 * 128 * 2


def test_revision_as_a_commit_hash_reads_that_snapshot(hub_cache):
    done = kvcache(hub_cache, "-m", "Qwen/Qwen2.5-7B-Instruct", "--revision", OLD_COMMIT,
                   "--seq", "1024")
    assert done.returncode == 0, done.stderr
    assert f"@ {OLD_COMMIT} ({OLD_COMMIT[:7]})" in done.stdout
    assert "14 layers" in done.stdout


def test_offline_and_not_cached_is_one_line_offering_config(hub_cache):
    done = kvcache(hub_cache, "--model", "meta-llama/Llama-3.1-8B")
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert "'meta-llama/Llama-3.1-8B'" in done.stderr
    assert "not in the local Hub cache and HF_HUB_OFFLINE is set" in done.stderr
    assert "--config PATH" in done.stderr


def test_unknown_revision_offline_is_one_line(hub_cache):
    done = kvcache(hub_cache, "-m", "Qwen/Qwen2.5-7B-Instruct", "--revision", "v9")
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "'v9'" in done.stderr, done.stderr


def test_unreachable_hub_falls_back_to_the_cache_and_says_when_missing(hub_cache):
    # Port 9 on the loopback refuses at once: an online user whose network is down.
    endpoint = {"HF_ENDPOINT": "http://127.0.0.1:9"}
    done = kvcache(hub_cache, "-m", "Qwen/Qwen2.5-7B-Instruct", "--json", offline=False,
                   **endpoint)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["total_bytes"] == 1_879_048_192
    missing = kvcache(hub_cache, "-m", "org/not-cached", offline=False, **endpoint)
    assert missing.returncode == 2, missing.stderr
    assert "127.0.0.1 is unreachable" in missing.stderr and "--config" in missing.stderr


def test_a_preset_hub_id_stays_the_preset_unless_a_revision_is_given(hub_cache):
    preset = kvcache(hub_cache, "-m", "Qwen/Qwen2.5-7B", "--json")
    assert preset.returncode == 0, preset.stderr
    assert json.loads(preset.stdout)["shape"]["params"] == 7_615_616_512
    hub = kvcache(hub_cache, "-m", "Qwen/Qwen2.5-7B", "--revision", "main")
    assert hub.returncode == 2 and "not in the local Hub cache" in hub.stderr, hub.stderr


@pytest.mark.parametrize("args, expected", [
    (["-m", "llama-2-7b", "--revision", "main"], "--revision 'main' applies to a Hub id"),
    (["--layers", "2", "--kv-heads", "2", "--revision", "main"], "applies to a Hub id"),
    (["-m", "Qwen/Qwen2.5-7B-Instruct", "--layers", "2"], "cannot be combined with --model"),
])
def test_misused_revision_or_flags_are_one_line(hub_cache, args, expected):
    done = kvcache(hub_cache, *args)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and expected in done.stderr, done.stderr


def hub_answers(monkeypatch, error_type, message: str) -> None:
    """Make every download fail as the Hub would with ERROR_TYPE, without a network."""
    import huggingface_hub
    from huggingface_hub import constants

    def download(*args, **kwargs):
        # A stand-in for the Hub's HTTP answer: only the parts the error reads.
        raise error_type(message, response=SimpleNamespace(headers={}, request=None))

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)


def test_gated_repository_says_accept_the_licence(monkeypatch):
    from huggingface_hub import errors

    from kvcache_cli import hub

    hub_answers(monkeypatch, errors.GatedRepoError, "403 Client Error: gated repo")
    with pytest.raises(hub.HubError, match="gated: accept the licence and set HF_TOKEN"):
        hub.config_json("meta-llama/Llama-3.1-8B")


def test_a_hub_server_error_is_a_runtime_failure_in_one_line(monkeypatch):
    from huggingface_hub import errors
    from typer.testing import CliRunner

    from kvcache_cli.cli import app

    hub_answers(monkeypatch, errors.HfHubHTTPError, "503 Server Error: Service Unavailable")
    result = CliRunner().invoke(app, ["size", "--model", "org/model"])
    assert result.exit_code == 1, result.output
    assert result.stderr.count("\n") == 1, result.stderr
    assert "the Hub failed to serve 'org/model'" in result.stderr and "503" in result.stderr


def test_hub_id_spelling():
    from kvcache_cli.hub import is_hub_id

    assert is_hub_id("Qwen/Qwen2.5-7B-Instruct") and is_hub_id("a/b")
    assert not is_hub_id("llama-2-7b")
    assert not is_hub_id("/tmp/model") and not is_hub_id("./a/b") and not is_hub_id("a/b/c")


@pytest.mark.parametrize("args", [
    ["--layers", "32", "--kv-heads", "8", "--seq", "1"],
    ["--model", "llama-2-7b"],
    ["--model", "meta-llama/Llama-2-7b-hf"],
])
def test_size_without_a_hub_id_never_imports_huggingface_hub(args):
    probe = ("import sys; from kvcache_cli.cli import app; from typer.testing import CliRunner; "
             f"r = CliRunner().invoke(app, ['size', *{args!r}]); assert r.exit_code == 0, "
             "r.output; print('huggingface_hub' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
