"""Metrics step: structured JSON log lines, MFU, and the progress contract.

Progress contract (read by the operator; documented in docs/progress-contract.md): rank 0 of
every worker serves, on the spec's monitoring.metricsPort,
  GET /metrics   Prometheus text (llamaft_train_* gauges and counters)
  GET /progress  JSON llamaft.api.contracts.ProgressDocument: {"rank", "pod", "phase", "step",
                 "totalSteps", "epoch", "loss", "evalLoss", "tokensPerSecond", "mfu", "etaSeconds",
                 "rewardAccuracy", "rewardMargin", "rewardChosen", "rewardRejected", "logpsChosen",
                 "logpsRejected", "evalRewardAccuracy", "evalRewardMargin" (DPO),
                 "exportPath", "tracking", "trackingWarning", "evaluation", "updatedAt"}, the keys set so far
and prints every logged step as one JSON line {"event": "step", ...} on stdout.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from llamaft.api.contracts import ProgressDocument, ProgressPhase
from llamaft.api.flops import flops_per_token
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from transformers import PretrainedConfig

from llamaft_trainer.process import termination
from llamaft_trainer.report.logline import (
    log_json as log_json,  # the trainer's modules log through metrics.log_json
)

_WIRE_NAMES = {name: str(field.alias) for name, field in ProgressDocument.model_fields.items()}
"""ProgressDocument's field names -> their camelCase wire names."""

PEAK_FLOPS_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def model_flops_per_token(config: PretrainedConfig, n_params: int, seq_len: int) -> float:
    """llamaft.api.flops.flops_per_token (the planner counts with it too) for a Hugging Face config
    and the model's parameter count."""
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    embedding = int(config.vocab_size) * int(config.hidden_size)
    return flops_per_token(n_params, embedding, int(config.num_hidden_layers), heads * head_dim, seq_len)


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of one device; LLAMAFT_PEAK_FLOPS overrides; None when unknown (CPU)."""
    if "LLAMAFT_PEAK_FLOPS" in os.environ:
        return float(os.environ["LLAMAFT_PEAK_FLOPS"])
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in PEAK_FLOPS_BF16.items():
            if key in name:
                return value
    return None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak device memory (CUDA) or peak resident host memory of this process (CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


REWARD_GAUGES = {
    "rewards/accuracies": ("llamaft_train_reward_accuracy", "DPO: share of the last logged step's pairs whose chosen "
                           "reward exceeds the rejected one's (TRL's rewards/accuracies, 0-1)"),
    "rewards/margins": ("llamaft_train_reward_margin", "DPO: mean chosen minus rejected reward of the last logged step "
                        "(TRL's rewards/margins)"),
    "rewards/chosen": ("llamaft_train_reward_chosen", "DPO: mean beta * (policy - reference) log-probability of the "
                       "last logged step's chosen completions (TRL's rewards/chosen)"),
    "rewards/rejected": ("llamaft_train_reward_rejected", "DPO: mean beta * (policy - reference) log-probability of "
                         "the last logged step's rejected completions (TRL's rewards/rejected)"),
    "logps/chosen": ("llamaft_train_logps_chosen", "DPO: mean policy log-probability of the last logged step's "
                     "chosen completions (TRL's logps/chosen)"),
    "logps/rejected": ("llamaft_train_logps_rejected", "DPO: mean policy log-probability of the last logged step's "
                       "rejected completions (TRL's logps/rejected)"),
    "eval_rewards/accuracies": ("llamaft_train_eval_reward_accuracy", "DPO: reward accuracy over the held-out pairs "
                                "at the last eval (TRL's eval_rewards/accuracies, 0-1)"),
    "eval_rewards/margins": ("llamaft_train_eval_reward_margin", "DPO: mean reward margin over the held-out pairs at "
                             "the last eval (TRL's eval_rewards/margins)"),
}
"""DPO's figures (step event or eval report key) -> their gauge and its help text."""


