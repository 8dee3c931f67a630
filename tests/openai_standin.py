"""A stand-in OpenAI-compatible server for the tests: real HTTP on 127.0.0.1, an ephemeral port, one thread.

It answers ``GET /v1/models`` and ``POST /v1/chat/completions`` as vLLM does, the caption made from the request
alone (a hash of its images' bytes, its text and its max_tokens), so the same request always gets the same caption
and a different frame another one. Every request is recorded (method, path, headers, JSON body). A test can make it
fail: ``fail_next`` answers the next N requests with an HTTP status (503: retried; 400: not), ``api_key`` makes it
refuse requests without that bearer key (401).

    with OpenAIStandin(model="tiny-vlm") as server:
        ServerCaptioner(CaptionSettings(model="tiny-vlm", server_url=server.url))...
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def standin_caption(body: dict[str, Any]) -> str:
    """The caption the stand-in gives a chat completions request: from its images' bytes, text and max_tokens."""
    digest = hashlib.sha256()
    for message in body.get("messages", []):
        content = message.get("content")
        for part in content if isinstance(content, list) else [{"type": "text", "text": content}]:
            if part.get("type") == "image_url":
                url = part["image_url"]["url"]
                digest.update(base64.b64decode(url.split(",", 1)[1]))
            elif part.get("type") == "text":
                digest.update(part["text"].encode("utf-8"))
    digest.update(str(body.get("max_tokens")).encode())
    return f"a caption {digest.hexdigest()[:16]}"


class OpenAIStandin:
    """The server; a context manager that starts it on enter and stops it on exit."""

    def __init__(self, model: str = "tiny-vlm", api_key: str | None = None) -> None:
        self.model = model
        self.api_key = api_key
        self.requests: list[dict[str, Any]] = []
        self.fail_next: list[int] = []  # HTTP statuses to answer the next requests with, in order
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, name="openai-standin", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def __enter__(self) -> OpenAIStandin:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self._answer(None)

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length", 0))
                self._answer(json.loads(self.rfile.read(length) or b"null"))

            def _answer(self, body: Any) -> None:
                with standin._lock:
                    standin.requests.append({"method": self.command, "path": self.path,
                                             "headers": dict(self.headers), "body": body})
                    failure = standin.fail_next.pop(0) if standin.fail_next else None
                if failure is not None:
                    return self._send(failure, {"error": {"message": f"stand-in failure {failure}"}})
                if standin.api_key is not None and self.headers.get("Authorization") != f"Bearer {standin.api_key}":
                    return self._send(401, {"error": {"message": "invalid api key"}})
                if self.command == "GET" and self.path == "/v1/models":
                    return self._send(200, {"object": "list", "data": [{"id": standin.model, "object": "model"}]})
                if self.command == "POST" and self.path == "/v1/chat/completions":
                    if body.get("model") != standin.model:
                        return self._send(404, {"error": {"message": f"model {body.get('model')} not found"}})
                    return self._send(200, {
                        "id": "chatcmpl-standin", "object": "chat.completion", "model": standin.model,
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": standin_caption(body)}}],
                    })
                return self._send(404, {"error": {"message": f"no route {self.command} {self.path}"}})

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode("utf-8")
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler
