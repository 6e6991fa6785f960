"""A DPO LlamaFineTune (training.method dpo) on the real control plane with the real training
operator, our kubelet running the real trainer on 2 workers (the fixtures of
test_training_operator.py). What a user relies on:

- status.progress shows the reward accuracy while it trains (the RewardAcc printer column's path)
  and, at the end, the trainer's final figures (reward accuracy and margin, held out too);
- the Succeeded condition and event say them;
- a killed container mid-run is classified, the next attempt resumes from the newest checkpoint
  and reads the precomputed reference back (no second pass), and every step is trained once, a
  redone step reproducing its loss bit for bit;
- the whole model is exported onto the claim as for SFT.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from llamaft_trainer.process.local_etcd import LocalEtcd

from tests.conftest import REPO
from tests.controlplane import runs
from tests.controlplane import test_training_operator as plane_runs
from tests.controlplane.cluster import ControlPlane
from tests.controlplane.kubelet import Kubelet
from tests.operator.conftest import Cluster, Operator, wait_for

rendezvous, admin = runs.rendezvous, runs.admin
checkpoint_claim, nodes, operator, dcgm = runs.checkpoint_claim, runs.nodes, plane_runs.operator, plane_runs.dcgm
"""test_training_operator's fixtures: the real training operator, a rendezvous etcd, two nodes of
the test's own, the claim, the llamaft operator as the chart runs it and the Prometheus it reads."""

PAIRS = REPO / "examples" / "data" / "preference-tiny.jsonl"
STEPS, EVERY, EVAL_EVERY = 60, 10, 30


def dpo_spec(model: Path, namespace: str, etcd: LocalEtcd) -> dict[str, Any]:
    """DPO on preference-tiny, 2 workers: 4 pairs per rank a step, the reference precomputed,
    held-out pairs scored every EVAL_EVERY steps, checkpoints every EVERY steps on the claim."""
    spec = runs.run_spec(model, namespace, etcd,
                               dataset={"format": "preference", "source": str(PAIRS), "maxSeqLength": 128,
                                        "packing": False, "validationSplit": 0.1},
                               checkpointing={"everyNSteps": EVERY})
    spec["training"].update({"maxSteps": STEPS, "method": "dpo", "dpo": {"beta": 0.1}, "perDeviceBatchSize": 4,
                             "learningRate": 5e-4, "evalInterval": EVAL_EVERY})
    return spec


