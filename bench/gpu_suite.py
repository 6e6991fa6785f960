"""One prepared GPU suite: what llamaft's GPU levers buy on one GPU, and whether a real run works.

    python bench/gpu_suite.py [--out DIR] [--case TEXT ...] [--budget-s 480] [--no-run]
    python bench/gpu_suite.py --cpu-smoke [--out DIR]     # tiny shapes on the CPU: CI's check

Sized for one H100/H200 and about 8 minutes including set-up, because device time is lent in
minutes: every case is measured once, in a process of its own (a case that runs out of memory or
crashes is a row saying so, and the next case starts with an empty GPU), and a case that would
start after `--budget-s` is a Skipped row. The budget is the lent GPU's: the CPU smoke has none
(it must run every path whatever the machine's load; its caller's timeout bounds it).

Throughput cases (world size 1, the trainer's own code: `model.build_meta_model` ->
`parallelize.parallelize` (float8 conversion, activation checkpointing, compile, FSDP2) ->
`train.build_optimizer`, steps of `train.token_loss_sum` / `micro_step_sync` / `optimizer_step` as
`train_loop` makes them), random init and random tokens (throughput does not depend on the
values), bf16:

- a Llama-3.2-1B shape at sequence 8192 and a Llama-3.1-8B shape at 4096 with 16 of its 32
  layers (8B's fp32 master weights, gradients and AdamW state alone are 128 GB: half the layers
  keep the per-layer work and memory per token of the real model on one GPU);
- each as bf16, + compile, + compile + float8 (tensorwise, float8 all-gather), + selective-op
  activation checkpointing;
- and bf16 on documents of samsum-like lengths, packed as the trainer packs them (bfd's whole
  documents, position ids restarting, no attention mask) and padded one a row (DOCUMENTS): real
  tokens/s and MFU side by side, what packing buys on the GPU.

For each: tokens/s/GPU over the steps after the warm-up, MFU by torchtitan's formula against the
GPU's dense bf16 peak (float8 too, as torchtitan reports it), torch.cuda.max_memory_allocated of
a steady step beside `llamaft plan`'s tensor-peak prediction for the same shape and settings, and
the prediction's error. The 8B case's batch starts at 2 and falls to 1 when the planner predicts
more than 90 % of the GPU.

Then `llamaft run --local` itself (the CLI, torchrun, NCCL, CUDA bf16) on a small Llama made with
`llamaft make-tiny-model`'s code: 20 steps with a sharded checkpoint every 10 and the export, then
the same spec to 30 steps resumed from step 20's checkpoint, and the export loaded back with
transformers.

Output: a table on stdout and `gpu_suite.json` (device, driver, torch, CUDA, every row) in --out.
`--cpu-smoke` runs the same code paths on the CPU (tiny shapes, float8 through torchao's emulation,
compile off, gloo, fp32 weights) so CI proves the suite runs before a GPU is ever lent.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO  # noqa: E402
from llamaft_trainer.report.logline import read_events  # noqa: E402
from plan_accuracy import _case, estimate, shape_config  # noqa: E402

LLAMA_32_1B: dict[str, Any] = {
    "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "rope_theta": 500000.0,
    "tie_word_embeddings": True,
}
LLAMA_31_8B_HALF: dict[str, Any] = {
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}
TINY: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
}

VARIANTS: dict[str, dict[str, Any]] = {
    "bf16": {},
    "bf16 + compile": {"compile": True},
    "bf16 + compile + float8": {"compile": True, "float8": {"enabled": True, "recipe": "tensorwise", "allGather": True}},
    "bf16 + selective-op AC": {"activationCheckpointing": {"mode": "selective-op"}},
}
"""fsdp fields of each variant, over `mixedPrecision: bf16, activationCheckpointing: none`."""
DOCUMENTS = ("packed documents", "padded documents")
"""The bf16 variant again on documents of samsum-like lengths (a quarter to a sixteenth of the
sequence) instead of one sequence per row: `packed` as the trainer packs them (whole documents
filling each row, position ids restarting per document and no attention mask, so transformers
masks each from the others), `padded` one document per row padded to the batch's longest. Their
tokens/s and MFU count real tokens only: the pair says what packing buys on this GPU."""

FIT_FRACTION = 0.9
"""A case's batch is halved (down to 1) while the planner predicts more than this share of the GPU."""


