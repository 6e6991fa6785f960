"""llamaft against HF Trainer on the CPU, side by side: tokens/s, start-up and peak RSS, and the
loss trace on identical batches.

The workload is examples/tiny.yaml's: the tiny Llama of `llamaft make-tiny-model`, samsum packed
into sequences of 128 tokens (examples/data/samsum-tiny.jsonl, validationSplit 0), 4 sequences per
process and step, fp32, AdamW (lr 3e-3, torch's betas and eps, no weight decay), 5 warm-up steps
then cosine decay, gradients clipped to norm 1.0, no accumulation, --steps optimizer steps.

- llamaft: the product path. A LlamaFineTune YAML (examples/tiny.yaml with the pair's workers,
  threads, sharding strategy and steps; logInterval 1, no eval, no export, one checkpoint at the
  end) run by `llamaft run --local` (the venv's console script), so start-up includes the CLI,
  torchrun and the trainer. Each pair's thread count goes in through spec.cluster.env (it wins
  over the pod's share and this machine's cores).
- HF: transformers' own Trainer with accelerate (bench/_hf_peer.py, in .venv-peers, which this
  script creates on first use from bench/peers-requirements.txt), DDP over gloo under torchrun for
  2 processes, on the same model directory and on exactly the batches llamaft trains on: before
  the runs, llamaft's own data code (data.build_store, data.loaders and the train loop's batch
  iterator, with the spec's seed) writes every rank's batches in order to a file the HF side reads
  (sequential sampler; accelerate's sharding hands rank r its own). Both sides start from
  tokenized data: each llamaft run's checkpoint directory links to that token store, which the
  trainer reuses as a later attempt does (the run fails if it does not); HF loads the file.

Pairs (1 process: tiny.yaml's FULL_SHARD, which on one rank has nothing to communicate):
  1p1t     1 process, OMP_NUM_THREADS=1 on both sides
  1p2t     1 process, 2 threads
  2p       2 processes of 1 thread; llamaft NO_SHARD (replicas, all-reduced gradients: DDP's work)
  2p-full  the same with llamaft FULL_SHARD (an extra row; HF is DDP again)
  2p-fsdp2 FSDP2 on both sides: llamaft FULL_SHARD, HF through accelerate's FSDP2 plugin with the
           same wrapping unit (each decoder layer, and the root) and reshard_after_forward true.
           accelerate turns FSDP on for accelerator devices only; on a CPU the HF side runs
           accelerate's own FSDP branch after its state chose MULTI_CPU (_hf_peer.fsdp_on_cpu),
           so the Trainer goes through accelerate's FSDP2 code over gloo. The HF side reports
           its sharded parameters, and the pair is refused unless every one is a DTensor.
Each round runs every pair's two tools back to back, alternating which goes first; the table is
the median over rounds (ratio and delta: the median of the per-round ones).

Columns, per run:
  tok/s      job tokens per second, the median over the steps after the first 5 of each step's
             rate (every token is real: packing has no padding). llamaft: the tokens_per_second of
             its step log lines (its step_seconds: from fetching the batch to the end of the step's
             loss all-reduce, after the optimizer step). HF: from fetching the step's batch
             (get_batch_samples) to on_step_end (after optimizer, scheduler and zero_grad). The
             `cadence` line adds every per-step cost of the loop (logging included): the tokens of
             those steps over the wall-clock time between the ends of step 5 and of the last step.
  start-up   seconds from launching the subprocess to the end of the first optimizer step: the
             wall-clock timestamp of llamaft's step-1 log line (its `ts`, in ms), or of HF's
             on_step_end of step 1, minus the launch time.
  peak RSS   the largest sum of RSS over the whole process tree (the CLI or torchrun agent and
             every trainer process), polled every 0.2 s with psutil.
Loss parity: on every pair but 2p-full, the largest |llamaft loss - HF loss| over every step (and
the learning rates, which must agree exactly: the same schedule, on every pair); above
--loss-tolerance (1e-5) the script exits 1. Those pairs run the same maths on both sides (fp32,
identical batches, gradients averaged by the same code), which leaves only summation-order
differences (foreach vs per-tensor AdamW and clipping, a sharded vs a whole-tensor norm): a few
1e-6 after 80 steps; a batch out of order or a schedule off by one step moves the loss by 1e-3 or
more. 2p-full's sides average gradients differently (FSDP2 sums then averages, DDP divides before
its all-reduce): about 3e-5 after 80 steps, reported, not held.

Run it on a quiet machine: on a 2-vCPU machine the 2-process pairs and 1p2t have no spare core, so
other load changes both sides' figures a lot (the load average is printed at the start and end).

    .venv/bin/python bench/peers.py                         # 3 rounds of every pair, 80 steps
    .venv/bin/python bench/peers.py --rounds 1 --steps 20   # a quick look
    .venv/bin/python bench/peers.py --pairs 1p1t,2p --json peers.json
    .venv/bin/python bench/peers.py --pairs 2p,2p-fsdp2 --phases        # where each step's time goes
    .venv/bin/python bench/peers.py --hf-python .venv/bin/python   # HF side in another venv

--phases times each step's phases on both sides and prints them per pair (rank 0, ms per step):
llamaft's LLAMAFT_PHASE_TIMERS (llamaft_trainer/report/profiling.py: data, forward, backward, FSDP2's
all-gathers and reduce-scatters, grad norm, optimizer, the loop's syncs, other) and the HF peer's
timers on the Trainer's own methods (data, forward = compute_loss, backward, grad norm, optimizer =
optimizer.step + scheduler + zero_grad, other; the collectives stay inside forward and backward).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import DATASET, REPO  # noqa: E402
from cpu_scaling import load_average  # noqa: E402
from llamaft_trainer.report.logline import read_events  # noqa: E402

HF_PEER = Path(__file__).with_name("_hf_peer.py")
REQUIREMENTS = Path(__file__).with_name("peers-requirements.txt")
VENV = REPO / ".venv-peers"
EXAMPLE = REPO / "examples" / "tiny.yaml"
SKIP = 5
"""Steps left out of the rates (the first ones: allocator and caches warming up)."""
TOLERANCE = 1e-5


@dataclass(frozen=True)
class Pair:
    processes: int
    threads: int
    strategy: str
    """llamaft's fsdp.shardingStrategy."""
    hf_fsdp2: bool = False
    """HF through accelerate's FSDP2 plugin (full_shard auto_wrap of LlamaDecoderLayer,
    reshard_after_forward true: llamaft's FULL_SHARD units and policy), else DDP (or one process)."""
    same_maths: bool = True
    """Both sides average the gradients by the same code, so their losses are held to the loss
    tolerance. Not 2p-full: FSDP2's reduce-scatter sums and then averages, DDP divides each
    gradient by the world size before its all-reduce, which rounds differently from step 1 on."""


