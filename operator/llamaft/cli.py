"""The `llamaft` command line: one entry point for the API, the trainer and the operator.

Subcommands import what they need lazily, so `llamaft validate` works without torch or kopf.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from llamaft.api.spec import BUILTIN_CHAT_TEMPLATES, LlamaFineTuneSpec
from llamaft.api.validation import FieldError, SpecInvalid

if TYPE_CHECKING:
    from llamaft.api.documents import Document
    from llamaft.render.admission import CheckCache


def _cmd_crd(args: argparse.Namespace) -> int:
    from llamaft.api.crd import crd_yaml

    text = crd_yaml()
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


MAX_ERRORS_PER_DOCUMENT = 50
MAX_MESSAGE_CHARS = 1000


def _bounded(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 1] + "…"


def _print_errors(label: str, errors: Sequence[object], out: TextIO | None = None) -> None:
    out = out or sys.stdout
    for error in errors[:MAX_ERRORS_PER_DOCUMENT]:
        print(_bounded(f"{label}: {error}"), file=out)
    if len(errors) > MAX_ERRORS_PER_DOCUMENT:
        print(f"{label}: ... and {len(errors) - MAX_ERRORS_PER_DOCUMENT} more errors", file=out)


def _admission(doc: Document) -> tuple[LlamaFineTuneSpec | None, list[FieldError]]:
    """The API server's verdict on one document: the spec, or every error naming its field."""
    from llamaft.api import resource
    from llamaft.api.validation import short, validate_resource

    if doc.errors:
        return None, doc.errors
    body = doc.body
    if isinstance(body, dict) and body.get("kind") != resource.KIND and isinstance(body.get("kind"), str):
        return None, [FieldError("kind", f"this document (line {doc.line}) is a {short(body.get('kind'))} "
                                         f"{short(body.get('apiVersion'))}, not a {resource.KIND}: give a file whose document is "
                                         f"a {resource.KIND}")]
    try:
        return validate_resource(body), []
    except SpecInvalid as exc:
        return None, [FieldError(f"document at line {doc.line}", e.message) if e.path == "<document>" else e
                      for e in exc.errors]


def _other_kind(doc: Document) -> bool:
    """A well-formed document of a kind other than LlamaFineTune (a PersistentVolumeClaim, a
    Secret): kubectl applies it; validate leaves it alone. A LlamaFineTune with a wrong apiVersion
    is not one: that is an error of a LlamaFineTune."""
    from llamaft.api import resource

    body = doc.body
    return (not doc.errors and isinstance(body, dict) and isinstance(body.get("kind"), str)
            and body["kind"] != resource.KIND)


def _cmd_validate(args: argparse.Namespace) -> int:
    from llamaft.api.documents import read_documents

    failed = 0
    checks = None
    if not args.schema_only:
        from llamaft.render.admission import CheckCache

        checks = CheckCache()  # documents of one template share the children's check, for this command
    notes: set[str] = set()  # notes printed once per command, however many documents are checked
    for path in args.files:
        try:
            docs = read_documents(path)
        except SpecInvalid as exc:
            _print_errors(path, [e.message for e in exc.errors])
            failed += 1
            continue
        others = [doc for doc in docs if _other_kind(doc)]
        if len(others) == len(docs):
            print(f"{path}: no LlamaFineTune document found (kind: LlamaFineTune)")
            failed += 1
        for doc in docs:
            if doc in others:
                # kubectl applies such a file whole (a results claim sits naturally beside its
                # fine-tune); validate checks only its own kind and says what it left alone.
                body = doc.body
                print(_bounded(f"{doc.label}: not checked: a {body['kind']} {body.get('apiVersion') or ''}".rstrip()
                               + f" (line {doc.line}); llamaft validate checks LlamaFineTune documents only"))
                continue
            try:
                failed += not _validate_document(doc, checks, notes)
            except Exception as exc:  # never a traceback: one line naming the document
                print(_bounded(f"{doc.label}: could not be checked ({type(exc).__name__}: {exc}); please report this"))
                failed += 1
    return 1 if failed else 0