def of(lines: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [line for line in lines if line.get("event") == kind]


def printer_column(name: str) -> list[str]:
    """The CRD's printer column `name` as a path of status keys."""
    crd = yaml.safe_load((REPO / "crds" / "llamafinetunes.llamaft.io.yaml").read_text())
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    path = next(c["jsonPath"] for c in columns if c["name"] == name)
    return str(path).lstrip(".").split(".")


def at(obj: dict[str, Any], path: list[str]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else None  # type: ignore[assignment]
    return obj


def leader_lines(nodes: list[Kubelet], namespace: str, job: str) -> list[dict[str, Any]]:
    """The JSON lines of `job`'s global rank 0: the pod whose log has the step lines."""
    events = runs.events(nodes, namespace, job)
    return next((lines for lines in events.values() if of(lines, "step")), [])


def test_a_dpo_run_reports_its_rewards_and_recovers_from_a_killed_container(
        control_plane: ControlPlane, namespace: str, nodes: list[Kubelet], operator: Operator, rendezvous: LocalEtcd,
        tiny_model: Path, admin: client.ApiClient, checkpoint_claim: Path) -> None:
    cluster = Cluster(admin, namespace)
    name = "dpo-kill"
    cluster.create(name, dpo_spec(tiny_model, namespace, rendezvous))
    reward_column = printer_column("RewardAcc")
    assert reward_column == ["status", "progress", "rewardAccuracy"]
    first_job = wait_for("attempt 1's job", lambda: cluster.attempt_job(name, 1), timeout=60)["metadata"]["name"]
    _, victim = wait_for("attempt 1 past checkpoint 10", lambda: runs.past_checkpoint(
        nodes, namespace, first_job, EVERY), timeout=240, interval=0.1)
    training = wait_for("reward accuracy in status", lambda: at(cluster.finetune(name), reward_column) is not None and
                        cluster.status(name), timeout=30)
    assert 0.0 <= training["progress"]["rewardAccuracy"] <= 1.0 and "rewardMargin" in training["progress"], training

    next(k for k in nodes if victim in runs.pod_names(k, namespace)).kill(namespace, victim)
    status = runs.end(cluster, name, nodes, operator, timeout=300)
    assert status["phase"] == "Succeeded", status
    assert status["attempt"] == 2 and status["retriesUsed"] == 1, status
    assert status["failures"][0]["reason"] == "Killed" and status["failures"][0]["retryable"], status

    first, second = (leader_lines(nodes, namespace, cluster.job_name(name, a)) for a in (1, 2))
    assert of(first, "reference")[0]["reused"] is False and of(second, "reference")[0]["reused"] is True
    resumed_at = of(second, "resume")[0]["step"]
    first_steps = {s["step"]: s for s in of(first, "step")}
    second_steps = of(second, "step")
    assert resumed_at % EVERY == 0 and resumed_at in first_steps
    assert [s["step"] for s in second_steps] == list(range(resumed_at + 1, STEPS + 1))
    assert sorted(set(first_steps) | {s["step"] for s in second_steps}) == list(range(1, STEPS + 1))
    redone = [s for s in second_steps if s["step"] in first_steps]
    assert redone, "the kill came after steps past the checkpoint, so the retry redoes some"
    for s in redone:  # exact resume: the same pairs, the same reference, the same state
        before = first_steps[s["step"]]
        assert {k: v for k, v in s.items() if k.startswith(("loss", "rewards/", "logps/"))} == \
            {k: v for k, v in before.items() if k.startswith(("loss", "rewards/", "logps/"))}, (s, before)

    done = of(second, "done")[-1]
    last_step, last_eval = second_steps[-1], of(second, "eval")[-1]
    assert last_eval["step"] == STEPS
    progress = status["progress"]
    assert progress["step"] == done["step"] == STEPS
    # The status holds the report's figures; the step and eval events round theirs to 6 decimals.
    for field, event, key in (("rewardAccuracy", last_step, "rewards/accuracies"), ("rewardMargin", last_step, "rewards/margins"),
                              ("evalRewardAccuracy", last_eval, "eval_rewards/accuracies"),
                              ("evalRewardMargin", last_eval, "eval_rewards/margins")):
        assert progress[field] == done[field] == pytest.approx(event[key], abs=1e-6), field
    assert at(cluster.finetune(name), reward_column) == progress["rewardAccuracy"]
    # Exported as an SFT run is: the whole model in Hugging Face's layout, on the claim (mounted at
    # the checkpoint directory itself, /checkpoints/run).
    assert status["exportPath"] == done["exportPath"]
    exported = checkpoint_claim / Path(done["exportPath"]).relative_to("/checkpoints/run")
    assert (exported / "config.json").exists() and (exported / "model.safetensors").exists(), sorted(exported.iterdir())
    assert last_eval["eval_rewards/accuracies"] > 0.5, "the held-out pairs are learnable (generate_preference_tiny.py)"

    words = f"reward accuracy {progress['rewardAccuracy']:.3f}"
    succeeded = next(c for c in status["conditions"] if c["type"] == "Succeeded")
    assert words in succeeded["message"] and "held out: " in succeeded["message"], succeeded
    cluster.wait_reasons(name, "JobCreated", "Running", "Killed", "Succeeded")
    event = next(e for e in cluster.events(name) if e["reason"] == "Succeeded")
    assert event["message"] == succeeded["message"]
    last = cluster.job_name(name, 2)
    live = wait_for("one live job", lambda: (names := [j["metadata"]["name"] for j in cluster.jobs(f"llamaft.io/finetune={name}")
                                                     if not j["metadata"].get("deletionTimestamp")]) == [last] and names)
    assert live == [last], "the killed attempt's job is gone: its pods never sit beside the next attempt's"