PAIRS = {
    "1p1t": Pair(1, 1, "FULL_SHARD"),
    "1p2t": Pair(1, 2, "FULL_SHARD"),
    "2p": Pair(2, 1, "NO_SHARD"),
    "2p-full": Pair(2, 1, "FULL_SHARD", same_maths=False),
    "2p-fsdp2": Pair(2, 1, "FULL_SHARD", hf_fsdp2=True),
}


@dataclass
class Run:
    tool: str
    tps: float
    """Median step rate over the steps after SKIP, job tokens/s."""
    cadence_tps: float
    """Tokens of the steps after SKIP over the wall-clock time from the end of step SKIP to the last."""
    startup_s: float
    peak_rss_mb: float
    seconds: float
    """The whole subprocess, launch to exit."""
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


class VenvError(RuntimeError):
    """.venv-peers could not be made (no package index, or the pins do not resolve)."""


# ----------------------------------------------------------------------------------- the venv
def pins() -> dict[str, str]:
    out = {}
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[name.strip()] = version.strip()
    return out


def _installed(python: Path) -> dict[str, str] | None:
    probe = ("import json, importlib.metadata as m; print(json.dumps({n: m.version(n) for n in "
             + repr(sorted(pins())) + "}))")
    try:
        proc = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    found: dict[str, str] = json.loads(proc.stdout)
    return found


