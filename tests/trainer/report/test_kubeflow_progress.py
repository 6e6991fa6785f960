"""The leader's progress posted to Kubeflow Trainer's TrainJob status endpoint
(llamaft_trainer.report.kubeflow_progress), against a local HTTPS endpoint that checks the bearer token the
way the upstream guide describes (tests/fixtures/upstream/kubeflow-trainer-v2.3/trainjob-progress.md)."""

from __future__ import annotations

import json
import re
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from llamaft_trainer.report import kubeflow_progress
from llamaft_trainer.report.kubeflow_progress import KubeflowProgress, trainer_status

from tests.conftest import REFERENCE, need_binary

STATUS_PATH = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/team-a/trainjobs/ft-1/status"
"""statusserver.StatusUrl(namespace, name) in Kubeflow Trainer v2.3."""
DOC = {"phase": "Training", "step": 25, "totalSteps": 100, "epoch": 0, "loss": 1.234567891, "evalLoss": 1.5,
       "tokensPerSecond": 12345.678, "mfu": 0.41234, "etaSeconds": 321.7}


# ------------------------------------------------------------------------------- the endpoint
@dataclass
class Tls:
    ca: Path
    cert: Path
    key: Path


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Tls:
    """A CA and a server certificate for 127.0.0.1 signed by it (openssl CLI)."""
    openssl = need_binary("openssl", "openssl")
    d = tmp_path_factory.mktemp("tls")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=llamaft-test-ca",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
                               "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
                               "authorityKeyIdentifier=keyid,issuer\nsubjectKeyIdentifier=hash\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "2", "-extfile", "ext.cnf")
    return Tls(d / "ca.crt", d / "server.crt", d / "server.key")


