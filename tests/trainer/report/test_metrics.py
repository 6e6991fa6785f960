"""metrics.ProgressPublisher's Prometheus exposition (GET /metrics), parsed with prometheus_client's own
parser: DPO's gauges (each of TRL's per-step metrics, the eval's rewards) and their help text; an
SFT run has none."""

from __future__ import annotations

import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

SFT_STEP = {"step": 3, "epoch": 0, "loss": 2.0, "lr": 1e-5, "grad_norm": 1.0, "tokens_per_second": 900.0,
            "tokens_per_second_per_device": 450.0, "mfu": None, "peak_memory_bytes": 2**20, "tokens": 64, "eta_seconds": 30}
DPO_STEP = {"rewards/chosen": 0.5, "rewards/rejected": -0.25, "rewards/accuracies": 0.625, "rewards/margins": 0.75,
            "logps/chosen": -12.0, "logps/rejected": -20.0}
DPO_EVAL = {"eval_loss": 0.5, "eval_rewards/chosen": 0.25, "eval_rewards/rejected": -0.5, "eval_rewards/accuracies": 0.875,
            "eval_rewards/margins": 0.75, "eval_logps/chosen": -11.0, "eval_logps/rejected": -21.0}
STEP_GAUGES = {"llamaft_train_reward_accuracy": "rewards/accuracies", "llamaft_train_reward_margin": "rewards/margins",
               "llamaft_train_reward_chosen": "rewards/chosen", "llamaft_train_reward_rejected": "rewards/rejected",
               "llamaft_train_logps_chosen": "logps/chosen", "llamaft_train_logps_rejected": "logps/rejected"}
"""The gauge of each of TRL's per-step DPO metrics (issue 38: every one on /metrics)."""
REWARD_GAUGES = (*STEP_GAUGES, "llamaft_train_eval_reward_accuracy", "llamaft_train_eval_reward_margin")


def scrape(url: str) -> dict[str, tuple[str, str, float]]:
    """name -> (type, help, value) of every single-sample family."""
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 (a local test server)
        text = response.read().decode()
    return {f.name: (f.type, f.documentation, f.samples[0].value) for f in text_string_to_metric_families(text)
            if len(f.samples) == 1}


def test_dpo_reward_gauges_in_the_exposition(served_progress: tuple[Any, str]) -> None:
    progress, base = served_progress
    url = f"{base}/metrics"
    progress.record_step({**SFT_STEP, **DPO_STEP})
    before_eval = scrape(url)
    assert set(REWARD_GAUGES) - set(before_eval) == {"llamaft_train_eval_reward_accuracy", "llamaft_train_eval_reward_margin"}
    progress.record_dpo_eval(3, DPO_EVAL)
    families = scrape(url)
    values = {name: families[name][2] for name in REWARD_GAUGES}
    assert values == {**{name: DPO_STEP[key] for name, key in STEP_GAUGES.items()},
                      "llamaft_train_eval_reward_accuracy": 0.875, "llamaft_train_eval_reward_margin": 0.75}
    for name in REWARD_GAUGES:
        kind, help_text, _ = families[name]
        assert kind == "gauge" and help_text.startswith("DPO: "), (name, help_text)
    for name, key in STEP_GAUGES.items():
        assert f"TRL's {key}" in families[name][1], (name, families[name][1])
    assert families["llamaft_train_eval_loss"][2] == 0.5 and families["llamaft_train_loss"][2] == 2.0
    assert families["llamaft_train_step"][2] == 3


def test_an_sft_run_has_no_reward_gauges(served_progress: tuple[Any, str]) -> None:
    progress, base = served_progress
    url = f"{base}/metrics"
    progress.record_step(SFT_STEP)
    progress.record_eval(3, 1.5, 4.48)
    families = scrape(url)
    assert not set(REWARD_GAUGES) & set(families)
    assert families["llamaft_train_eval_loss"][2] == 1.5