def _matches(found: dict[str, str] | None) -> bool:
    # torch's local label (2.13.0+cpu) satisfies ==2.13.0, as pip has it.
    return found is not None and all(found.get(n, "").split("+")[0] == v for n, v in pins().items())


def ensure_venv(venv: Path = VENV) -> Path:
    """The peer venv's python, made when missing or when its versions differ from the pins:
    python -m venv, then torch (pinned, first) and the rest by uv when the project's venv has it
    (.ci/setup installs it: from uv's cache, which .ci/setup's own torch filled, in seconds where
    pip unpacks several GB for minutes; byte-compiled as pip would), else by pip. Under an exclusive lock beside the
    venv: the tests that need it run in parallel, and two installs into one venv break it."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.with_name(venv.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _ensure_venv(venv)


def _ensure_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if python.exists() and _matches(_installed(python)):
        return python
    print(f"peers: creating {venv} ({', '.join(f'{n}=={v}' for n, v in pins().items())}); minutes, once", flush=True)
    if not python.exists():
        shutil.rmtree(venv, ignore_errors=True)
        made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
        if made.returncode != 0:
            raise VenvError(f"python -m venv {venv} failed: {made.stderr[-2000:]}")
    uv = Path(sys.executable).with_name("uv")
    if uv.exists():
        torch_pin = [f"torch=={pins()['torch']}"] if "torch" in pins() else []
        install = [str(uv), "pip", "install", "--quiet", "--compile-bytecode", "--python", str(python)]
        steps = [[*install, *torch_pin], [*install, "-r", str(REQUIREMENTS)]] if torch_pin else [[*install, "-r", str(REQUIREMENTS)]]
    else:
        steps = [[str(python), "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)]]
    for command in steps:
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
        if done.returncode != 0:
            raise VenvError(f"{' '.join(command[:4])} ... into {venv} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    if not _matches(_installed(python)):
        raise VenvError(f"{venv} does not have the versions {REQUIREMENTS.name} pins after installing them: {_installed(python)}")
    return python


# ------------------------------------------------------------------------------ preparation
def example_spec(name: str, pair: Pair, steps: int, model: Path, checkpoints: Path) -> dict[str, Any]:
    """examples/tiny.yaml, as this pair runs it."""
    import yaml

    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    spec = doc["spec"]
    spec["model"]["source"] = str(model)
    # Concatenated blocks: every row of every batch is maxSeqLength real tokens, so the HF side
    # replays plain (input_ids, labels, attention_mask) rows and both sides' tokens/s count the same
    # tokens. The default (bfd) gives variable-length padded blocks with per-example position ids,
    # which is a data question, not the engine speed this bench compares.
    spec["dataset"].update(source=str(DATASET), validationSplit=0, packingStrategy="concatenate")
    training = spec["training"]
    training.pop("epochs", None)
    training.update(maxSteps=steps, evalInterval=0, logInterval=1)
    spec["fsdp"]["shardingStrategy"] = pair.strategy
    spec["checkpointing"] = {"directory": str(checkpoints), "everyNSteps": 10_000_000, "exportHuggingFace": False,
                             "resume": False}
    spec["cluster"]["workers"] = pair.processes
    spec["cluster"]["env"] = [{"name": "OMP_NUM_THREADS", "value": str(pair.threads)}]
    return doc


def export_batches(doc: dict[str, Any], model: Path, store_root: Path, world: int, steps: int, out: Path) -> None:
    """Every rank's micro-batches of the first `steps` optimizer steps, as the trainer makes them
    (its data code, its seed), interleaved: row block k * world + r is rank r's k-th batch."""
    import torch
    from llamaft.api.spec import LlamaFineTuneSpec
    from llamaft_trainer.checkpoint.dcp import TrainState
    from llamaft_trainer.data.batching import loaders
    from llamaft_trainer.data.prepare import build_store
    from llamaft_trainer.train import _micro_batches
    from transformers import AutoTokenizer

    spec = LlamaFineTuneSpec.model_validate(doc["spec"])
    tok = AutoTokenizer.from_pretrained(model)
    if tok.pad_token_id is None:  # as model.load_tokenizer
        tok.pad_token = tok.eos_token
    tc = spec.training
    store = build_store(spec.dataset, tok, tc.seed, store_root)
    per_rank = []
    for rank in range(world):
        data = loaders(store, spec.dataset, int(tok.pad_token_id), tc.per_device_batch_size, tc.seed, rank, world)
        groups = _micro_batches(data, TrainState(), tc.gradient_accumulation_steps)
        per_rank.append([next(groups)[0] for _ in range(steps)])
    rows = [per_rank[r][k] for k in range(steps) for r in range(world)]
    torch.save({name: torch.cat([b[name] for b in rows]) for name in ("input_ids", "labels", "attention_mask")}, out)


