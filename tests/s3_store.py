"""A real S3 endpoint for the tests: moto's server on loopback, behind a fault-injecting proxy.

Every request of the code under test goes through the proxy: it logs each
request and can answer chosen ones with an error (503 SlowDown, 403
AccessDenied) or cut a response body short, the faults a real store produces
and moto does not. The fixtures (``moto_port``, ``proxy``, ``aws_env``) are in
conftest.py.
"""

from __future__ import annotations

import http.client
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3

ACCESS_KEY = "AKIATESTDIFFPREP0001"
SECRET_KEY = "secret-diffprep-never-shown-0123456789"
REGION = "us-east-1"


def admin_client(port: int):
    """The test's own client, straight to moto (not through the proxy): sets up and inspects the data."""
    return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name=REGION,
                        aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)


@dataclass
class Logged:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    status: int


class FaultProxy:
    """Forwards HTTP requests to ``upstream``; answers queued faults for a ``(method, path)`` first."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.log: list[Logged] = []
        self._faults: dict[tuple[str, str], list[tuple]] = {}
        self._lock = threading.Lock()
        handler = type("Handler", (_ProxyHandler,), {"proxy": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def inject(self, method: str, path: str, *faults: tuple) -> None:
        """Queue faults: ``("status", 503, "SlowDown")``, ``("truncate", nbytes)`` or ``("before", fn)`` (call
        ``fn`` first, then forward), one per request."""
        with self._lock:
            self._faults.setdefault((method, path), []).extend(faults)

    def take(self, method: str, path: str) -> tuple | None:
        with self._lock:
            queue = self._faults.get((method, path))
            return queue.pop(0) if queue else None

    def requests(self, method: str, path: str) -> list[Logged]:
        return [r for r in self.log if (r.method, r.path) == (method, path)]

    def reset(self) -> None:
        with self._lock:
            self._faults.clear()
            self.log.clear()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    proxy: FaultProxy

    def log_message(self, format: str, *args) -> None:
        pass

    def _forward(self) -> None:
        path, _, query = self.path.partition("?")
        body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
        fault = self.proxy.take(self.command, path)
        headers = dict(self.headers.items())
        if fault is not None and fault[0] == "before":
            fault[1]()  # something else happens first (another process's requests), then this one goes through
        if fault is not None and fault[0] == "status":
            _, status, code = fault
            self.proxy.log.append(Logged(self.command, path, query, headers, status))
            xml = f"<Error><Code>{code}</Code><Message>injected {code}</Message></Error>".encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(xml)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(xml)
            return
        upstream = http.client.HTTPConnection("127.0.0.1", self.proxy.upstream_port, timeout=30)
        try:
            upstream.request(self.command, self.path, body=body or None, headers=headers)
            response = upstream.getresponse()
            data = response.read()
            self.proxy.log.append(Logged(self.command, path, query, headers, response.status))
            self.send_response(response.status)
            for name, value in response.getheaders():
                if name.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                    self.send_header(name, value)
            self.send_header("Content-Length", response.getheader("Content-Length", "0")
                             if self.command == "HEAD" else str(len(data)))
            self.end_headers()
            if self.command == "HEAD":
                return
            if fault is not None and fault[0] == "truncate":
                self.wfile.write(data[: fault[1]])  # then hang up, as a dropped connection does
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(data)
        finally:
            upstream.close()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward
