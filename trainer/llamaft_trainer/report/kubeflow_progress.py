"""Progress where Kubeflow users look for it: TrainJob.status.trainerStatus.

Under Kubeflow Trainer v2.2+ with its TrainJobStatus feature gate, the controller injects into the
trainer container (upstream docs/user-guides/trainjob-progress.md, "Option C: Raw HTTP"; vendored in
tests/fixtures/upstream/kubeflow-trainer-v2.3/):
  KUBEFLOW_TRAINER_SERVER_URL      the HTTPS endpoint (…/namespaces/<ns>/trainjobs/<name>/status)
  KUBEFLOW_TRAINER_SERVER_CA_CERT  path of the CA certificate that signs the endpoint's
  KUBEFLOW_TRAINER_SERVER_TOKEN    path of a projected service account token (a rotating JWT: it is
                                   read again for every post)
and accepts `POST {"trainerStatus": {"progressPercentage", "estimatedRemainingSeconds", "metrics":
[{"name", "value"}], "lastUpdatedTime"}}` with `Authorization: Bearer <token>`. `kubectl get trainjob
-o jsonpath='{.status.trainerStatus}'` then shows the run's progress, ETA, loss, tokens/s and MFU.

The leader (global rank 0) feeds every update of its /progress document (metrics.ProgressPublisher) to
`KubeflowProgress.offer`, which only keeps the latest value (a queue of one) and returns at once.
A background thread posts it at most every `min_interval_s` (the guide asks for at most one post per
5 s) with short timeouts and a small bounded retry (urllib3), and `close()` makes one final post of
the last value, waiting a bounded time. Whatever the endpoint does (down, slow, 4xx, 5xx, a bad
certificate), the run neither fails nor waits: errors are logged once per change of state.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import urllib3

from llamaft_trainer.report.logline import log_json

if TYPE_CHECKING:  # metrics imports torch; this module must not
    from llamaft_trainer.report.metrics import ProgressPublisher

ENV_URL = "KUBEFLOW_TRAINER_SERVER_URL"
ENV_CA_CERT = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
ENV_TOKEN = "KUBEFLOW_TRAINER_SERVER_TOKEN"
MIN_INTERVAL_S = 5.0
"""At most one post per this many seconds (upstream's guidance and its SDK's throttle)."""
CLOSE_TIMEOUT_S = 10.0
"""Longest the final post may hold up the end of the run."""
INT32_MAX = 2**31 - 1
METRIC_TEXT_MAX = 64
"""trainerStatus.metrics[].name and .value are strings of at most 64 characters (the CRD)."""


def _number(value: Any) -> str:
    return f"{float(value):.6g}"[:METRIC_TEXT_MAX]


def trainer_status(doc: Mapping[str, Any], now: datetime | None = None) -> dict[str, Any]:
    """The trainerStatus for one /progress document (docs/progress-contract.md)."""
    status: dict[str, Any] = {}
    step, total = doc.get("step"), doc.get("totalSteps")
    if doc.get("phase") == "Succeeded":
        status["progressPercentage"] = 100
    elif isinstance(step, int | float) and isinstance(total, int | float) and total > 0:
        status["progressPercentage"] = max(0, min(100, int(100 * step / total)))
    eta = doc.get("etaSeconds")
    if doc.get("phase") == "Succeeded":
        status["estimatedRemainingSeconds"] = 0
    elif isinstance(eta, int | float) and not isinstance(eta, bool):
        status["estimatedRemainingSeconds"] = max(0, min(INT32_MAX, int(eta)))
    metrics = []
    for name, key in (("loss", "loss"), ("eval_loss", "evalLoss"), ("tokens_per_second", "tokensPerSecond"),
                      ("mfu", "mfu"), ("reward_accuracy", "rewardAccuracy"), ("eval_reward_accuracy", "evalRewardAccuracy")):
        value = doc.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            metrics.append({"name": name, "value": _number(value)})
    if metrics:
        status["metrics"] = metrics
    moment = now or datetime.now(UTC)
    status["lastUpdatedTime"] = moment.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    return status


class KubeflowProgress:
    """Posts the latest trainerStatus to Kubeflow Trainer's status endpoint from a background thread."""

    def __init__(
        self, url: str, ca_cert: str, token_file: str, *, min_interval_s: float = MIN_INTERVAL_S,
        timeout: urllib3.Timeout | None = None, retries: urllib3.Retry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.token_file = token_file
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._pool = urllib3.PoolManager(
            cert_reqs="CERT_REQUIRED", ca_certs=ca_cert,
            timeout=timeout or urllib3.Timeout(connect=2.0, read=3.0),
            # Applying a status is idempotent: POST may be retried, a little, without waiting on Retry-After.
            retries=retries or urllib3.Retry(total=2, backoff_factor=0.2, backoff_max=1.0, allowed_methods=None,
                                             status_forcelist=(429, 500, 502, 503, 504), raise_on_status=False,
                                             respect_retry_after_header=False),
        )
        self._cond = threading.Condition()
        self._latest: dict[str, Any] | None = None
        self._closing = False
        self._last_post: float | None = None
        self.posts = 0
        """Posts the endpoint accepted."""
        self.failures = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="kubeflow-progress")
        self._thread.start()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **kwargs: Any) -> KubeflowProgress | None:
        """A reporter when Kubeflow Trainer injected its endpoint, else None."""
        env = os.environ if env is None else env
        url, ca_cert, token = env.get(ENV_URL), env.get(ENV_CA_CERT), env.get(ENV_TOKEN)
        if not url:
            return None
        if not ca_cert or not token:
            log_json("warning", message=f"{ENV_URL} is set without {ENV_CA_CERT} and {ENV_TOKEN}: TrainJob progress "
                 "is not reported")
            return None
        try:
            return cls(url, ca_cert, token, **kwargs)
        except Exception as exc:  # e.g. an unreadable CA file: report it, never fail the run
            log_json("warning", message=f"TrainJob progress is not reported: {type(exc).__name__}: {exc}")
            return None

    # ------------------------------------------------------------------------------ the caller
    def offer(self, doc: Mapping[str, Any]) -> None:
        """Queue the trainerStatus of this /progress document (replacing one not yet posted).
        Never blocks on the network and never raises."""
        try:
            status = trainer_status(doc)
        except Exception as exc:
            self._failed(f"unusable progress document: {exc}")
            return
        with self._cond:
            if self._closing:
                return
            self._latest = status
            self._cond.notify()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Post the last offered value now (the final post) and stop, waiting at most `timeout_s`."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while self._latest is None and not self._closing:
                    self._cond.wait()
                if self._latest is None:
                    return  # closing, everything posted
                while not self._closing and self._last_post is not None:
                    wait = self._last_post + self.min_interval_s - self._clock()
                    if wait <= 0:
                        break
                    self._cond.wait(wait)
                status, self._latest = self._latest, None
            try:
                self._post(status)
            except Exception as exc:  # never let the thread die: the next value gets its chance
                self._failed(f"{type(exc).__name__}: {exc}")
            self._last_post = self._clock()

    def _post(self, status: dict[str, Any]) -> None:
        try:
            with open(self.token_file, encoding="utf-8") as f:  # rotates: read it every time
                token = f.read().strip()
        except OSError as exc:
            self._failed(f"cannot read the token file {self.token_file}: {exc}")
            return
        try:
            response = self._pool.request(
                "POST", self.url, body=json.dumps({"trainerStatus": status}).encode(),
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            )
        except urllib3.exceptions.HTTPError as exc:
            self._failed(f"{type(exc).__name__}: {exc}")
            return
        if 200 <= response.status < 300:
            if self.last_error is not None:
                log_json("kubeflow_progress", message="TrainJob progress reporting works again")
            self.last_error = None
            self.posts += 1
            return
        body = response.data[:300].decode("utf-8", "replace")
        self._failed(f"HTTP {response.status}: {body}")

    def _failed(self, error: str) -> None:
        self.failures += 1
        if error != self.last_error:  # once per change, not once per post
            log_json("warning", message=f"TrainJob progress not reported ({self.url}): {error}")
        self.last_error = error


def attach(progress: ProgressPublisher, env: Mapping[str, str] | None = None) -> KubeflowProgress | None:
    """Report `progress` (a metrics.ProgressPublisher) to Kubeflow Trainer when it injected its endpoint."""
    reporter = KubeflowProgress.from_env(env)
    if reporter is not None:
        progress.add_listener(reporter.offer)
        reporter.offer(progress.snapshot())
    return reporter