@dataclass
class Endpoint:
    url: str
    token_file: Path
    posts: list[dict[str, Any]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    delay_s: float = 0.0

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()


@pytest.fixture
def endpoint(tls: Tls, tmp_path: Path) -> Iterator[Endpoint]:
    """Kubeflow Trainer's status server, reduced to what the client sees: POST to the TrainJob's
    status URL with `Authorization: Bearer <the projected token>`, 200 with the payload back, a
    metav1.Status and 403 for a wrong token."""
    token_file = tmp_path / "token"
    token_file.write_text("token-1\n")
    ep = Endpoint("", token_file)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            time.sleep(ep.delay_s)
            if self.path != STATUS_PATH:
                self._reply(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404})
            elif self.headers.get("Authorization") != f"Bearer {ep.token}":
                ep.refused.append(str(self.headers.get("Authorization")))
                self._reply(403, {"kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403})
            else:
                ep.posts.append(json.loads(body))
                ep.times.append(time.monotonic())
                self._reply(200, json.loads(body))

        def _reply(self, code: int, doc: dict[str, Any]) -> None:
            data = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tls.cert, tls.key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ep.url = f"https://127.0.0.1:{server.server_address[1]}{STATUS_PATH}"
    yield ep
    server.shutdown()
    server.server_close()


def reporter(ep: Endpoint, tls: Tls, **kwargs: Any) -> KubeflowProgress:
    return KubeflowProgress(ep.url, str(tls.ca), str(ep.token_file), **kwargs)


def trainer_status_schema() -> dict[str, Any]:
    crd = yaml.safe_load((REFERENCE / "kubeflow-trainer-v2.3" / "trainer.kubeflow.org_trainjobs.yaml").read_text())
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["trainerStatus"]
    return schema


# ----------------------------------------------------------------------------------- the posts
def test_the_leader_posts_trainer_status_with_the_bearer_token(endpoint: Endpoint, tls: Tls) -> None:
    r = reporter(endpoint, tls, min_interval_s=0)
    r.offer(DOC)
    r.close()
    assert r.posts == 1 and r.failures == 0 and endpoint.refused == []
    status = endpoint.posts[0]["trainerStatus"]
    assert status["progressPercentage"] == 25 and status["estimatedRemainingSeconds"] == 321
    assert status["metrics"] == [{"name": "loss", "value": "1.23457"}, {"name": "eval_loss", "value": "1.5"},
                                 {"name": "tokens_per_second", "value": "12345.7"}, {"name": "mfu", "value": "0.41234"}]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", status["lastUpdatedTime"])
    jsonschema.Draft7Validator(trainer_status_schema()).validate(status)


def test_the_token_is_read_again_for_every_post(endpoint: Endpoint, tls: Tls) -> None:
    """The projected token is a JWT that rotates: a cached one would start failing."""
    r = reporter(endpoint, tls, min_interval_s=0)
    r.offer(DOC)
    deadline = time.monotonic() + 10
    while not endpoint.posts and time.monotonic() < deadline:
        time.sleep(0.02)
    endpoint.token_file.write_text("token-2\n")
    r.offer({**DOC, "step": 50})
    r.close()
    assert [p["trainerStatus"]["progressPercentage"] for p in endpoint.posts] == [25, 50]
    assert endpoint.refused == [] and r.failures == 0


def test_a_refused_token_is_logged_not_raised(endpoint: Endpoint, tls: Tls, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token")
    r = KubeflowProgress(endpoint.url, str(tls.ca), str(wrong), min_interval_s=0)
    r.offer(DOC)
    r.close()
    assert r.posts == 0 and r.failures == 1 and endpoint.refused == ["Bearer not-the-token"]
    assert "HTTP 403" in str(r.last_error) and "TrainJob progress not reported" in capsys.readouterr().out


def test_an_untrusted_certificate_is_a_failure_not_a_crash(endpoint: Endpoint, tls: Tls) -> None:
    r = KubeflowProgress(endpoint.url, str(tls.cert), str(endpoint.token_file), min_interval_s=0)  # leaf, not the CA
    r.offer(DOC)
    r.close()
    assert r.posts == 0 and r.failures >= 1 and endpoint.posts == []


# ----------------------------------------------------------------- never failing or blocking the run
def test_an_endpoint_that_is_down_neither_fails_nor_blocks_the_run(tls: Tls, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket is closed
    token = tmp_path / "token"
    token.write_text("t")
    r = KubeflowProgress(f"https://127.0.0.1:{port}{STATUS_PATH}", str(tls.ca), str(token), min_interval_s=0)
    start = time.monotonic()
    for step in range(200):
        r.offer({**DOC, "step": step})
    assert time.monotonic() - start < 0.5, "offer() must only queue"
    r.close(timeout_s=5)
    assert time.monotonic() - start < 6
    assert r.posts == 0 and r.failures >= 1


def test_a_slow_endpoint_does_not_hold_up_the_run_and_close_is_bounded(endpoint: Endpoint, tls: Tls) -> None:
    endpoint.delay_s = 2.0
    r = reporter(endpoint, tls, min_interval_s=0)
    start = time.monotonic()
    for step in range(50):
        r.offer({**DOC, "step": step})
    assert time.monotonic() - start < 0.5
    r.close(timeout_s=0.5)
    assert time.monotonic() - start < 1.5


def test_no_endpoint_in_the_environment_means_no_reporter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert KubeflowProgress.from_env({}) is None
    assert KubeflowProgress.from_env({"KUBEFLOW_TRAINER_SERVER_URL": "https://x"}) is None
    assert "is not reported" in capsys.readouterr().out
    (tmp_path / "token").write_text("t")
    missing_ca = {"KUBEFLOW_TRAINER_SERVER_URL": "https://127.0.0.1:1/x",
                  "KUBEFLOW_TRAINER_SERVER_CA_CERT": str(tmp_path / "missing.crt"),
                  "KUBEFLOW_TRAINER_SERVER_TOKEN": str(tmp_path / "token")}
    r = KubeflowProgress.from_env(missing_ca, min_interval_s=0)
    assert r is not None
    r.offer(DOC)
    r.close()
    assert r.posts == 0 and r.failures == 1, "an unreadable CA is a failed post, never an exception"


# ------------------------------------------------------------------------------------ throttling
def test_posts_are_throttled_and_the_latest_value_wins(endpoint: Endpoint, tls: Tls) -> None:
    interval = 0.4
    r = reporter(endpoint, tls, min_interval_s=interval)
    start = time.monotonic()
    step = 0
    while time.monotonic() - start < 1.5:
        step += 1
        r.offer({**DOC, "step": step})
        time.sleep(0.02)
    r.close()
    elapsed = time.monotonic() - start
    steps = [p["trainerStatus"]["progressPercentage"] for p in endpoint.posts]
    assert 3 <= len(steps) <= int(elapsed / interval) + 2, steps  # ~70 offers, a post per interval + the final one
    assert steps[-1] == min(step, 100), "the final post carries the last value"
    gaps = [b - a for a, b in zip(endpoint.times[:-1], endpoint.times[1:-1], strict=False)]
    assert all(gap >= interval * 0.9 for gap in gaps), gaps


# ------------------------------------------------------------------------------- the payload
def test_trainer_status_follows_the_crd() -> None:
    schema = trainer_status_schema()
    done = trainer_status({"phase": "Succeeded", "step": 100, "totalSteps": 100, "etaSeconds": 3})
    assert done["progressPercentage"] == 100 and done["estimatedRemainingSeconds"] == 0 and "metrics" not in done
    odd = trainer_status({"step": 150, "totalSteps": 100, "etaSeconds": 10**12, "loss": float("1e300"), "mfu": True})
    assert odd["progressPercentage"] == 100 and odd["estimatedRemainingSeconds"] == 2**31 - 1
    assert [m["name"] for m in odd["metrics"]] == ["loss"]
    for status in (done, odd, trainer_status({}), trainer_status(DOC)):
        jsonschema.Draft7Validator(schema).validate(status)
        assert all(len(m["name"]) <= 64 and len(m["value"]) <= 64 for m in status.get("metrics", []))


def test_the_progress_document_feeds_the_reporter(endpoint: Endpoint, tls: Tls) -> None:
    """metrics.ProgressPublisher (the /progress document) calls its listeners on every update; `attach`
    wires the reporter in when the environment names the endpoint, and close() is the final post."""
    from llamaft_trainer.report.metrics import ProgressPublisher

    progress = ProgressPublisher()
    env = {"KUBEFLOW_TRAINER_SERVER_URL": endpoint.url, "KUBEFLOW_TRAINER_SERVER_CA_CERT": str(tls.ca),
           "KUBEFLOW_TRAINER_SERVER_TOKEN": str(endpoint.token_file)}
    r = kubeflow_progress.attach(progress, env)
    assert r is not None
    progress.update(phase="Training", totalSteps=10)
    progress.record_step({"step": 4, "epoch": 0, "loss": 2.0, "lr": 1e-4, "grad_norm": 1.0, "tokens_per_second": 99.0,
                          "tokens_per_second_per_device": 49.5, "mfu": None, "peak_memory_bytes": 1, "tokens": 10,
                          "eta_seconds": 7})
    progress.update(phase="Succeeded")
    r.close()
    last = endpoint.posts[-1]["trainerStatus"]
    assert last["progressPercentage"] == 100 and last["estimatedRemainingSeconds"] == 0
    assert {m["name"]: m["value"] for m in last["metrics"]} == {"loss": "2", "tokens_per_second": "99"}
    assert kubeflow_progress.attach(ProgressPublisher(), {}) is None