def _fsdp(variant: dict[str, Any], cpu: bool) -> dict[str, Any]:
    fsdp: dict[str, Any] = {"mixedPrecision": "bf16", "activationCheckpointing": {"mode": "none"}, **variant}
    if cpu:
        fsdp.pop("compile", None)  # inductor on this CPU is minutes per shape: the smoke checks the paths, not speed
    return fsdp


def throughput_cases(cpu: bool) -> list[dict[str, Any]]:
    """Every (shape, variant) row, as bench/plan_accuracy.py's case dicts (the planner reads them too)."""
    shapes = [("tiny shape (CPU smoke)", TINY, 64, 2)] if cpu else [
        ("llama-3.2-1b shape", LLAMA_32_1B, 8192, 2), ("llama-3.1-8b shape, 16/32 layers", LLAMA_31_8B_HALF, 4096, 2)]
    cases = []
    for shape_name, shape, seq, batch in shapes:
        for variant_name, variant in VARIANTS.items():
            name = f"{shape_name}, {variant_name}"
            case = _case(name, dict(shape), 1, batch, seq, fsdp=_fsdp(variant, cpu))
            case["notes"] = ["compile off in the CPU smoke"] if cpu and "compile" in variant else []
            cases.append(case)
        for layout in DOCUMENTS:
            case = _case(f"{shape_name}, bf16, {layout}", dict(shape), 1, batch, seq, fsdp=_fsdp({}, cpu))
            case["documents"], case["notes"] = layout.split()[0], []
            cases.append(case)
    return cases


def document_batch(layout: str | None, batch: int, seq: int, vocab: int, device: Any) -> dict[str, Any]:
    """A micro-batch as the trainer's Collate makes it: full rows of random tokens (layout None),
    rows of whole documents packed with restarting position ids (`packed`), or one document a row
    right-padded to the longest (`padded`). Seeded: every case sees the same lengths."""
    import torch

    generator = torch.Generator().manual_seed(0)

    def length() -> int:
        return int(torch.randint(max(seq // 16, 1), seq // 4 + 1, (1,), generator=generator))

    if layout == "padded":
        lengths = [length() for _ in range(batch)]
        width = max(lengths)
        ids = torch.randint(0, vocab, (batch, width), generator=generator)
        mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
        return {"input_ids": ids.to(device), "labels": ids.masked_fill(mask == 0, -100).to(device),
                "attention_mask": mask.to(device)}
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    data = {"input_ids": ids.to(device), "labels": ids.clone().to(device), "attention_mask": torch.ones_like(ids).to(device)}
    if layout == "packed":
        rows = []
        for _ in range(batch):
            pieces, filled = [], 0
            while filled < seq:
                n = min(length(), seq - filled)
                pieces.append(torch.arange(n))
                filled += n
            rows.append(torch.cat(pieces))
        data["position_ids"] = torch.stack(rows).to(device)
    return data


# ------------------------------------------------------------------------------------ one case
def measure_case(case: dict[str, Any], steps: int, warmup: int) -> dict[str, Any]:
    """Train the case's steps in this process (world size 1) and measure them."""
    import torch
    from llamaft.api.spec import TrainingJobConfig
    from llamaft_trainer.model import model as model_step
    from llamaft_trainer.parallel.parallelize import parallelize
    from llamaft_trainer.process.runtime import build_mesh, init_runtime, sharding_plan
    from llamaft_trainer.report.metrics import model_flops_per_token, peak_flops
    from llamaft_trainer.train import build_optimizer, micro_step_sync, optimizer_step, token_loss_sum
    from transformers import LlamaConfig

    rt = init_runtime()
    cfg = TrainingJobConfig.model_validate(case["config"])
    batch, seq = cfg.training.per_device_batch_size, cfg.dataset.max_seq_length
    torch.manual_seed(1234)
    config = LlamaConfig(**shape_config(case), max_position_embeddings=seq)
    model = model_step.build_meta_model(config, cfg.model, model_step.master_dtype(cfg.fsdp.mixed_precision))
    n_params = sum(p.numel() for p in model.parameters())
    fsdp_plan = sharding_plan(cfg.fsdp, rt, force_fsdp=True)  # FSDP itself is measured
    model = parallelize(model, cfg.fsdp, fsdp_plan, build_mesh(fsdp_plan, rt), rt.device)
    model.to_empty(device=rt.device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model_step.rebuild_rotary_buffers(model, rt.device)
    optimizer = build_optimizer(model, cfg)
    data = document_batch(case.get("documents"), batch, seq, config.vocab_size, rt.device)
    real_tokens = int(data["attention_mask"].sum())
    cuda = rt.device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(rt.device)

    times: list[float] = []
    losses: list[float] = []
    for step in range(warmup + steps):
        if step == 1 and cuda:  # AdamW's state exists from the first step on: the peak of a steady step
            torch.cuda.reset_peak_memory_stats(rt.device)
        sync()
        start = time.perf_counter()
        with micro_step_sync(model, True, fsdp_plan):
            loss, tokens = token_loss_sum(model, data, rt.device)
            (loss / max(tokens, 1)).backward()
        optimizer_step(model, optimizer, None, cfg)
        sync()
        if step >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()) / max(tokens, 1))
    step_s = sum(times) / len(times)
    tps = real_tokens / step_s
    peak = peak_flops(rt.device)
    mfu = tps * model_flops_per_token(config, n_params, seq) / peak if peak else None
    result = {
        "params": n_params, "batch": batch, "seq": seq, "real_tokens_per_step": real_tokens, "step_s": step_s, "tokens_per_s_per_gpu": tps, "mfu": mfu,
        "peak_memory_bytes": int(torch.cuda.max_memory_allocated(rt.device)) if cuda else None,
        "losses": losses,
    }
    import torch.distributed as dist

    dist.destroy_process_group()
    return result


def _env(cpu: bool) -> dict[str, str]:
    from llamaft_trainer.process.local_etcd import free_port

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "operator"), str(REPO / "trainer"), env.get("PYTHONPATH", "")])
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the smoke is the CPU path even where a GPU is visible
    return env


