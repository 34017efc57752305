"""A scripted stand-in for the model, for tests that run the real `pi` (tests/pi/test_real_pi.py).

An HTTP server on loopback speaking the one provider API that both pi versions support for a
custom provider in `<agent dir>/models.json`: OpenAI chat completions (`api:
"openai-completions"`, `POST <baseUrl>/chat/completions`, answered as server-sent events when
the request says `"stream": true`).  Every answer is the next of a fixed list of texts, with no
tool calls, so what pi writes is known in advance; every request body is kept, so a test can
see what history pi sent (a fork's copied turns included).
"""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

PROVIDER = "standin"
MODEL = "scripted-model"
MAX_BODY = 16 << 20


@dataclass
class ScriptedModel:
    """The answers to give, in order (the last one repeats), and the requests received."""

    answers: Sequence[str]
    requests: list[dict[str, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def next_answer(self, request: dict[str, Any]) -> str:
        with self._lock:
            self.requests.append(request)
            return self.answers[min(len(self.requests), len(self.answers)) - 1]


def _chunks(answer: str, n: int) -> Iterator[dict[str, Any]]:
    """The SSE chunks of one streamed chat completion: role, the text in two pieces, the stop
    with usage (OpenAI's `stream_options.include_usage` shape)."""
    base = {"id": f"chatcmpl-standin{n}", "object": "chat.completion.chunk", "created": 1795300000,
            "model": MODEL}
    half = len(answer) // 2
    yield {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                "finish_reason": None}]}
    for piece in (answer[:half], answer[half:]):
        yield {**base, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
    yield {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
           "usage": {"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105}}


def _handler(model: ScriptedModel) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
            pass

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            length = int(self.headers.get("Content-Length") or 0)
            if not self.path.endswith("/chat/completions") or not 0 < length <= MAX_BODY:
                self.send_error(404 if length else 411)
                return
            request = json.loads(self.rfile.read(length))
            answer = model.next_answer(request)
            n = len(model.requests)
            if not request.get("stream"):
                body = json.dumps({"id": f"chatcmpl-standin{n}", "object": "chat.completion", "model": MODEL,
                                   "choices": [{"index": 0, "finish_reason": "stop",
                                                "message": {"role": "assistant", "content": answer}}],
                                   "usage": {"prompt_tokens": 100, "completion_tokens": 5,
                                             "total_tokens": 105}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            for chunk in _chunks(answer, n):
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

    return Handler


@contextmanager
def serve_model(model: ScriptedModel) -> Iterator[str]:
    """Serve `model` on 127.0.0.1 (any port) until the block ends; yields the base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(model))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def write_models_json(agent_dir: Path, base_url: str) -> None:
    """Point pi (started with PI_CODING_AGENT_DIR=agent_dir) at the stand-in: a custom provider
    in `<agent dir>/models.json`, the file both versions read for custom providers."""
    agent_dir.mkdir(parents=True, exist_ok=True)
    config = {"providers": {PROVIDER: {
        "baseUrl": base_url, "api": "openai-completions", "apiKey": "standin-key",
        "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
        "models": [{"id": MODEL, "name": "Scripted stand-in", "reasoning": False, "input": ["text"],
                    "contextWindow": 128000, "maxTokens": 4096,
                    "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0}}]}}}
    (agent_dir / "models.json").write_text(json.dumps(config, indent=2))