# ------------------------------------------------------------------------------------ running
@dataclass
class Tree:
    launched: float
    """time.time() just before the launch."""
    peak_rss_mb: float
    seconds: float
    spawned: list[tuple[float, str, float]]
    """(seconds after the launch, the command's first words, its own peak RSS MB) of every process of
    the tree. Times relative to the root's create_time (psutil has it to within a second of the clock)."""


def run_tree(argv: list[str], env: dict[str, str], cwd: Path, log: Path, timeout_s: float) -> Tree:
    """Run `argv` to its end, polling its process tree's RSS."""
    import psutil

    with log.open("w") as out:
        launched, started = time.time(), time.perf_counter()
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    root = psutil.Process(proc.pid)
    peak = 0
    seen: dict[int, tuple[float, str]] = {}
    own: dict[int, int] = {}
    while proc.poll() is None:
        if time.perf_counter() - started > timeout_s:
            for child in root.children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()
            raise SystemExit(f"{argv[:3]} ran past {timeout_s:.0f} s; log {log}")
        total = 0
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in tree:
            try:
                rss = p.memory_info().rss
                total += rss
                own[p.pid] = max(own.get(p.pid, 0), rss)
                if p.pid not in seen:
                    words = [Path(w).name if w.startswith("/") else w for w in p.cmdline()[:4]]
                    seen[p.pid] = (round(p.create_time() - root.create_time(), 2), " ".join(words))
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        peak = max(peak, total)
        time.sleep(0.2)
    code = proc.wait()
    seconds = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"{' '.join(argv[:4])} ... exited {code}; log {log}:\n" + "\n".join(log.read_text().splitlines()[-40:]))
    spawned = sorted((at, cmd, round(own[pid] / 2**20, 1)) for pid, (at, cmd) in seen.items())
    return Tree(launched, peak / 2**20, seconds, spawned)


