"""Every pair of feature values the API accepts, run together as real fine-tunes (issue #41).

tests/trainer/feature_matrix.py defines the factors, their values and the pairs the API refuses;
allpairspy covers every other pair in a few rows. Fast tests here check the generator (no pair
lost, every row valid, every wrapper reached) and the API's verdicts (each refused pair refused,
naming its fields, and refused because of that pair). The slow part runs every row on the tiny
model: a first torchrun launch per world size trains each row 4 steps (a checkpoint and an eval
with generations at the end), a second launch resumes each row from its checkpoint to step 6 and
exports; the exports are loaded back with transformers / peft and, in fp32 rows, their greedy
generations are compared with the trainer's last ones.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from filelock import FileLock
from llamaft.api.sharding import Wrapper, plan_sharding
from llamaft.api.spec import FsdpSpec
from llamaft.api.validation import SpecInvalid, validate_spec
from llamaft_trainer.report.logline import read_events

from tests.tiers import starts_processes
from tests.trackers import tensorboard_scalars
from tests.trainer import feature_matrix as fm
from tests.trainer.conftest import run_harness

ROWS = fm.covering_rows()
NAMES = [fm.row_name(index, row) for index, row in enumerate(ROWS)]
PLACEHOLDER = Path("/checkpoints/matrix")
"""Model and checkpoint paths of the specs the fast tests validate (nothing is read)."""


def _validated(row: fm.Row, model: Path = PLACEHOLDER, directory: Path = PLACEHOLDER) -> Any:
    return validate_spec(fm.spec_for(row, model, directory))


# ------------------------------------------------------------------------ the generator, the API
def test_every_allowed_pair_of_values_is_in_a_row() -> None:
    missing = [(a, b) for a, b in fm.value_pairs()
               if fm.allowed(dict([a, b])) and not any(row[a[0]] == a[1] and row[b[0]] == b[1] for row in ROWS)]
    assert not missing, f"allpairspy lost {len(missing)} pair(s): {missing[:10]}"


def test_no_row_holds_a_refused_pair_and_every_row_is_complete() -> None:
    for name, row in zip(NAMES, ROWS, strict=True):
        assert set(row) == {factor.name for factor in fm.FACTORS}, name
        assert fm.allowed(row), name
    assert len(set(NAMES)) == len(NAMES)


@pytest.mark.parametrize("row", ROWS, ids=NAMES)
def test_every_row_passes_the_api(row: fm.Row) -> None:
    """A pair the API refuses without being declared in REFUSED fails here (its row is refused)."""
    _validated(row)


@pytest.mark.parametrize("refusal", fm.REFUSED, ids=[r.name for r in fm.REFUSED])
def test_the_api_refuses_each_declared_pair_naming_its_fields(refusal: fm.Refusal) -> None:
    """The pair alone on the base spec (2 workers unless the pair says otherwise, so nothing else
    is refused) is refused with errors on exactly the declared fields; changing either value to
    another one the pair allows makes the spec valid: the refusal is that pair's."""
    row = {"world": "2", **dict([refusal.first, refusal.second])}
    with pytest.raises(SpecInvalid) as raised:
        _validated(row)
    assert {error.path for error in raised.value.errors} == set(refusal.fields), str(raised.value)
    for factor_name in (refusal.first[0], refusal.second[0]):
        others = [v.name for v in fm.BY_NAME[factor_name].values if fm.allowed({**row, factor_name: v.name})]
        assert others, f"{factor_name}: no value is allowed with the rest of {row}"
        _validated({**row, factor_name: others[0]})


def _plan_wrapper(row: fm.Row, spec: Any) -> Wrapper:
    world = int(row["world"])
    # On one torchrun node, as the matrix runs each world (local world size = world size).
    return plan_sharding(FsdpSpec.model_validate(spec["fsdp"]), world, world, force_fsdp=False).wrapper


def test_the_rows_reach_every_wrapper_the_sharding_plan_chooses() -> None:
    """none (1 process, full precision), DDP (NO_SHARD, full precision), FSDP2 and FSDP1."""
    reached = {_plan_wrapper(row, fm.spec_for(row, PLACEHOLDER, PLACEHOLDER)) for row in ROWS}
    assert reached == set(Wrapper)


