"""A Hugging Face Hub on localhost: the part of its HTTP API that huggingface_hub's
snapshot_download, repo_info and file_exists use (as huggingface_hub 1.x and 2.x call it).

  GET  /api/models/{repo}[/revision/{rev}] the repo's info: its commit (`sha`) and `siblings`
  GET  /api/models/{repo}/tree/{rev}       its files: path, size, oid (one page)
  HEAD /{repo}/resolve/{rev}/{file}        X-Repo-Commit, ETag, Content-Length
  GET  /{repo}/resolve/{rev}/{file}        the bytes

A missing repo, revision or file is a 404 with the X-Error-Code huggingface_hub turns into
RepositoryNotFoundError, RevisionNotFoundError or RemoteEntryNotFoundError. Every request is
recorded with its Authorization header.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import unquote, urlsplit

from tests.unit.model.local_http import LocalHTTPServer


@dataclass
class FakeHub(LocalHTTPServer):
    # repo id -> revision (a branch, tag or commit) -> (commit, {file path: bytes})
    repos: dict[str, dict[str, tuple[str, dict[str, bytes]]]] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, Authorization)
    url: str = ""

    def add(self, repo_id: str, revisions: dict[str, dict[str, bytes]]) -> dict[str, str]:
        """Add a repo: revision name -> its files. Returns revision name -> its commit, which
        names the revision as well."""
        commits = {}
        for name, files in revisions.items():
            commit = hashlib.sha1(f"{repo_id}@{name}".encode()).hexdigest()
            commits[name] = commit
            self.repos.setdefault(repo_id, {})[name] = self.repos[repo_id][commit] = (commit, files)
        return commits

    def start(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # no request lines on stderr
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                path = urlsplit(self.path).path
                hub.requests.append((self.command, path, self.headers.get("Authorization")))
                parts = [unquote(p) for p in path.strip("/").split("/")]
                if parts[:2] == ["api", "models"] and len(parts) == 4:  # the default branch's info
                    parts += ["revision", "main"]
                if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
                    repo_id, kind, rev = f"{parts[2]}/{parts[3]}", parts[4], parts[5]
                    found = self._revision(repo_id, rev)
                    if found is None:
                        return
                    commit, files = found
                    if kind == "revision":
                        info = {"id": repo_id, "sha": commit, "private": False,
                                "siblings": [{"rfilename": name} for name in sorted(files)]}
                        return self._send(200, json.dumps(info).encode(), body, {"Content-Type": "application/json"})
                    tree = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                            for name, data in sorted(files.items())]
                    return self._send(200, json.dumps(tree).encode(), body, {"Content-Type": "application/json"})
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo_id, rev, name = f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:])
                    found = self._revision(repo_id, rev)
                    if found is None:
                        return
                    commit, files = found
                    if name not in files:
                        return self._send(404, b"", body, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit})
                    data = files[name]
                    return self._send(200, data, body, {"X-Repo-Commit": commit,
                                                        "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                                                        "Content-Type": "application/octet-stream"})
                self._send(404, b"", body, {})

            def _revision(self, repo_id: str, rev: str) -> tuple[str, dict[str, bytes]] | None:
                if repo_id not in hub.repos:
                    self._send(404, b"", self.command == "GET", {"X-Error-Code": "RepoNotFound"})
                    return None
                if rev not in hub.repos[repo_id]:
                    self._send(404, b"", self.command == "GET", {"X-Error-Code": "RevisionNotFound"})
                    return None
                return hub.repos[repo_id][rev]

            def _send(self, status: int, data: bytes, body: bool, headers: dict[str, str]) -> None:
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

        self.serve(Handler, "fake-hub")
        return self


def files_of(model_dir: str) -> dict[str, bytes]:
    """A model directory's files, as a repo holds them."""
    return {p.name: p.read_bytes() for p in sorted(Path(model_dir).iterdir()) if p.is_file()}
