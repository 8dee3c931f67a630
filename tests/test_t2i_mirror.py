"""The BLIP3o mirror through huggingface_hub's real download code, against a stand-in hub on 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

import pytest

from diffprep import contract
from diffprep.errors import ConfigError
from diffprep.tools.t2i_mirror import mirror_blip3o, parse_repo_overrides

FILES = {"Org/Long": {"00000.tar": b"a" * 700, "sub/00001.tar": b"b" * 300, "README.md": b"hi"}}
COMMIT = "0" * 40


class StandInHub(BaseHTTPRequestHandler):

    def log_message(self, *args) -> None:
        pass

    def _file(self, path: str) -> tuple[str, bytes] | None:
        # /datasets/<org>/<name>/resolve/<revision>/<file>
        parts = unquote(path).split("/")
        if len(parts) > 6 and parts[1] == "datasets" and parts[4] == "resolve":
            repo, name = f"{parts[2]}/{parts[3]}", "/".join(parts[6:])
            data = FILES.get(repo, {}).get(name)
            return (name, data) if data is not None else None
        return None

    def _send_file(self, body: bool) -> None:
        found = self._file(urlparse(self.path).path)
        if found is None:
            self.send_error(404)
            return
        _, data = found
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
        self.send_header("X-Repo-Commit", COMMIT)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def do_HEAD(self) -> None:
        self._send_file(False)

    def do_GET(self) -> None:
        path = urlparse(self.path).path
        if path.startswith("/api/datasets/") and "/tree/" in path:
            repo = "/".join(path.split("/")[3:5])
            entries = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                       for name, data in FILES.get(repo, {}).items()]
            body = json.dumps(entries).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self._send_file(True)


@pytest.fixture
def hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandInHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_mirror_lands_every_tar_where_gae_looks_and_resumes(tmp_path, hub, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    overrides = parse_repo_overrides(["long=Org/Long"])
    (result,) = mirror_blip3o(str(tmp_path), ["long"], overrides, endpoint=hub)
    folder = tmp_path / contract.T2I_SPLIT_FOLDERS["long"]
    assert sorted(p.name for p in folder.iterdir()) == ["00000.tar", "00001.tar"]
    assert (folder / "00001.tar").read_bytes() == b"b" * 300 and result.downloaded == ["00000.tar", "00001.tar"]
    # A cut file is downloaded again; a complete one is skipped.
    (folder / "00000.tar").write_bytes(b"a" * 10)
    (again,) = mirror_blip3o(str(tmp_path), ["long"], overrides, endpoint=hub)
    assert again.downloaded == ["00000.tar"] and again.skipped == ["00001.tar"]
    assert (folder / "00000.tar").read_bytes() == b"a" * 700
    with pytest.raises(ConfigError, match="split=Org/Repo"):
        parse_repo_overrides(["medium=Org/Repo"])
