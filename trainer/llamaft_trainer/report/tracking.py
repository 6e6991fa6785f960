"""Experiment tracking: TensorBoard, MLflow and Weights & Biases, each through its own client
library, from rank 0 only.

One tracker run per fine-tune, whatever the number of attempts: its identity is derived from the
run (namespace, name and uid of the LlamaFineTune; `llamaft run --local` names its own), so a
resumed attempt finds and continues it: MLflow by the run's `llamaft.run` tag, W&B by the run id
itself (resume="allow"), TensorBoard by its directory. Steps that a resumed attempt trains again
(those after its checkpoint) are not logged twice: MLflow and W&B keep the points they have and
take only later steps; TensorBoard's own `purge_step` drops the old attempt's points past the
checkpoint, so its readers see the new ones.

Training never waits for a tracker: points go into a bounded queue that one thread drains, and
what does not fit is dropped. A tracker that fails is tried again every RETRY_S seconds, its points
meanwhile dropped (so the end of a run never waits on one that is away); each change between up and
down is a `tracking` warning in the log and in the progress document (the operator turns it into
an event). Credentials come from the environment (MLflow's and W&B's own variables, from the
spec's Secrets) and are never parameters or logged.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Protocol

from llamaft.api.spec import TrainingJobConfig, WandbMode

from llamaft_trainer.process.errors import ConfigError
from llamaft_trainer.report.metrics import log_json

QUEUE_SIZE = 10_000
"""Points waiting for the trackers (one per logged step or eval): hours of a slow tracker."""
CLOSE_TIMEOUT_S = 30.0
"""How long the end of a run waits for the queue to drain before it leaves the rest."""
RETRY_S = 10.0
"""A tracker that failed is tried again this long after: meanwhile its points are dropped."""
RUN_TAG = "llamaft.run"

STEP_METRICS = {
    "loss": "train/loss", "lr": "train/learning_rate", "grad_norm": "train/grad_norm",
    "tokens_per_second": "train/tokens_per_second", "tokens_per_second_per_device": "train/tokens_per_second_per_device",
    "mfu": "train/mfu", "peak_memory_bytes": "train/peak_memory_bytes", "step_seconds": "train/step_seconds",
    "epoch": "train/epoch",
    # DPO (training.method dpo): TRL's names, under train/ as transformers' trackers log them.
    "rewards/chosen": "train/rewards/chosen", "rewards/rejected": "train/rewards/rejected",
    "rewards/accuracies": "train/rewards/accuracies", "rewards/margins": "train/rewards/margins",
    "logps/chosen": "train/logps/chosen", "logps/rejected": "train/logps/rejected",
}
"""The step event's fields a tracker gets, under the names it shows them (a field the event
lacks, as an SFT step lacks the rewards, is not logged)."""


@dataclass(frozen=True)
class RunIdentity:
    """Which fine-tune this is: the LlamaFineTune's namespace, name and uid (the operator sets
    LLAMAFT_RUN_*), or a local run's name."""

    namespace: str
    name: str
    uid: str

    @classmethod
    def from_env(cls, cfg: TrainingJobConfig) -> RunIdentity:
        name = os.environ.get("LLAMAFT_RUN_NAME")
        if name:
            return cls(os.environ.get("LLAMAFT_RUN_NAMESPACE", "default"), name, os.environ.get("LLAMAFT_RUN_UID", ""))
        # Outside a cluster: the checkpoint directory is what makes two local runs one run.
        where = str(Path(cfg.checkpointing.directory).expanduser().resolve())
        return cls("local", Path(where).name or "run", hashlib.sha256(where.encode()).hexdigest()[:16])

    @property
    def key(self) -> str:
        """A short stable id: the W&B run id and the MLflow tag value."""
        return hashlib.sha256(f"{self.namespace}/{self.name}/{self.uid}".encode()).hexdigest()[:16]

    @property
    def display_name(self) -> str:
        return self.name if self.namespace in ("local", "default") else f"{self.namespace}/{self.name}"


class TrackerClient(Protocol):
    """One tracker. `open` finds or creates the run and says where to find it (for status);
    calls happen on the tracking thread only."""

    name: str

    def open(self, resumed_at: int) -> dict[str, str]: ...
    def params(self, params: dict[str, str]) -> None: ...
    def metrics(self, step: int, values: dict[str, float]) -> None: ...
    def text(self, step: int, generations: list[dict[str, str]]) -> None: ...
    def close(self, outcome: str) -> None: ...