def run_case(case: dict[str, Any], cpu: bool, timeout_s: float | None, out: Path) -> dict[str, Any]:
    """The case in a child process (this script's --worker), with its planner estimate beside it."""
    import torch

    device_bytes = None if cpu else torch.cuda.get_device_properties(0).total_memory
    notes: list[str] = list(case.get("notes", []))
    try:
        est = estimate(case, device="cpu" if cpu else "cuda")
    except Exception as exc:  # a spec the API refuses, or a planner bug: this row says so, the others still run
        return {"case": case["name"], "status": "Failed", "message": f"planner: {type(exc).__name__}: {exc}".replace("\n", " ")[:600]}
    training = case["config"]["training"]
    while device_bytes and est.peak_bytes > FIT_FRACTION * device_bytes and training["perDeviceBatchSize"] > 1:
        training["perDeviceBatchSize"] //= 2
        notes.append(f"batch halved to {training['perDeviceBatchSize']}: the planner predicted "
                     f"{est.peak_bytes / 2**30:.1f} GiB of {device_bytes / 2**30:.1f}")
        est = estimate(case, device="cuda")
    row: dict[str, Any] = {"case": case["name"], "estimate_bytes": est.peak_bytes, "estimate_peak_at": est.peak_event,
                           "notes": notes}
    case_file, result_file = out / "case.json", out / "result.json"
    case_file.write_text(json.dumps(case))
    result_file.unlink(missing_ok=True)
    steps, warmup = (3, 1) if cpu else (10, 3)
    command = [sys.executable, __file__, "--worker", str(case_file), str(result_file), str(steps), str(warmup)]
    started = time.monotonic()
    try:
        proc = subprocess.run(command, env=_env(cpu), capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {**row, "status": "TimedOut", "message": f"still running after {timeout_s} s"}
    row["wall_s"] = time.monotonic() - started
    if proc.returncode != 0 or not result_file.exists():
        tail = (proc.stdout + proc.stderr).strip().splitlines()
        oom = any("OutOfMemoryError" in line or "out of memory" in line for line in tail)
        return {**row, "status": "OutOfMemory" if oom else "Failed", "message": " | ".join(tail[-3:])[-600:]}
    result = json.loads(result_file.read_text())
    measured = result["peak_memory_bytes"]
    if measured:
        result["estimate_error"] = (est.peak_bytes - measured) / measured
    return {**row, "status": "Measured", **result}


# ---------------------------------------------------------------------------- the local run
def local_run(out: Path, cpu: bool, timeout_s: float | None) -> dict[str, Any]:
    """`llamaft run --local`: 20 steps with a checkpoint every 10 and the export, then to 30 from
    step 20's checkpoint; the export loaded back with transformers."""
    import yaml
    from llamaft_trainer.tiny import build_tiny_llama

    dataset = REPO / "examples" / "data" / "samsum-tiny.jsonl"
    model_dir = build_tiny_llama(out / "model", dataset, hidden_size=128 if cpu else 512, layers=2 if cpu else 8,
                                 heads=4 if cpu else 8, kv_heads=2, max_positions=1024, vocab_size=1024)
    first, every, then = (6, 3, 9) if cpu else (20, 10, 30)
    spec: dict[str, Any] = {
        "model": {"source": str(model_dir), "dtype": "float32" if cpu else "bfloat16"},
        "dataset": {"format": "samsum", "source": str(dataset), "maxSeqLength": 128 if cpu else 512, "packing": True,
                    "validationSplit": 0.1},
        "training": {"maxSteps": first, "perDeviceBatchSize": 2 if cpu else 8, "learningRate": 1e-3,
                     "evalInterval": 0, "logInterval": 1},
        "fsdp": {"mixedPrecision": "fp32" if cpu else "bf16", "activationCheckpointing": {"mode": "none"}},
        "checkpointing": {"directory": str(out / "checkpoints"), "everyNSteps": every, "exportHuggingFace": True},
        "cluster": {"workers": 1, "gpusPerWorker": 0 if cpu else 1, "image": "ghcr.io/llamaft/trainer:0.1.0"},
    }
    row: dict[str, Any] = {"case": "llamaft run --local", "status": "Measured"}
    for phase, steps in (("first", first), ("resumed", then)):
        spec["training"]["maxSteps"] = steps
        manifest = out / f"run-{phase}.yaml"
        manifest.write_text(yaml.safe_dump({"apiVersion": "llamaft.io/v1alpha1", "kind": "LlamaFineTune",
                                            "metadata": {"name": "gpu-suite"}, "spec": spec}))
        run_dir = out / f"run-{phase}"
        started = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, "-m", "llamaft.cli", "run", "--local", str(manifest), "--run-dir",
                                   str(run_dir)], env=_env(cpu), capture_output=True, text=True,
                                  timeout=timeout_s, cwd=REPO)
        except subprocess.TimeoutExpired:
            return {**row, "status": "TimedOut", "message": f"{phase} run still running after {timeout_s} s"}
        events = read_events(proc.stdout + proc.stderr) + _events_in(run_dir)
        done = [e for e in events if e.get("event") == "done"]
        resumed = [e for e in events if e.get("event") == "resume"]
        row[phase] = {"exit": proc.returncode, "wall_s": time.monotonic() - started, "log": proc.stdout[-20000:],
                      "done": done[-1] if done else None, "resume": resumed[-1] if resumed else None}
        if proc.returncode != 0 or not done:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            return {**row, "status": "Failed", "message": f"{phase} run: exit {proc.returncode}: " + " | ".join(tail)}
    problems = []
    if not row["resumed"]["resume"] or row["resumed"]["resume"].get("step") != first:
        problems.append(f"the second run did not resume from step {first}: {row['resumed']['resume']}")
    if row["resumed"]["done"].get("step") != then:
        problems.append(f"the second run ended at {row['resumed']['done'].get('step')}, not {then}")
    exported = [e for e in _events_in(out / "run-resumed") + read_events(row["resumed"].get("log", "")) if e["event"] == "export"]
    export = Path(exported[-1]["path"]) if exported else None
    if export is None or not (export / "config.json").exists() or not any(export.glob("*.safetensors")):
        problems.append(f"no export (config.json + safetensors) from the resumed run: {export}")
    else:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(export)
        row["export"] = {"path": str(export), "params": sum(p.numel() for p in loaded.parameters())}
    if problems:
        return {**row, "status": "Failed", "message": "; ".join(problems)}
    return row


