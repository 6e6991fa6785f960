"""The trainer program torchrun runs on every node: config -> model -> parallelize -> data ->
train loop -> checkpoint/export, each step from its own module.

    python -m llamaft_trainer --config /etc/llamaft/config.json

The config file is the training part of the LlamaFineTune spec (JSON or YAML, camelCase, the same
pydantic model the operator validated), or a whole LlamaFineTune.

How it ends (docs/progress-contract.md): exit 0 and a Succeeded message; 2 for a configuration
error (permanent: under torchrun it also closes the rendezvous, so no restart follows: restarts.py);
143 (128 + SIGTERM) when SIGTERM stopped it, after a checkpoint if the grace period allowed one
(130 and Interrupted for SIGINT: a person's Ctrl-C of llamaft run --local); 1 for any other failure. Every failing rank writes its termination message with the reason
(ConfigError, Preempted, CollectiveTimeout, PeerLost or the exception's type). The process always
leaves through shutdown.exit_process, never through interpreter finalization.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from llamaft.api.documents import parse_documents
from llamaft.api.sharding import ShardingPlan, Wrapper
from llamaft.api.spec import LoraExport, TrainingJobConfig, TrainingMethod
from llamaft.api.validation import SpecInvalid, validate_resource
from torch import nn

from llamaft_trainer import inputs
from llamaft_trainer.checkpoint.dcp import Checkpointer, RunState, TrainState
from llamaft_trainer.checkpoint.export import export_hugging_face
from llamaft_trainer.data import encoding
from llamaft_trainer.evaluation import build_evaluator
from llamaft_trainer.methods import dpo_step
from llamaft_trainer.model import loading
from llamaft_trainer.model import model as model_step
from llamaft_trainer.parallel import float8
from llamaft_trainer.parallel.parallelize import mixed_precision_policy, parallelize, replicate
from llamaft_trainer.process import restarts, termination
from llamaft_trainer.process.errors import EXIT_CONFIG_ERROR, EXIT_FAILURE, ConfigError
from llamaft_trainer.process.preemption import StopReport, StopSignal
from llamaft_trainer.process.runtime import Runtime, build_mesh, init_runtime, sharding_plan
from llamaft_trainer.process.shutdown import exit_process, teardown
from llamaft_trainer.process.termination import RunRecord
from llamaft_trainer.report import kubeflow_progress, tracking
from llamaft_trainer.report.metrics import ProgressPublisher, log_json, model_flops_per_token, peak_flops
from llamaft_trainer.train import (
    LoopResult,
    Session,
    Trainer,
    build_optimizer,
    build_scaler,
    build_scheduler,
    stop_agreed,
    total_steps,
)


def _yaml_document(text: str, source: str) -> Any:
    docs = parse_documents(text.encode("utf-8"), source)
    if len(docs) != 1 or docs[0].errors:
        problems = "; ".join(str(e) for d in docs for e in d.errors) or f"expected one document, found {len(docs)}"
        raise ValueError(problems)
    return docs[0].body


def load_config(path: str | Path) -> TrainingJobConfig:
    """Read the mounted config: a TrainingJobConfig document, or a whole LlamaFineTune."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {path}: {exc}") from exc
    try:
        # The operator's ConfigMap is JSON (numbers stay numbers: YAML 1.1 would read `2e-05` as a
        # string); anything else is YAML, read by the same safe parser as `llamaft validate`.
        body = json.loads(text) if text.lstrip().startswith("{") else _yaml_document(text, str(path))
    except ValueError as exc:
        raise ConfigError(f"--config: {path} is not JSON or YAML: {exc}") from exc
    try:
        if isinstance(body, dict) and body.get("kind") == "LlamaFineTune":
            return validate_resource(body).training_config()
        return TrainingJobConfig.model_validate(body)
    except SpecInvalid as exc:
        raise ConfigError(str(exc)) from exc
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def build_model(cfg: TrainingJobConfig, rt: Runtime, model_config: Any,
                plan: ShardingPlan | None = None, *, reference: bool = False) -> tuple[nn.Module, int]:
    """Meta model -> (LoRA) -> parallelize -> allocate shards -> pretrained weights streamed into
    the shards (loading.py: each rank reads only its own rows, or rank 0 broadcasts tensor by tensor)
    -> DDP where the sharding plan replicates without FSDP. `plan`: the run's sharding plan
    (derived from the spec and the runtime when not given).

    `reference`: DPO's live reference (dpo_step.frozen): the same model sharded the same way, its
    shards held in the compute dtype (the values the policy's first forward computes with: the
    master weights cast to FSDP's param_dtype), no LoRA, no DDP (nothing to synchronise), frozen."""
    dtype = model_step.master_dtype(cfg.fsdp.mixed_precision)
    if reference:
        dtype = mixed_precision_policy(cfg.fsdp.mixed_precision).param_dtype or dtype
    lora = cfg.training.lora if cfg.training.lora is not None and cfg.training.lora.enabled and not reference else None
    model = model_step.build_meta_model(model_config, cfg.model, dtype)
    if lora is not None:
        model = model_step.apply_lora(model, lora)
    n_params = sum(p.numel() for p in model.parameters())
    want = loading.wanted(model)  # the checkpoint's names, before wrappers rename the parameters
    plan = plan if plan is not None else sharding_plan(cfg.fsdp, rt)
    model = parallelize(model, cfg.fsdp, plan, build_mesh(plan, rt), rt.device)
    if plan.wrapper is not Wrapper.FSDP1:  # FSDP1 allocates its units itself (param_init_fn)
        model.to_empty(device=rt.device)
    model_step.rebuild_rotary_buffers(model, rt.device)
    loading.load_weights(model, want, cfg.model, rt, config=model_config, dtype=dtype, lora=lora, seed=cfg.training.seed)
    if reference:
        return dpo_step.frozen(model), n_params
    return replicate(model, plan, rt.device), n_params