# ------------------------------------------------------------------------------- the backends
class TensorBoardBackend:
    name = "tensorboard"

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.writer: Any = None

    def open(self, resumed_at: int) -> dict[str, str]:
        from torch.utils.tensorboard import SummaryWriter

        Path(self.directory).mkdir(parents=True, exist_ok=True)
        # purge_step: readers drop this directory's earlier points from that step on (a resumed
        # attempt trains those steps again).
        self.writer = SummaryWriter(self.directory, purge_step=resumed_at + 1 if resumed_at else None, flush_secs=10)
        return {"tensorboardDirectory": self.directory}

    def params(self, params: dict[str, str]) -> None:
        table = "\n".join(f"| {k} | {v} |" for k, v in sorted(params.items()))
        self.writer.add_text("params", "| parameter | value |\n|---|---|\n" + table, global_step=0)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)

    def text(self, step: int, generations: list[dict[str, str]]) -> None:
        self.writer.add_text("eval/generations", _markdown(generations), global_step=step)

    def close(self, outcome: str) -> None:
        if self.writer is not None:
            self.writer.close()


class MlflowBackend:
    name = "mlflow"

    def __init__(self, tracking_uri: str, experiment: str, identity: RunIdentity) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.identity = identity
        self.client: Any = None
        self.run_id = ""
        self.floor = 0
        """The last step the run had when this attempt opened it: later steps only."""
        self.logged: dict[str, str] = {}

    def open(self, resumed_at: int) -> dict[str, str]:
        # MLflow's client retries a failed request for minutes by default: the tracking thread
        # would hold every later point behind one of them. A few quick tries, then the next points.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(self.experiment)
        runs = self.client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{self.identity.key}'", max_results=1)
        if runs:
            run = runs[0]
            self.run_id = run.info.run_id
            self.logged = dict(run.data.params)
            history = self.client.get_metric_history(self.run_id, STEP_METRICS["loss"])
            self.floor = max((m.step for m in history), default=0)
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(experiment_id, run_name=self.identity.display_name,
                                         tags={RUN_TAG: self.identity.key, "llamaft.uid": self.identity.uid})
            self.run_id = run.info.run_id
        return {"mlflowRunId": self.run_id, "mlflowExperimentId": str(experiment_id)}

    def params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        # A parameter cannot change in an MLflow run: later attempts add what is new only.
        new = [Param(k, v[:6000]) for k, v in sorted(params.items()) if k not in self.logged]
        for i in range(0, len(new), 100):  # the server's limit per request
            self.client.log_batch(self.run_id, params=new[i:i + 100])
        self.logged.update({p.key: p.value for p in new})

    def metrics(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        if step <= self.floor:
            return  # trained again after a resume: the earlier attempt's point stays
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in values.items()])

    def text(self, step: int, generations: list[dict[str, str]]) -> None:
        if step <= self.floor:
            return
        self.client.log_dict(self.run_id, {"step": step, "generations": generations}, f"generations/step-{step:08d}.json")

    def close(self, outcome: str) -> None:
        if self.client is not None and self.run_id:
            self.client.set_terminated(self.run_id, status=outcome)


class WandbBackend:
    name = "wandb"

    def __init__(self, cfg: TrainingJobConfig, identity: RunIdentity, directory: str) -> None:
        assert cfg.tracking.wandb is not None
        self.spec = cfg.tracking.wandb
        self.identity = identity
        self.directory = directory
        self.run: Any = None
        self.floor = 0
        self.steps_file = Path(directory) / f"llamaft-{identity.key}.json"
        """The last step logged, kept beside the run: an offline run cannot ask W&B."""

    def open(self, resumed_at: int) -> dict[str, str]:
        import wandb

        Path(self.directory).mkdir(parents=True, exist_ok=True)
        if self.spec.base_url:
            os.environ.setdefault("WANDB_BASE_URL", self.spec.base_url)
        self.run = wandb.init(
            project=self.spec.project, entity=self.spec.entity, id=self.identity.key, resume="allow",
            name=self.identity.display_name, dir=self.directory, mode=self.spec.mode.value,
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )
        saved = json.loads(self.steps_file.read_text())["lastStep"] if self.steps_file.exists() else 0
        self.floor = max(int(self.run.step or 0) - 1, int(saved))
        info = {"wandbRunId": self.run.id}
        if self.spec.mode is WandbMode.ONLINE and getattr(self.run, "url", None):
            info["wandbUrl"] = str(self.run.url)
        return info

    def params(self, params: dict[str, str]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        if step <= self.floor:
            return  # trained again after a resume: the earlier attempt's point stays
        self.run.log(values, step=step)
        partial = self.steps_file.with_suffix(".tmp")
        partial.write_text(json.dumps({"lastStep": step}))
        partial.replace(self.steps_file)

    def text(self, step: int, generations: list[dict[str, str]]) -> None:
        if step <= self.floor:
            return
        import wandb

        table = wandb.Table(columns=["prompt", "reference", "generated"],
                            data=[[g["prompt"], g["reference"], g["generated"]] for g in generations])
        self.run.log({"eval/generations": table}, step=step)

    def close(self, outcome: str) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if outcome == "FINISHED" else 1)


