"""A loopback HTTP server that speaks enough of the Hugging Face Hub API for
``huggingface_hub.snapshot_download`` (HF_ENDPOINT=its url): repo info, the recursive tree
listing, HEAD and GET on resolve URLs. It serves model directories from disk, so tests fetch
"from the Hub" through the real huggingface-hub client with no traffic off the machine."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, Path]) -> None:
        self.repos = repos
        self.requests: list[str] = []
        self.fail_with: int | None = None  # an HTTP status to answer every request with
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> FakeHub:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}

    def _answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(handler.path).path)
        self.requests.append(f"{handler.command} {path}")
        if self.fail_with is not None:
            return _send_status(handler, self.fail_with)
        for repo in self.repos:
            if path.startswith(f"/api/models/{repo}/revision/"):
                siblings = [{"rfilename": name} for name in self._files(repo)]
                return _send_json(handler, {"id": repo, "sha": COMMIT, "siblings": siblings})
            if path.startswith(f"/api/models/{repo}/tree/"):
                tree = [{"type": "file", "path": name, "size": p.stat().st_size,
                         "oid": hashlib.sha1(p.read_bytes()).hexdigest()}
                        for name, p in self._files(repo).items()]
                return _send_json(handler, tree)
            prefix = f"/{repo}/resolve/"
            if path.startswith(prefix):
                name = path[len(prefix):].split("/", 1)[1]
                file = self._files(repo).get(name)
                if file is None:
                    break
                data = file.read_bytes()
                handler.send_response(200)
                handler.send_header("X-Repo-Commit", COMMIT)
                handler.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                handler.send_header("Content-Length", str(len(data)))
                handler.end_headers()
                if body:
                    handler.wfile.write(data)
                return None
        return _send_status(handler, 404, {"X-Error-Code": "RepoNotFound"})


def _send_status(handler: BaseHTTPRequestHandler, status: int,
                 headers: dict[str, str] | None = None) -> None:
    handler.send_response(status)
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    handler.send_header("Content-Length", "0")
    handler.end_headers()


def _send_json(handler: BaseHTTPRequestHandler, payload: object) -> None:
    data = json.dumps(payload).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
