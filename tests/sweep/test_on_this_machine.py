"""`llamaft sweep --local`: the tiny fine-tune at 1 and 2 workers here, each by the real local run
(torchrun, FSDP on gloo), their final reports collected into the table, the files and the chart;
a size the machine cannot hold is skipped, saying why."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from llamaft.cli import main as cli
from llamaft.sweep import chart
from llamaft_trainer.report.logline import read_events

from tests.trainer.test_local_run import finetune

pytestmark = pytest.mark.slow


def test_local_sweep_measures_each_size_and_charts_them(tiny_model: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = finetune(tiny_model, tmp_path, "tiny-sweep", rendezvous={"backend": "c10d"},
                    checkpointing={"directory": str(tmp_path / "ckpt"), "exportHuggingFace": True, "everyNSteps": 2})
    out = tmp_path / "sweep"
    code = cli(["sweep", str(path), "--local", "--workers", "1,2,512", "--max-steps", "5", "--output", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed[-3000:]
    assert "512 worker(s): skipped, this machine holds at most" in printed
    rows = {int(r["workers"]): r for r in csv.DictReader((out / "sweep.csv").open())}
    assert rows[512]["phase"] == "Skipped" and "core" in rows[512]["message"]
    for workers in (1, 2):
        row = rows[workers]
        assert row["phase"] == "Succeeded" and int(row["world_size"]) == workers
        assert int(row["steps"]) == 4, "5 steps, the first not timed"
        assert float(row["tokens_per_second"]) > 0 and float(row["step_seconds"]) > 0
        assert int(row["peak_memory_bytes"]) > 50 * 2**20, "resident memory of the largest rank (CPU)"
        assert row["mfu"] == "", "no MFU without a device peak (CPU)"
        # Each size's own checkpoints, none of the file's export.
        ckpt = tmp_path / "ckpt" / "sweep" / f"tiny-sweep-w{workers}"
        assert (ckpt / "step-00000004").is_dir() and not (ckpt / "export").exists()
        # The figures are the leader's final report, which the local run's worker logs also print.
        done = [e for log in sorted((out / f"tiny-sweep-w{workers}").glob("worker-*.log")) for e in read_events(log, "done")]
        assert done and done[-1]["performance"]["tokensPerSecond"] == float(row["tokens_per_second"])
        # What the trackers log as params: the whole spec at this size, as the operator mounts it.
        assert json.loads((out / f"tiny-sweep-w{workers}" / "spec.json").read_text())["cluster"]["workers"] == workers
    tps1, tps2 = float(rows[1]["tokens_per_second"]), float(rows[2]["tokens_per_second"])
    assert float(rows[1]["scaling_efficiency"]) == 1.0
    assert float(rows[2]["scaling_efficiency"]) == pytest.approx(tps2 / 2 / tps1, abs=1e-4)
    from PIL import Image

    with Image.open(out / "scaling.png") as image:
        doc = json.loads(image.text[chart.PNG_KEY])
    assert doc == json.loads((out / "sweep.json").read_text()) and doc["where"] == "local"
    assert f"{tps1:,.0f}" in printed and f"{tps2:,.0f}" in printed, "the table on stdout"