# ---------------------------------------------------------------------------- the real fine-tunes
@dataclass
class Launch:
    """One case of a harness launch: its events (global rank 0's log lines) and harness result."""

    events: list[dict[str, Any]]
    result: dict[str, Any]
    seconds: float

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]


@dataclass
class RowRun:
    name: str
    row: fm.Row
    directory: Path
    first: Launch | None = None
    resumed: Launch | None = None
    config: dict[str, Any] = field(default_factory=dict)


def _segments(log: Path, count: int) -> list[list[dict[str, Any]]]:
    """Rank 0's events of a harness launch, one list per case: each run begins with setup's first
    phase line."""
    events = read_events(log)
    segments: list[list[dict[str, Any]]] = []
    for event in events:
        if event["event"] == "phase" and event["phase"] == "loading the tokenizer and preparing the data":
            segments.append([])
        if segments:
            segments[-1].append(event)
    assert len(segments) == count, f"{log}: {len(segments)} runs for {count} cases"
    return segments


def _seconds(segments: list[list[dict[str, Any]]], end: float) -> Iterator[float]:
    starts = [_ts(segment[0]) for segment in segments] + [end]
    for begin, finish in zip(starts, starts[1:], strict=False):
        yield finish - begin


def _ts(event: dict[str, Any]) -> float:
    from datetime import datetime

    return datetime.fromisoformat(event["ts"]).timestamp()


def _launch(tmp: Path, label: str, world: int, runs: list[RowRun], steps: int) -> None:
    folder = tmp / label
    folder.mkdir()
    cases = []
    for run in runs:
        # The first launch ends at its maxSteps too: its export would be overwritten, so it writes none.
        config = {**run.config, "training": {**run.config["training"], "maxSteps": steps},
                  "checkpointing": {**run.config["checkpointing"], "exportHuggingFace": steps == fm.RESUMED_STEPS}}
        cases.append({"name": run.name, "config": config})
    try:
        results = run_harness(folder, world, cases)
    except AssertionError as exc:
        log = folder / f"log-{world}.txt"
        started = [e for e in _events_of(log) if e["event"] == "data"]
        where = started[-1]["store"] if started else "before the first row"
        raise AssertionError(f"{label}: the launch failed in the row whose data is {where}\n{exc}") from None
    segments = _segments(folder / f"log-{world}.txt", len(runs))
    for run, events, seconds in zip(runs, segments, _seconds(segments, time.time()), strict=True):
        launch = Launch(events, results[run.name], seconds)
        if steps == fm.FIRST_STEPS:
            run.first = launch
        else:
            run.resumed = launch


