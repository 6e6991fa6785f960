"""pytest fixtures: a Hugging Face Hub API server on loopback (tests/hub/server.py) and the repos on it.

    def test_x(hub_env: HubServer, tiny_model: Path) -> None:
        # hub_env: this process's huggingface_hub / transformers / datasets point at the server
        # (HF_ENDPOINT too, for subprocesses such as the trainer), empty caches, no token.
        sha = hub_env.add_model("acme/tiny", tiny_model, gated_token="hf_x")   # -> commit sha
        newer = hub_env.commit("acme/tiny", "model", {"config.json": b"..."})
        AutoConfig.from_pretrained("acme/tiny", revision=sha, token="hf_x")
        assert hub_env.downloads()[("acme/tiny", "config.json")] == 1
        assert hub_env.authorizations() == ["Bearer hf_x", ...]

`hub_server` (session) is the bare server; `hub_server.patch_endpoint(monkeypatch)` points this
process's clients at it. Repos are git repositories (branch main) that the server reads on every
request, so a test may add repos and commits at any time; repo ids (`org/name`) are unique per
session, so pick ids no other test uses.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from llamaft_trainer.process.local_etcd import free_port, parent_death_signal

from tests.hub.server import HEALTH
from tests.tiers import starts_processes

REPO_ROOT = Path(__file__).resolve().parents[2]
PLURAL = {"model": "models", "dataset": "datasets"}
Files = Mapping[str, "bytes | str | Path | None"]

_GIT_ENV = {
    "GIT_AUTHOR_NAME": "llamaft tests", "GIT_AUTHOR_EMAIL": "tests@llamaft.invalid",
    "GIT_COMMITTER_NAME": "llamaft tests", "GIT_COMMITTER_EMAIL": "tests@llamaft.invalid",
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
}


def _datasets_config() -> Any:
    """datasets.config when datasets is installed: imported now (once per session), so that its
    import-time copies of HF_ENDPOINT and the cache paths are patched and restored, rather than
    read from the environment of whichever test imported datasets first."""
    if importlib.util.find_spec("datasets") is None:
        return None
    import datasets.config

    return datasets.config


@starts_processes
class HubServer:
    """`with HubServer() as hub: hub.endpoint` -> "http://127.0.0.1:<port>" (olah + HubCompat)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._dir = tempfile.TemporaryDirectory(prefix="llamaft-hub-")
        self.root = Path(self._dir.name)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0
        self._access: dict[str, dict[str, Any]] = {}

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, timeout_s: float = 20.0) -> HubServer:
        env = dict(os.environ, HOME=str(self.root), PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "trainer")]))
        self.log_path = self.root / "server.log"
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.hub.server", "--root", str(self.root), "--port", str(self.port)],
            cwd=self.root, env=env, stdout=self.log_path.open("wb"), stderr=subprocess.STDOUT,
            preexec_fn=parent_death_signal(),
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(self.endpoint + HEALTH, timeout=1) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the Hub server did not start: {self.log_path.read_text()[-3000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- repos -----------------------------------------------------------------------------------
    def _git(self, work: Path, *args: str) -> str:
        proc = subprocess.run(["git", "-c", "commit.gpgsign=false", *args], cwd=work, env={**os.environ, **_GIT_ENV},
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"git {' '.join(args)}: {proc.stderr}")
        return proc.stdout.strip()

    def _work(self, repo_id: str, repo_type: str) -> Path:
        if repo_type not in PLURAL or repo_id.count("/") != 1:
            raise ValueError(f"repo_type model|dataset and an id `org/name`, not {repo_type!r} {repo_id!r}")
        return self.root / "mirrors" / PLURAL[repo_type] / repo_id

    def _set_access(self, repo_id: str, repo_type: str, **fields: Any) -> None:
        self._access.setdefault(f"{PLURAL[repo_type]}/{repo_id}", {}).update(fields)
        path = self.root / "access.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._access))
        os.replace(tmp, path)

    def create(self, repo_id: str, repo_type: str, files: Files, *, tags: tuple[str, ...] | list[str] = (),
               gated_token: str | None = None) -> str:
        """A new repo on the Hub with one commit on main holding `files`; its commit sha."""
        work = self._work(repo_id, repo_type)
        if work.exists():
            raise ValueError(f"{repo_type} {repo_id} exists already: repo ids are unique per session")
        work.mkdir(parents=True)
        self._git(work, "init", "-q", "-b", "main")
        self._set_access(repo_id, repo_type, tags=list(tags), gated_token=gated_token)
        return self.commit(repo_id, repo_type, files, message=f"create {repo_id}")

    def add_model(self, repo_id: str, folder: str | Path, *, tags: tuple[str, ...] | list[str] = (),
                  gated_token: str | None = None) -> str:
        """A model repo holding every file under `folder` (e.g. a save_pretrained output)."""
        folder = Path(folder)
        files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
        return self.create(repo_id, "model", files, tags=tags, gated_token=gated_token)

    def add_dataset(self, repo_id: str, files: Files, *, gated_token: str | None = None) -> str:
        """A dataset repo: {path in repo: bytes, text or a local file}."""
        return self.create(repo_id, "dataset", files, gated_token=gated_token)

    def commit(self, repo_id: str, repo_type: str, files: Files, *, message: str = "update") -> str:
        """A new commit on main: each path gets its content (None deletes it); the new commit sha.
        Earlier commits stay reachable by sha, so a revision can be pinned to them."""
        work = self._work(repo_id, repo_type)
        for name, content in files.items():
            dest = work / name
            if content is None:
                dest.unlink(missing_ok=True)
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, Path):
                shutil.copyfile(content, dest)
            else:
                dest.write_bytes(content.encode() if isinstance(content, str) else content)
        self._git(work, "add", "-A")
        self._git(work, "commit", "-q", "--allow-empty", "-m", message)
        return self._git(work, "rev-parse", "HEAD")

    def set_download_delay(self, repo_id: str, repo_type: str, seconds: float) -> None:
        """Answer each file GET of the repo `seconds` late (0: at once), e.g. so that concurrent
        fetchers overlap for certain."""
        self._set_access(repo_id, repo_type, download_delay_s=seconds)

    def tag(self, repo_id: str, repo_type: str, name: str, revision: str = "main") -> str:
        """A tag (a revision name, as `v1.0` on the Hub) on `revision`; the commit sha it names."""
        work = self._work(repo_id, repo_type)
        self._git(work, "tag", name, revision)
        return self._git(work, "rev-parse", f"{name}^{{commit}}")

    # -- what the server saw ---------------------------------------------------------------------
    def requests(self, *, include_pending: bool = False) -> list[dict[str, Any]]:
        """Every request answered since the last reset_counts(), oldest first (method, path, kind,
        repo_type, repo_id, file, authorization, status, time, end). include_pending: every request
        begun instead, answered or not (no status or end then)."""
        try:
            with (self.root / "requests.jsonl").open("rb") as f:
                f.seek(self._log_offset)
                data = f.read()
        except FileNotFoundError:
            return []
        phase = "start" if include_pending else "end"
        records = (json.loads(line) for line in data.splitlines() if line.strip())
        return [r for r in records if r.get("phase") == phase]

    def downloads(self) -> collections.Counter[tuple[str, str]]:
        """(repo_id, path) -> file contents served (GETs answered 200/206; HEADs are not downloads)."""
        return collections.Counter(
            (r["repo_id"], r["file"]) for r in self.requests()
            if r["kind"] == "resolve" and r["method"] == "GET" and r["status"] in (200, 206)
        )

    def authorizations(self) -> list[str]:
        """The Authorization headers received, in order (requests without one are left out)."""
        return [r["authorization"] for r in self.requests() if r["authorization"]]

    def reset_counts(self) -> None:
        path = self.root / "requests.jsonl"
        self._log_offset = path.stat().st_size if path.exists() else 0

    # -- clients in this process -----------------------------------------------------------------
    def patch_endpoint(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Point huggingface_hub, transformers and datasets in this process at the server.

        huggingface_hub reads HF_ENDPOINT into constants at import; the trainer's subprocesses only
        need the env var."""
        import huggingface_hub.constants as hub_constants

        monkeypatch.setenv("HF_ENDPOINT", self.endpoint)
        monkeypatch.setattr(hub_constants, "ENDPOINT", self.endpoint)
        monkeypatch.setattr(hub_constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            self.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        ds_config = _datasets_config()
        if ds_config is not None:
            monkeypatch.setattr(ds_config, "HF_ENDPOINT", self.endpoint)
            monkeypatch.setattr(ds_config, "HUB_DATASETS_URL", self.endpoint + "/datasets/{repo_id}/resolve/{revision}/{path}")


def need_olah() -> None:
    """Skip without olah on a developer machine; fail in CI, whose .ci/setup installs it (a silently
    skipped suite would look green)."""
    if importlib.util.find_spec("olah") is None or importlib.util.find_spec("fastapi_utils") is None:
        fix = "pip install --no-deps olah==0.5.4 fastapi-utils==0.8.0 (see pyproject.toml's dev extra)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must provide olah for the Hub server: {fix}")
        pytest.skip(f"olah is not installed: {fix}")


@pytest.fixture(scope="session")
def hub_server() -> Iterator[HubServer]:
    """A Hub API server on loopback for the session; add repos to it with add_model / add_dataset."""
    need_olah()
    with HubServer() as server:
        yield server


@pytest.fixture
def hub_env(hub_server: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HubServer:
    """hub_server with this process's clients pointed at it (huggingface_hub, transformers,
    datasets), empty caches (HF_HUB_CACHE, HF_DATASETS_CACHE) and no token; counts reset."""
    hub_server.patch_endpoint(monkeypatch)
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setattr(hub_constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    ds_config = _datasets_config()
    if ds_config is not None:
        datasets_cache = tmp_path / "datasets-cache"
        monkeypatch.setattr(ds_config, "HF_DATASETS_CACHE", datasets_cache)
        monkeypatch.setattr(ds_config, "DOWNLOADED_DATASETS_PATH", datasets_cache / "downloads")
        monkeypatch.setattr(ds_config, "EXTRACTED_DATASETS_PATH", datasets_cache / "downloads" / "extracted")
    hub_server.reset_counts()
    return hub_server
