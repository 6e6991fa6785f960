"""The import direction of ARCHITECTURE.md: every import points down the layers.

    api  <-  planner, render  <-  operator  <-  cli, local, launch, sweep, manifests
    api, render  <-  trainer (llamaft_trainer; the cluster never runs the operator's code there)

and inside the trainer, down its wings:

    process  <-  parallel  <-  report  <-  sources  <-  model  <-  data  <-  checkpoint  <-  methods
      <-  the program at the package's top (main, train, inputs, evaluation, tiny, public)

Every module of both packages is parsed (ast: imports inside functions and TYPE_CHECKING blocks
count too, relative imports are resolved); a module may import only its own layer and the layers
its row below names, a trainer module only its own wing and the wings below it. The pure layers
(api, planner, render) and the trainer never import kopf or the kubernetes client. The `llamaft`
package reaches the trainer through one seam, llamaft_trainer.public, and no other module of it.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

ROOTS = (REPO / "operator", REPO / "trainer")
TOP = "entry points"
ALLOWED: dict[str, set[str]] = {
    "package": set(),  # llamaft/__init__.py: the version, nothing else
    "api": {"package", "api"},
    "planner": {"package", "api", "planner"},
    "render": {"package", "api", "render"},
    "operator": {"package", "api", "planner", "render", "operator"},
    "trainer": {"package", "api", "render", "trainer"},
    TOP: {"package", "api", "planner", "render", "operator", "trainer", TOP},
}
"""For each layer, the layers its modules may import."""
TRAINER_WINGS = ("process", "parallel", "report", "sources", "model", "data", "checkpoint", "methods")
"""The trainer's wings from the bottom up (ARCHITECTURE.md names each one's job)."""
TRAINER_TOP = "program"
"""The modules at llamaft_trainer's top: main (the program), train (the loop), inputs, evaluation,
tiny, public and __main__; they may import every wing."""
TRAINER_SEAM = "llamaft_trainer.public"
"""The one module of the trainer the `llamaft` package may import."""
PURE_EXTERNAL_BANNED = {"kopf", "kubernetes"}
"""Libraries that mean API calls: only the operator (and the entry points) may import them."""


def layer_of(module: str) -> str | None:
    """The layer of a module of llamaft or llamaft_trainer; None for anything else."""
    parts = module.split(".")
    if parts[0] == "llamaft_trainer":
        return "trainer"
    if parts[0] != "llamaft":
        return None
    if len(parts) == 1:
        return "package"
    if parts[1] in ("api", "planner", "render", "operator"):
        return parts[1]
    return TOP  # cli, local, launch, sweep, manifests and anything else at the top


def wing_of(module: str) -> str | None:
    """The wing of a module of llamaft_trainer (TRAINER_TOP for the package's top modules); None
    for anything else."""
    parts = module.split(".")
    if parts[0] != "llamaft_trainer":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in TRAINER_WINGS else TRAINER_TOP


def wing_rank(wing: str) -> int:
    """Where a wing stands, from 0 at the bottom; the program stands above every wing."""
    return TRAINER_WINGS.index(wing) if wing in TRAINER_WINGS else len(TRAINER_WINGS)


def imported_modules(module: str, source: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the source, wherever it is in the file.
    `from a import b` counts as importing a.b (b may be a submodule; a.b's layer is a's anyway)."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return found


def violations(module: str, source: str, is_package: bool = False) -> list[str]:
    """Every import of `module` (given as source text) that points up or sideways across layers."""
    layer = layer_of(module)
    if layer is None:
        return []
    problems = []
    for line, target in imported_modules(module, source, is_package):
        top = target.split(".")[0]
        if top in PURE_EXTERNAL_BANNED and layer in ("api", "planner", "render", "trainer"):
            problems.append(f"{module}:{line} imports {target}: the {layer} layer makes no API calls")
            continue
        target_layer = layer_of(target)
        if target_layer is not None and target_layer not in ALLOWED[layer]:
            problems.append(f"{module}:{line} imports {target}: the {layer} layer may not import the {target_layer} "
                            "layer (ARCHITECTURE.md)")
        elif target_layer == "trainer" and layer != "trainer" and not (
                target == TRAINER_SEAM or target.startswith(TRAINER_SEAM + ".")):
            problems.append(f"{module}:{line} imports {target}: the llamaft package reaches the trainer through "
                            f"{TRAINER_SEAM} only (ARCHITECTURE.md)")
        elif target_layer == "trainer" and layer == "trainer":
            wing, target_wing = wing_of(module), wing_of(target)
            assert wing is not None and target_wing is not None
            if wing_rank(target_wing) > wing_rank(wing):
                problems.append(f"{module}:{line} imports {target}: the trainer's {wing} wing may not import the "
                                f"{target_wing} wing above it (ARCHITECTURE.md)")
    return problems


def modules() -> list[tuple[str, Path]]:
    found = []
    for root in ROOTS:
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found.append((".".join(parts), path))
    return found


def test_every_import_points_down() -> None:
    checked = modules()
    assert len(checked) > 50 and {layer_of(m) for m, _ in checked} == set(ALLOWED), "every layer has modules"
    assert {wing_of(m) for m, _ in checked} - {None} == {*TRAINER_WINGS, TRAINER_TOP}, "every wing has modules"
    problems = [p for module, path in checked
                for p in violations(module, path.read_text(encoding="utf-8"), path.name == "__init__.py")]
    assert problems == []


@pytest.mark.parametrize(("module", "source"), [
    ("llamaft.render.desired", "from llamaft.operator import kube\n"),
    ("llamaft.render.desired", "def f():\n    from llamaft.operator.handlers import validated\n"),
    ("llamaft.render.admission", "import llamaft.operator.handlers\n"),
    ("llamaft.render.naming", "from ..operator import lifecycle\n"),
    ("llamaft.render", "from ..operator import lifecycle\n"),
    ("llamaft.render.desired", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from llamaft.cli import main\n"),
    ("llamaft.render.desired", "from llamaft.planner import admission\n"),
    ("llamaft.render.desired", "import kopf\n"),
    ("llamaft.api.spec", "from llamaft.render.naming import Owner\n"),
    ("llamaft.planner.plan", "from llamaft import render\n"),
    ("llamaft.operator.handlers", "from llamaft.local import run_local\n"),
    ("llamaft.operator.handlers", "from llamaft_trainer import termination\n"),
    ("llamaft_trainer.main", "from llamaft.operator.kube import Kube\n"),
    ("llamaft_trainer.main", "from kubernetes import client\n"),
    ("llamaft.cli", "from llamaft_trainer.tiny import build_tiny_llama\n"),
    ("llamaft.local", "from llamaft_trainer.process import termination\n"),
    ("llamaft.sweep.on_this_machine", "def f():\n    from llamaft_trainer.checkpoint.dcp import Checkpointer\n"),
    ("llamaft.local", "import llamaft_trainer\n"),
    ("llamaft_trainer.process.runtime", "from llamaft_trainer.report.metrics import log_json\n"),
    ("llamaft_trainer.data.encoding", "from llamaft_trainer.methods.dpo import concatenated_batch\n"),
    ("llamaft_trainer.data.preview", "def f():\n    from llamaft_trainer import train\n"),
    ("llamaft_trainer.model", "from llamaft_trainer.data import encoding\n"),
])
def test_an_import_up_the_layers_is_found(module: str, source: str) -> None:
    assert violations(module, source, is_package=module == "llamaft.render") != []


@pytest.mark.parametrize(("module", "source"), [
    ("llamaft.render.desired", "from llamaft.render.naming import Owner\nfrom llamaft.api.spec import LlamaFineTuneSpec\n"),
    ("llamaft.render.desired", "from .naming import Owner\nimport json\nimport jsonschema\n"),
    ("llamaft.operator.handlers", "import kopf\nfrom llamaft.render import desired\nfrom llamaft.planner import admission\n"),
    ("llamaft.cli", "from llamaft.operator import peering\nfrom llamaft_trainer.public import make_tiny_model\n"),
    ("llamaft.local", "from llamaft_trainer import public\n"),
    ("llamaft_trainer.main", "from llamaft.api.spec import TrainingJobConfig\nfrom llamaft.render.naming import CONFIG_FILE\n"),
    ("llamaft_trainer.methods.dpo", "from llamaft_trainer.data.preference import PreferenceExample\n"),
    ("llamaft_trainer.data.batching", "from llamaft_trainer.data.encoding import IGNORE_INDEX\nfrom llamaft_trainer.process.errors import ConfigError\n"),
    ("llamaft_trainer.train", "from llamaft_trainer.methods import sft\nfrom llamaft_trainer.checkpoint.dcp import Checkpointer\n"),
    ("llamaft_trainer.public", "from llamaft_trainer.process import termination\n"),
])
def test_an_import_down_the_layers_is_fine(module: str, source: str) -> None:
    assert violations(module, source) == []


def test_every_trainer_folder_is_a_wing_in_the_order() -> None:
    """A new folder of the trainer takes its place in TRAINER_WINGS (and ARCHITECTURE.md), or its
    imports would go unchecked."""
    trainer = REPO / "trainer" / "llamaft_trainer"
    folders = {p.name for p in trainer.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(TRAINER_WINGS)


def test_architecture_md_names_every_module() -> None:
    """ARCHITECTURE.md draws both halves from the code: a module it never names is one a reader
    cannot place."""
    text = (REPO / "ARCHITECTURE.md").read_text(encoding="utf-8")
    unnamed = [str(path.relative_to(REPO)) for _, path in modules()
               if path.stem != "__init__" and not re.search(rf"(?<!\w){re.escape(path.stem)}(?!\w)", text)]
    assert unnamed == []


def test_the_trainer_tests_mirror_its_wings() -> None:
    """tests/trainer has a folder per wing, the same names (the program's tests and the shared
    workers and helpers stay at its top), so a wing's tests are where its code is."""
    tests = REPO / "tests" / "trainer"
    assert {p.name for p in tests.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == set(TRAINER_WINGS)


def test_the_seam_starts_without_torch() -> None:
    """Importing llamaft_trainer.public loads neither torch nor transformers (the CLI's start stays
    free of them): what needs them is imported inside the seam's functions."""
    probe = "import sys, llamaft_trainer.public; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


BACKEND_MODULES = {"llamaft.api.spec", "llamaft.render.backends", "llamaft.render.desired", "llamaft.render.trainjob"}
"""Where the backends' knowledge lives: the enum, the JobBackend protocol and its registry, and one
module per backend (ARCHITECTURE.md, Backends)."""
STILL_BRANCHING = {"llamaft.render.admission"}
"""Call sites that still branch on the kind (issue 53: admission's hostname rule, its job
rendering and its per-kind schema checks are to move into the backends)."""
JOB_KINDS = {"PyTorchJob", "TrainJob"}


def kind_branches(source: str) -> list[int]:
    """Lines that compare something with a job kind: a `Backend` member, a kind's name as a string
    or a backend module's KIND constant."""
    def is_kind(node: ast.expr) -> bool:
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            return node.value.id == "Backend" or (node.attr == "KIND" and node.value.id in ("trainjob", "desired"))
        if isinstance(node, ast.Constant):
            return node.value in JOB_KINDS
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return any(is_kind(e) for e in node.elts)
        return False

    return sorted({node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Compare)
                   and any(is_kind(n) for n in (node.left, *node.comparators))})


def test_no_call_site_branches_on_the_backend_kind() -> None:
    """ARCHITECTURE.md: the operator and the CLI ask `backend_for(kind)`; only the backends know
    what a kind means."""
    found = {module: lines for module, path in modules() if layer_of(module) not in (None, "trainer")
             and module not in BACKEND_MODULES | STILL_BRANCHING
             and (lines := kind_branches(path.read_text(encoding="utf-8")))}
    assert found == {}


@pytest.mark.parametrize(("source", "branches"), [
    ("if backend is Backend.TRAIN_JOB:\n    pass\n", True),
    ("x = [o for o in objs if o['kind'] == 'PyTorchJob']\n", True),
    ("if kind in ('Service', trainjob.KIND):\n    pass\n", True),
    ("job = backend_for(backend).render(owner, spec, 1)\nok = job['kind'] == backend_for(backend).kind\n", False),
])
def test_a_branch_on_the_kind_is_found(source: str, branches: bool) -> None:
    assert bool(kind_branches(source)) is branches


MAX_HANDLER_STATEMENTS = 8


def handler_bodies(source: str) -> dict[str, tuple[bool, int]]:
    """Each top-level function of a module: (whether kopf registers it, its statements beyond the
    docstring)."""
    out: dict[str, tuple[bool, int]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            registered = any("kopf" in ast.unparse(d) for d in node.decorator_list)
            body = node.body[1:] if node.body and isinstance(node.body[0], ast.Expr) and isinstance(
                getattr(node.body[0], "value", None), ast.Constant) else node.body
            out[node.name] = (registered, sum(1 for n in body for _ in ast.walk(n) if isinstance(_, ast.stmt)))
    return out


def test_handlers_is_the_kopf_registry_only() -> None:
    """operator/llamaft/operator/handlers.py registers handlers that hand off in a few lines to a
    module with one job (ARCHITECTURE.md): no helper functions, no classes, no handler bodies
    that grow into logic."""
    source = (REPO / "operator/llamaft/operator/handlers.py").read_text()
    tree = ast.parse(source)
    assert not [n for n in tree.body if isinstance(n, ast.ClassDef)], "classes belong in the modules handlers hands off to"
    bodies = handler_bodies(source)
    assert bodies, "no handlers found"
    for name, (registered, statements) in bodies.items():
        assert registered, f"handlers.{name} is not a kopf handler: move it to the module whose job it is"
        assert statements <= MAX_HANDLER_STATEMENTS, f"handlers.{name} has {statements} statements: hand its logic off"


def test_the_registry_check_finds_logic() -> None:
    helper = "import kopf\ndef helper():\n    return 1\n"
    assert handler_bodies(helper) == {"helper": (False, 1)}
    grown = "import kopf\n@kopf.on.event('x')\ndef h():\n    '''doc'''\n" + "".join(f"    a{i} = {i}\n" for i in range(9))
    assert handler_bodies(grown) == {"h": (True, 9)}


def private_torch_imports(module: str, source: str) -> list[str]:
    """Imports of a private torch module (a name after `torch.` that starts with "_")."""
    return [f"{module}:{line} imports {target}" for line, target in imported_modules(module, source)
            if target.split(".")[0] == "torch" and any(p.startswith("_") for p in target.split(".")[1:])]


def test_the_trainer_imports_public_torch_only() -> None:
    """The trainer reads like torchtitan: public torch APIs, so a torch upgrade cannot move the
    ground under it (FSDP2's collectives are timed through `set_custom_all_gather`, not its
    private classes)."""
    checked = [(m, p) for m, p in modules() if layer_of(m) == "trainer"]
    assert len(checked) > 20
    assert [p for module, path in checked for p in private_torch_imports(module, path.read_text(encoding="utf-8"))] == []


@pytest.mark.parametrize(("source", "private"), [
    ("from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather\n", True),
    ("def f():\n    from torch.distributed.fsdp import _fully_shard\n", True),
    ("import torch._dynamo\n", True),
    ("from torch.distributed.fsdp import FSDPModule, fully_shard\nimport torch.distributed as dist\n", False),
])
def test_a_private_torch_import_is_found(source: str, private: bool) -> None:
    assert bool(private_torch_imports("llamaft_trainer.x", source)) is private


def import_cycles(sources: dict[str, tuple[str, bool]]) -> list[list[str]]:
    """Groups of modules that import each other, directly or round a loop (strongly connected
    components of the import graph; imports inside functions and TYPE_CHECKING blocks count: a
    lazy import hides a cycle from the interpreter, not from a reader). `sources`: module ->
    (source text, whether it is a package's __init__)."""
    known = set(sources)

    def resolve(target: str) -> str | None:
        parts = target.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in known:
                return ".".join(parts[:end])
        return None

    graph = {module: sorted({t for _, target in imported_modules(module, text, package)
                             if (t := resolve(target)) is not None and t != module})
             for module, (text, package) in sources.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(cycles)


def test_no_module_imports_itself_round_a_loop() -> None:
    """Modules that share something share it through a module both import (issue 40: a cycle
    means two modules hold one piece of knowledge between them)."""
    sources = {module: (path.read_text(encoding="utf-8"), path.name == "__init__.py") for module, path in modules()}
    assert import_cycles(sources) == []


def test_a_cycle_is_found_through_lazy_and_type_checking_imports() -> None:
    sources = {
        "llamaft.sweep.report": ("def f():\n    from llamaft.sweep import chart\n", False),
        "llamaft.sweep.chart": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from llamaft.sweep.report import P\n", False),
        "llamaft.sweep.point": ("import json\n", False),
        "llamaft.sweep": ("from llamaft.sweep.report import f\n", True),
    }
    assert import_cycles(sources) == [["llamaft.sweep.chart", "llamaft.sweep.report"]]
    sources["llamaft.sweep.chart"] = ("from llamaft.sweep.point import P\n", False)
    assert import_cycles(sources) == []
