"""Asynchronous checkpoints (spec.checkpointing.async, the default), under real torchrun:

1. Bit-identical: async and sync saves give the same training, and a run resumed from an async
   checkpoint ends with the same losses, grad norms and weights as the uninterrupted run (one
   harness launch, LoRA with dropout so that the random states matter; the resume reads the
   run's second save, staged into the host buffers the first one allocated).
2. A SIGKILL of the whole tree while a background write is in flight leaves that step without
   COMPLETE (only its `.metadata` and marker are missing: rank 0's shard and both random states
   are on disk): resume picks the previous checkpoint and still ends bit for bit like case 1.
3. SIGTERM while a background write is in flight: it is awaited within the grace period, then the
   stop's own save follows; a write that outlasts the grace period is abandoned unmarked and both
   ranks still exit 143 in time.

The write is made slow by a test-only fsspec filesystem, `slowfile://`, selected through the
checkpoint directory's URI (DCP's fsspec storage), registered by this module when torchrun runs it
as the worker program (see the bottom): no test hook in the trainer. It sleeps after rank 1 has
written (and fsynced) its shard of step LLAMAFT_TEST_SLOW_STEP, for LLAMAFT_TEST_SLOW_SECONDS,
and leaves `<shard>.sleeping` next to it while it does.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem
from llamaft_trainer.report.logline import parse_event, read_events

from tests.conftest import REPO
from tests.trainer.conftest import base_config, kill_tree, run_harness, torchrun_cmd, trainer_env

STEPS, EVERY, STOP_AT = 12, 3, 8
LORA = {"r": 4, "alpha": 8, "dropout": 0.1, "targetModules": ["q_proj", "v_proj"]}
SLOW_STEP, SLOW_SECONDS = "LLAMAFT_TEST_SLOW_STEP", "LLAMAFT_TEST_SLOW_SECONDS"


# ------------------------------------------------------------------ the slow storage (worker side)
class _SlowOpener(LocalFileOpener):  # type: ignore[misc]
    def __exit__(self, *exc: Any) -> None:
        marker = Path(f"{self.path}.sleeping")
        marker.touch()
        time.sleep(float(os.environ.get(SLOW_SECONDS, "0")))
        marker.unlink()
        super().__exit__(*exc)


class SlowFileSystem(LocalFileSystem):  # type: ignore[misc]
    """The local filesystem, except that rank 1's DCP shard of one step is slow to close."""

    protocol = ("slowfile",)

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        step = os.environ.get(SLOW_STEP)
        if step and "w" in mode and re.search(rf"/step-{int(step):08d}/__1_\d+\.distcp$", path):
            self.makedirs(self._parent(path), exist_ok=True)
            return _SlowOpener(path, mode, fs=self, **kwargs)
        return super()._open(path, mode, block_size=block_size, **kwargs)


fsspec.register_implementation("slowfile", SlowFileSystem, clobber=True)  # here and in the workers


# ------------------------------------------------------------------ helpers
def _config(model: Path, directory: str, *, resume: bool, export: bool = False, **checkpointing: Any) -> dict[str, Any]:
    return base_config(
        model, Path(directory),  # a URI too: `directory` below replaces it as given
        training={"maxSteps": STEPS, "learningRate": 1e-2, "lora": LORA},
        checkpointing={"directory": directory, "everyNSteps": EVERY, "keepLast": 2, "resume": resume,
                       "exportHuggingFace": export, **checkpointing},
    )