class StoppedDuringStartUp(Exception):
    """Every rank agreed, at a start-up boundary, that a stop signal came (SIGTERM, or a Ctrl-C
    through llamaft run --local): nothing trained yet, nothing to save, so the run ends there
    instead of finishing a start-up (minutes for a large model) only to stop before step 1."""

    def __init__(self, phase: str) -> None:
        super().__init__(f"the signal came during start-up (before {phase}): nothing trained since the last checkpoint")
        self.phase = phase


def _phase(rt: Runtime, phase: str, stop: StopSignal | None = None) -> None:
    """A start-up boundary: with `stop`, the ranks agree on whether a stop signal came (a
    collective; every rank passes the same boundaries) and end the run if so; then global rank
    0's `phase` log line: what start-up is doing now (llamaft run --local shows it with the
    seconds since launch, so the minute before the first step is not silent)."""
    if stop_agreed(stop, rt.device):
        raise StoppedDuringStartUp(phase)
    if rt.is_leader:
        log_json("phase", phase=phase)


def setup(cfg: TrainingJobConfig, rt: Runtime, stop: StopSignal | None = None) -> Session:
    """The session of a run. `stop`: a stop signal the ranks check for at each start-up phase."""
    torch.manual_seed(cfg.training.seed)
    tracking.check(cfg)  # on every rank, before any collective: rank 0 alone must not fail later
    float8.check_device(cfg.fsdp, rt.device)  # likewise: each rank its own GPU
    _phase(rt, "loading the tokenizer and preparing the data", stop)
    tokenizer = model_step.load_tokenizer(cfg.model, rt)
    model_config = model_step.load_model_config(cfg.model, rt)
    encoding.check_sequence_length(cfg.dataset, getattr(model_config, "max_position_embeddings", None))
    data = inputs.build_data(
        cfg.dataset, tokenizer, cfg.training.per_device_batch_size, cfg.training.seed, rt, cfg.checkpointing.directory,
        cfg.training.global_batch_size,
    )
    plan = sharding_plan(cfg.fsdp, rt)
    _phase(rt, "loading the model", stop)
    model, n_params = build_model(cfg, rt, model_config, plan)
    reference = None
    if dpo_step.live_reference(cfg):  # the initial model again, frozen: never in a checkpoint, loaded on resume
        _phase(rt, "loading the reference model", stop)
        reference, _ = build_model(cfg, rt, model_config, plan, reference=True)
    elif cfg.training.method is TrainingMethod.DPO:
        _phase(rt, "scoring the pairs with the reference model", stop)
    dpo = dpo_step.prepare(cfg, rt, model, data, reference)  # None for SFT; the initial model's pass, before any resume
    optimizer = build_optimizer(model, cfg)
    per_epoch = data.batches_per_epoch
    if per_epoch is None and cfg.training.max_steps is None:
        raise ConfigError("spec.training.epochs: a streamed dataset has no known length: set training.maxSteps instead")
    steps = total_steps(cfg, per_epoch or 0)
    scheduler = build_scheduler(optimizer, cfg, steps)
    fpt = model_flops_per_token(model_config, n_params, cfg.dataset.max_seq_length)
    return Session(cfg, rt, model, tokenizer, model_config, data, optimizer, scheduler, steps, fpt, n_params, plan, dpo)


