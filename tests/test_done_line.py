"""`llamaft run --local`'s last line of a finished run (local.done_line): the first and last logged
loss, then the final figures in the words of the operator's Succeeded condition
(contracts.final_figures): for DPO the last step's reward accuracy and margin and the last eval's."""

from __future__ import annotations

from typing import Any

from llamaft.api.contracts import SucceededReport
from llamaft.local import done_line


def step(loss: float, **metrics: float) -> dict[str, Any]:
    return {"event": "step", "loss": loss, **metrics}


def test_a_dpo_run_ends_with_its_reward_accuracy_and_margin() -> None:
    events = [step(0.6931, **{"rewards/accuracies": 0.0, "rewards/margins": 0.0}),
              {"event": "eval", "step": 4, "eval_loss": 0.6, "eval_rewards/accuracies": 0.5, "eval_rewards/margins": 0.1},
              step(0.4123, **{"rewards/accuracies": 0.875, "rewards/margins": 0.9123}),
              {"event": "eval", "step": 8, "eval_loss": 0.5, "eval_rewards/accuracies": 0.75, "eval_rewards/margins": 0.6}]
    assert done_line(events) == ("loss 0.6931 -> 0.4123, reward accuracy 0.875 (margin 0.912); "
                                 "held out: loss 0.5000, reward accuracy 0.750 (margin 0.600)")
    # The operator's Succeeded message words the same figures the same way.
    report = SucceededReport(loss=0.4123, eval_loss=0.5, reward_accuracy=0.875, reward_margin=0.9123,
                             eval_reward_accuracy=0.75, eval_reward_margin=0.6)
    assert done_line(events).endswith(report.figures().removeprefix("loss 0.4123, "))  # type: ignore[union-attr]


def test_an_sft_run_ends_with_its_losses() -> None:
    assert done_line([step(2.5), step(1.25)]) == "loss 2.5000 -> 1.2500"
    assert done_line([step(2.5), {"event": "eval", "eval_loss": 1.5, "perplexity": 4.48}, step(1.25)]) == \
        "loss 2.5000 -> 1.2500; held out: loss 1.5000"
    assert done_line([{"event": "setup"}]) is None
