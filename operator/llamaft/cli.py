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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llamaft", description="Llama fine-tuning with PyTorch FSDP on Kubernetes.")
    sub = parser.add_subparsers(dest="command", required=True)

    crd = sub.add_parser("crd", help="print the LlamaFineTune CustomResourceDefinition (generated from the API)")
    crd.add_argument("-o", "--output", help="write to this file instead of stdout")
    crd.set_defaults(func=_cmd_crd)

    validate = sub.add_parser("validate", help="check LlamaFineTune YAML files exactly as the cluster would")
    validate.add_argument("files", nargs="+", help="YAML files (several documents per file allowed)")
    validate.set_defaults(func=_cmd_validate)

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