# --------------------------------------------------------------------------------- the tracker
@dataclass
class _Health:
    down: bool = False
    retry_at: float = 0.0
    dropped: int = 0


@dataclass
class Tracker:
    """The trackers of one run behind one bounded queue (see the module docstring)."""

    backends: list[TrackerClient]
    on_warning: Callable[[str], None] = field(default=lambda message: None)
    on_info: Callable[[dict[str, str]], None] = field(default=lambda info: None)
    """Called with where the runs are (run ids, directories) each time a tracker opens."""
    info: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue(maxsize=QUEUE_SIZE)
        self._health = {b.name: _Health() for b in self.backends}
        self._opened: set[str] = set()
        self._thread: threading.Thread | None = None
        self._resumed_at = 0
        self._params: dict[str, str] = {}

    def start(self, resumed_at: int, params: dict[str, str]) -> None:
        """Open every tracker (on the thread: a server that hangs never holds the first step)."""
        self._resumed_at, self._params = resumed_at, params
        self._thread = threading.Thread(target=self._drain, daemon=True, name="tracking")
        self._thread.start()

    def step(self, metrics: dict[str, Any]) -> None:
        values = {name: float(metrics[k]) for k, name in STEP_METRICS.items() if metrics.get(k) is not None}
        self._put(("metrics", (int(metrics["step"]), values)))

    def eval(self, step: int, loss: float, perplexity: float) -> None:
        self._put(("metrics", (step, {"eval/loss": float(loss), "eval/perplexity": float(perplexity)})))

    def eval_metrics(self, step: int, report: dict[str, float]) -> None:
        """An eval event's `eval_*` figures (DPO's `eval_loss`, `eval_rewards/accuracies` ...)
        under `eval/` (`eval/loss`, `eval/rewards/accuracies`), as transformers' trackers name them."""
        values = {f"eval/{k.removeprefix('eval_')}": float(v) for k, v in report.items()
                  if k.startswith("eval_") and v is not None}
        self._put(("metrics", (step, values)))

    def generations(self, report: dict[str, Any]) -> None:
        """An evaluation's task scores (metrics `eval/rouge1` ...) and its generations (text)."""
        step = int(report["step"])
        values = {f"eval/{k}": float(v) for k, v in report.items() if k.startswith("rouge")}
        if values:
            self._put(("metrics", (step, values)))
        self._put(("text", (step, list(report.get("generations", [])))))

    def close(self, outcome: str, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Send what is queued (waiting at most `timeout_s`) and end the runs with `outcome`
        (MLflow's FINISHED, FAILED or KILLED)."""
        if self._thread is None:
            return
        self._put(("close", outcome))
        self._put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log_json("tracking", warning="the trackers did not take every point before the run ended", queued=self._queue.qsize())

    # -------------------------------------------------------------------------- the thread
    def _put(self, item: tuple[str, Any] | None) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            for health in self._health.values():
                health.dropped += 1

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            kind, payload = item
            for backend in self.backends:
                self._call(backend, kind, payload)

    def _call(self, backend: TrackerClient, kind: str, payload: Any) -> None:
        health = self._health[backend.name]
        if health.down and time.monotonic() < health.retry_at:
            health.dropped += 1  # not tried again yet: the run never waits on a tracker that is away
            return
        try:
            if backend.name not in self._opened:
                if kind == "close":
                    return
                self.info.update(backend.open(self._resumed_at))
                backend.params(self._params)
                self._opened.add(backend.name)
                log_json("tracking", tracker=backend.name, **self.info)
                self.on_info(dict(self.info))
            if kind == "metrics":
                backend.metrics(*payload)
            elif kind == "text":
                backend.text(*payload)
            elif kind == "close":
                backend.close(payload)
        except Exception as exc:  # a tracker's failure is never the run's
            health.retry_at = time.monotonic() + RETRY_S
            if kind == "metrics":
                health.dropped += 1
            if not health.down:
                health.down = True
                self._warn(f"{backend.name}: {type(exc).__name__}: {str(exc)[:300]}; training goes on, "
                           "its points are retried and dropped while it stays away")
            return
        if health.down:
            health.down = False
            self._warn(f"{backend.name}: reachable again" + (f" ({health.dropped} points dropped)" if health.dropped else ""))
            health.dropped = 0

    def _warn(self, message: str) -> None:
        log_json("tracking", warning=message)
        self.on_warning(message)


# ----------------------------------------------------------------------------------- wiring
def _markdown(generations: list[dict[str, str]]) -> str:
    rows = ["| prompt (end) | reference | generated |", "|---|---|---|"]
    for g in generations:
        cells = [g[k][-300:].replace("|", "\\|").replace("\n", "<br>") for k in ("prompt", "reference", "generated")]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def check(cfg: TrainingJobConfig) -> None:
    """A tracker whose client library is missing is a ConfigError naming its field (every rank
    checks, so rank 0 never fails alone after the others began)."""
    import importlib.util

    for field_name, module in (("tensorboard", "tensorboard"), ("mlflow", "mlflow"), ("wandb", "wandb")):
        if getattr(cfg.tracking, field_name) is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(f"spec.tracking.{field_name}: the trainer image has no `{module}` package: install "
                              f"llamaft[trainer] (it includes the trackers' clients) or remove spec.tracking.{field_name}")


def backends(cfg: TrainingJobConfig, identity: RunIdentity) -> list[TrackerClient]:
    """The spec's trackers, in the order they are called."""
    check(cfg)
    root = cfg.checkpointing.directory.rstrip("/")
    found: list[TrackerClient] = []
    tracking = cfg.tracking
    if tracking.tensorboard is not None:
        found.append(TensorBoardBackend(tracking.tensorboard.directory or f"{root}/tensorboard"))
    if tracking.mlflow is not None:
        found.append(MlflowBackend(tracking.mlflow.tracking_uri, tracking.mlflow.experiment, identity))
    if tracking.wandb is not None:
        found.append(WandbBackend(cfg, identity, f"{root}/wandb"))
    return found


def params(cfg: TrainingJobConfig, world_size: int, spec: dict[str, Any] | None = None) -> dict[str, str]:
    """The spec flattened (`training.learningRate`, `cluster.workers` ...: the whole LlamaFineTune
    spec when the operator mounted it (`spec`), else the trainer's part), the image, the world
    size and the versions that made the run. Secrets appear by reference (their names) only."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif value is not None:
            flat[prefix] = str(value)

    walk("", spec if spec is not None else cfg.to_k8s())
    flat["worldSize"] = str(world_size)
    if os.environ.get("LLAMAFT_IMAGE"):
        flat["image"] = os.environ["LLAMAFT_IMAGE"]
    for package in ("torch", "transformers", "llamaft"):
        try:
            flat[f"versions.{package}"] = version(package)
        except PackageNotFoundError:
            continue
    return flat


def whole_spec(path: str | None = None) -> dict[str, Any] | None:
    """The LlamaFineTune spec the operator mounts beside the config (LLAMAFT_SPEC); None when
    there is none (a trainer started by hand) or it cannot be read: the params are then the
    trainer's part of the spec, and training never depends on this file."""
    path = path or os.environ.get("LLAMAFT_SPEC")
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            body = json.load(f)
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def start(cfg: TrainingJobConfig, world_size: int, resumed_at: int, on_warning: Callable[[str], None],
          on_info: Callable[[dict[str, str]], None]) -> Tracker | None:
    """The run's tracker, started (rank 0 calls this); None when the spec names none."""
    identity = RunIdentity.from_env(cfg)
    found = backends(cfg, identity)
    if not found:
        return None
    tracker = Tracker(found, on_warning, on_info)
    tracker.start(resumed_at, params(cfg, world_size, whole_spec()))
    return tracker
