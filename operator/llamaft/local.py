"""`llamaft run --local FILE`: the same LlamaFineTune, run by torchrun on this machine.

What each agent runs is the cluster's launch by construction: the operator's PyTorchJob for the
file is rendered (llamaft.render.desired) and turned into torchrun's command and env
(llamaft.launch.torchrun_launch), then only the machine-bound values are changed (localize:
rendezvous address, config path, metrics port, termination log, CPU when there are no GPUs). The
config JSON is the ConfigMap's own text.

One torchrun agent per `spec.cluster.workers` (each a "node" with its processes), rendezvousing
exactly as on the cluster: through a local etcd for the etcd backends (started here unless
`spec.rendezvous.endpoint` is set), or c10d on loopback. A spec that asks for GPUs runs on this
machine's GPUs (fewer per worker when it has fewer) and is refused when it has less than one per
worker, unless --cpu runs it on the CPU anyway; a CPU spec (gpusPerWorker 0) runs one CPU process
per worker (gloo). Local input files are checked before anything starts (missing_inputs). Rank 0's JSON log
lines are shown as live progress; every agent's full output goes to `<run dir>/worker-<i>.log` (rank 0 may be on any of them).

How it ends:
- Exit code: the trainer's (0; 2 for a configuration error; 143 stopped on SIGTERM; 1 other),
  from the termination messages the workers wrote (`<run dir>/termination-<i>.json`, one per
  agent as one per pod), not torchrun's (always 1 on failure). The first line of the error is
  printed last.
- Ctrl-C or SIGTERM: every agent gets the same signal (agents and trainers run in their own
  sessions, so the terminal's SIGINT reaches none of them by itself): SIGTERM as the kubelet sends
  it, SIGINT for a Ctrl-C, which the trainers report as Interrupted instead of Preempted. The
  trainers stop after their step and save when torchrun's shutdown timeout allows; after that
  timeout (plus a margin) whatever is left of the tree is SIGKILLed. A second signal SIGKILLs at
  once (the line printed at the first says so). Then it prints where a rerun resumes (the newest
  complete checkpoint).
- If this process is killed outright, each agent gets SIGTERM from the kernel (PR_SET_PDEATHSIG)
  and stops its workers; a worker whose agent died exits by itself (elastic.watch_agent).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

from llamaft_trainer.public import (
    EXIT_CONFIG_ERROR,
    ConfigError,
    LocalEtcd,
    free_port,
    parent_death_signal,
    parse_event,
    termination,
)

from llamaft.api.contracts import final_figures
from llamaft.api.sources import SourceKind, parse_source
from llamaft.api.spec import LlamaFineTuneSpec, RendezvousBackend, TensorBoardSpec
from llamaft.launch import Launch, Localized, local_cache, localize, torchrun_launch
from llamaft.manifests import load_finetune
from llamaft.render import desired
from llamaft.render.naming import CONFIG_FILE, SPEC_FILE, Owner
from llamaft.startup_progress import StartupProgress

STOP_MARGIN_S = 15.0
"""Beyond torchrun's shutdown timeout, how long an interrupted run may take to end before it is SIGKILLed."""


@dataclass(frozen=True)
class LocalPlan:
    name: str
    workers: int
    nproc_per_worker: int
    device: str
    backend: RendezvousBackend
    run_dir: Path
    config_path: Path
    launch: Launch
    """What every worker pod of the cluster's PyTorchJob runs (llamaft.launch)."""
    checkpoints: str
    resume: bool
    threads: str | None = None
    """OMP_NUM_THREADS of every trainer process when it differs from the pod's (local_threads)."""

    @property
    def run_uid(self) -> str:
        """The run's identity for its trackers: a rerun of the file continues its checkpoints,
        and so its tracker runs (the rendezvous id, not this, is new per run)."""
        return hashlib.sha256(str(Path(self.checkpoints).expanduser().resolve()).encode()).hexdigest()[:16]

    @property
    def rdzv_id(self) -> str:
        return str(self.launch.flag("rdzv_id"))


def visible_gpus() -> int:
    """CUDA devices this process may use, as the trainers will see them (CUDA_VISIBLE_DEVICES)."""
    import torch

    return int(torch.cuda.device_count())