def _validate_document(doc: Document, checks: CheckCache | None, notes: set[str]) -> bool:
    """Check one document; `checks`: the operator's checks with this cache (None: --schema-only,
    the LlamaFineTune's own schema and rules only, what the API server checks). True when it would
    be accepted: by the API server, and (without --schema-only) by the operator too."""
    spec, errors = _admission(doc)
    if spec is None:
        _print_errors(doc.label, errors)
        return False
    name = doc.body["metadata"]["name"]
    summary = (f"{name}: {spec.cluster.workers} worker(s) x {spec.cluster.gpus_per_worker} GPU(s), "
               f"{spec.fsdp.sharding_strategy.value}, {spec.fsdp.mixed_precision.value}")
    if checks is None:
        print(f"{doc.label}: ok ({summary})")
        print("  schema only: the API server would accept it; the operator's checks were not run")
        return True
    from llamaft.render.schemas import schemas_available

    if not schemas_available() and "schemas" not in notes:
        print("note: kubernetes-validate is not installed (pip install 'llamaft[operator]'): the objects the "
              "operator would create are checked without the Kubernetes and CRD schemas")
        notes.add("schemas")
    namespace = doc.body["metadata"].get("namespace") or "default"
    problems = _operator_problems(spec, name, namespace, cache=checks)
    if problems:
        _print_errors(doc.label, problems)
        return False
    try:
        line, refused = _capacity(spec)
    except Exception as exc:  # the estimate cannot be made: the operator then does not refuse on it
        line, refused = _bounded(f"not checked ({type(exc).__name__}: {exc})"), False
    print(f"{doc.label}: {'refused by the operator' if refused else 'ok'} ({summary})")
    print(f"  capacity: {line}")
    return not refused


def _operator_problems(spec: LlamaFineTuneSpec, name: str, namespace: str, **render: Any) -> list[object]:
    """What the operator refuses an admitted spec for before it creates anything, but capacity:
    a GPU the trainer refuses (float8), and every problem of the objects it would create
    (render.admission.child_errors: schemas, admission rules, names, and where the results go).
    `render`: child_errors' uid, attempt, backend and cache."""
    from llamaft.planner.plan import float8_problem
    from llamaft.render.admission import child_errors

    problem = float8_problem(spec)  # a GPU the trainer refuses: not advisory like the memory estimate
    return [problem] if problem is not None else list(child_errors(spec, name, namespace, **render))


def _capacity(spec: LlamaFineTuneSpec) -> tuple[str, bool]:
    """The capacity verdict the operator will reach (its CapacityFits condition), as one line, and
    whether the operator refuses the run for it (spec.preflight Enforce and a run that will not fit:
    phase Failed, reason WillNotFit; Warn only warns)."""
    from llamaft.api.spec import PreflightMode
    from llamaft.planner import admission, read_model_config

    if spec.preflight is PreflightMode.OFF:
        return "not checked (spec.preflight: Off)", False
    found = read_model_config(spec.model.source)
    verdict = admission(spec, found[0] if found else None)
    action = ""
    if verdict.fits is False:
        action = " [the operator will refuse it]" if verdict.refuse else " [spec.preflight Warn: the operator only warns]"
    return f"{verdict.reason}{action}: {verdict.message} (details: llamaft plan)", verdict.refuse


