"""A structured log record reaches stdout in one write (llamaft_trainer/report/logline.py), and reads
back through the one reader beside the writer (parse_event, read_events).

Where stdout and stderr share one file, as in the simulated cluster's pod logs or any merged
container log, torchrun's agent writing a warning between a record's text and its newline made
the record unparseable (seen: a step line glued to the agent's "failed to send a keep-alive
heartbeat" warning, so the step went missing from the run's history). The reader skips whatever
else such a stream carries, never failing on it."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from llamaft_trainer.report import kubeflow_progress, metrics
from llamaft_trainer.report.logline import log_json, parse_event, read_events


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


# ------------------------------------------------------------------------------------ the reader
STEP = '{"ts": "2026-12-03T10:00:00.000+00:00", "event": "step", "step": 1, "loss": 4.5}'
EVAL = '{"ts": "2026-12-03T10:00:01.000+00:00", "event": "eval", "step": 1, "eval_loss": 4.25}'
NOISE = [
    "W1203 10:00:00.123 torch/distributed/run.py:793] Setting OMP_NUM_THREADS environment variable",
    "Traceback (most recent call last):",
    '  File "/app/main.py", line 3, in <module>',
    "Map:  50%|#####     | 157/315 [00:00<00:00, 1571.05 examples/s]",
    "",
]
"""What shares a trainer's stream with its records: torchrun's warnings, a traceback, a progress bar."""


def test_a_record_written_by_log_json_reads_back(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = Writes()
    monkeypatch.setattr(sys, "stdout", stream)
    log_json("checkpoint", step=4, path=Path("/ckpt/step-00000004"), seconds=0.25)
    record = parse_event(stream.calls[0])
    assert record is not None and record == json.loads(stream.calls[0])
    assert record["event"] == "checkpoint" and record["step"] == 4 and record["path"] == "/ckpt/step-00000004"
    assert read_events(stream.calls) == [record]


@pytest.mark.parametrize("line", [
    *NOISE,
    "step 5 | loss 4.5",  # a human line, not JSON
    '["step", 1]', "1", '"step"', "null", "true",  # JSON, but not an object
    '{"ts": "2026-12-03T10:00:00.000+00:00", "step": 1}', "{}",  # an object without `event`
    STEP[:-9],  # cut off: a killed writer's half line
    STEP + ' [W socket.cpp:464] failed to send a keep-alive heartbeat',  # a record glued to a warning
    "[rank0]: " + STEP,  # something before the record on its line
    "  " + STEP,
])
def test_what_is_not_a_whole_record_line_is_skipped(line: str) -> None:
    assert parse_event(line) is None
    assert read_events([line]) == [] and read_events(line) == []


def test_the_line_ending_is_not_part_of_the_record() -> None:
    for ending in ("\n", "\r\n", "  \n"):
        assert parse_event(STEP + ending) == json.loads(STEP)


def test_events_in_order_among_the_noise_and_by_kind() -> None:
    text = "\n".join([NOISE[0], STEP, NOISE[1], EVAL, STEP[:20], STEP.replace('"step": 1', '"step": 2')])
    events = read_events(text)
    assert [(e["event"], e["step"]) for e in events] == [("step", 1), ("eval", 1), ("step", 2)]
    assert [e["step"] for e in read_events(text, "step")] == [1, 2]
    assert read_events(text, "eval") == [json.loads(EVAL)]
    assert read_events(text, "done") == []


def test_a_log_file(tmp_path: Path) -> None:
    log = tmp_path / "worker-0.log"
    log.write_bytes(b"\n".join([NOISE[0].encode(), STEP.encode(), b"\xff\xfe not utf-8", EVAL.encode(), b""]))
    assert read_events(log) == [json.loads(STEP), json.loads(EVAL)], "bytes that are not UTF-8 do not fail the read"
    assert read_events(log, "eval") == [json.loads(EVAL)]


def test_a_str_is_the_text_never_a_file_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "worker-0.log").write_text(STEP + "\n")
    monkeypatch.chdir(tmp_path)
    assert read_events("worker-0.log") == []


def test_lines_as_they_come_from_a_stream(tmp_path: Path) -> None:
    log = tmp_path / "out.txt"
    log.write_text("\n".join([STEP, *NOISE, EVAL]) + "\n")
    with log.open() as stream:  # lines keep their newline, as `for line in proc.stdout` gives them
        assert read_events(stream) == [json.loads(STEP), json.loads(EVAL)]

    def lines() -> Iterator[str]:
        yield from (EVAL, NOISE[0], STEP)

    assert read_events(lines(), "step") == [json.loads(STEP)]
    assert read_events([]) == [] and read_events("") == []