def _events_in(run_dir: Path) -> list[dict[str, Any]]:
    return [e for log in sorted(run_dir.glob("**/*.log")) for e in read_events(log)]


# ------------------------------------------------------------------------------------ report
def environment(cpu: bool) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "cpu_smoke": cpu}
    if not cpu:
        env["device"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
        env["memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()
        except OSError:
            env["driver"] = None
    else:
        env["device"] = f"cpu ({os.cpu_count()} cores)"
    return env


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'case':<52} {'status':<11} {'batch x seq':>12} {'tok/s/GPU':>11} {'MFU':>6} {'peak GiB':>9} "
             f"{'plan GiB':>9} {'error':>7}"]
    gib = 2**30
    for r in rows:
        if r["case"] == "llamaft run --local":
            continue
        if r["status"] != "Measured":
            lines.append(f"{r['case']:<52} {r['status']:<11} {r.get('message', '')[:80]}")
            continue
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        peak = f"{r['peak_memory_bytes'] / gib:.1f}" if r.get("peak_memory_bytes") else "-"
        err = f"{r['estimate_error']:+.1%}" if r.get("estimate_error") is not None else "-"
        lines.append(f"{r['case']:<52} {r['status']:<11} {r['batch']:>4} x {r['seq']:<5} {r['tokens_per_s_per_gpu']:>11,.0f} "
                     f"{mfu:>6} {peak:>9} {r['estimate_bytes'] / gib:>9.1f} {err:>7}")
    for r in rows:
        if r["case"] == "llamaft run --local":
            if r.get("message"):
                detail = r["message"]
            else:
                first, resumed = r["first"]["done"], r["resumed"]["done"]
                perf = first.get("performance") or {}
                detail = (f"{first['step']} steps ({perf.get('tokensPerSecondPerDevice', 0):,.0f} tok/s/device, peak "
                          f"{(perf.get('peakMemoryBytes') or 0) / gib:.2f} GiB), resumed from step "
                          f"{r['resumed']['resume']['step']} to {resumed['step']}, export loaded back "
                          f"({r['export']['params']:,} parameters)")
            lines.append(f"llamaft run --local: {r['status']}: {detail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        case_file, result_file, steps, warmup = sys.argv[2:6]
        result = measure_case(json.loads(Path(case_file).read_text()), int(steps), int(warmup))
        Path(result_file).write_text(json.dumps(result))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU: checks every path runs")
    parser.add_argument("--out", help="where gpu_suite.json goes (default: a new temporary directory)")
    parser.add_argument("--case", action="append", help="only the throughput cases whose name contains this")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="on a GPU: no case starts after this many seconds (the CPU smoke has no budget)")
    parser.add_argument("--no-run", action="store_true", help="skip the llamaft run --local part")
    args = parser.parse_args(argv)
    import torch

    cpu = bool(args.cpu_smoke)
    if not cpu and not torch.cuda.is_available():
        print("gpu_suite: no CUDA device here; run it on a GPU machine (or --cpu-smoke)", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="llamaft-gpu-suite-"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {"environment": environment(cpu), "rows": rows}

    budget = float("inf") if cpu else args.budget_s

    def left() -> float:
        return budget - (time.monotonic() - started)

    cases = [c for c in throughput_cases(cpu) if not args.case or any(s in c["name"] for s in args.case)]
    for case in cases:
        if left() <= 0:
            rows.append({"case": case["name"], "status": "Skipped", "message": f"past the {budget:.0f} s budget"})
            continue
        row = run_case(case, cpu, timeout_s=None if cpu else max(left(), 30.0), out=out)
        rows.append(row)
        print(json.dumps({"event": "case", **{k: v for k, v in row.items() if k != "losses"}}), flush=True)
        (out / "gpu_suite.json").write_text(json.dumps(report, indent=2))
    if not args.no_run:
        if left() <= 0:
            rows.append({"case": "llamaft run --local", "status": "Skipped", "message": "past the budget"})
        else:
            rows.append(local_run(out / "local-run", cpu, timeout_s=None if cpu else max(left(), 120.0)))
    report["wall_s"] = time.monotonic() - started
    (out / "gpu_suite.json").write_text(json.dumps(report, indent=2))
    print(table(rows))
    print(f"report: {out / 'gpu_suite.json'} ({report['wall_s']:.0f} s)")
    return 0 if all(r["status"] in ("Measured", "Skipped") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
