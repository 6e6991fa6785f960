"""The `llamaft` command line: one entry point for the API, the trainer and the operator.

Subcommands import what they need lazily, so `llamaft validate` works without torch or kopf.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from llamaft.api.validation import SpecInvalid


def _cmd_crd(args: argparse.Namespace) -> int:
    from llamaft.api.crd import crd_yaml

    text = crd_yaml()
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    from llamaft.api.validation import validate_resource
    from llamaft.manifests import is_finetune, read_documents

    failed = 0
    for path in args.files:
        try:
            docs = [d for d in read_documents(path) if is_finetune(d.body)]
        except (OSError, SpecInvalid) as exc:
            print(f"{path}: {exc}")
            failed += 1
            continue
        if not docs:
            print(f"{path}: no LlamaFineTune document found (kind: LlamaFineTune)")
            failed += 1
        for doc in docs:
            try:
                spec = validate_resource(doc.body)
            except SpecInvalid as exc:
                failed += 1
                for error in exc.errors:
                    print(f"{doc.label}: {error}")
                continue
            name = doc.body["metadata"]["name"]
            print(
                f"{doc.label}: ok ({name}: {spec.cluster.workers} worker(s) x {spec.cluster.gpus_per_worker} GPU(s), "
                f"{spec.fsdp.sharding_strategy.value}, {spec.fsdp.mixed_precision.value})"
            )
    return 1 if failed else 0


def _cmd_run(args: argparse.Namespace) -> int:
    if not args.local:
        print(
            "llamaft run without --local would need a cluster: apply the file there instead "
            f"(kubectl apply -f {args.file}) and the operator runs it. Use --local to run it on this machine.",
            file=sys.stderr,
        )
        return 2
    try:
        from llamaft_trainer.local import run_local
    except ImportError as exc:
        print(f"llamaft run --local needs the trainer extra (pip install 'llamaft[trainer]'): {exc}", file=sys.stderr)
        return 2
    return run_local(args.file, nproc_per_worker=args.nproc_per_worker, run_dir=args.run_dir)


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from llamaft_trainer.tiny import build_tiny_llama

    out = build_tiny_llama(Path(args.output), Path(args.dataset))
    print(f"wrote a tiny random-init Llama and its tokenizer to {out}")
    return 0


def _cmd_render(args: argparse.Namespace) -> int:
    """Every object the operator would create for the file's LlamaFineTune, as YAML."""
    import yaml

    from llamaft.manifests import load_finetune
    from llamaft.operator.desired import desired_objects
    from llamaft.operator.naming import Owner

    body, spec = load_finetune(args.file)
    namespace = args.namespace or body["metadata"].get("namespace") or "default"
    owner = Owner(body["metadata"]["name"], namespace, body["metadata"].get("uid", ""))
    objects = desired_objects(owner, spec, args.attempt)
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False, width=120))
    return 0


def _cmd_operator(args: argparse.Namespace) -> int:
    """Run the operator in this process (what the chart's Deployment runs)."""
    import kopf

    import llamaft.operator.handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.JSON if args.json_logs else kopf.LogFormat.FULL)
    kopf.run(
        standalone=args.standalone,
        clusterwide=not args.namespace,
        namespaces=args.namespace or (),
        liveness_endpoint=args.liveness,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llamaft", description="Llama fine-tuning with PyTorch FSDP on Kubernetes.")
    sub = parser.add_subparsers(dest="command", required=True)

    crd = sub.add_parser("crd", help="print the LlamaFineTune CustomResourceDefinition (generated from the API)")
    crd.add_argument("-o", "--output", help="write to this file instead of stdout")
    crd.set_defaults(func=_cmd_crd)

    validate = sub.add_parser("validate", help="check LlamaFineTune YAML files exactly as the cluster would")
    validate.add_argument("files", nargs="+", help="YAML files (several documents per file allowed)")
    validate.set_defaults(func=_cmd_validate)

    run = sub.add_parser("run", help="run a LlamaFineTune (--local: torchrun on this machine)")
    run.add_argument("file", help="YAML file with one LlamaFineTune")
    run.add_argument("--local", action="store_true", help="run here with torchrun (CPU or GPUs)")
    run.add_argument("--nproc-per-worker", type=int, help="processes per worker (default: its GPUs, or 1 on CPU)")
    run.add_argument("--run-dir", help="where logs and the trainer config go (default: runs/<name>)")
    run.set_defaults(func=_cmd_run)

    render = sub.add_parser("render", help="print every object the operator would create (review, GitOps)")
    render.add_argument("file", help="YAML file with one LlamaFineTune")
    render.add_argument("--namespace", help="namespace to render into (default: the file's, else default)")
    render.add_argument("--attempt", type=int, default=1, help="run attempt to render (names and rendezvous id)")
    render.set_defaults(func=_cmd_render)

    op = sub.add_parser("operator", help="run the kopf operator (in-cluster or with KUBECONFIG)")
    op.add_argument("--namespace", action="append", help="watch only this namespace (repeatable; default: all)")
    op.add_argument("--standalone", action="store_true", help="no peering with other operator replicas")
    op.add_argument("--liveness", default="http://0.0.0.0:8081/healthz", help="kopf liveness endpoint")
    op.add_argument("--json-logs", action="store_true", help="structured JSON log lines")
    op.add_argument("--verbose", action="store_true")
    op.set_defaults(func=_cmd_operator)

    tiny = sub.add_parser("make-tiny-model", help="build a tiny random-init Llama + tokenizer (no downloads)")
    tiny.add_argument("output", help="directory to write (save_pretrained layout)")
    tiny.add_argument("--dataset", default="examples/data/samsum-tiny.jsonl", help="JSONL text to train the tokenizer on")
    tiny.set_defaults(func=_cmd_make_tiny_model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except SpecInvalid as exc:
        for error in exc.errors:
            print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
