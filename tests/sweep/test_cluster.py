"""`llamaft sweep --at-once` and its waiting, against the API emulator, the test playing the
operator: every size is created before any has finished, a failed or unfinished size is a row
saying so (exit 1), and the figures are the runs' status.performance."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.operator.conftest import CHECKPOINT_CLAIM, Cluster, wait_for
from tests.operator.emulator import EmulatorThread, write_kubeconfig


@pytest.fixture
def emulated(tmp_path: Path) -> Iterator[tuple[Cluster, Path]]:
    emulator = EmulatorThread().start()
    config = client.Configuration()
    config.host = emulator.url
    try:
        yield Cluster(client.ApiClient(config)), write_kubeconfig(emulator.url, tmp_path / "kubeconfig")
    finally:
        emulator.stop()


def finetune_file(tmp: Path) -> Path:
    path = tmp / "blog.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "llamaft.io/v1alpha1", "kind": "LlamaFineTune", "metadata": {"name": "blog"},
                                    "spec": {"model": {"source": "meta-llama/Llama-2-7b-hf"},
                                             "dataset": {"source": "Samsung/samsum", "format": "samsum"},
                                             "training": {"epochs": 1},
                                             # each size's checkpoints on the claim (the sweep gives each its own directory)
                                             "checkpointing": {"volumeClaim": CHECKPOINT_CLAIM, "directory": "/checkpoints"},
                                             "cluster": {"workers": 2, "gpusPerWorker": 8}}}))
    return path


def finish(cluster: Cluster, name: str, phase: str, tps: float | None = None, world: int = 0) -> None:
    status: dict[str, Any] = {"phase": phase, "message": f"{phase} at step 10"}
    if tps is not None:
        status["performance"] = {"steps": 9, "worldSize": world, "tokensPerSecond": tps,
                                 "tokensPerSecondPerDevice": tps / world, "stepSeconds": 1.0}
    cluster.custom.patch_namespaced_custom_object_status("llamaft.io", "v1alpha1", "default", "llamafinetunes", name,
                                                         {"status": status})


def test_at_once_creates_every_size_then_collects_each_ending(emulated: tuple[Cluster, Path], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from llamaft.cli import main as cli

    cluster, kubeconfig = emulated
    out = tmp_path / "out"
    result: list[int] = []
    sweep = threading.Thread(target=lambda: result.append(cli([
        "sweep", str(finetune_file(tmp_path)), "--workers", "1,2,4", "--max-steps", "10", "--at-once",
        "--kubeconfig", str(kubeconfig), "--poll-seconds", "0.1", "--timeout", "60", "--output", str(out)])))
    sweep.start()
    names = ["blog-w1", "blog-w2", "blog-w4"]

    def created() -> bool:
        items = cluster.custom.list_namespaced_custom_object("llamaft.io", "v1alpha1", "default", "llamafinetunes",
                                                             label_selector="llamaft.io/sweep=blog")["items"]
        return sorted(i["metadata"]["name"] for i in items) == sorted(names)

    wait_for("every size created before any ended", created, timeout=30)
    assert [cluster.finetune(n)["spec"]["cluster"]["workers"] for n in names] == [1, 2, 4]
    finish(cluster, "blog-w4", "Failed")
    finish(cluster, "blog-w2", "Succeeded", 1800.0, 16)
    finish(cluster, "blog-w1", "Succeeded", 1000.0, 8)
    sweep.join(60)
    assert result == [1], "a size failed: the sweep says so in its exit status"
    text = (out / "sweep.csv").read_text().splitlines()
    assert text[1].startswith("1,8,1000.0,125.0,1.0,,,1.0,1000.0,9,Succeeded,blog-w1")
    assert text[2].startswith("2,16,1800.0,112.5,1.0,,,0.9,2000.0,9,Succeeded,blog-w2")
    assert text[3].startswith("4,,,,,,,,,,Failed,blog-w4,Failed at step 10")
    assert "blog-w4: Failed: Failed at step 10" in capsys.readouterr().out


def test_a_size_that_does_not_end_in_time_is_reported_and_left_running(emulated: tuple[Cluster, Path], tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from llamaft.cli import main as cli

    cluster, kubeconfig = emulated
    code = cli(["sweep", str(finetune_file(tmp_path)), "--workers", "1", "--max-steps", "10", "--kubeconfig", str(kubeconfig),
                "--poll-seconds", "0.1", "--timeout", "0.5", "--output", str(tmp_path / "out")])
    assert code == 1
    assert "TimedOut: not finished after 0.5 s (--timeout); it is still on the cluster" in capsys.readouterr().out
    assert cluster.finetune("blog-w1")["spec"]["training"]["maxSteps"] == 10


def test_no_cluster_is_an_error_that_says_what_to_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from llamaft.cli import main as cli

    missing = tmp_path / "no-kubeconfig"
    assert cli(["sweep", str(finetune_file(tmp_path)), "--workers", "1", "--max-steps", "3", "--kubeconfig", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "llamaft sweep: error: no cluster to run the sizes on" in err and "--local" in err
