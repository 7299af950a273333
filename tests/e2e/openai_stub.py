"""A tiny OpenAI-shaped streaming server (stdlib only) for testing the load-test harness.

It stands in for a real server's wire format, not for FASER: `/v1/models`, and streaming
`/v1/chat/completions` and `/v1/completions` that emit `max_tokens` one-word chunks over chunked
transfer encoding, a usage chunk and `data: [DONE]`. Every `reject_every`-th request is refused
with 503 and Retry-After, as a full replica queue would be.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "stub-model"


class StubState:
    def __init__(self, reject_every: int, token_delay_s: float) -> None:
        self.reject_every = reject_every
        self.token_delay_s = token_delay_s
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def admit(self, body: dict[str, Any]) -> bool:
        with self.lock:
            self.bodies.append(body)
            return not (self.reject_every and len(self.bodies) % self.reject_every == 0)


class StubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: StubState

    def log_message(self, *_args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if self.path not in ("/v1/chat/completions", "/v1/completions"):
            self._json(404, {"error": {"message": "not found"}})
        elif not self.state.admit(body):
            self._json(503, {"error": {"message": "queue full"}}, {"Retry-After": "1"})
        else:
            self._stream(body, chat=self.path.endswith("chat/completions"))

    def _json(self, code: int, payload: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        for name, value in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, body: dict[str, Any], chat: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        num_tokens = int(body.get("max_tokens") or 16)
        if chat:
            self._event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        for i in range(num_tokens):
            time.sleep(self.state.token_delay_s)
            piece = {"delta": {"content": f" w{i}"}} if chat else {"text": f" w{i}"}
            self._event({"choices": [{"index": 0, **piece, "finish_reason": None}]})
        usage = {"prompt_tokens": 7, "completion_tokens": num_tokens}
        self._event({"choices": [], "usage": {**usage, "total_tokens": 7 + num_tokens}})
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _event(self, payload: dict[str, Any]) -> None:
        self._chunk(f"data: {json.dumps(payload)}\n\n".encode())

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients hanging up at the end of a load test are expected


def start_stub(
    reject_every: int = 0, token_delay_s: float = 0.002
) -> tuple[QuietServer, StubState]:
    """Serve on 127.0.0.1 (a free port) in a daemon thread; `server.shutdown()` stops it."""
    state = StubState(reject_every, token_delay_s)
    handler = type("BoundStubHandler", (StubHandler,), {"state": state})
    server = QuietServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, state