def _cmd_plan(args: argparse.Namespace) -> int:
    """The capacity plan of a LlamaFineTune (GPU memory by component, verdict, fixes, host RAM,
    checkpoints, time). Exit status 0 when it fits or cannot be told, 3 when it will not fit."""
    import json

    from llamaft.manifests import load_finetune
    from llamaft.planner import UnknownShape, read_model_config, resolve_shape, verdict
    from llamaft.planner.plan import DEFAULT_MFU, apply_changes, build_plan
    from llamaft.planner.plan_text import render_plan
    from llamaft.planner.shapes import meta_parameter_count

    body, spec = load_finetune(args.file)
    overrides = {}
    if args.gpu_model:
        overrides["cluster.gpuModel"] = args.gpu_model
    if args.gpu_memory:
        overrides["cluster.gpuMemory"] = args.gpu_memory
    if overrides:
        spec = apply_changes(spec, overrides)
    config: dict[str, object] | None = None
    origin = "built-in table"
    if args.model_config:
        path = Path(args.model_config)
        path = path / "config.json" if path.is_dir() else path
        config = json.loads(path.read_text(encoding="utf-8"))
        origin = str(path)
    else:
        found = read_model_config(spec.model.source)
        if found is not None:
            config, origin = found
    try:
        shape = resolve_shape(spec.model.source, config)
    except UnknownShape as exc:
        print(f"{args.file}: {exc}", file=sys.stderr)
        return 2
    source = f"shape from {origin}; analytic count"
    exact_notes: list[str] = []
    if args.exact:
        from llamaft.planner.shapes import KNOWN_CONFIGS

        cfg = config if config is not None else KNOWN_CONFIGS.get(spec.model.source.strip().rstrip("/").lower())
        with _without_torchao():  # a meta-device count does no float8 work
            counted = meta_parameter_count(dict(cfg)) if cfg is not None else None
        if counted is None:
            exact_notes.append("--exact: torch/transformers are not installed (or no config dict): analytic count used")
        elif counted == shape.parameters:
            source = f"shape from {origin}; {counted:,} on the meta device = analytic"
        else:
            exact_notes.append(f"the meta-device model has {counted:,} parameters, the analytic Llama count "
                               f"{shape.parameters:,}: the model has parts the planner does not model")
    plan = build_plan(spec, shape, mfu=args.mfu if args.mfu is not None else DEFAULT_MFU,
                      dataset_records=args.dataset_records, dataset_tokens=args.dataset_tokens,
                      parameter_source=source)
    plan.notes.extend(exact_notes)
    result = verdict(plan)
    if args.json:
        print(json.dumps({"name": body["metadata"]["name"], **result.to_dict()}, indent=2, default=str))
    else:
        print(render_plan(body["metadata"]["name"], plan, result))
    return 3 if result.fits is False else 0


def _cmd_run(args: argparse.Namespace) -> int:
    if not args.local:
        print(
            "llamaft run without --local would need a cluster: apply the file there instead "
            f"(kubectl apply -f {args.file}) and the operator runs it. Use --local to run it on this machine.",
            file=sys.stderr,
        )
        return 2
    try:
        from llamaft.local import run_local
    except ImportError as exc:
        print(f"llamaft run --local needs the trainer extra (pip install 'llamaft[trainer]'): {exc}", file=sys.stderr)
        return 2
    return run_local(args.file, nproc_per_worker=args.nproc_per_worker, run_dir=args.run_dir, cpu=args.cpu)


