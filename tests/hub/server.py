"""A Hugging Face Hub API server on loopback: olah (a self-hosted Hub mirror, FastAPI) in offline
mode, serving local git repositories as mirrors, behind a small ASGI middleware that makes it
answer as huggingface.co does where olah's mirror mode does not.

    python -m tests.hub.server --root DIR --port N

DIR holds:
  mirrors/{models,datasets}/<org>/<name>/  git work trees (branch main), written by tests/hub/fixture.py
  access.json                              {"models/<org>/<name>": {"gated_token": ..., "tags": [...],
                                            "download_delay_s": ...}} (a delay before each file GET, so
                                            that tests can make concurrent downloads overlap)
  requests.jsonl                           two lines per request, when it starts and when it was answered
                                            (the fixture counts from it)

What the middleware fixes (olah 0.5.4, offline, mirrors) — the real Hub's answers are those
huggingface_hub.utils._http.hf_raise_for_status maps to its errors:
  - a missing file: olah answers 401 RepoNotFound (HEAD) or 500 (GET); the Hub answers 404 with
    X-Error-Code: EntryNotFound, which transformers needs: AutoTokenizer probes optional files.
  - a missing revision: olah answers 401 RepoNotFound; the Hub answers 404 RevisionNotFound.
  - a missing repo: the Hub answers 401 RepoNotFound to anonymous callers, 404 to authenticated ones.
  - gated repos (olah has none): 401 GatedRepo without a token, 403 GatedRepo with the wrong one.
  - repo info without a revision (/api/models/<repo>) fails for mirrors (olah looks in its upstream
    cache); it is answered as /revision/main is, with the tags and gated flag filled in.
  - resolve GETs stream without Content-Length, ETag or X-Repo-Commit, and ignore Range (which
    HfFileSystem, i.e. datasets streaming, relies on); the middleware adds the headers and slices.
  - revisions are resolved to the commit sha before olah sees them (branches, tags, `refs/...`).
  - every other route (whoami, xet tokens, ...) would be proxied to huggingface.co: refused with
    the Hub's 404, and olah's upstream is an unroutable loopback port, so nothing leaves the machine.
Not modelled: token validity (any bearer token is a valid user; the Hub answers 401 "Invalid
credentials in Authorization header" to a bad one), private repos (a gated one stands in), LFS/Xet
(files are plain git blobs: ETag is the blob sha, no X-Linked-Etag or redirect), pagination.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

REPO_TYPES = {"models": "model", "datasets": "dataset"}
HEALTH = "/_llamaft/health"


@dataclass
class Target:
    """What a request is about, from its raw (still percent-encoded) path."""

    kind: str  # resolve | info | tree | paths-info | commits | refs
    plural: str  # models | datasets
    repo_id: str
    revision: str | None
    path: str = ""


def parse_target(raw_path: str) -> Target | None:
    seg = [unquote(s) for s in raw_path.split("/")[1:]]
    if len(seg) >= 4 and seg[0] == "api" and seg[1] in REPO_TYPES:
        plural, repo_id, rest = seg[1], f"{seg[2]}/{seg[3]}", seg[4:]
        if not rest:
            return Target("info", plural, repo_id, None)
        if rest[0] == "revision" and len(rest) == 2:
            return Target("info", plural, repo_id, rest[1])
        if rest[0] == "tree" and len(rest) >= 2:
            return Target("tree", plural, repo_id, rest[1], "/".join(p for p in rest[2:] if p))
        if rest[0] in ("paths-info", "commits") and len(rest) == 2:
            return Target(rest[0], plural, repo_id, rest[1])
        if rest == ["refs"]:
            return Target("refs", plural, repo_id, None)
        return None
    plural = "models"
    if seg and seg[0] == "datasets":
        plural, seg = "datasets", seg[1:]
    if len(seg) >= 5 and seg[2] == "resolve":
        return Target("resolve", plural, f"{seg[0]}/{seg[1]}", seg[3], "/".join(seg[4:]))
    return None


def olah_path(t: Target, sha: str | None) -> str:
    """The path olah is asked for: the same route with the revision replaced by its commit sha."""
    repo = quote(t.repo_id)
    if t.kind == "resolve":
        prefix = "" if t.plural == "models" else "/datasets"
        return f"{prefix}/{repo}/resolve/{sha}/{quote(t.path)}"
    if t.kind == "info":
        return f"/api/{t.plural}/{repo}/revision/{sha}"
    if t.kind == "tree":
        return f"/api/{t.plural}/{repo}/tree/{sha}/{quote(t.path)}"
    if t.kind == "refs":
        return f"/api/{t.plural}/{repo}/refs"
    return f"/api/{t.plural}/{repo}/{t.kind}/{sha}"


def hub_error(status: int, code: str | None, message: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    headers = [(b"content-type", b"application/json"), (b"x-error-message", message.encode())]
    if code is not None:
        headers.append((b"x-error-code", code.encode()))
    return status, headers, json.dumps({"error": message}).encode()


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """`bytes=a-b`, `bytes=a-` or `bytes=-n` -> [start, end) within size; None when unsatisfiable."""
    unit, _, spec = header.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        return None
    first, _, last = spec.strip().partition("-")
    if first == "":
        start, end = max(0, size - int(last)), size
    else:
        start = int(first)
        end = min(size, int(last) + 1) if last else size
    return (start, end) if start < end or size == 0 else None


class Mirrors:
    """The git repositories behind the server, and the access rules the fixture wrote."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def repo(self, plural: str, repo_id: str) -> Any:
        import git

        path = self.root / "mirrors" / plural / repo_id
        if not (path / ".git").is_dir():
            return None
        return git.Repo(path)

    def access(self, plural: str, repo_id: str) -> dict[str, Any]:
        """Read on every request (a few hundred bytes): the fixture changes it at any time."""
        try:
            rules = json.loads((self.root / "access.json").read_text())
        except FileNotFoundError:
            return {}
        return dict(rules.get(f"{plural}/{repo_id}", {}))

    @staticmethod
    def commit(repo: Any, revision: str) -> Any:
        """The commit a branch, tag or full sha names, or None (GitPython resolves shas lazily)."""
        try:
            obj = repo.rev_parse(revision)
            while obj.type == "tag":
                obj = obj.object
            if obj.type != "commit":
                return None
            obj.tree  # noqa: B018 - reads the object: a missing sha fails here
            return obj
        except Exception:  # BadName, BadObject, ValueError, IndexError: no such revision
            return None

    @staticmethod
    def entry(commit: Any, path: str) -> Any:
        try:
            return commit.tree / path if path else commit.tree
        except KeyError:
            return None


