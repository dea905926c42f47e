"""A loopback HTTP server that speaks enough of the Anthropic Messages API for the real ``anthropic`` SDK.

``POST /v1/messages`` answers with the next entry of a script, and every request is recorded (path, headers,
JSON body) in ``server.requests``, in memory only. A script entry is

- a reply: ``reply(text("..."), tool_use("read_file", {"path": "updater.py"}), usage=...)``;
- an error: ``error(429, "rate_limit_error", "slow down", headers={"retry-after": "0"})``;
- or a function of the request's JSON body returning one of those (to answer from what the client sent).

When the script runs out the server answers 400 ``script exhausted``, which the client treats as a failure, so
an unexpected extra request shows in the test. Use it as a context manager::

    with MessagesServer([reply(text("done"))]) as server:
        client = anthropic.Anthropic(api_key="k", base_url=server.url)
"""

from __future__ import annotations

import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

USAGE = {"input_tokens": 1200, "output_tokens": 300, "cache_creation_input_tokens": 2000,
         "cache_read_input_tokens": 0}
_ids = itertools.count(1)


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def tool_use(name: str, arguments: dict[str, Any], tool_id: str | None = None) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_id or f"toolu_{next(_ids):06d}", "name": name, "input": arguments}


def reply(*blocks: dict[str, Any], usage: dict[str, int] | None = None, stop_reason: str | None = None) -> dict:
    """A 200 answer: an assistant message with ``blocks``; stop_reason ``tool_use`` when a block calls a tool."""
    calls = any(block["type"] == "tool_use" for block in blocks)
    return {"status": 200, "body": {
        "type": "message", "role": "assistant", "content": list(blocks),
        "stop_reason": stop_reason or ("tool_use" if calls else "end_turn"), "stop_sequence": None,
        "usage": dict(usage or USAGE)}}


def error(status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> dict:
    return {"status": status, "headers": dict(headers or {}),
            "body": {"type": "error", "error": {"type": kind, "message": message}}}


def last_tool_results(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool_result blocks of the last user turn of a request body."""
    content = body["messages"][-1]["content"]
    return [block for block in content if isinstance(block, dict) and block.get("type") == "tool_result"]


class _Server(ThreadingHTTPServer):
    """The loopback server; a request still being handled after the ``with`` block (a script step that sleeps past
    its client, killed at its limit) ends without a traceback: printed then, it would land in whatever later test
    of the same worker captures stderr."""

    daemon_threads = True
    closed = False

    def handle_error(self, request, client_address) -> None:
        if not self.closed:
            super().handle_error(request, client_address)


class MessagesServer:
    def __init__(self, script: list[Any]):
        self.script = list(script)
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [r["body"] for r in self.requests]

    def _next(self, body: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.requests.append({"body": body, **meta})
            entry = self.script.pop(0) if self.script else error(400, "invalid_request_error", "script exhausted")
        if callable(entry):
            entry = entry(body)
        if entry["status"] == 200:
            entry["body"] = {"id": f"msg_{next(_ids):06d}", "model": body.get("model"), **entry["body"]}
        return entry

    def __enter__(self) -> MessagesServer:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802 - the http.server interface
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {"unparsed": raw.decode(errors="replace")}
                meta = {"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}}
                if not self.path.startswith("/v1/messages"):
                    entry = error(404, "not_found_error", f"no route {self.path}")
                else:
                    entry = outer._next(body, meta)
                data = json.dumps(entry["body"]).encode()
                self.send_response(entry["status"])
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.send_header("request-id", f"req_{next(_ids):06d}")
                for name, value in entry.get("headers", {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # quiet
                pass

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="messages-server", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