class Job:
    """This module as torchrun's worker program (it registers slowfile://), output read line by line."""

    def __init__(self, config: dict[str, Any], tmp: Path, name: str, **env: str) -> None:
        path = tmp / f"{name}.json"
        path.write_text(json.dumps(config))
        self.termination = tmp / f"{name}-termination.json"
        self.proc = subprocess.Popen(
            torchrun_cmd(2, str(Path(__file__)), "--config", str(path)),
            env=trainer_env(LLAMAFT_TERMINATION_LOG=str(self.termination), **env), cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        self.lines: list[str] = []

    def events(self) -> list[dict[str, Any]]:
        return read_events(self.lines)

    def read_until(self, event: str, step: int) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            doc = parse_event(line)
            if doc is not None and doc["event"] == event and doc["step"] >= step:
                return
        raise AssertionError(f"the run ended before {event} {step}:\n" + "".join(self.lines[-60:]))

    def finish(self, timeout: float = 300) -> int:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        finally:
            kill_tree(self.proc)
        self.lines += out.splitlines(keepends=True)
        return self.proc.returncode

    def log(self) -> str:
        return "".join(self.lines[-80:])


def _wait_for(paths: Any, timeout: float = 60) -> list[Path]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list(paths())
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError("timed out waiting for the slow write to start")


def _trace(events: list[dict[str, Any]], kind: str, *keys: str) -> dict[int, tuple[Any, ...]]:
    return {e["step"]: tuple(e[k] for k in keys) for e in events if e["event"] == kind}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------ 1. bit-identical, one harness launch
@pytest.fixture(scope="module")
def harness(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("async-harness")
    cases: list[dict[str, Any]] = [
        {"name": "async/straight", "config": _config(tiny_model, str(tmp / "a-straight"), resume=False, export=True)},
        {"name": "async/stopped", "steps": STOP_AT, "config": _config(tiny_model, str(tmp / "a-stop"), resume=False)},
        {"name": "async/resumed", "config": _config(tiny_model, str(tmp / "a-stop"), resume=True)},
        {"name": "sync/straight", "config": _config(tiny_model, str(tmp / "s-straight"), resume=False, **{"async": False})},
        {"name": "sync/stopped", "steps": STOP_AT, "config": _config(tiny_model, str(tmp / "s-stop"), resume=False, **{"async": False})},
        {"name": "sync/resumed", "config": _config(tiny_model, str(tmp / "s-stop"), resume=True, **{"async": False})},
    ]
    started = time.monotonic()
    out = run_harness(tmp, 2, cases)
    out["seconds"] = time.monotonic() - started
    out["tmp"] = tmp
    return out


def test_async_and_sync_checkpoints_resume_bit_identically(harness: dict[str, Any]) -> None:
    straight = harness["async/straight"]
    assert len(straight["losses"]) == STEPS
    assert harness["sync/straight"]["losses"] == straight["losses"], "async saving does not change training"
    assert harness["sync/straight"]["checksum"] == straight["checksum"]
    for mode in ("async", "sync"):
        resumed = harness[f"{mode}/resumed"]
        start = STEPS - len(resumed["losses"])
        assert start == STOP_AT - STOP_AT % EVERY, f"{mode}: resumed from the last checkpoint before the stop"
        assert resumed["losses"] == straight["losses"][start:], mode
        assert resumed["grad_norms"] == straight["grad_norms"][start:], mode
        assert resumed["checksum"] == straight["checksum"], mode
    tmp = harness["tmp"]
    # keepLast 2, both complete; the stopped run's last checkpoint was awaited before run() returned.
    assert sorted(p.name for p in (tmp / "a-straight").glob("step-*")) == ["step-00000009", "step-00000012"]
    assert all((tmp / "a-straight" / name / "COMPLETE").exists() for name in ("step-00000009", "step-00000012"))


def test_prune_keeps_the_newest_complete_and_anything_newer(tmp_path: Path) -> None:
    from llamaft_trainer.checkpoint.dcp import Checkpointer

    for step, complete in ((3, True), (6, False), (9, True), (12, False)):
        (tmp_path / f"step-{step:08d}").mkdir()
        if complete:
            (tmp_path / f"step-{step:08d}" / "COMPLETE").write_text("{}")
    checkpointer = Checkpointer(str(tmp_path), 1, 0)
    checkpointer._prune()
    # 3: beyond keepLast; 6: an interrupted save older than the newest; 12: in flight, kept.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000009", "step-00000012"]
    assert checkpointer.latest() == 9


# ------------------------------------------------------------------ 2. SIGKILL during a background write
def test_a_kill_during_a_background_write_leaves_nothing_resumable(
    tiny_model: Path, tmp_path: Path, harness: dict[str, Any],
) -> None:
    from llamaft_trainer.checkpoint.dcp import Checkpointer

    directory = tmp_path / "killed"
    uri = f"slowfile://{directory}"
    job = Job(_config(tiny_model, uri, resume=True, export=True), tmp_path, "killed",
              **{SLOW_STEP: "6", SLOW_SECONDS: "600"})
    try:
        job.read_until("checkpoint_staged", 6)
        _wait_for(lambda: directory.glob("step-00000006/*.sleeping"))
        job.read_until("step", 8)  # training went on while the step-6 write is in flight
    finally:
        kill_tree(job.proc)  # torchrun and both workers, no clean-up of any kind
    events = job.events()
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [3], job.log()
    partial = directory / "step-00000006"
    assert (partial / "__0_0.distcp").exists() and (partial / "__1_0.distcp").exists(), sorted(partial.iterdir())
    assert (partial / "rng-rank-0.pt").exists() and (partial / "rng-rank-1.pt").exists()
    assert not (partial / ".metadata").exists() and not (partial / "COMPLETE").exists()
    assert Checkpointer(str(directory), 2, 0).complete_steps() == [3]
    assert Checkpointer(uri, 2, 0).latest() == 3

    resumed = Job(_config(tiny_model, uri, resume=True, export=True), tmp_path, "resumed")
    assert resumed.finish() == 0, resumed.log()
    events = resumed.events()
    assert [e["step"] for e in events if e["event"] == "resume"] == [3]
    straight = harness["async/straight"]["losses"]
    again = _trace(events, "step", "loss")
    assert sorted(again) == list(range(4, STEPS + 1))
    assert {s: (round(straight[s - 1], 6),) for s in again} == again
    adapter = "export/adapter_model.safetensors"
    assert _sha256(directory / adapter) == _sha256(harness["tmp"] / "a-straight" / adapter)
    assert Checkpointer(str(directory), 2, 0).complete_steps() == [9, 12]
    assert sorted(p.name for p in directory.glob("step-*")) == ["step-00000009", "step-00000012"]
    staged = [e for e in events if e["event"] == "checkpoint_staged"]
    done = [e for e in events if e["event"] == "checkpoint"]
    assert [e["step"] for e in staged] == [e["step"] for e in done] == [6, 9, 12]
    assert all(e["async"] and e["write_seconds"] >= 0 and e["stall_seconds"] >= 0 for e in done)


# ------------------------------------------------------------------ 3. SIGTERM during a background write
@pytest.mark.slow
def test_sigterm_waits_for_the_background_write_then_saves_the_stop(tiny_model: Path, tmp_path: Path) -> None:
    directory = tmp_path / "stopped"
    config = _config(tiny_model, f"slowfile://{directory}", resume=True)
    config["training"]["maxSteps"] = 1000
    job = Job(config, tmp_path, "stopped", LLAMAFT_TERMINATION_GRACE_SECONDS="30", **{SLOW_STEP: "3", SLOW_SECONDS: "3"})
    try:
        job.read_until("checkpoint_staged", 3)
        _wait_for(lambda: directory.glob("step-00000003/*.sleeping"))
        job.proc.send_signal(signal.SIGTERM)
        job.finish(timeout=120)
    finally:
        kill_tree(job.proc)
    report = json.loads(job.termination.read_text())
    step = report["step"]
    assert report["reason"] == "Preempted" and report["checkpointStep"] == step, job.log()
    assert "saved a checkpoint" in report["message"]
    events = job.events()
    kinds = [(e["event"], e.get("step")) for e in events if e["event"] in ("checkpoint", "preempted")]
    assert kinds == [("checkpoint", 3), ("preempted", step), ("checkpoint", step)], kinds
    assert next(e for e in events if e["event"] == "checkpoint")["write_seconds"] >= 3
    assert sorted(p.parent.name for p in directory.glob("step-*/COMPLETE")) == ["step-00000003", f"step-{step:08d}"]


@pytest.mark.slow
def test_sigterm_after_the_last_step_keeps_its_save_once_written(tiny_model: Path, tmp_path: Path) -> None:
    """The signal comes after the last step (3) while its background write runs and the write
    ends within the grace period: that checkpoint is the stop's, not replaced by a second save."""
    directory = tmp_path / "last"
    config = _config(tiny_model, f"slowfile://{directory}", resume=True)
    config["training"]["maxSteps"] = EVERY
    job = Job(config, tmp_path, "last", LLAMAFT_TERMINATION_GRACE_SECONDS="30", **{SLOW_STEP: "3", SLOW_SECONDS: "3"})
    try:
        job.read_until("checkpoint_staged", EVERY)
        _wait_for(lambda: directory.glob("step-00000003/*.sleeping"))
        job.proc.send_signal(signal.SIGTERM)
        job.finish(timeout=120)
    finally:
        kill_tree(job.proc)
    report = json.loads(job.termination.read_text())
    assert report["reason"] == "Preempted" and report["step"] == EVERY and report["checkpointStep"] == EVERY, job.log()
    assert "the background save of step 3 completed" in report["message"]
    saves = [e for e in job.events() if e["event"] in ("checkpoint_staged", "checkpoint")]
    assert [(e["event"], e.get("step")) for e in saves] == [("checkpoint_staged", EVERY), ("checkpoint", EVERY)], saves
    assert sorted(p.parent.name for p in directory.glob("step-*/COMPLETE")) == ["step-00000003"]


@pytest.mark.slow
@pytest.mark.parametrize("signalled", ["while-training", "while-the-next-save-waits", "after-the-last-step"])
def test_sigterm_abandons_a_background_write_that_outlasts_the_grace_period(
    tiny_model: Path, tmp_path: Path, signalled: str,
) -> None:
    """The signal comes while training goes on with the step-3 write in flight, or once the loop
    has logged step 6 and waits for that write before the step-6 save (one save in flight at a
    time), or after the last step (3) while the run waits for that step's write: each way the
    ranks agree on it within a STOP_CHECK_SECONDS slice and give the write what is left of the
    grace period."""
    from llamaft_trainer.checkpoint.dcp import Checkpointer

    directory = tmp_path / "abandoned"
    config = _config(tiny_model, f"slowfile://{directory}", resume=True)
    config["training"]["maxSteps"] = EVERY if signalled == "after-the-last-step" else 1000
    job = Job(config, tmp_path, "abandoned", LLAMAFT_TERMINATION_GRACE_SECONDS="6", **{SLOW_STEP: "3", SLOW_SECONDS: "600"})
    try:
        job.read_until("checkpoint_staged", 3)
        _wait_for(lambda: directory.glob("step-00000003/*.sleeping"))
        if signalled == "while-the-next-save-waits":
            job.read_until("step", EVERY * 2)  # logged after the step's read: the save's wait comes next
        job.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        job.finish(timeout=120)
        seconds = time.monotonic() - sent
    finally:
        kill_tree(job.proc)
    report = json.loads(job.termination.read_text())
    assert report["reason"] == "Preempted" and report["checkpointStep"] is None, job.log()
    assert "background save of step 3 did not finish within the grace period" in report["message"]
    if signalled == "while-the-next-save-waits":
        assert report["step"] == EVERY * 2, report
    if signalled == "after-the-last-step":
        assert report["step"] == EVERY, report
    # Both ranks gave up before SIGKILL and left cleanly (the write still hung in its thread).
    assert "rank 0 exits with code 143" in job.log() and "rank 1 exits with code 143" in job.log()
    assert seconds < 20, seconds  # torchrun would SIGKILL at 30 s
    assert (directory / "step-00000003" / "__0_0.distcp").exists() and Checkpointer(str(directory), 2, 0).latest() is None


# ------------------------------------------------------------------ worker entry (torchrun runs this file)
if __name__ == "__main__":
    from llamaft_trainer.main import main
    from llamaft_trainer.process.shutdown import exit_process

    exit_process(main())
