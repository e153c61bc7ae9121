"""A local stand-in for the Hugging Face Hub's HTTP API, so that tests run the converters' hub
code path (`datasets.load_dataset("<owner>/<name>", ...)`, `hf_hub_download`, `HfApi`,
`hf://` files) unchanged, with no network.

It serves local folders as dataset repositories at given commits (each `commit()` snapshots a
folder and moves a branch, so a test can move `main` under a running conversion), and implements
the part of the Hub API that the installed `huggingface_hub` and `datasets` call, found by reading
them and logging their requests (`FakeHub.requests`):

- `GET /api/datasets/{repo}[/revision/{rev}]`: repository info, `sha` = the commit of `rev`
  (`HfApi.dataset_info`, `repo_info`; `datasets` asks it too);
- `GET /api/datasets/{repo}/tree/{rev}[/{path}]?recursive=&expand=false[&cursor=]`: the listing
  (`list_repo_files`, `HfFileSystem.ls/glob` behind `datasets`' data files), paginated with a
  `Link: <...>; rel="next"` header, `page_size` entries per page (1000 on the Hub; tests use a
  few, so that the clients' page following runs);
- `HEAD` / `GET /datasets/{repo}/resolve/{rev}/{path}`, with a `Range` too (`HfFileSystem`'s
  reads after a seek, e.g. a parquet footer, and resumed downloads): the file, with the headers
  `hf_hub_download` checks (`X-Repo-Commit`, `ETag`, `Content-Length`). LFS files (binary
  suffixes, or over 10 MB) are answered as on the Hub: a 302 to another origin (the "CDN",
  `/{sha256}`) carrying `X-Linked-Etag` / `X-Linked-Size`, which `huggingface_hub` reads
  without following it for metadata, and follows to download.
Errors carry the Hub's `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound), which
`huggingface_hub` turns into its typed exceptions. Anything else (another endpoint, `expand=true`)
is answered 501 and listed in `FakeHub.unhandled`, so a test sees when a library starts using
more of the API. Revisions are branch names or full commit ids; contents are copied into memory
at commit time.

    with FakeHub() as hub:
        sha = hub.commit("TIGER-Lab/Mantis-Instruct", folder)
        env = hub.environ(tmp_path / "hf_home")   # HF_ENDPOINT, an isolated HF_HOME, ...
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

#: files stored with Git LFS on the Hub (the default .gitattributes of a dataset repository),
#: and any file over 10 MB (the Hub refuses larger plain git files)
LFS_SUFFIXES = (".parquet", ".arrow", ".zip", ".gz", ".tar", ".mp4", ".jpg", ".png", ".bin")
LFS_MIN_SIZE = 10 * 2**20


@dataclass(frozen=True, slots=True)
class _Blob:
    data: bytes
    git_oid: str  #: git blob id (the tree's `oid` of a plain file)
    sha256: str


@dataclass(slots=True)
class _Commit:
    sha: str
    files: dict[str, _Blob]  #: repository path -> content

    def is_lfs(self, path: str) -> bool:
        return path.endswith(LFS_SUFFIXES) or len(self.files[path].data) > LFS_MIN_SIZE

    def entry(self, path: str) -> dict:
        """A tree entry, as the Hub writes it (without `expand`)."""
        if path not in self.files:
            return {"type": "directory", "path": path,
                    "oid": hashlib.sha1(f"tree {self.sha} {path}".encode()).hexdigest()}
        blob = self.files[path]
        out = {"type": "file", "path": path, "size": len(blob.data)}
        if self.is_lfs(path):
            pointer = _lfs_pointer(blob)
            out["oid"] = _git_oid(pointer)
            out["lfs"] = {"oid": blob.sha256, "size": len(blob.data),
                          "pointerSize": len(pointer)}
        else:
            out["oid"] = blob.git_oid
        return out

    def folders(self) -> set[str]:
        return {"/".join(p.split("/")[:k]) for p in self.files
                for k in range(1, p.count("/") + 1)}


@dataclass(slots=True)
class _Repo:
    commits: dict[str, _Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)  #: branch -> commit sha


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs_pointer(blob: _Blob) -> bytes:
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{blob.sha256}\n"
            f"size {len(blob.data)}\n").encode()


class FakeHub:
    """The fake Hub: a Hub API server and a CDN server on two local ports (see module doc)."""

    def __init__(self, page_size: int = 1000):
        self.page_size = page_size
        #: "METHOD /path?query" of every request in order (the CDN's: "GET cdn:/<sha256>")
        self.requests: list[str] = []
        self.unhandled: list[str] = []  #: requests the fake does not implement (answered 501)
        self._repos: dict[str, _Repo] = {}
        self._blobs: dict[str, _Blob] = {}  #: sha256 -> blob (what the CDN serves)
        self._lock = threading.Lock()
        self._servers: list[ThreadingHTTPServer] = []

    # ---- repositories ---------------------------------------------------------------------------

    def commit(self, repo_id: str, folder: Path, *, branch: str = "main") -> str:
        """Snapshot every file under `folder` as a new commit of dataset `repo_id`, move `branch`
        to it and return the commit id (40 hex digits)."""
        files = {}
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                data = path.read_bytes()
                blob = _Blob(data=data, git_oid=_git_oid(data),
                             sha256=hashlib.sha256(data).hexdigest())
                files[path.relative_to(folder).as_posix()] = blob
        with self._lock:
            repo = self._repos.setdefault(repo_id, _Repo())
            parent = repo.branches.get(branch, "")
            listing = "".join(f"{p} {b.git_oid}\n" for p, b in files.items())
            sha = hashlib.sha1(f"{repo_id}\n{parent}\n{listing}".encode()).hexdigest()
            repo.commits[sha] = _Commit(sha=sha, files=files)
            repo.branches[branch] = sha
            self._blobs.update({b.sha256: b for b in files.values()})
        return sha

    def head(self, repo_id: str, branch: str = "main") -> str:
        """The commit `branch` of `repo_id` points at."""
        return self._repos[repo_id].branches[branch]

    def _find(self, repo_id: str, revision: str) -> tuple[_Commit | None, str | None]:
        """(commit, None), or (None, the Hub's error code)."""
        repo = self._repos.get(repo_id)
        if repo is None:
            return None, "RepoNotFound"
        sha = repo.branches.get(revision, revision)
        commit = repo.commits.get(sha)
        return (commit, None) if commit else (None, "RevisionNotFound")

    # ---- servers --------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._servers[0].server_port}"

    @property
    def cdn(self) -> str:
        return f"http://127.0.0.1:{self._servers[1].server_port}"

    def environ(self, hf_home: Path) -> dict[str, str]:
        """The environment of a process that uses this hub, with its own empty `hf_home`."""
        return {**os.environ, "HF_ENDPOINT": self.endpoint, "HF_HOME": str(hf_home),
                "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1",
                "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "HF_TOKEN": ""}

    def start(self) -> FakeHub:
        for handler in (_HubHandler, _CdnHandler):
            server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
            server.daemon_threads = True
            server.hub = self  # type: ignore[attr-defined]
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self._servers.append(server)
        return self

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the clients' connection pools expect

    @property
    def hub(self) -> FakeHub:
        return self.server.hub  # type: ignore[attr-defined]

    def log_message(self, *args) -> None:  # the request log is `FakeHub.requests`
        pass

    def _record(self) -> None:
        with self.hub._lock:
            self.hub.requests.append(f"{self.command} {self.path}")

    def _unhandled(self, head: bool = False) -> None:
        with self.hub._lock:
            self.hub.unhandled.append(f"{self.command} {self.path}")
        self._send(501, b"not implemented by the fake hub", head=head)

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None,
              head: bool = False) -> None:
        self.send_response(status)
        headers = {"Content-Length": str(len(body)), **(headers or {})}
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if body and not head:
            self.wfile.write(body)

    def _json(self, doc, headers: dict | None = None) -> None:
        self._send(200, json.dumps(doc).encode(),
                   {"Content-Type": "application/json", **(headers or {})})

    def _error(self, code: str, headers: dict | None = None, head: bool = False) -> None:
        status = 401 if code == "RepoNotFound" else 404  # the Hub's answer to an unknown repo
        body = json.dumps({"error": code}).encode()
        self._send(status, body, {"Content-Type": "application/json", "X-Error-Code": code,
                                  "X-Error-Message": code, **(headers or {})}, head=head)

    def _serve_bytes(self, data: bytes, headers: dict, head: bool) -> None:
        """The body (or the requested byte range) of a file."""
        headers = {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream",
                   **headers}
        match = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", ""))
        if not match:
            self._send(200, data, headers, head=head)
            return
        first, last = match.groups()
        if first:
            start, end = int(first), int(last) if last else len(data) - 1
        else:
            start, end = max(0, len(data) - int(last)), len(data) - 1
        end = min(end, len(data) - 1)
        if start >= len(data) or start > end:
            self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"}, head=head)
            return
        self._send(206, data[start:end + 1],
                   {**headers, "Content-Range": f"bytes {start}-{end}/{len(data)}"}, head=head)


class _CdnHandler(_Handler):
    """Serves LFS contents by sha256 (the Hub redirects LFS files here)."""

    def do_GET(self, head: bool = False) -> None:  # noqa: N802 (http.server's names)
        with self.hub._lock:
            self.hub.requests.append(f"{self.command} cdn:{self.path}")
        blob = self.hub._blobs.get(urlsplit(self.path).path.strip("/"))
        if blob is None:
            self._send(404, b"no such object", head=head)
            return
        self._serve_bytes(blob.data, {"ETag": f'"{blob.sha256}"'}, head)

    def do_HEAD(self) -> None:  # noqa: N802
        self.do_GET(head=True)


_API = re.compile(r"/api/datasets/(?P<repo>[^/]+/[^/]+)(?:/(?P<kind>revision|tree)/(?P<rest>.*))?")
_RESOLVE = re.compile(r"/datasets/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rest>.+)")


class _HubHandler(_Handler):
    """The Hub API and the `resolve` file URLs."""

    def do_GET(self) -> None:  # noqa: N802
        self._record()
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if (m := _RESOLVE.fullmatch(url.path)) is not None:
            self._resolve(m["repo"], m["rest"], head=False)
        elif (m := _API.fullmatch(url.path)) is not None and m["kind"] in (None, "revision"):
            self._info(m["repo"], unquote(m["rest"] or "main"))
        elif m is not None and m["kind"] == "tree" and query.get("expand") != "true":
            revision, _, path = m["rest"].partition("/")
            self._tree(m["repo"], unquote(revision), unquote(path), query, url.path)
        else:
            self._unhandled()

    def do_HEAD(self) -> None:  # noqa: N802
        self._record()
        m = _RESOLVE.fullmatch(urlsplit(self.path).path)
        if m is None:
            self._unhandled(head=True)
            return
        self._resolve(m["repo"], m["rest"], head=True)

    def do_POST(self) -> None:  # noqa: N802
        self._record()
        self._unhandled()

    def _info(self, repo_id: str, revision: str) -> None:
        commit, error = self.hub._find(repo_id, revision)
        if commit is None:
            self._error(error)
            return
        self._json({"id": repo_id, "author": repo_id.split("/")[0], "sha": commit.sha,
                    "private": False, "gated": False, "disabled": False, "downloads": 0,
                    "likes": 0, "tags": [], "lastModified": "2026-01-01T00:00:00.000Z",
                    "siblings": [{"rfilename": p} for p in commit.files]})

    def _tree(self, repo_id: str, revision: str, path: str, query: dict, url_path: str) -> None:
        commit, error = self.hub._find(repo_id, revision)
        if commit is None:
            self._error(error)
            return
        path = path.strip("/")
        prefix = f"{path}/" if path else ""
        if path and path not in commit.folders():
            self._error("EntryNotFound")
            return
        recursive = query.get("recursive", "false").lower() == "true"
        names = sorted(p for p in set(commit.files) | commit.folders()
                       if p.startswith(prefix) and (recursive or "/" not in p[len(prefix):]))
        start, size = int(query.get("cursor", 0)), self.hub.page_size
        headers = {}
        if start + size < len(names):
            following = dict(query, cursor=str(start + size))
            link = (f"{self.hub.endpoint}{url_path}?"
                    + "&".join(f"{k}={quote(v)}" for k, v in following.items()))
            headers["Link"] = f'<{link}>; rel="next"'
        self._json([commit.entry(n) for n in names[start:start + size]], headers)

    def _resolve(self, repo_id: str, rest: str, head: bool) -> None:
        revision, _, path = rest.partition("/")
        revision, path = unquote(revision), unquote(path)
        commit, error = self.hub._find(repo_id, revision)
        if commit is None:
            self._error(error, head=head)
            return
        if path not in commit.files:
            self._error("EntryNotFound", {"X-Repo-Commit": commit.sha}, head=head)
            return
        blob = commit.files[path]
        headers = {"X-Repo-Commit": commit.sha}
        if commit.is_lfs(path):
            headers.update({"ETag": f'"{_git_oid(_lfs_pointer(blob))}"',
                            "X-Linked-Etag": f'"{blob.sha256}"',
                            "X-Linked-Size": str(len(blob.data)),
                            "Location": f"{self.hub.cdn}/{blob.sha256}"})
            self._send(302, b"", headers, head=head)
            return
        self._serve_bytes(blob.data, {**headers, "ETag": f'"{blob.git_oid}"'}, head)