def missing_inputs(spec: LlamaFineTuneSpec) -> list[str]:
    """What this machine lacks of the files and directories the trainer will read, one message per
    field naming the path and the fix. Checked before torchrun starts (seconds of worker start-up
    otherwise); which sources are paths is api.sources' decision, the trainer's too (downloads,
    records). A pvc:// source is read where the pod mounts its claim (PVC_MOUNT_ROOT)."""
    problems: list[str] = []
    fields = (("spec.model.source", spec.model.source, "directory"), ("spec.model.tokenizer", spec.model.tokenizer, None),
              ("spec.dataset.source", spec.dataset.source, "file"))
    for field, text, kind in fields:
        if text is None:
            continue
        source = parse_source(text)
        if source.kind not in (SourceKind.LOCAL, SourceKind.PVC):
            continue  # hub ids and URIs are fetched by the trainer
        path = Path(source.location).expanduser()
        resolved = f"(resolved to {path.resolve() if source.kind is SourceKind.LOCAL else path})"
        if not path.exists():
            fix = ("pvc:// sources are read where the pod mounts the claim: for llamaft run --local use a local path"
                   if source.kind is SourceKind.PVC else "check the path (relative paths are from this directory)")
            if field == "spec.model.source" and source.kind is SourceKind.LOCAL:
                fix += f"; for the tiny example, build it first: llamaft make-tiny-model {text}"
            problems.append(f"{field}: {text} does not exist {resolved}; {fix}")
        elif kind == "file" and path.is_dir():
            problems.append(f"{field}: {text} is a directory {resolved}; it must name a JSON Lines file")
        elif kind == "directory" and not path.is_dir():
            problems.append(f"{field}: {text} is a file {resolved}; it must name a model directory (config.json and "
                            f"weights)")
    return problems


def device_for(spec: LlamaFineTuneSpec, gpus: int, *, cpu: bool) -> tuple[str, int, str | None]:
    """(device, processes per worker, a note) for the spec on a machine with `gpus` visible GPUs.

    A spec that asks for GPUs runs on them; with fewer than it asks for but at least one per
    worker, on those (the note says so); with fewer than one per worker it is refused (a ConfigError
    naming cluster.gpusPerWorker and --cpu) unless `cpu` (--cpu) runs it on the CPU anyway. A
    silent CPU fallback trained a GPU spec in bf16 at a hundred tokens per second."""
    wanted, workers = spec.cluster.gpus_per_worker, spec.cluster.workers
    if not wanted:
        return "cpu", 1, None
    if cpu:
        return "cpu", 1, (f"--cpu: running on the CPU, one process per worker, although spec.cluster.gpusPerWorker is "
                          f"{wanted}")
    if gpus >= wanted * workers:
        return "cuda", wanted, None
    if gpus >= workers:
        return "cuda", gpus // workers, (f"spec.cluster.gpusPerWorker asks for {wanted} GPU(s) per worker, this machine "
                                         f"has {gpus}: running {gpus // workers} per worker")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    raise ConfigError(
        f"spec.cluster.gpusPerWorker: the file asks for {wanted} GPU(s) per worker x {workers} worker(s), and this "
        f"machine has {gpus} visible{f' (CUDA_VISIBLE_DEVICES={visible!r})' if visible is not None else ''}. "
        f"To run it here on the CPU anyway (slow), pass --cpu: llamaft run --local --cpu FILE; or set "
        f"cluster.gpusPerWorker: 0"
    )