def _cmd_sweep(args: argparse.Namespace) -> int:
    """Run the file at each size (here with --local, else on the cluster), then print and write the
    table and the chart. Exit 0 when every size that could run was measured, 1 when one failed or
    timed out, 2 for bad input."""
    from llamaft.sweep import SweepError, plan_sweep, write_outputs
    from llamaft.sweep.point import with_scaling
    from llamaft.sweep.report import table
    from llamaft.sweep.runs import parse_sizes

    if args.local and args.at_once:
        print("llamaft sweep: error: --at-once is for a cluster: here the sizes run one after another (they would share "
              "this machine's cores or GPUs)", file=sys.stderr)
        return 2
    try:
        sizes = parse_sizes(args.workers)
        # --local creates no Kubernetes objects and writes to this machine (as run --local): the
        # operator's checks of the objects, and where the results go, are a cluster's.
        plan = plan_sweep(args.file, sizes, args.max_steps, name=args.name, check_children=not args.local)
        for note in plan.notes:
            print(f"llamaft sweep: note: {note}", flush=True)
        if args.local:
            from llamaft.sweep import on_this_machine

            output = Path(args.output or Path("runs") / f"sweep-{plan.sweep}")
            points = on_this_machine.run(plan, output)
            where = "local"
        else:
            from llamaft.sweep import cluster

            api, context_namespace = cluster.connect(args.kubeconfig, args.context)
            namespace = args.namespace or plan.namespace or context_namespace
            output = Path(args.output or f"sweep-{plan.sweep}")
            points = cluster.run(plan, api, namespace, at_once=args.at_once, poll_s=args.poll_seconds,
                                 timeout_s=args.timeout)
            where = f"cluster, namespace {namespace}"
    except SweepError as exc:
        for line in exc.lines:
            print(_bounded(f"llamaft sweep: error: {line}"), file=sys.stderr)
        return 2
    except SpecInvalid as exc:
        _print_errors(f"llamaft sweep: error: {args.file}", exc.errors, sys.stderr)
        return 2
    points = with_scaling(points)
    written = write_outputs(points, output, sweep=plan.sweep, source=str(args.file), model=plan.model,
                            max_steps=plan.max_steps, where=where)
    print(table(points))
    print("llamaft sweep: wrote " + ", ".join(str(path) for path in written.values()), flush=True)
    if "png" not in written:
        print("llamaft sweep: no chart: " + ("install matplotlib (pip install 'llamaft[sweep]')"
                                              if any(p.measured for p in points) else "no size was measured"))
    # A size this machine cannot hold (Skipped) is explained in the table, not a failure.
    return 0 if any(p.measured for p in points) and all(p.measured or p.phase == "Skipped" for p in points) else 1


def _without_torchao() -> contextlib.AbstractContextManager[None]:
    """transformers imports torchao whenever it is installed, and torchao's import prints notices
    that concern float8 only (the trainer's process/quiet.py says which): kept out of commands that load
    transformers for other work."""
    try:
        from llamaft_trainer.public import torchao_kept_out
    except ImportError:
        return contextlib.nullcontext()
    return torchao_kept_out()


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    with _without_torchao():
        from llamaft_trainer.public import make_tiny_model

        out = make_tiny_model(Path(args.output), Path(args.dataset), chat_template=args.chat_template)
    chat = f" (chat template {args.chat_template})" if args.chat_template else ""
    print(f"wrote a tiny random-init Llama and its tokenizer{chat} to {out}")
    return 0


def _cmd_data_preview(args: argparse.Namespace) -> int:
    """The first examples of the file's dataset exactly as the trainer will see them (tokens, what
    carries loss, truncation, packing), through the trainer's own code (llamaft_trainer.public.data_preview).
    Bad input (the file, a missing path, a record without its fields) exits 1 naming the field."""
    from llamaft.local import missing_inputs
    from llamaft.manifests import load_finetune

    _, spec = load_finetune(args.file)  # SpecInvalid: main reports it, exit 1
    problems = missing_inputs(spec)  # what run --local checks before torchrun starts
    if problems:
        _print_errors("error", problems, sys.stderr)
        return 1
    with _without_torchao():
        from llamaft_trainer.public import ConfigError, data_preview

        try:
            shown = data_preview(spec.training_config(), count=args.examples, split=args.split,
                                 store=Path(args.store) if args.store else None, as_json=args.json,
                                 colour=args.color, stream=sys.stdout, environ=os.environ)
        except ConfigError as exc:
            _print_errors("error", str(exc).splitlines(), sys.stderr)
            return 1
    sys.stdout.write(shown)
    return 0