def rates(tokens: list[float], seconds: list[float], ends: list[float]) -> tuple[float, float]:
    """(median step rate, cadence rate) over the steps after SKIP (lists indexed by step - 1)."""
    skip = min(SKIP, len(tokens) // 2)
    median = statistics.median(t / s for t, s in zip(tokens[skip:], seconds[skip:], strict=True))
    cadence = sum(tokens[skip:]) / (ends[-1] - ends[skip - 1]) if skip else float("nan")
    return median, cadence


def run_llamaft(name: str, pair: Pair, steps: int, model: Path, store_root: Path, work: Path, timeout_s: float,
                nproc_layout: bool, phases: bool = False) -> Run:
    import yaml

    folder = work / "llamaft" / name
    checkpoints = folder / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "data").symlink_to(store_root, target_is_directory=True)  # the trainer's store root
    doc = example_spec(name, pair, steps, model, checkpoints)
    argv = [str(Path(sys.executable).with_name("llamaft")), "run", "--local", str(folder / "finetune.yaml"),
            "--run-dir", str(folder / "run")]
    if nproc_layout and pair.processes > 1:  # one torchrun agent with every process, as HF's
        doc["spec"]["cluster"]["workers"] = 1
        argv += ["--nproc-per-worker", str(pair.processes)]
    (folder / "finetune.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    env = dict(os.environ, OMP_NUM_THREADS=str(pair.threads),
               PYTHONPATH=os.pathsep.join([str(REPO / "operator"), str(REPO / "trainer")]))
    if phases:
        env["LLAMAFT_PHASE_TIMERS"] = "1"  # profiling.py: a `phases` event per step and rank
    tree = run_tree(argv, env, folder, folder / "cli.log", timeout_s)
    events = [e for log in sorted((folder / "run").glob("worker-*.log")) for e in read_events(log)]
    data = next((e for e in events if e.get("event") == "data"), {})
    if not data.get("reused"):
        raise SystemExit(f"{name}: llamaft built a token store of its own ({data}): not the exported batches")
    by_step = {e["step"]: e for e in events if e.get("event") == "step"}
    if sorted(by_step) != list(range(1, steps + 1)):
        raise SystemExit(f"{name}: llamaft logged steps {sorted(by_step)}, not 1..{steps}")
    rows = [by_step[k] for k in range(1, steps + 1)]
    ends = [datetime.fromisoformat(r["ts"]).timestamp() for r in rows]
    median, cadence = rates([r["tokens"] for r in rows], [r["tokens"] / r["tokens_per_second"] for r in rows], ends)
    stamps = {e["event"]: datetime.fromisoformat(e["ts"]).timestamp() - tree.launched for e in reversed(events) if "ts" in e}
    extra: dict[str, Any] = {"spawned": tree.spawned,
                             "trainer_events_s": {k: round(stamps[k], 2) for k in ("data", "setup") if k in stamps}}
    if phases:
        timed = {e["step"]: e for e in events if e.get("event") == "phases" and e.get("rank") == 0}
        if sorted(timed) != list(range(1, steps + 1)):
            raise SystemExit(f"{name}: llamaft logged phases for steps {sorted(timed)}, not 1..{steps}")
        from llamaft_trainer.report.profiling import PHASES

        extra["phases"] = phase_medians([timed[k] for k in range(1, steps + 1)], PHASES)
    return Run("llamaft", median, cadence, ends[0] - tree.launched, tree.peak_rss_mb, tree.seconds,
               [r["loss"] for r in rows], [r["lr"] for r in rows], [r["grad_norm"] for r in rows], extra)


HF_SCHEDULERS = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}
"""transformers' `lr_scheduler_type` for each `training.scheduler` (train.lr_factor's formulas)."""