def plan(path: str | Path, *, nproc_per_worker: int | None, run_dir: str | Path | None,
         cpu: bool = False) -> tuple[LocalPlan, LlamaFineTuneSpec]:
    """The cluster's launch for this file, rendered exactly as the operator renders it (a fresh uid
    per run, so the rendezvous id is new and a rerun never meets a closed rendezvous). Refuses
    (ConfigError) a file whose local inputs are missing, or whose GPUs are, unless `cpu`."""
    body, spec = load_finetune(path)
    name = str(body["metadata"]["name"])
    problems = missing_inputs(spec)
    if problems:
        raise ConfigError("\n".join(problems))
    # A CPU spec (or --cpu) never imports torch here (seconds, ~240 MB held).
    gpus = visible_gpus() if spec.cluster.gpus_per_worker and not cpu else 0
    device, nproc, note = device_for(spec, gpus, cpu=cpu)
    if note is not None:
        print(f"llamaft: note: {note}", flush=True)
    if nproc_per_worker is not None:
        nproc = nproc_per_worker
    spec = with_local_tracking(spec)
    owner = Owner(name, str(body["metadata"].get("namespace") or "local"), str(uuid.uuid4()))
    directory = Path(run_dir or Path("runs") / name)
    directory.mkdir(parents=True, exist_ok=True)
    config_path = directory / CONFIG_FILE
    # The ConfigMap's own bytes: the trainer reads the same JSON here as in a pod.
    data = desired.config_map(owner, spec)["data"]
    config_path.write_text(data[CONFIG_FILE])
    (directory / SPEC_FILE).write_text(data[SPEC_FILE])
    launch = torchrun_launch(desired.pytorch_job(owner, spec, 1))
    return LocalPlan(
        name, spec.cluster.workers, nproc, device, spec.rendezvous.backend, directory, config_path, launch,
        spec.checkpointing.directory, spec.checkpointing.resume,
        local_threads(spec, device, spec.cluster.workers * nproc, os.environ),
    ), spec