def run(
    cfg: TrainingJobConfig, rt: Runtime, *, progress: ProgressPublisher | None = None, stop_after: int | None = None,
    stop: StopSignal | None = None, record: RunRecord | None = None,
) -> tuple[Session, LoopResult]:
    """One whole run: setup, resume, train, final checkpoint and export (not after a stop on
    SIGTERM). `record` is kept current for the termination message."""
    record = record if record is not None else RunRecord()
    started = time.perf_counter()
    s = setup(cfg, rt, stop)
    if rt.is_leader:
        log_json(
            "setup", parameters=s.n_params, world_size=rt.world_size, device=str(rt.device),
            strategy=cfg.fsdp.sharding_strategy.value, wrapper=s.plan.wrapper.value,
            precision=cfg.fsdp.mixed_precision.value,
            activation_checkpointing=cfg.fsdp.activation_checkpointing.mode.value,
            **s.data.info, total_steps=s.steps, seconds=round(time.perf_counter() - started, 2),
        )
    if progress is not None:
        progress.total_steps.set(s.steps)
        progress.update(phase="Training", totalSteps=s.steps)
    _phase(rt, "training: the first steps", stop)
    state, scaler = TrainState(global_order=s.data.order is not None), build_scaler(cfg, rt)
    checkpointer = Checkpointer(
        cfg.checkpointing.directory, cfg.checkpointing.keep_last, rt.rank,
        run=RunState(s.model, s.optimizer, s.scheduler, state, scaler),
        async_save=cfg.checkpointing.async_save, device=rt.device, timeout_s=rt.timeout_s,
    )
    latest = checkpointer.latest() if cfg.checkpointing.resume else None
    if latest is not None:
        checkpointer.load(latest)
        record.checkpoint_step = latest
        if rt.is_leader:
            log_json("resume", step=state.step, epoch=state.epoch, path=f"{cfg.checkpointing.directory}/step-{latest:08d}")
    tracker = _start_tracking(cfg, rt, state.step, progress)
    outcome = "FAILED"
    try:
        if tracker is not None:
            progress = progress or ProgressPublisher()
            progress.trackers.append(tracker)
        trainer = Trainer(
            s, state=state, scaler=scaler, checkpointer=checkpointer, progress=progress, record=record, stop=stop,
            evaluator=build_evaluator(cfg.evaluation, s.data.validation, s.tokenizer), peak_flops=peak_flops(rt.device),
        )
        result = trainer.train(stop_after)
        outcome = "KILLED" if result.stopped is not None else "FINISHED"
    finally:
        if tracker is not None:
            tracker.close(outcome)
    checkpointer.close()  # the loop waited for its last save; releases the checkpoint process group
    if result.stopped is None and state.step >= s.steps and cfg.checkpointing.export_hugging_face:
        destination = f"{cfg.checkpointing.directory.rstrip('/')}/export"
        lora = cfg.training.lora is not None and cfg.training.lora.enabled
        lora_export = cfg.training.lora.export if cfg.training.lora is not None else LoraExport.ADAPTER
        export_hugging_face(
            s.model, s.model_config, s.tokenizer, destination, rank=rt.rank,
            dtype=model_step.DTYPES[cfg.model.dtype.value], lora=lora, lora_export=lora_export,
        )
        if rt.is_leader:
            kind = {LoraExport.ADAPTER: "peft-adapter", LoraExport.MERGED: "safetensors (LoRA merged)",
                    LoraExport.BOTH: "safetensors (LoRA merged) + peft-adapter in adapter/"}[lora_export]
            log_json("export", path=destination, format=kind if lora else "safetensors")
        record.export_path = destination
        if progress is not None:
            progress.update(exportPath=destination)
    return s, result