def _cmd_render(args: argparse.Namespace) -> int:
    """Every object the operator would create for the file's LlamaFineTune, as YAML. When the
    operator would refuse it (the API server's schema and rules, the children's admission checks,
    where the results go, capacity), the reasons on stderr and exit status 1, and nothing printed;
    with --force the objects all the same (exit 0), the reasons on stderr as warnings. A spec the
    schema refuses has no objects to print: --force cannot help there."""
    import uuid

    import yaml

    from llamaft.api.documents import read_documents
    from llamaft.api.resource import MAX_ATTEMPTS
    from llamaft.api.spec import Backend
    from llamaft.render import trainjob
    from llamaft.render.admission import PLACEHOLDER_UID
    from llamaft.render.naming import Owner
    from llamaft.render.objects import desired_objects

    if not 1 <= args.attempt <= MAX_ATTEMPTS:
        print(f"error: --attempt must be 1..{MAX_ATTEMPTS}", file=sys.stderr)
        return 2
    if args.uid is not None:
        try:
            uid = str(uuid.UUID(args.uid))
        except ValueError:
            print(f"error: --uid {_bounded(args.uid)!r} is not a uid: give the LlamaFineTune's metadata.uid, a UUID such as "
                  "3f2a9c4e-1b7d-4e6a-9c1f-0a2b3c4d5e6f (kubectl get llamafinetune NAME -o jsonpath='{.metadata.uid}')",
                  file=sys.stderr)
            return 2
    docs = read_documents(args.file)
    if len(docs) != 1:
        print(f"error: {args.file}: expected exactly one LlamaFineTune document, found {len(docs)}", file=sys.stderr)
        return 1
    spec, errors = _admission(docs[0])
    if spec is None:
        _print_errors("error", errors, sys.stderr)
        if args.force:
            print("error: the API server would refuse this LlamaFineTune, so there are no objects to render, even with "
                  "--force", file=sys.stderr)
        return 1
    body = docs[0].body
    name = body["metadata"]["name"]
    namespace = args.namespace or body["metadata"].get("namespace") or "default"
    if args.uid is None:
        uid = str(body["metadata"].get("uid") or "")
    # --backend, else the spec's; `auto` prints what it picks when the cluster serves both.
    backend = Backend(args.backend) if args.backend else trainjob.preferred_backend(spec)
    problems = _operator_problems(spec, name, namespace, uid=uid or PLACEHOLDER_UID, attempt=args.attempt,
                                  backend=backend)
    try:
        capacity, refused = _capacity(spec)
    except Exception:  # the estimate cannot be made: the operator then does not refuse on it
        capacity, refused = "", False
    if refused:
        problems.append(f"capacity: {capacity}")
    if problems:
        label = "warning" if args.force else "error"
        _print_errors(label, problems, sys.stderr)
        print(f"{label}: the operator would refuse this LlamaFineTune"
              + (" (printed anyway: --force)" if args.force else "; --force prints its objects all the same"),
              file=sys.stderr)
        if not args.force:
            return 1
    owner = Owner(name, namespace, uid)
    try:
        objects = desired_objects(owner, spec, args.attempt, backend=backend)
    except Exception as exc:  # --force of a spec the renderer cannot handle (child_errors said so)
        print(_bounded(f"error: cannot be rendered ({type(exc).__name__}: {exc})"), file=sys.stderr)
        return 1
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False, width=120))
    return 0