def local_threads(spec: LlamaFineTuneSpec, device: str, processes: int, environ: Mapping[str, str]) -> str | None:
    """Threads per trainer process here: the spec's own OMP_NUM_THREADS (cluster.env, which the
    launch carries), else this shell's, else on CPU this machine's cores shared among the run's
    processes (the pod's value, from cluster.resources.cpu, describes a cluster node). None: the
    launch's value stands."""
    if any(e.name == "OMP_NUM_THREADS" for e in spec.cluster.env):
        return None
    if environ.get("OMP_NUM_THREADS"):
        return environ["OMP_NUM_THREADS"]
    if device != "cpu":
        return None
    return str(max(1, len(os.sched_getaffinity(0)) // max(processes, 1)))


def with_local_tracking(spec: LlamaFineTuneSpec) -> LlamaFineTuneSpec:
    """A local run writes TensorBoard files by default (when the tensorboard package is there)."""
    if spec.tracking.tensorboard is not None or importlib.util.find_spec("tensorboard") is None:
        return spec
    return spec.model_copy(update={"tracking": spec.tracking.model_copy(update={"tensorboard": TensorBoardSpec()})})


def tensorboard_directory(spec: LlamaFineTuneSpec) -> str | None:
    board = spec.tracking.tensorboard
    if board is None:
        return None
    return board.directory or f"{spec.checkpointing.directory.rstrip('/')}/tensorboard"


def agent(p: LocalPlan, endpoint: str, index: int) -> Localized:
    """Agent (\"node\") `index` of the local run: the cluster's launch, localized."""
    return localize(p.launch, rdzv_endpoint=endpoint, config_path=str(p.config_path), nproc_per_node=p.nproc_per_worker,
                    metrics_port=free_port(), termination_log=str(p.run_dir / f"termination-{index}.json"),
                    cpu_only=p.device == "cpu", cache=local_cache(os.environ), run_uid=p.run_uid, threads=p.threads)


@contextlib.contextmanager
def local_rendezvous_endpoint(p: LocalPlan, spec: LlamaFineTuneSpec) -> Iterator[str]:
    if p.backend is RendezvousBackend.C10D:
        yield f"127.0.0.1:{free_port()}"
    elif spec.rendezvous.endpoint:
        yield spec.rendezvous.endpoint
    else:
        with LocalEtcd() as etcd:
            print(f"llamaft: started a local etcd at {etcd.endpoint} for the {p.backend.value} rendezvous", flush=True)
            yield etcd.endpoint


def format_event(event: dict[str, Any]) -> str | None:
    """One human line for a rank-0 JSON log event (None: not shown)."""
    kind = event.get("event")
    if kind == "step":
        eta = event.get("eta_seconds")
        accuracy = event.get("rewards/accuracies")  # training.method dpo
        return (
            f"step {event['step']:>5}/{event['total_steps']} | epoch {event['epoch']} | loss {event['loss']:.4f} | "
            + (f"reward acc {accuracy:.3f} | " if accuracy is not None else "")
            + f"lr {event['lr']:.2e} | {event['tokens_per_second']:,.0f} tok/s | eta {eta}s"
        )
    if kind == "eval":
        if "perplexity" not in event:  # training.method dpo: the held-out pairs' reward accuracy
            return (f"eval  step {event['step']}: loss {event['eval_loss']:.4f}, "
                    f"reward accuracy {event.get('eval_rewards/accuracies', float('nan')):.3f}")
        return f"eval  step {event['step']}: loss {event['eval_loss']:.4f}, perplexity {event['perplexity']:.2f}"
    if kind == "setup":
        return (
            f"setup: {event['parameters']:,} parameters on {event['world_size']} rank(s) ({event['device']}), "
            f"{event['strategy']} {event['precision']}, {event['total_steps']} steps"
        )
    if kind == "data":
        if event.get("reused"):
            return f"data: the token store {event['store']} again ({event['train_examples']:,} training examples)"
        return (f"data: {event['records']:,} records tokenized into {event['store']} in {event['seconds']}s "
                f"({event['train_examples']:,} training, {event['validation_examples']:,} validation examples)")
    if kind == "checkpoint":
        return f"checkpoint: {event['path']}"
    if kind == "resume":
        return f"resumed from {event['path']} (step {event['step']})"
    if kind == "export":
        return f"exported the fine-tuned model ({event['format']}) to {event['path']}"
    if kind == "error":
        return f"error: {event['message']}"
    if kind == "preempted":
        return (f"{event.get('signal', 'SIGTERM')}: stopping after step {event['step']} "
                f"({'saving' if event['save'] else 'no time to save'}: {event['detail']})")
    if kind == "done" and event.get("phase") == "Failed" and event.get("reason") == termination.INTERRUPTED:
        return f"interrupted at step {event.get('step')}: {event.get('message')}"
    if kind == "done" and event.get("phase") == "Failed" and event.get("reason") != "ConfigError":
        return f"failed ({event['reason']}) at step {event.get('step')}: {event.get('message')}"
    return None


def done_line(events: list[dict[str, Any]]) -> str | None:
    """What a finished run's last line says (None: no step was logged): the first and last logged
    loss, then the final figures as the operator's Succeeded condition words them
    (contracts.final_figures: DPO's reward accuracy and margin, the last eval's)."""
    steps = [e for e in events if e.get("event") == "step"]
    if not steps:
        return None
    first, last = steps[0], steps[-1]
    evals = [e for e in events if e.get("event") == "eval"]
    held = evals[-1] if evals else {}
    figures = final_figures(None, held.get("eval_loss"), last.get("rewards/accuracies"), last.get("rewards/margins"),
                            held.get("eval_rewards/accuracies"), held.get("eval_rewards/margins"))
    line = f"loss {first['loss']:.4f} -> {last['loss']:.4f}"
    if not figures:
        return line
    return line + ("; " if figures.startswith("held out") else ", ") + figures


def _pump(stream: IO[str], log: IO[str], show: bool, seen: list[dict[str, Any]],
          progress: StartupProgress | None = None) -> None:
    for line in stream:
        log.write(line)
        log.flush()
        event = parse_event(line)
        if event is None:
            continue
        seen.append(event)
        text = format_event(event) if show else None
        if progress is not None:
            progress.event(event)
            if text:
                progress.write(text)
        elif text:
            print(text, flush=True)


class Interrupt:
    """SIGINT / SIGTERM of this process, recorded (the main loop acts on it); the previous handlers
    come back on exit. Only the main thread can install handlers: elsewhere it records nothing."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Interrupt:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signals.append(signum)

    @property
    def first(self) -> int | None:
        return self.signals[0] if self.signals else None


def _tree(procs: list[subprocess.Popen[str]]) -> list[Any]:
    """The agents' descendants (the trainers, in sessions of their own), as psutil processes."""
    import psutil

    found = []
    for proc in procs:
        try:
            found += psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            pass
    return found


def _kill(processes: list[Any]) -> int:
    import psutil

    killed = 0
    for proc in processes:
        try:
            if proc.is_running():
                proc.kill()  # psutil refuses a reused pid
                killed += 1
        except psutil.Error:
            pass
    return killed


def stop_signal(interrupt: Interrupt) -> signal.Signals:
    """What the agents get: SIGINT for a user's Ctrl-C (the trainers report it as Interrupted),
    SIGTERM otherwise (this process's own SIGTERM, or an error here: as the kubelet stops a pod)."""
    return signal.SIGINT if interrupt.first == signal.SIGINT else signal.SIGTERM


def stop_tree(procs: list[subprocess.Popen[str]], interrupt: Interrupt, grace_s: float) -> None:
    """`stop_signal` to every agent (torchrun passes the signal it got to its workers, which stop
    after their step and save when there is time), wait up to `grace_s`, then SIGKILL what is left
    of the tree: agents and trainers. A further signal skips the wait."""
    seen = {p.pid: p for p in _tree(procs)}
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, stop_signal(interrupt))
    deadline = time.monotonic() + grace_s
    signals = len(interrupt.signals)
    while time.monotonic() < deadline and len(interrupt.signals) <= signals:
        seen.update((p.pid, p) for p in _tree(procs))  # workers that were starting
        if all(proc.poll() is not None for proc in procs):
            break
        time.sleep(0.2)
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.wait()
    # Trainers are not in the agents' process groups; with the agents gone they are orphans.
    _kill(list(seen.values()))


def stopping_line(signum: int, grace_s: float) -> str:
    """What happens now, and what a second signal does (the user is about to press Ctrl-C again)."""
    if signum == signal.SIGINT:
        return (f"Ctrl-C: interrupting: the trainers stop after their current step and save a checkpoint if there is "
                f"time (everything is killed after {grace_s:.0f} s); press Ctrl-C again to kill them at once (the "
                f"step in progress and an unfinished save are lost)")
    return (f"{signal.Signals(signum).name}: stopping the agents and trainers (SIGTERM, then SIGKILL after "
            f"{grace_s:.0f} s; a second signal kills them at once)")


def _checkpoint_note(p: LocalPlan) -> str:
    """Where a rerun of the same command starts."""
    from llamaft_trainer.public import latest_checkpoint

    if not p.resume:
        return "spec.checkpointing.resume is false: a rerun starts from step 0"
    try:
        latest = latest_checkpoint(p.checkpoints)
    except Exception as exc:  # an unreadable directory must not hide the interrupt
        return f"cannot read {p.checkpoints}: {exc}"
    if latest is None:
        return f"no complete checkpoint in {p.checkpoints}: a rerun starts from step 0"
    return f"a rerun of the same command resumes from step {latest} ({p.checkpoints.rstrip('/')}/step-{latest:08d})"


def outcome(p: LocalPlan, agent_codes: list[int]) -> tuple[int, str | None]:
    """(exit code, first error line): the trainer's, from the workers' termination messages (the
    most telling one, in the operator's order); torchrun's code when no trainer wrote one. Every
    agent exiting 0 is a success: torchrun exits 0 only when its last worker group finished, and a
    message a failed attempt left (a non-leader rank writes none when a restart succeeds) is history."""
    if agent_codes and all(code == 0 for code in agent_codes):
        return 0, None
    docs = [termination.read(str(p.run_dir / f"termination-{i}.json")) for i in range(p.workers)]
    failures = [d for d in docs if d and d.get("phase") == "Failed"]
    if failures:
        worst = max(failures, key=lambda d: termination.PRECEDENCE.get(str(d.get("reason")), termination.OTHER_ERROR_PRECEDENCE))
        code = int(worst.get("exitCode") or termination.exit_code(str(worst.get("reason"))))
        message = str(worst.get("message") or "").strip().splitlines()
        return code, f"{worst.get('reason')}: {message[0] if message else ''}"
    code = max(agent_codes) if agent_codes else 1
    return code, None if code == 0 else _first_error_line(p)


def _first_error_line(p: LocalPlan) -> str | None:
    for index in range(p.workers):
        path = p.run_dir / f"worker-{index}.log"
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            if "Error" in line or "error:" in line:
                return line.strip()
    return None


def _spawn(command: list[str], env: dict[str, str], preexec: Callable[[], None] | None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, preexec_fn=preexec,
    )


def run_local(path: str | Path, *, nproc_per_worker: int | None = None, run_dir: str | Path | None = None,
              cpu: bool = False) -> int:
    """`cpu`: run on the CPU even when the spec asks for GPUs (--cpu)."""
    with Interrupt() as interrupt:
        try:
            p, spec = plan(path, nproc_per_worker=nproc_per_worker, run_dir=run_dir, cpu=cpu)
        except ConfigError as exc:
            for line in str(exc).splitlines():
                print(f"llamaft: configuration error: {line}", file=sys.stderr, flush=True)
            return EXIT_CONFIG_ERROR
        return _run(p, spec, interrupt)


def _run(p: LocalPlan, spec: LlamaFineTuneSpec, interrupt: Interrupt) -> int:
    if interrupt.first is not None:
        print(f"llamaft: {signal.Signals(interrupt.first).name} before the run started: nothing was started",
              file=sys.stderr, flush=True)
        return 128 + interrupt.first
    print(
        f"llamaft: running {p.name} locally: {p.workers} worker(s) x {p.nproc_per_worker} process(es) on {p.device}, "
        f"rendezvous {p.backend.value} (id {p.rdzv_id}); logs in {p.run_dir}",
        flush=True,
    )
    board = tensorboard_directory(spec)
    if board is not None:
        print(f"llamaft: TensorBoard: tensorboard --logdir {board}", flush=True)
    # torchrun's SIGTERM-to-SIGKILL time for its workers, as in the pod (the grace period).
    grace_s = float(p.launch.env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30)) + STOP_MARGIN_S
    for index in range(p.workers):  # an earlier run's messages are not this run's
        (p.run_dir / f"termination-{index}.json").unlink(missing_ok=True)
    events: list[dict[str, Any]] = []
    # The phase and the seconds since launch until the first step (rank 0's log lines).
    progress = StartupProgress(sys.stdout, live=sys.stdout.isatty())
    procs: list[subprocess.Popen[str]] = []
    threads: list[threading.Thread] = []
    codes: list[int] = []
    with local_rendezvous_endpoint(p, spec) as endpoint:
        try:
            for index in range(p.workers):
                if interrupt.first is not None:
                    break
                local = agent(p, endpoint, index)
                # This machine's environment (PATH, HF_TOKEN for a Secret-backed variable, ...), then the pod's.
                procs.append(_spawn(local.launch.argv, {**os.environ, **local.launch.env}, parent_death_signal(signal.SIGTERM)))
            # Readers start after every fork (preexec_fn and threads do not mix).
            for index, proc in enumerate(procs):
                log = (p.run_dir / f"worker-{index}.log").open("w")
                assert proc.stdout is not None
                # Only global rank 0 prints JSON events, and the rendezvous decides which agent hosts it.
                thread = threading.Thread(target=_pump, args=(proc.stdout, log, True, events, progress), daemon=True)
                thread.start()
                threads.append(thread)
            while interrupt.first is None and any(proc.poll() is None for proc in procs):
                progress.tick()
                time.sleep(0.1)
            progress.close()
            if interrupt.first is not None:
                print(f"llamaft: {stopping_line(interrupt.first, grace_s)}", file=sys.stderr, flush=True)
            else:
                codes = [proc.wait() for proc in procs]
        finally:
            if interrupt.first is not None or any(proc.poll() is None for proc in procs):
                stop_tree(procs, interrupt, grace_s)
        for thread in threads:
            thread.join(5)
    if interrupt.first is not None:
        print(f"llamaft: interrupted; nothing of the run is left running; {_checkpoint_note(p)}", file=sys.stderr, flush=True)
        return 128 + interrupt.first
    code, error = outcome(p, codes)
    if code != 0:
        if not any(e.get("event") == "error" for e in events):  # not already shown: the log's end
            failed = next((i for i, c in enumerate(codes) if c != 0), 0)
            log_path = p.run_dir / f"worker-{failed}.log"
            if log_path.exists():
                print("\n".join(log_path.read_text(errors="replace").splitlines()[-25:]), file=sys.stderr)
        print(f"llamaft: the run failed (exit {code}); full logs in {p.run_dir}", file=sys.stderr)
        if error:
            print(f"llamaft: error: {error}", file=sys.stderr, flush=True)
        return code
    exported = [e["path"] for e in events if e.get("event") == "export"]
    summary = done_line(events)
    if summary:
        print(f"llamaft: done: {summary}", flush=True)
    if exported:
        print(f"llamaft: fine-tuned model: {exported[-1]}", flush=True)
    return 0
