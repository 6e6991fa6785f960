"""A DPO LlamaFineTune (training.method dpo, issue 38) on the simulated cluster of test_runs.py: the
real kopf operator, the API emulator, simulated Kubeflow and kubelets running the real trainer on
2 workers. What a user relies on:

- status.progress shows the reward accuracy while it trains (the RewardAcc printer column's path)
  and, at the end, the trainer's final figures (reward accuracy and margin, held out too);
- the Succeeded condition and event say them;
- a killed container mid-run is classified, the next attempt resumes from the newest checkpoint
  and reads the precomputed reference back (no second pass), and every step is trained once with
  a redone step reproducing its loss bit for bit;
- the whole model is exported onto the claim as for SFT.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO
from tests.operator import test_runs
from tests.operator.conftest import Cluster, Operator, wait_for
from tests.operator.sim import SimCluster
from tests.operator.sim_fixtures import CHECKPOINT_CLAIM, on_claim
from tests.operator.test_runs import (
    EVERY,
    RUN,
    STEPS,
    assert_one_live_job,
    attempt_logs,
    delete_and_assert_no_orphans,
    inject,
    other_pod,
    phase,
    run_spec,
    stepping,
)

world, dcgm, operator, cluster, sim = test_runs.world, test_runs.dcgm, test_runs.operator, test_runs.cluster, test_runs.sim
"""test_runs' fixtures: this module's own simulated cluster, operator and Prometheus."""

PAIRS = REPO / "examples" / "data" / "preference-tiny.jsonl"
EVAL_EVERY = 30


def dpo_spec(model: Path) -> dict[str, Any]:
    """test_runs' run (2 workers, checkpoints every EVERY steps on the claim, STEPS steps) as DPO
    on preference-tiny: 4 pairs per rank a step, the reference precomputed, held-out pairs scored
    every EVAL_EVERY steps."""
    spec = run_spec(model, dataset={"format": "preference", "source": str(PAIRS), "maxSeqLength": 128,
                                    "packing": False, "validationSplit": 0.1})
    spec["training"].update({"method": "dpo", "dpo": {"beta": 0.1}, "perDeviceBatchSize": 4, "learningRate": 5e-4,
                             "evalInterval": EVAL_EVERY})
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


def test_a_dpo_run_reports_its_rewards_and_recovers_from_a_killed_container(
        cluster: Cluster, sim: SimCluster, operator: Operator, tiny_model: Path) -> None:
    name = "dpo-kill"
    cluster.create(name, dpo_spec(tiny_model))
    reward_column = printer_column("RewardAcc")
    assert reward_column == ["status", "progress", "rewardAccuracy"]
    first_job = cluster.job_name(name, 1)
    stepping(cluster, sim, name, EVERY + 1, job=first_job)
    training = wait_for("reward accuracy in status", lambda: at(cluster.finetune(name), reward_column) is not None and
                        cluster.status(name), timeout=30)
    assert isinstance(training, dict)
    assert 0.0 <= training["progress"]["rewardAccuracy"] <= 1.0 and "rewardMargin" in training["progress"]

    inject(sim, "kill_container", other_pod(cluster, sim, name, first_job))
    status = phase(cluster, name, "Succeeded", "Failed", timeout=300)
    assert status["phase"] == "Succeeded", status
    assert status["attempt"] == 2 and status["retriesUsed"] == 1
    assert status["failures"][0]["reason"] == "Killed" and status["failures"][0]["retryable"]

    first, second = attempt_logs(cluster, sim, name, 2)
    assert of(first, "reference")[0]["reused"] is False and of(second, "reference")[0]["reused"] is True
    resumed_at = of(second, "resume")[0]["step"]
    first_steps = {s["step"]: s for s in of(first, "step")}
    second_steps = of(second, "step")
    assert resumed_at % EVERY == 0 and resumed_at in first_steps
    assert [s["step"] for s in second_steps] == list(range(resumed_at + 1, STEPS + 1))
    assert sorted(set(first_steps) | {s["step"] for s in second_steps}) == list(range(1, STEPS + 1))
    redone = [s for s in second_steps if s["step"] in first_steps]
    assert redone, "the kill came after steps past the checkpoint (stepping), so the retry redoes some"
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
    # Exported as an SFT run is: the whole model in Hugging Face's layout, on the claim.
    assert status["exportPath"] == done["exportPath"]
    exported = on_claim(sim.claims[CHECKPOINT_CLAIM], RUN, done["exportPath"])
    assert (exported / "config.json").exists() and (exported / "model.safetensors").exists(), sorted(exported.iterdir())
    assert last_eval["eval_rewards/accuracies"] > 0.5, "the held-out pairs are learnable (generate_preference_tiny.py)"

    words = f"reward accuracy {progress['rewardAccuracy']:.3f}"
    succeeded = next(c for c in status["conditions"] if c["type"] == "Succeeded")
    assert words in succeeded["message"] and "held out: " in succeeded["message"], succeeded
    cluster.wait_reasons(name, "JobCreated", "Running", "Killed", "Succeeded")
    event = next(e for e in cluster.events(name) if e["reason"] == "Succeeded")
    assert event["message"] == succeeded["message"]
    assert_one_live_job(cluster, name)
    delete_and_assert_no_orphans(cluster, sim, name)
