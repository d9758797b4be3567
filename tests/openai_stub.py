"""A small OpenAI-compatible streaming server for `kvcache serve --target`'s tests, which can
be told to misbehave.

It answers what vLLM's API server answers and what kvcache's client reads: GET /v1/models
(one model, owned by "stub"), GET /version, GET /metrics (vLLM's metric names, counting
what it served), and POST /v1/completions streamed as server-sent events, a token a chunk
(two with `chunk_tokens=2`), a usage event, then `data: [DONE]`. A reply is `max_tokens`
long, or with `stop_token_ids` (a chat workload) stops after 3 + len(prompt) % 4 tokens.
What it can be told to do instead (`Behaviour`): answer HTTP 500 from the n-th request on,
cut the n-th stream mid-reply, stream slowly, answer /v1/models with HTML or a 404, stream
an event that is not JSON, answer a request with one JSON body (not a stream), have no
/metrics. Standard library only; it listens on
127.0.0.1 on a free port.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "stub-model"
POOL_BLOCKS, BLOCK_SIZE = 100, 16


@dataclass
class Behaviour:
    """What the stub does now; a test sets it, the `stub` fixture resets it."""

    fail_from: int | None = None  # requests from this index on answer HTTP 500
    cut_at: int | None = None  # this request's stream closes after 2 chunks, no [DONE]
    token_s: float = 0.002  # seconds between chunks
    models: str = "ok"  # "ok", "html" (not JSON), "404"
    bad_event_at: int | None = None  # this request streams an event that is not JSON
    whole_at: int | None = None  # this request's reply is one JSON body, as without stream
    metrics: bool = True
    chunk_tokens: int = 1  # tokens a chunk carries
    # What it saw: every request body, in the order they came.
    bodies: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # vLLM's counters and gauges, as /metrics shows them
    running: int = 0
    most_running: int = 0  # the most requests it streamed at once
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    tokens_held: int = 0


class _Handler(BaseHTTPRequestHandler):
    server_version = "stub/1"
    protocol_version = "HTTP/1.0"  # a stream ends when the connection closes

    def log_message(self, *args) -> None:  # quiet: the tests print nothing
        pass

    @property
    def behaviour(self) -> Behaviour:
        return self.server.behaviour

    def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        b = self.behaviour
        if self.path == "/v1/models":
            if b.models == "404":
                return self._send(404, b"Not Found", "text/plain")
            if b.models == "html":
                return self._send(200, b"<html><body>hello</body></html>", "text/html")
            data = {"object": "list",
                    "data": [{"id": MODEL, "object": "model", "owned_by": "stub"}]}
            return self._send(200, json.dumps(data).encode())
        if self.path == "/version":
            return self._send(200, b'{"version": "0.1"}')
        if self.path == "/metrics" and b.metrics:
            return self._send(200, self._metrics().encode(), "text/plain; version=0.0.4")
        return self._send(404, b'{"detail": "Not Found"}')

    def _metrics(self) -> str:
        b = self.behaviour
        with b.lock:
            usage = min(1.0, b.tokens_held / (POOL_BLOCKS * BLOCK_SIZE))
            return "\n".join([
                "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
                "# TYPE vllm:kv_cache_usage_perc gauge",
                f'vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} {usage}',
                f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} {b.running}',
                "# TYPE vllm:num_preemptions counter",
                f'vllm:num_preemptions_total{{engine="0",model_name="{MODEL}"}} '
                f"{float(b.preemptions)}",
                f'vllm:num_preemptions_created{{engine="0",model_name="{MODEL}"}} 1.7e9',
                f'vllm:prefix_cache_queries_total{{engine="0",model_name="{MODEL}"}} '
                f"{float(b.prefix_queries)}",
                f'vllm:prefix_cache_hits_total{{engine="0",model_name="{MODEL}"}} '
                f"{float(b.prefix_hits)}",
                f'vllm:cache_config_info{{block_size="{BLOCK_SIZE}",engine="0",'
                f'num_gpu_blocks="{POOL_BLOCKS}",kv_cache_size_tokens="{POOL_BLOCKS * BLOCK_SIZE}"'
                "} 1.0", ""])

    def do_POST(self) -> None:  # noqa: N802
        b = self.behaviour
        if self.path == "/reset_prefix_cache" and os.environ.get("VLLM_SERVER_DEV_MODE") == "1":
            return self._send(200, b"")  # vLLM serves it in its dev mode only
        if self.path != "/v1/completions":
            return self._send(404, b'{"detail": "Not Found"}')
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with b.lock:
            index = len(b.bodies)
            b.bodies.append(body)
        if body.get("model") != MODEL:
            return self._send(404, json.dumps({"error": {
                "message": f"The model `{body.get('model')}` does not exist."}}).encode())
        if b.fail_from is not None and index >= b.fail_from:
            return self._send(500, b'{"error": {"message": "stub: internal error"}}')
        prompt, cap = body["prompt"], body["max_tokens"]
        if b.whole_at == index:
            return self._send(200, json.dumps({"object": "text_completion", "choices": [
                {"index": 0, "text": " tok" * cap, "finish_reason": "length"}]}).encode())
        n = min(cap, 3 + len(prompt) % 4) if body.get("stop_token_ids") else cap
        with b.lock:
            b.running += 1
            b.most_running = max(b.most_running, b.running)
            b.tokens_held += len(prompt) + n
            b.prefix_queries += len(prompt)
            b.prefix_hits += min(len(prompt) - 1, 16) if index else 0
            b.preemptions += index % 4 == 3
        try:
            self._stream(b, index, prompt, n, cap)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client cut it: what a server sees when a client gives up
        finally:
            with b.lock:
                b.running -= 1
                b.tokens_held -= len(prompt) + n

    def _stream(self, b: Behaviour, index: int, prompt, n: int, cap: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        sent = chunks = 0
        while sent < n:
            time.sleep(b.token_s)
            k = min(b.chunk_tokens, n - sent)
            sent += k
            chunks += 1
            finish = None if sent < n else ("length" if sent == cap else "stop")
            event = {"id": f"cmpl-{index}", "object": "text_completion", "model": MODEL,
                     "choices": [{"index": 0, "text": " tok" * k, "finish_reason": finish}]}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            if b.cut_at == index and chunks == 2:
                return  # the connection closes: no usage, no [DONE]
            if b.bad_event_at == index:
                self.wfile.write(b"data: <html>oops</html>\n\n")
                return
        usage = {"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                                          "total_tokens": len(prompt) + n}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())


class StubServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # a slow reply the client gave up on does not hold the close

    def __init__(self, port: int = 0):
        super().__init__(("127.0.0.1", port), _Handler)
        self.behaviour = Behaviour()
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start(self) -> StubServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        self.thread.join(timeout=5)

    def reset(self) -> Behaviour:
        self.behaviour = Behaviour()
        return self.behaviour