class HubCompat:
    """The ASGI middleware in front of olah (see the module docstring)."""

    def __init__(self, app: ASGIApp, root: Path) -> None:
        self.app = app
        self.mirrors = Mirrors(root)
        self.log_path = root / "requests.jsonl"
        self._lock = threading.Lock()

    def _log(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record) + "\n").encode()
        with self._lock:
            fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        raw_path = scope.get("raw_path", scope["path"].encode()).decode("latin-1").split("?")[0]
        target = parse_target(raw_path)
        record: dict[str, Any] = {
            "time": time.time(), "method": scope["method"], "path": raw_path, "authorization": headers.get("authorization"),
            "kind": target.kind if target else None, "repo_type": REPO_TYPES.get(target.plural) if target else None,
            "repo_id": target.repo_id if target else None, "file": target.path if target else None,
        }
        self._log({**record, "phase": "start"})
        status_box: list[int] = []

        def finish() -> None:
            if not done:
                done.append(True)
                record["status"] = status_box[0] if status_box else None
                record["end"] = time.time()
                self._log({**record, "phase": "end"})

        done: list[bool] = []

        async def logged_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_box.append(int(message["status"]))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                # Logged before the last byte leaves: a client that has its answer finds it counted.
                finish()
            await send(message)

        try:
            await self._handle(scope, receive, logged_send, headers, target)
        finally:
            finish()

    async def _respond(self, send: Send, answer: tuple[int, list[tuple[bytes, bytes]], bytes], head: bool = False,
                       length: int | None = None) -> None:
        """Send a whole answer; a HEAD gets the headers (Content-Length: `length` or the body's) alone."""
        status, headers, body = answer
        headers = [*headers, (b"content-length", str(len(body) if length is None else length).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if head else body})

    async def _handle(self, scope: Scope, receive: Receive, send: Send, headers: dict[str, str], target: Target | None) -> None:
        head = scope["method"] == "HEAD"
        if scope["path"] == HEALTH:
            await self._respond(send, (200, [(b"content-type", b"text/plain")], b"ok"), head)
            return
        if target is None:
            # The Hub's answer for a page it does not have; olah would proxy it upstream.
            await self._respond(send, hub_error(404, None, "Sorry, we can't find the page you are looking for."), head)
            return
        auth = headers.get("authorization")
        noun = target.plural[:-1]
        repo = self.mirrors.repo(target.plural, target.repo_id)
        if repo is None:
            # huggingface.co: 401 to anonymous callers (a private repo looks the same), 404 with a token.
            await self._respond(send, hub_error(404 if auth else 401, "RepoNotFound", "Repository not found"), head)
            return
        access = self.mirrors.access(target.plural, target.repo_id)
        token = access.get("gated_token")
        if token and auth != f"Bearer {token}":
            if auth is None:
                message = (f"Access to {noun} {target.repo_id} is restricted. You must have access to it and be "
                           "authenticated to access it. Please log in.")
                await self._respond(send, hub_error(401, "GatedRepo", message), head)
            else:
                message = (f"Access to {noun} {target.repo_id} is restricted and you are not in the authorized "
                           f"list. Visit https://huggingface.co/{target.repo_id} to ask for access.")
                await self._respond(send, hub_error(403, "GatedRepo", message), head)
            return
        sha = None
        commit = None
        if target.kind != "refs":
            revision = target.revision or "main"
            commit = self.mirrors.commit(repo, revision)
            if commit is None:
                await self._respond(send, hub_error(404, "RevisionNotFound", f"Invalid rev id: {revision}"), head)
                return
            sha = commit.hexsha
        if target.kind in ("resolve", "tree"):
            entry = self.mirrors.entry(commit, target.path)
            wanted = "blob" if target.kind == "resolve" else "tree"
            if entry is None or entry.type != wanted:
                message = f'{target.path} does not exist on "{target.revision}"'
                await self._respond(send, hub_error(404, "EntryNotFound", message), head)
                return
        new_path = olah_path(target, sha)
        scope = {**scope, "path": unquote(new_path), "raw_path": new_path.encode()}
        if target.kind == "resolve":
            if scope["method"] == "GET" and access.get("download_delay_s"):
                await asyncio.sleep(float(access["download_delay_s"]))
            await self._resolve(scope, receive, send, headers, sha or "", entry)
        elif target.kind == "info":
            await self._info(scope, receive, send, access, sha or "")
        else:
            await self.app(scope, receive, send)

    async def _buffered(self, scope: Scope, receive: Receive) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """Run olah and collect its whole answer."""
        start: Message = {}
        chunks: list[bytes] = []

        async def collect(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(bytes(message.get("body", b"")))

        await self.app(scope, receive, collect)
        return int(start.get("status", 500)), list(start.get("headers", [])), b"".join(chunks)

    async def _resolve(self, scope: Scope, receive: Receive, send: Send, headers: dict[str, str], sha: str, blob: Any) -> None:
        """A file: olah's bytes with the Hub's headers (ETag = git blob sha, X-Repo-Commit), ranges sliced."""
        head = scope["method"] == "HEAD"
        # olah's mirror HEAD carries no body, and its GET ignores Range: ask for the whole file.
        status, olah_headers, body = await self._buffered(scope, receive)
        if status != 200:
            await self._respond(send, (status, [h for h in olah_headers if h[0].lower() != b"content-length"], body), head)
            return
        size = int(blob.size)
        out = [
            (b"content-type", b"application/octet-stream"), (b"etag", f'"{blob.hexsha}"'.encode()),
            (b"x-repo-commit", sha.encode()), (b"accept-ranges", b"bytes"),
        ]
        wanted = headers.get("range")
        if wanted:
            span = parse_range(wanted, size)
            if span is None:
                await self._respond(send, (416, [(b"content-range", f"bytes */{size}".encode())], b""), head)
                return
            start, end = span
            out.append((b"content-range", f"bytes {start}-{end - 1}/{size}".encode()))
            await self._respond(send, (206, out, body[start:end]), head, length=end - start)
            return
        await self._respond(send, (200, out, body), head, length=size)

    async def _info(self, scope: Scope, receive: Receive, send: Send, access: dict[str, Any], sha: str) -> None:
        """Repo info: olah's (from the git commit) with the Hub's fields olah leaves empty."""
        head = scope["method"] == "HEAD"
        scope = {**scope, "method": "GET"}
        status, olah_headers, body = await self._buffered(scope, receive)
        if status != 200:
            await self._respond(send, (status, [h for h in olah_headers if h[0].lower() != b"content-length"], body), head)
            return
        info = json.loads(body)
        info["sha"] = sha
        info["tags"] = sorted(set(info.get("tags") or []) | set(access.get("tags", [])))
        info["gated"] = "manual" if access.get("gated_token") else False
        info["private"] = False
        await self._respond(send, (200, [(b"content-type", b"application/json")], json.dumps(info).encode()), head)


def build_app(root: Path) -> ASGIApp:
    """olah's app, configured for offline mirrors under root, behind HubCompat."""
    root = root.resolve()
    config = root / "olah.toml"
    # olah reads everything from a TOML file. hf-netloc: the discard port on loopback, refused at
    # once, so that nothing olah might forward upstream could ever leave this machine.
    config.write_text(
        "[basic]\n"
        f'repos-path = "{root / "olah-cache"}"\n'
        f'mirrors-path = ["{root / "mirrors"}"]\n'
        'hf-scheme = "http"\nhf-netloc = "127.0.0.1:9"\nhf-lfs-netloc = "127.0.0.1:9"\n'
        "metadata-cache-ttl = 0\n"
        "[accessibility]\n"
        "offline = true\n"
        # olah's default rules allow "*" and "*/*"; stated here, as olah refuses any repo no rule allows.
        'proxy = [{repo = "*", allow = true}, {repo = "*/*", allow = true}]\n'
        'cache = [{repo = "*", allow = false}, {repo = "*/*", allow = false}]\n'
    )
    (root / "mirrors" / "models").mkdir(parents=True, exist_ok=True)
    (root / "mirrors" / "datasets").mkdir(parents=True, exist_ok=True)
    from olah.configs import OlahConfig
    from olah.server import AppSettings, app

    app.state.app_settings = AppSettings(config=OlahConfig(str(config)))
    return HubCompat(app, root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    import uvicorn

    uvicorn.run(build_app(args.root), host=args.host, port=args.port, log_level="warning",
                access_log=False, lifespan="on")


if __name__ == "__main__":
    main()
