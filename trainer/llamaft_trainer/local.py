"""`llamaft run --local FILE`: the same LlamaFineTune, run by torchrun on this machine.

One torchrun agent per `spec.cluster.workers` (each a "node" with its processes), rendezvousing
exactly as on the cluster: through a local etcd for the etcd backends (started here unless
`spec.rendezvous.endpoint` is set), or c10d on loopback. GPUs are used when the machine has as
many as the spec asks for; otherwise each worker runs one CPU process (gloo). Rank 0's JSON log
lines are shown as live progress; every agent's full output goes to `<run dir>/worker-<i>.log` (rank 0 may be on any of them).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from llamaft.api.sources import SourceKind, parse_source
from llamaft.api.spec import LlamaFineTuneSpec, RendezvousBackend
from llamaft.manifests import load_finetune

from llamaft_trainer.local_etcd import LocalEtcd, free_port


@dataclass(frozen=True)
class LocalPlan:
    name: str
    workers: int
    nproc_per_worker: int
    device: str
    backend: RendezvousBackend
    run_dir: Path
    config_path: Path
    rdzv_id: str


def plan(path: str | Path, *, nproc_per_worker: int | None, run_dir: str | Path | None) -> tuple[LocalPlan, LlamaFineTuneSpec]:
    body, spec = load_finetune(path)
    name = str(body["metadata"]["name"])
    model = parse_source(spec.model.source)
    if model.kind is SourceKind.LOCAL and not Path(model.location).expanduser().exists():
        raise SystemExit(
            f"error: spec.model.source: {spec.model.source} does not exist. For the tiny example, build it "
            f"first: llamaft make-tiny-model {spec.model.source}"
        )
    import torch

    gpus = torch.cuda.device_count()
    wanted = spec.cluster.gpus_per_worker
    if wanted and gpus >= wanted * spec.cluster.workers:
        device, nproc = "cuda", wanted
    elif wanted and gpus >= spec.cluster.workers:
        device, nproc = "cuda", gpus // spec.cluster.workers
    else:
        device, nproc = "cpu", 1
    if nproc_per_worker is not None:
        nproc = nproc_per_worker
    directory = Path(run_dir or Path("runs") / name)
    directory.mkdir(parents=True, exist_ok=True)
    config_path = directory / "config.json"
    config_path.write_text(json.dumps(spec.training_config().to_k8s(), indent=2))
    rdzv_id = f"{name}-{uuid.uuid4().hex[:8]}"  # unique per run: a rerun never meets a closed rendezvous
    return LocalPlan(name, spec.cluster.workers, nproc, device, spec.rendezvous.backend, directory, config_path, rdzv_id), spec


def agent_command(p: LocalPlan, spec: LlamaFineTuneSpec, endpoint: str) -> list[str]:
    nnodes = str(p.workers)
    if spec.cluster.elastic is not None:
        nnodes = f"{spec.cluster.elastic.min_workers}:{spec.cluster.elastic.max_workers}"
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", nnodes, "--nproc_per_node", str(p.nproc_per_worker),
        "--rdzv_backend", p.backend.value, "--rdzv_endpoint", endpoint, "--rdzv_id", p.rdzv_id,
        "--max_restarts", str(spec.rendezvous.max_restarts),
        "-m", "llamaft_trainer", "--config", str(p.config_path),
    ]


@contextlib.contextmanager
def rendezvous_endpoint(p: LocalPlan, spec: LlamaFineTuneSpec) -> Iterator[str]:
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
        return (
            f"step {event['step']:>5}/{event['total_steps']} | epoch {event['epoch']} | loss {event['loss']:.4f} | "
            f"lr {event['lr']:.2e} | {event['tokens_per_second']:,.0f} tok/s | eta {eta}s"
        )
    if kind == "eval":
        return f"eval  step {event['step']}: loss {event['eval_loss']:.4f}, perplexity {event['perplexity']:.2f}"
    if kind == "setup":
        return (
            f"setup: {event['parameters']:,} parameters on {event['world_size']} rank(s) ({event['device']}), "
            f"{event['strategy']} {event['precision']}, {event['total_steps']} steps"
        )
    if kind == "checkpoint":
        return f"checkpoint: {event['path']}"
    if kind == "resume":
        return f"resumed from {event['path']} (step {event['step']})"
    if kind == "export":
        return f"exported the fine-tuned model ({event['format']}) to {event['path']}"
    if kind == "error":
        return f"error: {event['message']}"
    if kind == "preempted":
        return f"SIGTERM: stopping after step {event['step']} ({'saving' if event['save'] else 'no time to save'}: {event['detail']})"
    if kind == "done" and event.get("phase") == "Failed" and event.get("reason") != "ConfigError":
        return f"failed ({event['reason']}) at step {event.get('step')}: {event.get('message')}"
    return None


def _pump(stream: IO[str], log: IO[str], show: bool, seen: list[dict[str, Any]]) -> None:
    for line in stream:
        log.write(line)
        log.flush()
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        seen.append(event)
        text = format_event(event) if show else None
        if text:
            print(text, flush=True)


def run_local(path: str | Path, *, nproc_per_worker: int | None = None, run_dir: str | Path | None = None) -> int:
    p, spec = plan(path, nproc_per_worker=nproc_per_worker, run_dir=run_dir)
    total = p.workers * p.nproc_per_worker
    print(
        f"llamaft: running {p.name} locally: {p.workers} worker(s) x {p.nproc_per_worker} process(es) on {p.device}, "
        f"rendezvous {p.backend.value} (id {p.rdzv_id}); logs in {p.run_dir}",
        flush=True,
    )
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // total)))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    if p.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    events: list[dict[str, Any]] = []
    procs: list[subprocess.Popen[str]] = []
    threads: list[threading.Thread] = []
    with rendezvous_endpoint(p, spec) as endpoint:
        try:
            for index in range(p.workers):
                worker_env = dict(env)
                worker_env["LLAMAFT_METRICS_PORT"] = str(free_port())
                worker_env["LLAMAFT_TERMINATION_LOG"] = str(p.run_dir / f"termination-{index}.json")
                proc = subprocess.Popen(
                    agent_command(p, spec, endpoint), env=worker_env, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True, start_new_session=True,
                )
                procs.append(proc)
                log = (p.run_dir / f"worker-{index}.log").open("w")
                assert proc.stdout is not None
                # Only global rank 0 prints JSON events, and the rendezvous decides which agent hosts it.
                thread = threading.Thread(target=_pump, args=(proc.stdout, log, True, events), daemon=True)
                thread.start()
                threads.append(thread)
            codes = [proc.wait() for proc in procs]
        except KeyboardInterrupt:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
            for proc in procs:
                proc.wait()
            print("llamaft: interrupted; the newest complete checkpoint resumes on the next run", flush=True)
            return 130
        for thread in threads:
            thread.join(5)
    code = max(codes)
    if code != 0:
        failed = next((i for i, c in enumerate(codes) if c != 0), 0)
        tail = (p.run_dir / f"worker-{failed}.log").read_text(errors="replace").splitlines()[-25:]
        print("\n".join(tail), file=sys.stderr)
        print(f"llamaft: the run failed (exit {code}); full logs in {p.run_dir}", file=sys.stderr, flush=True)
        return code
    exported = [e["path"] for e in events if e.get("event") == "export"]
    losses = [e["loss"] for e in events if e.get("event") == "step"]
    if losses:
        print(f"llamaft: done: loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    if exported:
        print(f"llamaft: fine-tuned model: {exported[-1]}", flush=True)
    return 0
