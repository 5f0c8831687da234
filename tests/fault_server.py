"""A small fault-injecting OpenAI-compatible server for tests and benchmarks (stdlib only).

`FaultServer` answers `GET /v1/models` and `POST /v1/chat/completions` on 127.0.0.1 (a free port) from a
thread-per-request `ThreadingHTTPServer`. What each chat request gets is scripted: `script(...)` queues
`Behaviour`s consumed one per request, in arrival order; when the queue is empty `default` applies.
Behaviours: a delay, an HTTP error status (with an optional `Retry-After`), a malformed JSON body, a
non-JSON body, a dropped connection, empty content, no choices. It records every request (body and
headers) and the highest number of requests in flight at once, so tests can assert on retries, the
semaphore and the cache (requests that never reached the server).

The reply text echoes the last user message (`echo: …`) unless a behaviour names one or a `responder`
(messages → text) is given, which answers by content; token counts are whitespace word counts, so tests can
compute costs by hand.

Run standalone (the latency benchmark does, so the server has its own process and GIL):
    python tests/fault_server.py --delay 0.2 [--port 0]     # prints the port on stdout, serves forever
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal, Self

Kind = Literal["ok", "status", "malformed", "not_json", "drop", "empty", "no_choices"]


@dataclass
class Behaviour:
    """What the server does with one chat request."""

    kind: Kind = "ok"
    delay_s: float = 0.0
    """Sleep before acting (for `drop`, before dropping)."""
    status: int = 500
    """HTTP status for kind `status`."""
    retry_after: str | None = None
    """`Retry-After` header value sent with kind `status`."""
    text: str | None = None
    """Reply text for kind `ok` (default: echo of the last user message)."""
    finish_reason: str = "stop"
    """`finish_reason` of the choice (`length` stands for a reply cut at max_tokens)."""


@dataclass
class RecordedRequest:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    """Lower-cased header names."""
    at: float = field(default_factory=time.monotonic)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # listen backlog: 32+ clients connect at once in the latency benchmark


def _words(text: str) -> int:
    return len(text.split())


class FaultServer:
    """A scripted OpenAI-compatible chat server in a background thread; use as a context manager."""

    def __init__(self, default: Behaviour | None = None, *, model: str = "fault-model", port: int = 0,
                 responder: Callable[[list[dict[str, Any]]], str] | None = None) -> None:
        self.default = default or Behaviour()
        self.responder = responder
        """Reply text from the request's messages, for `ok` behaviours that name no text (default: echo)."""
        self.model = model
        self._queue: deque[Behaviour] = deque()
        self._lock = threading.Lock()
        self.requests: list[RecordedRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._httpd = _HTTPServer(("127.0.0.1", port), self._handler_class())
        self._thread: threading.Thread | None = None

    # -- control ----------------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        """Base URL ending in /v1, as `EnvironmentConfig.url`."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def chat_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.path.endswith("/chat/completions")]

    def script(self, *behaviours: Behaviour) -> FaultServer:
        """Queue behaviours for the next requests (one each, in order)."""
        with self._lock:
            self._queue.extend(behaviours)
        return self

    def reset(self) -> None:
        with self._lock:
            self._queue.clear()
            self.requests.clear()
            self.max_in_flight = self.in_flight

    def start(self) -> FaultServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fault-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- request handling -------------------------------------------------------------------------------

    def _next(self) -> Behaviour:
        with self._lock:
            return self._queue.popleft() if self._queue else self.default

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as real servers do

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def setup(self) -> None:
                super().setup()
                # Headers and body leave in separate writes: without TCP_NODELAY, Nagle's algorithm and the
                # client's delayed ACK add ~40 ms to every response (real servers set it too).
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def _send(self, status: int, body: bytes, content_type: str = "application/json",
                      headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                server.requests.append(RecordedRequest(self.path, {}, {k.lower(): v for k, v in self.headers.items()}))
                if self.path.rstrip("/").endswith("/v1/models"):
                    body = {"object": "list", "data": [{"id": server.model, "object": "model", "owned_by": "test"}]}
                    self._send(200, json.dumps(body).encode())
                else:
                    self._send(404, b'{"error": {"message": "not found"}}')

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw or b"{}")
                except json.JSONDecodeError:
                    body = {"_raw": raw.decode("utf-8", "replace")}
                with server._lock:
                    server.requests.append(RecordedRequest(self.path, body, {k.lower(): v for k, v in self.headers.items()}))
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    if not self.path.rstrip("/").endswith("/chat/completions"):
                        self._send(404, b'{"error": {"message": "not found"}}')
                        return
                    self._chat(body, server._next())
                finally:
                    with server._lock:
                        server.in_flight -= 1

            def _chat(self, body: dict[str, Any], behaviour: Behaviour) -> None:
                if behaviour.delay_s:
                    time.sleep(behaviour.delay_s)
                kind = behaviour.kind
                if kind == "drop":
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    return
                if kind == "status":
                    headers = {"Retry-After": behaviour.retry_after} if behaviour.retry_after else {}
                    error = {"error": {"message": f"injected {behaviour.status}", "type": "injected"}}
                    self._send(behaviour.status, json.dumps(error).encode(), headers=headers)
                    return
                if kind == "malformed":
                    self._send(200, b'{"id": "x", "choices": [{"message": {"content": "trunc')
                    return
                if kind == "not_json":
                    self._send(200, b"<html>gateway says hi</html>", content_type="text/html")
                    return
                messages = body.get("messages") or []
                prompt_text = " ".join(str(m.get("content", "")) for m in messages)
                last_user = next((m.get("content", "") for m in reversed(messages) if m.get("role") == "user"), "")
                if kind == "empty":
                    text = ""
                elif behaviour.text is not None:
                    text = behaviour.text
                else:
                    text = server.responder(messages) if server.responder else f"echo: {last_user}"
                choices = [] if kind == "no_choices" else [
                    {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": behaviour.finish_reason}
                ]
                reply = {
                    "id": "chatcmpl-fault", "object": "chat.completion", "created": int(time.time()),
                    "model": body.get("model", server.model), "choices": choices,
                    "usage": {"prompt_tokens": _words(prompt_text), "completion_tokens": _words(text),
                              "total_tokens": _words(prompt_text) + _words(text)},
                }
                self._send(200, json.dumps(reply).encode())

        return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before every chat reply")
    parser.add_argument("--model", default="fault-model", help="model id listed by /v1/models")
    args = parser.parse_args(argv)
    server = FaultServer(Behaviour(delay_s=args.delay), port=args.port, model=args.model)
    sys.stdout.write(f"{server.port}\n")
    sys.stdout.flush()
    try:
        server._httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server._httpd.server_close()


if __name__ == "__main__":
    main()
