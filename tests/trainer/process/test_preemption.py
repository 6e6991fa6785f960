"""Preemption and dead peers, under real torchrun (2 processes, c10d on loopback, tiny Llama):

- SIGTERM to torchrun (what the kubelet sends to the container's PID 1) -> every rank stops after
  the same step, saves it when the grace period allows, reports Preempted and exits 143; a rerun
  resumes there and ends with the same losses as an uninterrupted run. With no grace: no save,
  and nothing a resume would pick.
- A SIGSTOPped peer -> the other rank fails after training.collectiveTimeoutSeconds with a
  CollectiveTimeout termination message.
Plus the termination message contract itself (size limit, classification, which rank's wins).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch.distributed as dist
from llamaft_trainer.checkpoint.dcp import Checkpointer
from llamaft_trainer.process import termination
from llamaft_trainer.process.errors import ConfigError
from llamaft_trainer.process.preemption import grace_budget_seconds
from llamaft_trainer.report.logline import parse_event, read_events

from tests.conftest import REPO
from tests.tiers import starts_processes
from tests.trainer.conftest import base_config, torchrun_cmd, trainer_env

STEPS = 30
SIGNAL_AT_STEP = 3
TIMEOUT_S = 10  # the API's minimum collectiveTimeoutSeconds


@starts_processes
class Launch:
    """One torchrun job whose output is read line by line; its workers (torchrun starts them in
    their own sessions, so a process-group kill would miss them) are killed if a test leaves them."""

    def __init__(self, config: dict[str, Any], tmp: Path, name: str, **env: str) -> None:
        path = tmp / f"{name}.json"
        path.write_text(json.dumps(config))
        self.termination = tmp / f"{name}-termination.json"
        self.proc = subprocess.Popen(
            torchrun_cmd(2, "-m", "llamaft_trainer", "--config", str(path)),
            env=trainer_env(LLAMAFT_TERMINATION_LOG=str(self.termination), **env), cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        self.lines: list[str] = []
        self.workers: list[psutil.Process] = []

    def events(self) -> list[dict[str, Any]]:
        return read_events(self.lines)

    def read_until_step(self, step: int) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            event = parse_event(line)
            if event is not None and event["event"] == "step" and event["step"] >= step:
                self.workers = psutil.Process(self.proc.pid).children(recursive=True)
                return
        raise AssertionError(f"the run ended before step {step}:\n" + "".join(self.lines[-60:]))

    def finish(self, timeout: float = 300) -> int:
        out, _ = self.proc.communicate(timeout=timeout)
        self.lines += out.splitlines(keepends=True)
        return self.proc.returncode

    def report(self) -> dict[str, Any]:
        return dict(json.loads(self.termination.read_text()))

    def log(self) -> str:
        return "".join(self.lines[-80:])

    def close(self) -> None:
        left = list(self.workers) + ([psutil.Process(self.proc.pid)] if self.proc.poll() is None else [])
        for proc in left:
            try:  # psutil refuses to signal a reused pid
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            except psutil.Error:
                pass
        if self.proc.poll() is None:
            self.proc.wait(30)


def test_a_sigterm_during_start_up_ends_the_run_at_the_next_start_up_phase(tiny_model: Path, tmp_path: Path) -> None:
    """SIGTERM while the ranks prepare the data: they agree on it at the next start-up boundary
    and end there (Preempted, 143 each, no step trained), instead of finishing a start-up that
    can take minutes only to stop before step 1."""
    job = Launch(_config(tiny_model, tmp_path / "early"), tmp_path, "early")
    try:
        assert job.proc.stdout is not None
        for line in job.proc.stdout:
            job.lines.append(line)
            event = parse_event(line)
            if event is not None and event["event"] == "phase":  # the first boundary is behind the ranks
                break
        else:
            raise AssertionError("the run ended before start-up began:\n" + job.log())
        job.proc.send_signal(signal.SIGTERM)
        job.finish(timeout=120)
    finally:
        job.close()
    events = job.events()
    assert not [e for e in events if e["event"] in ("setup", "step")], job.log()
    report = job.report()
    assert report["reason"] == "Preempted" and report["retryable"] is True, report
    assert "during start-up (before " in report["message"], report["message"]
    assert "rank 0 exits with code 143" in job.log() and "rank 1 exits with code 143" in job.log()


def _config(model: Path, directory: Path, **training: Any) -> dict[str, Any]:
    return base_config(
        model, directory, training={"maxSteps": STEPS, **training},
        # No scheduled checkpoint before the end: the one a stop leaves is the stop's own.
        checkpointing={"everyNSteps": 1000, "keepLast": 2, "resume": True},
    )


def _losses(events: list[dict[str, Any]]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events if e["event"] == "step"}


def _sigterm_mid_run(model: Path, tmp: Path, name: str, grace: str) -> tuple[Launch, float]:
    """SIGTERM to torchrun only, as the kubelet does; returns the job and seconds until it ended."""
    job = Launch(_config(model, tmp / name), tmp, name, LLAMAFT_TERMINATION_GRACE_SECONDS=grace)
    try:
        job.read_until_step(SIGNAL_AT_STEP)
        job.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        job.finish(timeout=120)
        return job, time.monotonic() - sent
    finally:
        job.close()


@pytest.fixture(scope="module")
def preemption(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("preempt")
    full = Launch(_config(tiny_model, tmp / "full"), tmp, "full")
    try:
        assert full.finish() == 0, full.log()
    finally:
        full.close()
    stopped, seconds = _sigterm_mid_run(tiny_model, tmp, "stopped", grace="30")
    complete_after_stop = sorted(p.parent.name for p in (tmp / "stopped").glob("step-*/COMPLETE"))
    resumed = Launch(_config(tiny_model, tmp / "stopped"), tmp, "resumed")
    try:
        assert resumed.finish() == 0, resumed.log()
    finally:
        resumed.close()
    yield {"full": full, "stopped": stopped, "seconds": seconds, "complete": complete_after_stop, "resumed": resumed}


@pytest.mark.slow
def test_sigterm_stops_every_rank_after_one_step_and_saves_it(preemption: dict[str, Any]) -> None:
    stopped: Launch = preemption["stopped"]
    report = stopped.report()
    step = report["step"]
    assert report["phase"] == "Failed" and report["reason"] == "Preempted" and report["retryable"] is True
    assert SIGNAL_AT_STEP <= step < STEPS and report["checkpointStep"] == step
    assert preemption["complete"] == [f"step-{step:08d}"], "the stop's own checkpoint, complete"
    assert "saved a checkpoint" in report["message"]
    # Both ranks stopped on their own, with 143, long before torchrun's SIGKILL (30 s)...
    assert "rank 0 exits with code 143" in stopped.log() and "rank 1 exits with code 143" in stopped.log()
    assert preemption["seconds"] < 20
    # ...but torchrun re-raises its SignalException: the pod's exit code is 1, the message is the evidence.
    assert stopped.proc.returncode == 1
    events = stopped.events()
    assert max(_losses(events)) == step
    assert [e for e in events if e["event"] == "preempted"][0]["save"] is True
    assert events[-1]["event"] == "done" and events[-1]["reason"] == "Preempted" and events[-1]["step"] == step


@pytest.mark.slow
def test_the_rerun_resumes_there_and_ends_like_an_uninterrupted_run(preemption: dict[str, Any]) -> None:
    step = preemption["stopped"].report()["step"]
    resumed: Launch = preemption["resumed"]
    events = resumed.events()
    assert [e["step"] for e in events if e["event"] == "resume"] == [step]
    full, again = _losses(preemption["full"].events()), _losses(events)
    assert sorted(again) == list(range(step + 1, STEPS + 1))
    for s, loss in again.items():
        assert loss == pytest.approx(full[s], abs=1e-6), s
    report = resumed.report()
    assert report["phase"] == "Succeeded" and report["step"] == report["totalSteps"] == STEPS
    assert report["loss"] == pytest.approx(preemption["full"].report()["loss"], abs=1e-6)
    assert report["evalLoss"] == pytest.approx(preemption["full"].report()["evalLoss"], abs=1e-6)
    done = events[-1]
    assert done["event"] == "done" and {k: done[k] for k in ("phase", "step", "totalSteps")} == {
        "phase": "Succeeded", "step": STEPS, "totalSteps": STEPS}


@pytest.mark.slow
def test_without_grace_it_exits_at_once_and_leaves_nothing_to_resume(tiny_model: Path, tmp_path: Path) -> None:
    job, seconds = _sigterm_mid_run(tiny_model, tmp_path, "nograce", grace="0")
    report = job.report()
    assert report["reason"] == "Preempted" and report["checkpointStep"] is None, report
    assert "no new checkpoint" in report["message"]
    assert "rank 0 exits with code 143" in job.log() and "rank 1 exits with code 143" in job.log()
    assert seconds < 10, "one step and the exit, not a save nor torchrun's 30 s SIGKILL"
    assert not list((tmp_path / "nograce").glob("step-*")), "no partial checkpoint either"
    assert Checkpointer(str(tmp_path / "nograce"), 2, 0).latest() is None


@pytest.mark.slow
def test_a_stopped_peer_becomes_a_collective_timeout(tiny_model: Path, tmp_path: Path) -> None:
    config = base_config(
        tiny_model, tmp_path / "ck", training={"maxSteps": 100_000, "collectiveTimeoutSeconds": TIMEOUT_S},
    )
    job = Launch(config, tmp_path, "hang")
    try:
        job.read_until_step(SIGNAL_AT_STEP)
        peer = next(p for p in job.workers if p.environ().get("RANK") == "1")
        peer.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        report: dict[str, Any] = {}
        while time.monotonic() - stopped_at < TIMEOUT_S + 60 and report.get("phase") != "Failed":
            time.sleep(0.1)
            if job.termination.exists() and job.termination.read_text():
                report = job.report()
        failed_after = time.monotonic() - stopped_at
        # torchrun would SIGKILL the stopped worker 30 s after the failure (its failure path
        # ignores --shutdown-timeout); do it now.
        peer.kill()
        code = job.finish(timeout=60)
    finally:
        job.close()
    assert report.get("reason") == "CollectiveTimeout", job.log()
    # The blocked collective started at most a step before the SIGSTOP; the error and the message
    # follow the timeout at once (slack for a loaded machine).
    assert TIMEOUT_S - 1 <= failed_after <= TIMEOUT_S + 10, failed_after
    assert report["retryable"] is True and report["step"] >= SIGNAL_AT_STEP
    assert "Timed out" in report["message"]
    assert code == 1
    done = job.events()[-1]
    assert done["event"] == "done" and done["reason"] == "CollectiveTimeout" and done["rank"] == 0


# ------------------------------------------------------------------ the termination message itself
def test_a_long_message_is_cut_to_valid_json_under_4096_bytes() -> None:
    doc = termination.failed("RuntimeError", "é" * 10_000, termination.RunRecord(step=3), retryable=True)
    text = termination.fit(doc)
    assert len(text.encode()) <= termination.LIMIT_BYTES
    parsed = json.loads(text)
    assert parsed["message"].endswith("...") and len(parsed["message"]) > 100
    assert {k: parsed[k] for k in ("phase", "reason", "step", "retryable")} == {
        "phase": "Failed", "reason": "RuntimeError", "step": 3, "retryable": True}


@pytest.mark.parametrize(("exc", "reason", "retryable"), [
    (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete"),
     "CollectiveTimeout", True),
    (RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer"), "PeerLost", True),
    (RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:29500"), "PeerLost", True),
    (dist.DistBackendError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE)"),
     "CollectiveTimeout", True),
    (dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1, remote process exited or there was a network error"),
     "PeerLost", True),
    (dist.DistNetworkError("failed to recv, got 0 bytes"), "PeerLost", True),
    (ConfigError("spec.model.source: missing"), "ConfigError", False),
    (ValueError("bad"), "ValueError", True),
    (RuntimeError("CUDA out of memory"), "RuntimeError", True),
])
def test_failures_are_classified(exc: Exception, reason: str, retryable: bool) -> None:
    assert termination.classify_exception(exc) == (reason, retryable)


def test_an_echo_never_hides_the_cause_in_the_shared_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """All local ranks of a pod write the same file: rank 1's "connection closed" after rank 0's
    real error must not replace it; a new torchrun restart starts over."""
    path = tmp_path / "termination-log"
    monkeypatch.setenv("LLAMAFT_TERMINATION_LOG", str(path))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    record = termination.RunRecord(step=5)
    assert termination.write(termination.failed("ValueError", "the cause", record, retryable=True))
    assert not termination.write(termination.failed("PeerLost", "the echo", record, retryable=True))
    assert json.loads(path.read_text())["message"] == "the cause"
    assert termination.write(termination.failed("Preempted", "SIGTERM", record, retryable=True))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert termination.write(termination.failed("PeerLost", "next attempt", record, retryable=True))
    assert json.loads(path.read_text())["reason"] == "PeerLost"


def test_the_grace_budget_is_the_shorter_of_the_pods_and_torchruns(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LLAMAFT_TERMINATION_GRACE_SECONDS", "TORCHELASTIC_RUN_ID", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    assert grace_budget_seconds() == 30  # torchrun's default shutdown timeout
    monkeypatch.setenv("LLAMAFT_TERMINATION_GRACE_SECONDS", "120")
    assert grace_budget_seconds() == 120  # not under torchrun
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert grace_budget_seconds() == 30  # torchrun SIGKILLs its workers after 30 s
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "600")
    assert grace_budget_seconds() == 120
    monkeypatch.setenv("LLAMAFT_TERMINATION_GRACE_SECONDS", "0")
    assert grace_budget_seconds() == 0
