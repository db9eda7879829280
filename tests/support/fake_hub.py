"""A fake Hugging Face Hub on 127.0.0.1, so tests can run huggingface_hub's real download path with no network.

It answers the requests `snapshot_download` makes (huggingface_hub 2.x), with the headers that code checks:
  GET  /api/models/ORG/NAME/revision/REV  the commit REV names (`HfApi.repo_info`)
  GET  /api/models/ORG/NAME/tree/COMMIT   the repo's files (`HfApi.list_repo_tree`; one page: no Link header)
  HEAD /ORG/NAME/resolve/COMMIT/FILE      X-Repo-Commit, a quoted ETag and Content-Length (`get_hf_file_metadata`)
  GET  /ORG/NAME/resolve/COMMIT/FILE      the bytes
and fails as the Hub does: a 404 whose X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound) huggingface_hub
turns into its typed errors; so does anything else it is asked (huggingface_hub's best-effort
GET /api/agent-harnesses, say). No Xet headers, so files come over plain HTTP.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    commit: str
    files: dict[str, bytes]


class FakeHub:
    """`with FakeHub() as hub:` serves the repos `hub.add` gives it at `hub.url` and records each request as
    "METHOD PATH" in `hub.requests`; leaving the block stops the server."""

    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.requests: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, repo: str, directory: Path) -> str:
        """Serve the files of `directory` as the main branch of `repo`; its commit hash."""
        files = {f.relative_to(directory).as_posix(): f.read_bytes() for f in sorted(directory.rglob("*"))
                 if f.is_file()}
        commit = hashlib.sha1(b"".join(name.encode() + hashlib.sha256(data).digest()
                                       for name, data in files.items())).hexdigest()
        self.repos[repo] = Repo(commit, files)
        return commit

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.answer(body=True)

        def do_HEAD(self) -> None:
            self.answer(body=False)

        def answer(self, body: bool) -> None:
            path = urlsplit(self.path).path
            hub.requests.append(f"{self.command} {path}")
            api = path.startswith("/api/models/")
            # Revisions come URL-quoted ("refs%2Fpr%2F1"); names are ORG/NAME/ENDPOINT/REV[/FILE...]
            parts = [unquote(p) for p in path.removeprefix("/api/models/" if api else "/").split("/")]
            if len(parts) < 4:
                return self.fail("RepoNotFound", body)
            repo, endpoint, revision, file = "/".join(parts[:2]), parts[2], parts[3], "/".join(parts[4:])
            if repo not in hub.repos:
                return self.fail("RepoNotFound", body)
            served = hub.repos[repo]
            if revision not in ("main", served.commit):
                return self.fail("RevisionNotFound", body)
            if api and endpoint == "revision":
                return self.json({"id": repo, "sha": served.commit}, body)  # the file list comes from the tree
            if api and endpoint == "tree":
                return self.json([{"type": "file", "path": name, "size": len(data), "oid": _git_blob_id(data)}
                                  for name, data in served.files.items()], body)
            if not api and endpoint == "resolve" and file in served.files:
                data = served.files[file]
                return self.send(200, data, body, {"X-Repo-Commit": served.commit,
                                                   "ETag": f'"{hashlib.sha256(data).hexdigest()}"'})
            self.fail("EntryNotFound", body, {"X-Repo-Commit": served.commit})

        def json(self, value: object, body: bool) -> None:
            self.send(200, json.dumps(value).encode(), body, {"Content-Type": "application/json"})

        def fail(self, error_code: str, body: bool, headers: dict[str, str] | None = None) -> None:
            self.send(404, error_code.encode(), body, {"X-Error-Code": error_code, **(headers or {})})

        def send(self, status: int, data: bytes, body: bool, headers: dict[str, str]) -> None:
            self.send_response(status)
            for name, value in {**headers, "Content-Length": str(len(data))}.items():
                self.send_header(name, value)
            self.end_headers()
            if body:
                self.wfile.write(data)

        def log_message(self, *args) -> None:  # the test asserts on hub.requests; stderr stays quiet
            pass

    return Handler


def _git_blob_id(data: bytes) -> str:
    """The id git gives a file's content, as the Hub's tree listing reports it (`oid`)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
