"""training.method dpo on a streamed preference set (dataset.streaming, methods/dpo_stream.py)
through the trainer (torchrun, FSDP on CPU): the same losses and TRL metrics as the token store's
run on the same pairs, the precomputed reference scored in a pass over the stream and read back by
a resumed run, which continues with the uninterrupted run's losses."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.trainer.methods.test_dpo_run import METRICS, dpo_config, head, of, train

REL, ABS = 1e-6, 2e-6
"""The streamed batch holds the same pairs in another order (the stream's shuffle, not the
sampler's), so sums run in another order: fp32 roundings of about 1e-7 relative; the events round
to 6 decimals (ABS: two such roundings), as tests/trainer/methods/test_dpo_combinations.py's EXACT runs."""


def test_a_streamed_set_trains_as_the_token_stores_on_the_same_pairs(tiny_model: Path, tmp_path: Path) -> None:
    """8 pairs, 2 ranks x 4 pairs a step: every step's batch is the whole set in both runs (order
    cannot matter), the reference precomputed in both."""
    source = head(8, tmp_path)
    common = {"dataset": {"validationSplit": 0}, "training": {"maxSteps": 4, "perDeviceBatchSize": 4}}
    stored = dpo_config(tiny_model, tmp_path / "stored", source, **common)
    streamed = dpo_config(tiny_model, tmp_path / "streamed", source, **{**common, "dataset": {"validationSplit": 0,
                                                                                               "streaming": True}})
    rc, events, out = train(stored, tmp_path, "stored", nproc=2)
    assert rc == 0, out[-3000:]
    rc, streamed_events, out = train(streamed, tmp_path, "streamed", nproc=2)
    assert rc == 0, out[-3000:]
    reference = of(streamed_events, "reference")
    assert reference and reference[0]["streaming"] is True and reference[0]["reused"] is False
    want, got = of(events, "step"), of(streamed_events, "step")
    assert [s["step"] for s in got] == [1, 2, 3, 4]
    for mine, theirs in zip(got, want, strict=True):
        for name in ("loss", *METRICS):
            assert mine[name] == pytest.approx(theirs[name], rel=REL, abs=ABS), (name, mine, theirs)
    assert got[-1]["loss"] < got[0]["loss"]


def test_a_streamed_run_resumes_with_the_losses_of_an_uninterrupted_one(tiny_model: Path, tmp_path: Path) -> None:
    """48 pairs (5 held out), 4 a step: the epoch of 10 steps is cut at step 3's checkpoint; the
    resumed run skips to its position in the stream and reads the reference back."""
    source = head(48, tmp_path)

    def config(directory: Path, resume: bool) -> dict[str, object]:
        return dpo_config(tiny_model, directory, source, dataset={"streaming": True, "validationSplit": 0.1},
                          training={"maxSteps": 6, "perDeviceBatchSize": 4, "evalInterval": 3},
                          checkpointing={"everyNSteps": 3, "keepLast": 5, "resume": resume})

    rc, events, out = train(config(tmp_path / "whole", False), tmp_path, "whole")
    assert rc == 0, out[-3000:]
    expected = {s["step"]: s for s in of(events, "step")}
    expected_evals = {e["step"]: e for e in of(events, "eval")}
    assert of(events, "reference")[0]["reused"] is False
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "step-00000006")
    rc, events, out = train(config(tmp_path / "resumed", True), tmp_path, "resumed")
    assert rc == 0, out[-3000:]
    assert of(events, "resume")[0]["step"] == 3
    assert of(events, "reference")[0]["reused"] is True  # read back, not scored again
    got = of(events, "step")
    assert [s["step"] for s in got] == [4, 5, 6]
    for s in got:
        assert {k: s[k] for k in ("loss", *METRICS)} == {k: expected[s["step"]][k] for k in ("loss", *METRICS)}
    evals = of(events, "eval")
    assert [e["step"] for e in evals] == [6] and evals[0] == {**expected_evals[6], "ts": evals[0]["ts"]}