def _events_of(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return read_events(log)


class Matrix:
    """Every row, both launches, run per world size when a test first asks for one of its rows:
    one torchrun launch trains each row of that world its first 4 steps, then a second launch
    resumes each (a new process group: nothing of the first run is left in memory). Per world, so
    that no single test waits for every launch (a test's time limit covers its fixtures), and a
    worker that takes only some rows runs only their world's launches.

    The launches of a world run once per session, not once per xdist worker (a module fixture is
    built in each worker, and worksteal hands rows of one world to both): the first worker to ask
    runs them under a file lock in the session's shared folder and leaves what they logged there
    (`world-<n>.json`, or `.failed`); a worker asking meanwhile waits on the lock and reads it."""

    def __init__(self, tiny_model: Path, root: Path) -> None:
        self.root = root
        self.model = tiny_model
        """The model the launches trained: a worker that reads another's results gets its path."""
        self.runs: dict[str, RowRun] = {}
        for name, row in zip(NAMES, ROWS, strict=True):
            directory = root / name
            config = _validated(row, tiny_model, directory).training_config().to_k8s()
            self.runs[name] = RowRun(name, row, directory, config=config)

    def __getitem__(self, name: str) -> RowRun:
        world = self.runs[name].row["world"]
        group = [run for run in self.runs.values() if run.row["world"] == world]
        if group[0].resumed is None:
            with FileLock(self.root / f"world-{world}.lock"):
                self._launch_or_read(world, group)
        return self.runs[name]

    def _launch_or_read(self, world: str, group: list[RowRun]) -> None:
        saved, failed = self.root / f"world-{world}.json", self.root / f"world-{world}.failed"
        if failed.exists():
            raise AssertionError(f"the launches of world {world} failed: {failed.read_text()}")
        if not saved.exists():
            try:
                _launch(self.root, f"first-{world}", int(world), group, fm.FIRST_STEPS)
                _launch(self.root, f"resumed-{world}", int(world), group, fm.RESUMED_STEPS)
            except BaseException as exc:
                failed.write_text(str(exc))
                raise
            saved.write_text(json.dumps({"model": str(self.model), "runs": [_saved(run) for run in group]}))
            table = [f"{run.first.seconds + run.resumed.seconds:7.1f} s  {run.name}" for run in group
                     if run.first is not None and run.resumed is not None]
            (self.root / f"seconds-{world}.txt").write_text("\n".join(table) + "\n")
            print(f"\nfeature matrix, world {world}, seconds per row (both launches, start-up excluded):\n" + "\n".join(table))
        doc = json.loads(saved.read_text())
        self.model = Path(doc["model"])
        for run, stored in zip(group, doc["runs"], strict=True):
            assert run.name == stored["name"]
            run.config, run.first, run.resumed = stored["config"], Launch(**stored["first"]), Launch(**stored["resumed"])


def _saved(run: RowRun) -> dict[str, Any]:
    assert run.first is not None and run.resumed is not None
    return {"name": run.name, "config": run.config, "first": asdict(run.first), "resumed": asdict(run.resumed)}


@pytest.fixture(scope="module")
@starts_processes  # the rows' launches, when a test first asks for a row
def matrix(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Matrix:
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker's basetemp is a folder of the session's own: its parent is shared.
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "feature-matrix"
    root.mkdir(exist_ok=True)
    return Matrix(tiny_model, root)


def _steps(launch: Launch) -> list[int]:
    return [e["step"] for e in launch.of("step")]


@pytest.mark.parametrize("name", NAMES)
def test_row_trains_checkpoints_and_evaluates(matrix: Matrix, name: str) -> None:
    run = matrix[name]
    assert run.first is not None
    setup = run.first.of("setup")[0]
    assert setup["wrapper"] == _plan_wrapper(run.row, run.config).value, "the row ran the wrapper its plan names"
    assert setup["world_size"] == int(run.row["world"])
    assert _steps(run.first) == [1, 2, 3, 4] and not run.first.of("resume")
    assert all(math.isfinite(e["loss"]) and math.isfinite(e["grad_norm"]) for e in run.first.of("step"))
    assert [e["step"] for e in run.first.of("checkpoint")] == [fm.FIRST_STEPS]
    assert (run.directory / f"step-{fm.FIRST_STEPS:08d}" / "COMPLETE").exists()
    assert [e["step"] for e in run.first.of("eval")] == [fm.FIRST_STEPS]
    assert math.isfinite(run.first.of("eval")[0]["eval_loss"])
    _check_generations(run, run.first, fm.FIRST_STEPS)


def _check_generations(run: RowRun, launch: Launch, step: int) -> None:
    reports = launch.of("generations")
    if run.row["evaluation"] == "off":
        assert not reports
        return
    assert [r["step"] for r in reports] == [step]
    assert reports[0]["samples"] == 2 and len(reports[0]["generations"]) == 2
    rouge = {"rouge1", "rouge2", "rougeL"}
    if run.row["evaluation"] == "rouge":
        assert all(0.0 <= reports[0][k] <= 1.0 for k in rouge)
    else:
        assert not rouge & set(reports[0])


@pytest.mark.parametrize("name", NAMES)
def test_row_resumes_from_its_checkpoint_in_a_second_launch(matrix: Matrix, name: str) -> None:
    run = matrix[name]
    assert run.resumed is not None
    resume = run.resumed.of("resume")
    assert [(e["step"], e["path"]) for e in resume] == [(fm.FIRST_STEPS, f"{run.directory}/step-{fm.FIRST_STEPS:08d}")]
    assert _steps(run.resumed) == list(range(fm.FIRST_STEPS + 1, fm.RESUMED_STEPS + 1))
    assert run.resumed.result["step"] == fm.RESUMED_STEPS
    assert all(math.isfinite(e["loss"]) for e in run.resumed.of("step"))
    _check_generations(run, run.resumed, fm.RESUMED_STEPS)
    board = run.directory / "tensorboard"
    if run.row["tracker"] == "tensorboard":
        # Both launches append to one TensorBoard run: every step once, the resumed ones after.
        logged = {e["step"]: e["loss"] for launch in (run.first, run.resumed) if launch for e in launch.of("step")}
        points = tensorboard_scalars(board)["train/loss"]
        assert [step for step, _ in points] == list(range(1, fm.RESUMED_STEPS + 1))
        assert [value for _, value in points] == pytest.approx([logged[s] for s, _ in points], rel=1e-5)
    else:
        assert not board.exists()


def _held_out_prompts(run: RowRun, tokenizer: Any) -> list[list[int]]:
    from llamaft_trainer import evaluation
    from llamaft_trainer.data import store as store_mod

    stores = sorted((run.directory / "data").iterdir())
    opened = store_mod.open_store(stores[0])
    assert opened is not None
    return [s.prompt_ids for s in evaluation.held_out_samples(opened.validation, tokenizer, 2)]


@pytest.mark.parametrize("name", NAMES)
def test_row_export_loads_back_with_transformers(matrix: Matrix, name: str) -> None:
    """The export of the resumed run: a plain model (full fine-tune; DoRA's merged root), a peft
    adapter (LoRA; DoRA's adapter/, whose logits equal the merged model's); trained weights; and
    in fp32 rows without float8 the same greedy generations as the trainer's last eval."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = matrix[name]
    tiny_model = matrix.model
    assert run.resumed is not None
    export = run.directory / "export"
    assert [e["path"] for e in run.resumed.of("export")] == [str(export)]
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    adapter = run.row["adapter"]
    if adapter == "lora":
        model = PeftModel.from_pretrained(base, export).eval()
        trained = [n for n, p in model.named_parameters() if "lora_B" in n and p.abs().sum() > 0]
        assert trained, "lora_B starts at zero and must have trained"
    else:
        model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
        assert not any("lora" in k for k in model.state_dict())
        changed = [k for k, v in model.state_dict().items() if not torch.equal(v, base_state[k])]
        assert changed, "the exported weights are the trained ones"
        if adapter == "dora":
            # pure-bf16 trains on bf16 base weights and stores the merged weights in bf16: the
            # reference adapter runs on the base the trainer saw, and the merge may differ by the
            # one rounding to bf16 (export merges in fp32; peft's merge in bf16 drifts further).
            bf16_weights = run.row["precision"] == "pure-bf16"
            if bf16_weights:
                with torch.no_grad():
                    for p in base.parameters():
                        p.copy_(p.to(torch.bfloat16).float())
            adapted = PeftModel.from_pretrained(base, export / "adapter").eval()
            ids = torch.randint(3, base.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                want, got = adapted(input_ids=ids).logits, model(input_ids=ids).logits
            tolerance = 2**-8 if bf16_weights else 1e-4  # bf16's machine epsilon, or fp32 merge order
            assert (want - got).abs().max() < tolerance * want.abs().max()
    reports = run.resumed.of("generations")
    if not reports or run.row["precision"] != "fp32" or run.row["float8"] != "off":
        return  # bf16 / fp16 / float8 compute may pick other tokens than the fp32 export: not compared
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    with torch.no_grad():
        for prompt, logged in zip(_held_out_prompts(run, tokenizer), reports[-1]["generations"], strict=True):
            ids = torch.tensor([prompt])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            assert tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip() == logged["generated"]