def _cmd_operator(args: argparse.Namespace) -> int:
    """Run the operator in this process (what the chart's Deployment runs).

    --standalone: the only replica, no peering. --peering NAME: one of several replicas; kopf keeps
    only the highest-priority live one active (llamaft/operator/peering.py explains the priorities).
    Without any Kubernetes credentials it exits 1 with one line before kopf starts (credentials.py)."""
    from llamaft.credentials import missing_credentials

    problem = missing_credentials(os.environ)
    if problem is not None:
        print(f"llamaft operator: error: {problem}", file=sys.stderr)
        return 1
    import kopf

    import llamaft.operator.handlers  # noqa: F401  (registers the handlers)
    from llamaft.operator import peering

    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.JSON if args.json_logs else kopf.LogFormat.FULL)
    # The startup handler (startup.configure) gets this same settings object and leaves .peering alone.
    settings = kopf.OperatorSettings()
    settings.peering.lifetime = args.peering_lifetime
    settings.peering.stealth = True  # keep-alives go to the debug log only when they fail
    kopf.run(
        settings=settings,
        standalone=True if args.standalone else None,
        peering_name=args.peering,
        priority=(args.priority if args.priority is not None else peering.age_priority()) if args.peering else None,
        clusterwide=not args.namespace,
        namespaces=args.namespace or (),
        liveness_endpoint=args.liveness,
    )
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llamaft", description="Llama fine-tuning with PyTorch FSDP on Kubernetes.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    crd = sub.add_parser("crd", help="print the LlamaFineTune CustomResourceDefinition (generated from the API)")
    crd.add_argument("-o", "--output", help="write to this file instead of stdout")
    crd.set_defaults(func=_cmd_crd)

    validate = sub.add_parser(
        "validate", help="check LlamaFineTune YAML files exactly as the cluster would",
        description="Check each LlamaFineTune as the API server (the CRD's schema and CEL rules) and the operator "
                    "would: the objects it would create against the Kubernetes, Kubeflow and Prometheus Operator "
                    "schemas and rules, where the results go (a volume that outlives the pod or an fsspec URI, unless "
                    "checkpointing.discardWithPod), and the capacity verdict. Exit status 0 when every document would "
                    "be accepted and run, 1 when one would be refused (by the API server or by the operator).")
    validate.add_argument("files", nargs="+", help="YAML files (several documents per file allowed; - reads stdin)")
    validate.add_argument("--schema-only", action="store_true",
                          help="only the API server's verdict (the CRD's schema and CEL rules): the operator's checks "
                               "(the objects it would create, where the results go, float8 GPUs, capacity) are not "
                               "run, so exit status 0 means kubectl apply succeeds, not that the run starts")
    validate.set_defaults(func=_cmd_validate)

    plan = sub.add_parser("plan", help="capacity plan: per-GPU memory by component, verdict and fixes, host RAM, "
                                       "checkpoint size, time (no GPU, no weights needed)")
    plan.add_argument("file", help="YAML file with one LlamaFineTune")
    plan.add_argument("--model-config", help="the model's config.json (file or directory) when the source is "
                                             "not a local directory nor a well-known hub id")
    plan.add_argument("--gpu-model", help="plan for this GPU (as cluster.gpuModel: A100-80GB, H100, H200, L40S, ...)")
    plan.add_argument("--gpu-memory", help="plan for this much memory per GPU (as cluster.gpuMemory, e.g. 80Gi)")
    plan.add_argument("--mfu", type=float, help="model FLOPs utilisation to assume for the time estimate (default 0.4)")
    plan.add_argument("--dataset-records", type=int, help="records in the dataset (to turn epochs into steps)")
    plan.add_argument("--dataset-tokens", type=int, help="tokens in the dataset (epochs into steps with packing)")
    plan.add_argument("--exact", action="store_true", help="also count parameters on the meta device (needs torch)")
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.set_defaults(func=_cmd_plan)

    run = sub.add_parser("run", help="run a LlamaFineTune (--local: torchrun on this machine)")
    run.add_argument("file", help="YAML file with one LlamaFineTune")
    run.add_argument("--local", action="store_true", help="run here with torchrun (CPU or GPUs)")
    run.add_argument("--nproc-per-worker", type=int, help="processes per worker (default: its GPUs, or 1 on CPU)")
    run.add_argument("--run-dir", help="where logs and the trainer config go (default: runs/<name>)")
    run.add_argument("--cpu", action="store_true",
                     help="run on the CPU (one process per worker) even when the file asks for GPUs "
                          "(cluster.gpusPerWorker); without it such a file is refused on a machine without them")
    run.set_defaults(func=_cmd_run)

    sweep = sub.add_parser(
        "sweep", help="run the same fine-tune at several sizes and chart throughput and scaling efficiency",
        description="Run FILE's fine-tune once per size (--workers), each for --max-steps steps, collect every run's "
                    "final report (tokens/s, step time, memory per device, MFU) and write the table (stdout, "
                    "sweep.csv, sweep.json) and scaling.png. On the cluster: one LlamaFineTune per size, named "
                    "<name>-w<N> and labelled llamaft.io/sweep=<name>; --local: here, the sizes this machine holds.")
    sweep.add_argument("file", help="YAML file with one LlamaFineTune")
    sweep.add_argument("--workers", required=True, help="sizes, comma-separated: workers per run, e.g. 1,2,4,8,16")
    sweep.add_argument("--max-steps", type=_positive_int, required=True,
                       help="optimizer steps per size (the first step of each is not timed)")
    sweep.add_argument("--local", action="store_true", help="run the sizes here (llamaft run --local), one after another")
    sweep.add_argument("--at-once", action="store_true",
                       help="on a cluster: create every size at once instead of one after another")
    sweep.add_argument("--name", help="the sweep's name: the runs are <name>-w<N> (default: the file's metadata.name)")
    sweep.add_argument("--namespace", help="namespace of the runs (default: the file's, else the context's)")
    sweep.add_argument("--kubeconfig", help="kubeconfig file (default: KUBECONFIG, ~/.kube/config, in-cluster)")
    sweep.add_argument("--context", help="kubeconfig context (default: the current one)")
    sweep.add_argument("--output", help="where sweep.csv, sweep.json and scaling.png go "
                                        "(default: sweep-<name>, or runs/sweep-<name> with --local)")
    sweep.add_argument("--timeout", type=float, default=24 * 3600.0, metavar="SECONDS",
                       help="how long to wait for each size (all sizes with --at-once) before reporting it TimedOut")
    sweep.add_argument("--poll-seconds", type=float, default=10.0, help="how often to read the runs' status")
    sweep.set_defaults(func=_cmd_sweep)

    render = sub.add_parser("render", help="print every object the operator would create (review, GitOps)")
    render.add_argument("file", help="YAML file with one LlamaFineTune")
    render.add_argument("--namespace", help="namespace to render into (default: the file's, else default)")
    render.add_argument("--attempt", type=int, default=1, help="run attempt to render (names and rendezvous id)")
    render.add_argument("--uid", help="the LlamaFineTune's metadata.uid: render exactly what the operator creates for "
                                      "that object (job <name>-<uid token>-<attempt>, LLAMAFT_RUN_UID, the rendezvous "
                                      "id); default the file's metadata.uid, else none (job <name>-<attempt>, an empty "
                                      "LLAMAFT_RUN_UID, rendezvous id <namespace>-<name>-local-<attempt>)")
    render.add_argument("--force", action="store_true",
                        help="print the objects even when the operator would refuse the LlamaFineTune (the reasons "
                             "still go to stderr as warnings); without it such a file prints nothing and exits 1")
    render.add_argument("--backend", choices=["PyTorchJob", "TrainJob"],
                        help="the Kubeflow job to print: PyTorchJob (training operator v1) or TrainJob (Kubeflow "
                             "Trainer v2); default: the spec's backend (auto: what it picks on a cluster that serves "
                             "both, TrainJob unless the spec needs a PyTorchJob)")
    render.set_defaults(func=_cmd_render)

    op = sub.add_parser("operator", help="run the kopf operator (in-cluster or with KUBECONFIG)")
    scope = op.add_mutually_exclusive_group()
    scope.add_argument("--namespace", action="append", help="watch only this namespace (repeatable; default: all)")
    scope.add_argument("--all-namespaces", action="store_true", help="watch every namespace (the default)")
    mode = op.add_mutually_exclusive_group()
    mode.add_argument("--standalone", action="store_true", help="no peering with other operator replicas")
    mode.add_argument("--peering", metavar="NAME",
                    help="run as one of several replicas: peer through the KopfPeering NAME in every watched "
                         "namespace (with --namespace) or the ClusterKopfPeering NAME; only the highest-priority "
                         "live replica handles resources")
    op.add_argument("--priority", type=int,
                    help="this replica's peering priority (default: by start time, the oldest replica highest)")
    op.add_argument("--peering-lifetime", type=_positive_int, default=60, metavar="SECONDS",
                    help="how long this replica's peering entry lives without a keep-alive, i.e. how long the "
                         "others wait after it dies without a clean exit (default: kopf's 60)")
    op.add_argument("--liveness", default="http://0.0.0.0:8081/healthz", help="kopf liveness endpoint")
    op.add_argument("--json-logs", action="store_true", help="structured JSON log lines")
    op.add_argument("--verbose", action="store_true")
    op.set_defaults(func=_cmd_operator)

    data = sub.add_parser("data", help="look at a LlamaFineTune's data as the trainer will see it")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    data_preview = data_sub.add_parser(
        "preview", help="the first examples as the trainer tokenizes them, loss-carrying tokens marked",
        description="Tokenize FILE's dataset exactly as the trainer does (its tokenizer, its token store, the same "
                    "key) and show the first examples of a split: the decoded text with the tokens that carry loss "
                    "marked, token and loss counts, what truncation to dataset.maxSeqLength removed, and with "
                    "packing the blocks. No GPU, no torchrun. Exit status 0, or 1 for bad input.")
    data_preview.add_argument("file", help="YAML file with one LlamaFineTune")
    data_preview.add_argument("--examples", type=_positive_int, default=3, metavar="N", help="examples to show (default 3)")
    data_preview.add_argument("--split", choices=["train", "validation"], default="train",
                              help="the part of the store to show (default train)")
    data_preview.add_argument("--json", action="store_true",
                              help="one JSON document: token ids, loss flags, spans, counts, truncation, packing")
    data_preview.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                              help="mark loss in colour (auto: on a terminal, unless NO_COLOR is set) or with [[...]]")
    data_preview.add_argument("--store", metavar="DIR",
                              help="build (or reuse) the token store here and keep it (default: a temporary directory, "
                                   "removed at the end); <checkpointing.directory>/data is the trainer's own")
    data_preview.set_defaults(func=_cmd_data_preview)

    tiny = sub.add_parser("make-tiny-model", help="build a tiny random-init Llama + tokenizer (no downloads)")
    tiny.add_argument("output", help="directory to write (save_pretrained layout)")
    tiny.add_argument("--dataset", default="examples/data/samsum-tiny.jsonl", help="JSONL text to train the tokenizer on")
    tiny.add_argument(
        "--chat-template", choices=BUILTIN_CHAT_TEMPLATES, default=None,
        help="give the tokenizer this built-in chat template and its special tokens (for dataset.format: chat)",
    )
    tiny.set_defaults(func=_cmd_make_tiny_model)
    return parser


def _version() -> str:
    """The installed distribution's version (its metadata), else the source tree's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llamaft")
    except PackageNotFoundError:
        from llamaft import __version__

        return __version__


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from llamaft_trainer.public import silence_known_warnings
    except ImportError:
        pass
    else:
        silence_known_warnings()
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit (a second traceback)
        return code
    except SpecInvalid as exc:
        _print_errors("error", exc.errors, sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _closed_pipe()


def _closed_pipe() -> int:
    """The reader of stdout went away (`llamaft plan FILE | head -1`): end quietly with status 1.
    Python's documented recipe (https://docs.python.org/3/library/signal.html#note-on-sigpipe):
    point stdout at devnull, so that the interpreter's final flush of the unwritable buffer raises
    nothing, and exit 1."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