class ProgressPublisher:
    """What the leader publishes: Prometheus gauges plus the JSON progress document."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels: list[str] = []
        self.step = Gauge("llamaft_train_step", "Optimizer steps done", labels, registry=self.registry)
        self.total_steps = Gauge("llamaft_train_total_steps", "Optimizer steps planned", registry=self.registry)
        self.epoch = Gauge("llamaft_train_epoch", "Current epoch", registry=self.registry)
        self.loss = Gauge("llamaft_train_loss", "Training loss of the last step", registry=self.registry)
        self.eval_loss = Gauge("llamaft_train_eval_loss", "Last eval loss", registry=self.registry)
        self.lr = Gauge("llamaft_train_learning_rate", "Learning rate", registry=self.registry)
        self.grad_norm = Gauge("llamaft_train_grad_norm", "Gradient norm before clipping", registry=self.registry)
        self.tokens_per_second = Gauge("llamaft_train_tokens_per_second", "Job throughput", registry=self.registry)
        self.tokens_per_second_per_device = Gauge(
            "llamaft_train_tokens_per_second_per_device", "Throughput per device", registry=self.registry
        )
        self.mfu = Gauge("llamaft_train_mfu", "Model FLOPs utilisation (0-1)", registry=self.registry)
        self.memory = Gauge("llamaft_train_peak_memory_bytes", "Peak memory of rank 0", registry=self.registry)
        self.tokens = Counter("llamaft_train_tokens", "Tokens trained on", registry=self.registry)
        self._rewards: dict[str, Gauge] = {}
        """DPO's gauges (REWARD_GAUGES), each registered when its first value comes: an SFT run has
        none, and an eval's before the first eval."""
        self.last_progress = Gauge(
            "llamaft_train_last_progress_timestamp_seconds", "Unix time of the last step", registry=self.registry
        )
        self._document = ProgressDocument(phase=ProgressPhase.STARTING)
        self._lock = threading.Lock()
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self.trackers: list[Any] = []
        """Experiment trackers (tracking.Tracker): each logged step and eval, queued, never waited on."""

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call `listener` with a copy of the document after every update; it must return at once
        (kubeflow_progress.KubeflowProgress.offer only queues)."""
        self._listeners.append(listener)

    def update(self, **fields: Any) -> None:
        """Set these fields of the document (by their wire names, or field names of
        contracts.ProgressDocument; an unknown one or a wrong type is an error) and updatedAt."""
        with self._lock:
            merged = {**self._document.model_dump(by_alias=True, exclude_unset=True),
                      **{_WIRE_NAMES.get(k, k): v for k, v in fields.items()},
                      "updatedAt": datetime.now(UTC).isoformat(timespec="seconds")}
            self._document = ProgressDocument.model_validate(merged)
            snapshot = self._wire()
        for listener in self._listeners:
            listener(snapshot)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return self._wire()

    def _wire(self) -> dict[str, Any]:
        """The document as /progress sends it: the keys set so far, camelCase."""
        return self._document.model_dump(by_alias=True, exclude_unset=True)

    def record_step(self, m: dict[str, Any]) -> None:
        self.step.set(m["step"])
        self.epoch.set(m["epoch"])
        self.loss.set(m["loss"])
        self.lr.set(m["lr"])
        self.grad_norm.set(m["grad_norm"])
        self.tokens_per_second.set(m["tokens_per_second"])
        self.tokens_per_second_per_device.set(m["tokens_per_second_per_device"])
        if m.get("mfu") is not None:
            self.mfu.set(m["mfu"])
        self.memory.set(m["peak_memory_bytes"])
        self.tokens.inc(m["tokens"])
        self.last_progress.set(time.time())
        self.update(
            phase="Training", step=m["step"], epoch=m["epoch"], loss=m["loss"],
            tokensPerSecond=m["tokens_per_second"], mfu=m.get("mfu"), etaSeconds=m.get("eta_seconds"),
        )
        if m.get("rewards/accuracies") is not None:  # a DPO step (dpo.METRIC_NAMES)
            self._set_rewards(m)
            # Every one of TRL's step metrics (issue 38), each by keyword: test_contracts reads
            # the keys the trainer writes from these calls.
            self.update(rewardAccuracy=m["rewards/accuracies"], rewardMargin=m["rewards/margins"],
                        rewardChosen=m["rewards/chosen"], rewardRejected=m["rewards/rejected"],
                        logpsChosen=m["logps/chosen"], logpsRejected=m["logps/rejected"])
        for tracker in self.trackers:
            tracker.step(m)

    def record_generations(self, report: dict[str, Any]) -> None:
        """An evaluation's generations and task scores: the scores into the document (the
        operator's status.evaluation), everything to the trackers."""
        self.update(evaluation={k: v for k, v in report.items() if k != "generations"})
        for tracker in self.trackers:
            tracker.generations(report)

    def record_eval(self, step: int, loss: float, perplexity: float) -> None:
        self.eval_loss.set(loss)
        self.update(evalLoss=loss)
        for tracker in self.trackers:
            tracker.eval(step, loss, perplexity)

    def record_dpo_eval(self, step: int, report: dict[str, float]) -> None:
        """A DPO eval (dpo_step.evaluate's report: `eval_loss` and `eval_rewards/...`,
        `eval_logps/...`, TRL's names): no perplexity, the rewards in the document too."""
        self.eval_loss.set(report["eval_loss"])
        self._set_rewards(report)
        self.update(evalLoss=report["eval_loss"], evalRewardAccuracy=report["eval_rewards/accuracies"],
                    evalRewardMargin=report["eval_rewards/margins"])
        for tracker in self.trackers:
            tracker.eval_metrics(step, report)

    def _set_rewards(self, figures: dict[str, Any]) -> None:
        """Set the DPO gauges the figures have (REWARD_GAUGES), each registered the first time."""
        for key, (name, text) in REWARD_GAUGES.items():
            if figures.get(key) is None:
                continue
            if key not in self._rewards:
                self._rewards[key] = Gauge(name, text, registry=self.registry)
            self._rewards[key].set(figures[key])

    def serve(self, port: int) -> ThreadingHTTPServer:
        progress = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.startswith("/metrics"):
                    body, ctype = generate_latest(progress.registry), "text/plain; version=0.0.4"
                elif self.path.startswith("/progress"):
                    body, ctype = json.dumps(progress.snapshot()).encode(), "application/json"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        # All interfaces by default (the pod's IP, and localhost for kubectl port-forward);
        # LLAMAFT_METRICS_HOST pins one address, e.g. when several "pods" share one host in tests.
        server = ThreadingHTTPServer((os.environ.get("LLAMAFT_METRICS_HOST", "0.0.0.0"), port), Handler)
        threading.Thread(target=server.serve_forever, daemon=True, name="metrics").start()
        return server


def write_termination_message(doc: dict[str, Any]) -> None:
    """Kubernetes shows /dev/termination-log in the pod status; the operator reads it. The contract
    (fields, the 4096-byte limit, which rank's message wins) lives in termination.py."""
    termination.write(doc)


def eprint(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)
