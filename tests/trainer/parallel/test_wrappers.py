"""The wrappers the sharding plan picks without FSDP (llamaft.api.sharding) train exactly as FSDP2
does, and their checkpoints are FSDP2's: a plain module at one process, DDP for NO_SHARD in full
precision. Two torchrun launches (1 process, 2 processes); LLAMAFT_WRAPPER=fsdp is the reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from llamaft.api.sharding import WRAPPER_ENV

from tests.trainer.conftest import base_config, run_harness

FSDP = {WRAPPER_ENV: "fsdp"}
SAVE_AT_2 = {"maxSteps": 4, "seed": 7}


def case(name: str, model: Path, tmp: Path, *, steps: int | None = 4, env: dict[str, str] | None = None,
         directory: str | None = None, resume: bool = False, **overrides: Any) -> dict[str, Any]:
    config = base_config(model, tmp / (directory or name), **overrides)
    config["checkpointing"].update({"everyNSteps": 2, "resume": resume})
    return {"name": name, "steps": steps, "config": config, "env": env or {}}


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("wrappers")
    one = [
        case("plain", tiny_model, tmp),
        case("fsdp2", tiny_model, tmp, env=FSDP),
        # A plain run's checkpoint at step 2, continued under FSDP2 (and the other way round).
        case("plain-to-2", tiny_model, tmp, steps=2, directory="p2f"),
        case("fsdp2-from-plain", tiny_model, tmp, steps=None, env=FSDP, directory="p2f", resume=True),
        case("fsdp2-to-2", tiny_model, tmp, steps=2, env=FSDP, directory="f2p"),
        case("plain-from-fsdp2", tiny_model, tmp, steps=None, directory="f2p", resume=True),
    ]
    no_shard = {"fsdp": {"shardingStrategy": "NO_SHARD", "mixedPrecision": "fp32",
                         "activationCheckpointing": {"mode": "none"}},
                "training": {"perDeviceBatchSize": 1, "gradientAccumulationSteps": 2}}
    two = [
        case("ddp", tiny_model, tmp, **no_shard),
        case("fsdp2-no-shard", tiny_model, tmp, env=FSDP, **no_shard),
        case("ddp-to-2", tiny_model, tmp, steps=2, directory="d2f", **no_shard),
        case("fsdp2-from-ddp", tiny_model, tmp, steps=None, env=FSDP, directory="d2f", resume=True, **no_shard),
    ]
    out = run_harness(tmp, 1, one)
    out.update(run_harness(tmp, 2, two))
    return out


def test_one_process_trains_unwrapped_exactly_as_fsdp2(runs: dict[str, Any]) -> None:
    plain, fsdp2 = runs["plain"], runs["fsdp2"]
    assert plain["wrapper"] == "LlamaForCausalLM" and fsdp2["wrapper"].startswith("FSDP")
    assert plain["losses"] == fsdp2["losses"] and plain["grad_norms"] == fsdp2["grad_norms"]
    assert plain["checksum"] == fsdp2["checksum"], "the same parameters, bit for bit"


def test_no_shard_in_full_precision_is_ddp_and_matches_fsdp2(runs: dict[str, Any]) -> None:
    ddp, fsdp2 = runs["ddp"], runs["fsdp2-no-shard"]
    assert ddp["wrapper"] == "DistributedDataParallel" and fsdp2["wrapper"].startswith("FSDP")
    assert ddp["losses"] == pytest.approx(fsdp2["losses"], abs=1e-6, rel=0)
    assert ddp["grad_norms"] == pytest.approx(fsdp2["grad_norms"], abs=1e-6, rel=1e-6)
    first, second = ddp["param_sums"]
    assert first == second, "every replica holds the same parameters after the accumulated steps"


@pytest.mark.parametrize(("start", "resumed", "reference"), [
    ("plain-to-2", "fsdp2-from-plain", "plain"),
    ("fsdp2-to-2", "plain-from-fsdp2", "fsdp2"),
    ("ddp-to-2", "fsdp2-from-ddp", "ddp"),
])
def test_checkpoints_resume_across_wrappers(runs: dict[str, Any], start: str, resumed: str, reference: str) -> None:
    whole = runs[reference]
    assert runs[start]["step"] == 2 and runs[resumed]["step"] == 4
    assert runs[start]["losses"] == whole["losses"][:2]
    assert runs[resumed]["losses"] == pytest.approx(whole["losses"][2:], abs=1e-6, rel=0)
