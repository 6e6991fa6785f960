"""Bad data and a bad model end the run at once with exit 2 and one message naming the file (and the
line and field), run directly, under torchrun and through `llamaft run --local`; torchrun never
restarts the workers into the same error (process/restarts.py), so nothing hangs or turns retryable.

Time bounds: measured on 2 CPU cores, a case takes 3.5-11 s directly, 7-15 s under one torchrun
and 9-28 s through `llamaft run --local` (2 agents and 2 trainers importing torch at once; the high
end with other jobs on the machine). Before, under torchrun, the agent restarted the workers after
exit 2 and the run ended after 38-79 s with a retryable CollectiveTimeout, or hung in
init_process_group for more than 300 s. What tells the new behaviour apart is asserted directly
(one exit 2 per rank, no restart); the bounds catch a hang and leave headroom for a loaded machine.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from llamaft_trainer.report.logline import read_events

from tests.conftest import REPO
from tests.trainer.conftest import DATASET, base_config, torchrun_cmd, trainer_env

GOOD = DATASET.read_text().splitlines()[:4]


def _missing_dataset(tmp: Path, model: Path) -> tuple[dict[str, Any], str]:
    return {"dataset": {"source": str(tmp / "absent.jsonl")}}, r"spec\.dataset\.source: cannot read .*absent\.jsonl: FileNotFoundError"


def _empty_file(tmp: Path, model: Path) -> tuple[dict[str, Any], str]:
    (tmp / "empty.jsonl").write_text("")
    return {"dataset": {"source": str(tmp / "empty.jsonl")}}, r"spec\.dataset\.source: .*empty\.jsonl holds no records"


def _malformed_line(tmp: Path, model: Path) -> tuple[dict[str, Any], str]:
    (tmp / "broken.jsonl").write_text("\n".join([*GOOD, '{"dialogue": "a: hi", "summary": ', *GOOD]) + "\n")
    return {"dataset": {"source": str(tmp / "broken.jsonl")}}, r"broken\.jsonl line 5 is not JSON"


def _record_without_field(tmp: Path, model: Path) -> tuple[dict[str, Any], str]:
    (tmp / "fields.jsonl").write_text("\n".join([*GOOD, json.dumps({"id": "x", "dialogue": "a: hi"}), *GOOD]) + "\n")
    return {"dataset": {"source": str(tmp / "fields.jsonl")}}, r"fields\.jsonl line 5 has no field\(s\) \['summary'\]"


def _missing_tokenizer(tmp: Path, model: Path) -> tuple[dict[str, Any], str]:
    bare = tmp / "no-tokenizer"
    bare.mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model / name, bare / name)
    return {"model": {"source": str(bare)}}, r"spec\.model: no usable tokenizer at .*no-tokenizer"


def _missing_model(tmp: Path, model: Path) -> tuple[dict[str, Any], str]:
    return {"model": {"source": str(tmp / "absent-model")}}, r"spec\.model\.source: .*absent-model does not exist"


CASES: dict[str, Callable[[Path, Path], tuple[dict[str, Any], str]]] = {
    "missing-dataset": _missing_dataset,
    "empty-file": _empty_file,
    "malformed-json-line": _malformed_line,
    "record-without-field": _record_without_field,
    "missing-tokenizer": _missing_tokenizer,
    "missing-model": _missing_model,
}


def _config(model: Path, tmp: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    cfg = base_config(model, tmp / "ck")
    for key, value in overrides.items():
        cfg[key] = {**cfg[key], **value}
    return cfg


def _left_behind(marker: str) -> list[str]:
    """Processes whose command line names `marker` (agents and trainers carry the config path)."""
    left = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in proc.info["cmdline"] or []):
                left.append(" ".join(proc.info["cmdline"]))
        except psutil.Error:
            pass
    return left


@pytest.mark.parametrize("case", list(CASES))
def test_direct(case: str, tiny_model: Path, tmp_path: Path) -> None:
    overrides, pattern = CASES[case](tmp_path, tiny_model)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_config(tiny_model, tmp_path, overrides)))
    termination = tmp_path / "termination.json"
    proc = subprocess.run(
        [sys.executable, "-m", "llamaft_trainer", "--config", str(config)],
        env=trainer_env(LLAMAFT_TERMINATION_LOG=str(termination), MASTER_PORT="0"),
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert re.search("llamaft: configuration error: .*" + pattern, proc.stderr), proc.stderr[-3000:]
    errors = read_events(proc.stdout, "error")
    assert len(errors) == 1 and re.search(pattern, errors[0]["message"]), proc.stdout
    doc = json.loads(termination.read_text())
    assert {k: doc[k] for k in ("phase", "reason", "retryable", "exitCode")} == {
        "phase": "Failed", "reason": "ConfigError", "retryable": False, "exitCode": 2}
    assert re.search(pattern, doc["message"])


CLI_CASES = ["empty-file", "missing-tokenizer", "missing-model"]
"""Through `llamaft run --local`, one case per place the error is found: the data step (every
dataset case raises its ConfigError there, so the launcher's handling is the same for each; their
messages are test_direct's), the model step, and the CLI's own check before torchrun starts."""


@pytest.mark.parametrize("case", CLI_CASES)
def test_through_llamaft_run_local(case: str, tiny_model: Path, tmp_path: Path) -> None:
    """Two torchrun agents (as two pods) with the default maxRestarts 3: exit 2, the error last,
    no restart, nothing left running."""
    overrides, pattern = CASES[case](tmp_path, tiny_model)
    spec = _config(tiny_model, tmp_path, overrides)
    spec.update({"cluster": {"workers": 2, "gpusPerWorker": 0}, "rendezvous": {"backend": "c10d", "maxRestarts": 3}})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "llamaft.io/v1alpha1", "kind": "LlamaFineTune",
                                    "metadata": {"name": f"bad-{case}"}, "spec": spec}))
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("llamaft")), "run", "--local", str(path), "--run-dir", str(run_dir)],
        env=trainer_env(), capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert re.search(pattern, last), proc.stderr[-3000:]
    assert not _left_behind(str(run_dir))
    if case == "missing-model":  # found before torchrun starts (with the make-tiny-model hint)
        assert "llamaft make-tiny-model" in last
        return
    assert last.startswith("llamaft: error: ConfigError: ")
    logs = "".join(p.read_text() for p in sorted(run_dir.glob("worker-*.log")))
    assert logs.count("exits with code 2") == 2 and "exits with code 1" not in logs, "no torchrun restart"
    assert "closed torchrun's rendezvous" in logs
    docs = [json.loads(p.read_text()) for p in sorted(run_dir.glob("termination-*.json"))]
    assert len(docs) == 2 and all(d["reason"] == "ConfigError" and d["restartCount"] == 0 and d["exitCode"] == 2 for d in docs)


def test_under_torchrun_a_config_error_is_not_restarted(tiny_model: Path, tmp_path: Path) -> None:
    """One torchrun (`--max-restarts 3`, two workers), as in a pod: both workers exit 2 once, the
    rendezvous is closed, torchrun ends at once; the message stays the permanent ConfigError."""
    overrides, pattern = _empty_file(tmp_path, tiny_model)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_config(tiny_model, tmp_path, overrides)))
    termination = tmp_path / "termination.json"
    started = time.monotonic()
    proc = subprocess.run(
        torchrun_cmd(2, "--max_restarts", "3", "-m", "llamaft_trainer", "--config", str(config)),
        env=trainer_env(LLAMAFT_TERMINATION_LOG=str(termination)), capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    took = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, (took, out[-3000:])  # torchrun's own code
    assert out.count("exits with code 2") == 2 and "exits with code 1" not in out, out[-3000:]
    assert "RendezvousClosedError" in out
    doc = json.loads(termination.read_text())
    assert doc["reason"] == "ConfigError" and doc["retryable"] is False and doc["restartCount"] == 0


def test_a_restart_after_a_config_error_replays_it_at_once(tmp_path: Path) -> None:
    """Should torchrun restart the workers anyway (the rendezvous could not be closed), the new
    worker finds its group's ConfigError of the earlier restart in the termination log and exits 2
    before it imports torch or joins a process group; the first message is kept."""
    termination = tmp_path / "termination.json"
    first = {"phase": "Failed", "reason": "ConfigError", "message": "spec.dataset.source: x.jsonl holds no records",
             "step": None, "checkpointStep": None, "retryable": False, "exitCode": 2, "restartCount": 0}
    termination.write_text(json.dumps(first))
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "llamaft_trainer", "--config", str(tmp_path / "never-read.json")],
        env=trainer_env(LLAMAFT_TERMINATION_LOG=str(termination), TORCHELASTIC_RESTART_COUNT="1",
                        TORCHELASTIC_RUN_ID="job", RANK="0", WORLD_SIZE="2", MASTER_PORT="1"),
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 2, proc.stderr
    assert time.monotonic() - started < 15
    assert "configuration error: spec.dataset.source: x.jsonl holds no records" in proc.stderr
    assert "not starting again" in proc.stderr
    assert json.loads(termination.read_text()) == first
    # A restart after any other failure starts normally (here: and fails on the missing config).
    termination.write_text(json.dumps({**first, "reason": "PeerLost", "retryable": True, "exitCode": 1}))
    other = subprocess.run(
        [sys.executable, "-m", "llamaft_trainer", "--config", str(tmp_path / "never-read.json")],
        env=trainer_env(LLAMAFT_TERMINATION_LOG=str(termination), TORCHELASTIC_RESTART_COUNT="1", MASTER_PORT="0"),
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert other.returncode == 2 and "--config: cannot read" in other.stderr
    assert json.loads(termination.read_text())["restartCount"] == 1