def run_hf(name: str, pair: Pair, steps: int, model: Path, batches: Path, work: Path, python: Path, doc: dict[str, Any],
           timeout_s: float, phases: bool = False) -> Run:
    from llamaft.api.spec import LlamaFineTuneSpec

    tc = LlamaFineTuneSpec.model_validate(doc["spec"]).training
    folder = work / "hf" / name
    folder.mkdir(parents=True)
    out = folder / "result.json"
    # llamaft's optimizer (train.build_optimizer): torch's AdamW with its default betas and eps.
    cfg = {
        "model": str(model), "batches": str(batches), "out": str(out), "output_dir": str(folder / "trainer"),
        "steps": steps, "batch_size": tc.per_device_batch_size, "learning_rate": tc.learning_rate,
        "warmup_steps": tc.warmup_steps, "lr_scheduler_type": HF_SCHEDULERS[tc.scheduler.value],
        "weight_decay": tc.weight_decay, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8,
        "max_grad_norm": tc.max_grad_norm, "optim": "adamw_torch", "seed": tc.seed, "fsdp2": pair.hf_fsdp2,
        "phases": phases,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    argv = [str(python), str(HF_PEER), str(folder / "config.json")]
    if pair.processes > 1:
        from llamaft_trainer.process.local_etcd import free_port

        argv[1:1] = ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(pair.processes),
                     "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS=str(pair.threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    tree = run_tree(argv, env, folder, folder / "hf.log", timeout_s)
    result = json.loads(out.read_text())
    if result["mismatched_batches"]:
        raise SystemExit(f"{name}: HF trained on {result['mismatched_batches']} batches other than llamaft's")
    rows = result["steps"]
    if [r["step"] for r in rows] != list(range(1, steps + 1)):
        raise SystemExit(f"{name}: HF recorded steps {[r['step'] for r in rows]}, not 1..{steps}")
    if pair.hf_fsdp2 and result["sharded_parameters"] != result["parameters"]:
        # accelerate enables FSDP for accelerator devices only (AcceleratorState: the FSDP branch is
        # under MULTI_GPU/XPU/NPU/...); _hf_peer.fsdp_on_cpu takes it on a CPU. Should another
        # accelerate leave the plugin unused all the same, this is not an FSDP2 pair.
        raise SystemExit(f"{name}: accelerate's FSDP2 plugin sharded {result['sharded_parameters']} of "
                         f"{result['parameters']} parameters (the model ran as {result['wrapper']}): not an FSDP2 "
                         "pair")
    tokens = [float(result["tokens_per_step"])] * steps
    median, cadence = rates(tokens, [r["seconds"] for r in rows], [r["end"] for r in rows])
    return Run("hf", median, cadence, rows[0]["end"] - tree.launched, tree.peak_rss_mb, tree.seconds,
               [r["loss"] for r in rows], [r["lr"] for r in rows], [r["grad_norm"] for r in rows],
               {"spawned": tree.spawned, "threads": result["threads"], "versions": result["versions"],
                "wrapper": result["wrapper"], "sharded_parameters": result["sharded_parameters"],
                "parameters": result["parameters"],
                **({"phases": phase_medians([r["phases"] for r in rows], list(rows[0]["phases"]))} if phases else {})})


def timeline(run: Run) -> str:
    """When each process of the run's tree appeared, the trainer's first events, and step 1's end."""
    marks = [f"{cmd} {t:.1f}" for t, cmd, _ in run.extra.get("spawned", [])]
    marks += [f"{event} {t:.1f}" for event, t in run.extra.get("trainer_events_s", {}).items()]
    return ", ".join([*marks, f"step 1 {run.startup_s:.1f}"])


def parity(a: Run, b: Run) -> dict[str, float]:
    def worst(x: list[float], y: list[float]) -> float:
        return max(abs(p - q) for p, q in zip(x, y, strict=True))

    return {"max_abs_loss_diff": worst(a.losses, b.losses), "max_abs_lr_diff": worst(a.lrs, b.lrs),
            "max_abs_grad_norm_diff": worst(a.grad_norms, b.grad_norms)}


def phase_medians(rows: list[dict[str, Any]], names: Sequence[str]) -> dict[str, float]:
    """Median milliseconds per phase over the steps after SKIP (rows indexed by step - 1), and
    `step`: the median of each step's sum. llamaft's names are its profiling.PHASES (exclusive,
    summing to the step); HF's are the ones its rows carry (_hf_peer.PHASES, the collectives
    inside forward and backward)."""
    skip = min(SKIP, len(rows) // 2)
    kept = rows[skip:]
    out = {name: float(statistics.median(float(r.get(name, 0.0)) for r in kept)) for name in names}
    out["step"] = float(statistics.median(sum(float(r.get(name, 0.0)) for name in names) for r in kept))
    return out


def print_phases(report: dict[str, Any]) -> None:
    """Per pair and tool, the median over rounds of each phase's median ms per step (rank 0)."""
    from llamaft_trainer.report.profiling import PHASES

    print()
    print("phases, ms per step (rank 0; the median over rounds of each run's median after the first "
          f"{SKIP} steps; · = inside forward/backward on that side):")
    print("| run | tool | " + " | ".join(PHASES) + " | step |")
    print("|---|---|" + "---:|" * (len(PHASES) + 1))
    for name, entry in report["pairs"].items():
        for tool in ("llamaft", "hf"):
            runs = [r[tool]["extra"]["phases"] for r in entry["rounds"]]
            cells = [f"{statistics.median(p[k] for p in runs):.1f}" if k in runs[0] else "·"
                     for k in (*PHASES, "step")]
            print(f"| {name} | {tool} | " + " | ".join(cells) + " |")


# ------------------------------------------------------------------------------------ reporting
def summary(rounds: list[dict[str, Any]]) -> dict[str, float]:
    def med(tool: str, key: str) -> float:
        return float(statistics.median(r[tool][key] for r in rounds))

    return {
        "llamaft_tps": med("llamaft", "tps"), "hf_tps": med("hf", "tps"),
        "ratio": statistics.median(r["llamaft"]["tps"] / r["hf"]["tps"] for r in rounds),
        "llamaft_cadence_tps": med("llamaft", "cadence_tps"), "hf_cadence_tps": med("hf", "cadence_tps"),
        "cadence_ratio": statistics.median(r["llamaft"]["cadence_tps"] / r["hf"]["cadence_tps"] for r in rounds),
        "llamaft_startup_s": med("llamaft", "startup_s"), "hf_startup_s": med("hf", "startup_s"),
        "startup_delta_s": statistics.median(r["llamaft"]["startup_s"] - r["hf"]["startup_s"] for r in rounds),
        "llamaft_peak_rss_mb": med("llamaft", "peak_rss_mb"), "hf_peak_rss_mb": med("hf", "peak_rss_mb"),
    }


def print_table(medians: dict[str, dict[str, float]], rounds: int) -> None:
    print()
    print("| run | llamaft tok/s | HF tok/s | ratio | llamaft start-up s | HF start-up s | Δ | llamaft peak RSS MB "
          "| HF peak RSS MB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, m in medians.items():
        print(f"| {name} | {m['llamaft_tps']:,.0f} | {m['hf_tps']:,.0f} | {m['ratio']:.2f} | {m['llamaft_startup_s']:.1f} "
              f"| {m['hf_startup_s']:.1f} | {m['startup_delta_s']:+.1f} | {m['llamaft_peak_rss_mb']:,.0f} "
              f"| {m['hf_peak_rss_mb']:,.0f} |")
    print(f"(median of {rounds} round(s); ratio = llamaft / HF, Δ = llamaft - HF start-up, each the median of the "
          "per-round values)")
    print("cadence (every per-step cost of the loop): " + "; ".join(
        f"{n} {m['llamaft_cadence_tps']:,.0f} vs {m['hf_cadence_tps']:,.0f} ({m['cadence_ratio']:.2f})"
        for n, m in medians.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every pair (medians over them)")
    parser.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated, of {', '.join(PAIRS)}")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--loss-tolerance", type=float, default=TOLERANCE, help="the largest loss difference allowed, every pair")
    parser.add_argument("--hf-python", type=Path, help="run the HF side with this python (default: .venv-peers, made here)")
    parser.add_argument("--nproc-layout", action="store_true",
                        help="2-process llamaft runs as 1 worker x 2 processes (one torchrun agent, like HF's) instead "
                             "of 2 workers x 1 process (examples/tiny.yaml's)")
    parser.add_argument("--phases", action="store_true",
                        help="time each step's phases on both sides (llamaft: LLAMAFT_PHASE_TIMERS; HF: the Trainer's "
                             "own methods) and print them per pair; the timers cost a little on both sides")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    parser.add_argument("--work-dir", type=Path, help="keep every run's files here (default: a temporary directory)")
    args = parser.parse_args()
    chosen = [p.strip() for p in args.pairs.split(",") if p.strip()]
    unknown = sorted(set(chosen) - set(PAIRS))
    if unknown or not chosen:
        parser.error(f"--pairs: unknown {unknown}; choose from {', '.join(PAIRS)}")
    if args.steps <= SKIP:
        parser.error(f"--steps must be more than {SKIP} (the steps left out of the rates)")
    try:
        python = args.hf_python or ensure_venv()
    except VenvError as exc:
        raise SystemExit(f"peers: {exc}") from exc
    from llamaft_trainer.tiny import build_tiny_llama

    start_load = os.getloadavg()
    print(f"peers: {load_average()} at the start; {os.cpu_count()} CPUs; {args.steps} steps, {args.rounds} round(s), "
          f"pairs {', '.join(chosen)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp_name:
        work = (args.work_dir or Path(tmp_name)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        model = build_tiny_llama(work / "model", DATASET)  # `llamaft make-tiny-model`'s model
        store_root = work / "store"
        batches: dict[int, Path] = {}
        for world in sorted({PAIRS[n].processes for n in chosen}):
            doc = example_spec("export", Pair(world, 1, "FULL_SHARD"), args.steps, model, work)
            batches[world] = work / f"batches-{world}.pt"
            export_batches(doc, model, store_root, world, args.steps, batches[world])
        report: dict[str, Any] = {"load_average_start": start_load, "cpus": os.cpu_count(), "steps": args.steps,
                                  "rounds": args.rounds, "skip_steps": SKIP, "nproc_layout": args.nproc_layout,
                                  "hf_python": str(python), "pairs": {}}
        for name in chosen:
            report["pairs"][name] = {"config": asdict(PAIRS[name]), "rounds": []}
        for index in range(args.rounds):
            for position, name in enumerate(chosen):
                pair = PAIRS[name]
                run_name = f"peers-{name}-r{index}"
                doc = example_spec(run_name, pair, args.steps, model, work)
                order = ("llamaft", "hf") if (index + position) % 2 == 0 else ("hf", "llamaft")
                done: dict[str, Run] = {}
                before = load_average()
                for tool in order:
                    if tool == "llamaft":
                        done[tool] = run_llamaft(run_name, pair, args.steps, model, store_root, work, args.timeout,
                                                 args.nproc_layout, args.phases)
                    else:
                        done[tool] = run_hf(run_name, pair, args.steps, model, batches[pair.processes], work, python, doc,
                                            args.timeout, args.phases)
                ll, hf = done["llamaft"], done["hf"]
                check = parity(ll, hf)
                report["pairs"][name]["rounds"].append(
                    {"order": list(order), "load_before": before, "llamaft": asdict(ll), "hf": asdict(hf), "parity": check})
                print(f"round {index + 1} {name} ({order[0]} first): llamaft {ll.tps:,.0f} tok/s, start-up {ll.startup_s:.1f} s, "
                      f"{ll.peak_rss_mb:,.0f} MB | HF {hf.tps:,.0f} tok/s, start-up {hf.startup_s:.1f} s, "
                      f"{hf.peak_rss_mb:,.0f} MB | ratio {ll.tps / hf.tps:.2f} | max |Δloss| "
                      f"{check['max_abs_loss_diff']:.1e} ({before})", flush=True)
                print(f"  start-up, s after launch: llamaft {timeline(ll)} | HF {timeline(hf)}", flush=True)
        medians = {name: summary(report["pairs"][name]["rounds"]) for name in chosen}
        for name in chosen:
            report["pairs"][name]["median"] = medians[name]
    hf_versions = next(iter(report["pairs"].values()))["rounds"][0]["hf"]["extra"]["versions"]
    import torch
    import transformers

    report["versions"] = {"llamaft_side": {"torch": torch.__version__, "transformers": transformers.__version__},
                          "hf_side": hf_versions}
    report["load_average_end"] = os.getloadavg()
    print_table(medians, args.rounds)
    if args.phases:
        print_phases(report)
    print(f"versions: HF side {hf_versions}; {load_average()} at the end")
    checks = {n: [r["parity"] for r in report["pairs"][n]["rounds"]] for n in chosen}
    worst = {n: max(c["max_abs_loss_diff"] for c in cs) for n, cs in checks.items()}
    held = {n: v for n, v in worst.items() if PAIRS[n].same_maths}
    worst_lr = max(c["max_abs_lr_diff"] for cs in checks.values() for c in cs)
    passed = max(held.values(), default=0.0) <= args.loss_tolerance and worst_lr <= 1e-12
    report["parity"] = {"steps": args.steps, "max_abs_loss_diff": max(held.values(), default=None),
                        "max_abs_loss_diff_by_pair": held, "max_abs_lr_diff": worst_lr,
                        "tolerance": args.loss_tolerance, "passed": passed,
                        "not_held": {n: v for n, v in worst.items() if n not in held}}
    print(f"loss parity ({args.steps} steps, identical batches): max |Δloss| "
          + ", ".join(f"{n} {v:.1e}" for n, v in held.items())
          + f"; max |Δlr| {worst_lr:.1e}; tolerance {args.loss_tolerance:g}: {'passed' if passed else 'FAILED'}")
    if len(held) < len(worst):
        print("max |Δloss| of pairs that average gradients by different code (not held to the tolerance): "
              + ", ".join(f"{n} {v:.1e}" for n, v in worst.items() if n not in held))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
        print(f"report: {args.json}")
    if not passed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
