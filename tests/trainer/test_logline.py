"""A structured log record reaches stdout in one write (llamaft_trainer/logline.py).

Where stdout and stderr share one file, as in the simulated cluster's pod logs or any merged
container log, torchrun's agent writing a warning between a record's text and its newline made
the record unparseable (seen: a step line glued to the agent's "failed to send a keep-alive
heartbeat" warning, so the step went missing from the run's history)."""

from __future__ import annotations

import json
import sys

import pytest
from llamaft_trainer import kubeflow_progress, metrics
from llamaft_trainer.logline import log_json


class Writes:
    """A text stream that keeps every write call apart."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_print_writes_a_record_and_its_newline_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why logline exists: print's two writes leave room for another writer in between."""
    stream = Writes()
    monkeypatch.setattr(sys, "stdout", stream)
    print(json.dumps({"event": "step"}), flush=True)
    assert stream.calls == ['{"event": "step"}', "\n"]


def test_every_trainer_module_logs_through_it() -> None:
    assert metrics.log_json is log_json and kubeflow_progress.log_json is log_json


def test_a_record_is_one_write_of_one_whole_line(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = Writes()
    monkeypatch.setattr(sys, "stdout", stream)
    log_json("step", step=14, loss=4.5)
    assert len(stream.calls) == 1 and stream.calls[0].endswith("\n") and stream.calls[0].count("\n") == 1
    record = json.loads(stream.calls[0])
    assert record["event"] == "step" and record["step"] == 14 and record["loss"] == 4.5 and record["ts"]