def _start_tracking(cfg: TrainingJobConfig, rt: Runtime, resumed_at: int, progress: ProgressPublisher | None) -> tracking.Tracker | None:
    """Rank 0's experiment trackers (tracking.py): where the runs are, and a tracker that is
    down, go into the progress document (the operator's status.tracking and events)."""
    if not rt.is_leader:
        return None

    def warn(message: str) -> None:
        if progress is not None:
            progress.update(trackingWarning=message)

    def located(info: dict[str, str]) -> None:
        if progress is not None:
            progress.update(tracking=info)

    return tracking.start(cfg, rt.world_size, resumed_at, warn, located)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the trainer; returns the process's exit code (the caller exits with exit_process)."""
    parser = argparse.ArgumentParser(prog="llamaft_trainer", description=__doc__)
    parser.add_argument("--config", default=os.environ.get("LLAMAFT_CONFIG", "/etc/llamaft/config.json"))
    parser.add_argument("--metrics-port", type=int, default=int(os.environ.get("LLAMAFT_METRICS_PORT", "0")),
                        help="serve /metrics and /progress on this port from local rank 0 (0: off)")
    args = parser.parse_args(argv)
    stop = StopSignal()
    stop.install()  # first: a SIGTERM during setup is remembered, not fatal
    restarts.watch_agent()
    record = RunRecord()
    rt: Runtime | None = None
    server: ThreadingHTTPServer | None = None
    kubeflow: kubeflow_progress.KubeflowProgress | None = None
    healthy = False
    try:
        cfg = load_config(args.config)
        rt = init_runtime(cfg.training.collective_timeout_seconds)
        progress = None
        if rt.is_local_leader:
            progress = ProgressPublisher()
            # The operator asks every worker and takes global rank 0's document as the leader's.
            progress.update(rank=rt.rank, pod=os.environ.get("LLAMAFT_POD_NAME") or os.environ.get("HOSTNAME"))
            if args.metrics_port:
                server = progress.serve(args.metrics_port)
            if rt.is_leader:  # TrainJob.status.trainerStatus, when Kubeflow Trainer asks for it
                kubeflow = kubeflow_progress.attach(progress)
        try:
            _, result = run(cfg, rt, progress=progress, stop=stop, record=record)
        except StoppedDuringStartUp as exc:
            result = LoopResult(TrainState(), stopped=StopReport(record.step or 0, stop.requested, False, str(exc)))
        healthy = True  # every rank got here together (a stop is agreed on collectively)
        if result.stopped is not None:
            return _stopped(result.stopped, stop, record, rt, progress)
        if progress is not None:
            progress.update(phase="Succeeded")
        if rt.is_leader:
            _report(termination.succeeded(record), rt)
        return 0
    except ConfigError as exc:
        if rt is None or rt.is_leader:
            log_json("error", kind="ConfigError", message=str(exc))
            print(f"llamaft: configuration error: {exc}", file=sys.stderr, flush=True)
        _report(termination.failed(termination.CONFIG_ERROR, str(exc), record, retryable=False), rt)
        # Permanent: torchrun must not restart the workers into the same error (restarts.py).
        restarts.end_job(rt.timeout_s if rt is not None else restarts.CLOSE_TIMEOUT_S)
        return EXIT_CONFIG_ERROR
    except Exception as exc:
        traceback.print_exc()
        reason, retryable = termination.classify_exception(exc)
        _report(termination.failed(reason, f"{type(exc).__name__}: {exc}", record, retryable=retryable), rt, always=True)
        return EXIT_FAILURE
    finally:
        if kubeflow is not None:
            kubeflow.close()  # the final post, bounded
        teardown(rt, server, healthy=healthy)


def _stopped(report: StopReport, stop: StopSignal, record: RunRecord, rt: Runtime, progress: ProgressPublisher | None) -> int:
    """The termination message and exit code of a run that stopped on a signal."""
    message = report.message(record.checkpoint_step, stop.name)
    # A person's Ctrl-C (SIGINT, from llamaft run --local) is no preemption; a SIGTERM is
    # one unless the agent sent it because it lost the rendezvous.
    lost = None if stop.interrupted else restarts.rendezvous_lost()
    reason: str = (termination.INTERRUPTED if stop.interrupted
                   else termination.PREEMPTED if lost is None else termination.RENDEZVOUS_LOST)
    _report(termination.failed(reason, message if lost is None else f"{lost}: {message}", record, retryable=True), rt)
    if progress is not None:
        progress.update(phase="Preempted")
    return termination.exit_code(reason)


def _report(doc: dict[str, Any], rt: Runtime | None, *, always: bool = False) -> None:
    """The termination message, and the same document as the last `done` line on stdout (global
    rank 0's, or every rank's for an unexpected error: the rank that failed may not be rank 0)."""
    termination.write(doc)
    if always or rt is None or rt.is_leader:
        log_json("done", **doc, **({"rank": rt.rank} if rt is not None else {}))


if __name__ == "__main__":
    exit_process(main())
