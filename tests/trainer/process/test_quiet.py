"""The first screen: torchao (and its notices) only in processes that use float8, and torch's
known Enum-deprecation notice dropped exactly, nothing else (llamaft_trainer/process/quiet.py)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from llamaft_trainer.process import quiet

from tests.conftest import REPO
from tests.trainer.conftest import DATASET, trainer_env

NOTICES = ("Failed to load", "is an Enum subclass", "Traceback")

# What the trainer process does first (`python -m llamaft_trainer`: __main__.py), then the imports
# the trainer makes; prints whether torchao got imported.
PROBE = """
import sys
from llamaft_trainer.process.quiet import prepare_trainer
prepare_trainer(sys.argv[1])
from llamaft_trainer import main  # noqa: F401  (transformers, peft, torch: everything the trainer imports)
import transformers
transformers.LlamaForCausalLM
print("torchao imported:", sys.modules.get("torchao") is not None)
"""


@pytest.mark.parametrize("float8", [False, True])
def test_torchao_is_imported_only_by_a_float8_run_and_no_notice_shows(float8: bool, tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"fsdp": {"float8": {"enabled": float8}}}))
    done = subprocess.run([sys.executable, "-c", PROBE, str(config)], env=trainer_env(), capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"torchao imported: {float8}" in done.stdout
    if not float8:
        assert not [n for n in NOTICES if n in done.stderr], done.stderr[-3000:]
    assert "is an Enum subclass" not in done.stderr, "silenced for a float8 run too"


def test_make_tiny_model_prints_no_notice(tmp_path: Path) -> None:
    done = subprocess.run([str(Path(sys.executable).with_name("llamaft")), "make-tiny-model", str(tmp_path / "m"),
                           "--dataset", str(DATASET)], env=trainer_env(), capture_output=True, text=True, cwd=REPO,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not [n for n in NOTICES if n in done.stderr + done.stdout], done.stderr[-3000:]


def test_the_filter_drops_exactly_the_enum_notice(caplog: pytest.LogCaptureFixture) -> None:
    quiet.silence_known_warnings()
    quiet.silence_known_warnings()
    logger = logging.getLogger(quiet.PYTREE_LOGGER)
    assert len([f for f in logger.filters if isinstance(f, quiet._DropMessage)]) == 1, "installed once"
    notice = ("%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. Calling "
              "register_constant() on Enum subclasses is deprecated and will be an error in a future release.")
    with caplog.at_level(logging.WARNING, logger=quiet.PYTREE_LOGGER):
        logger.warning(notice, "<enum 'KernelPreference'>")
        logger.warning("%s cannot be registered as a pytree", "<enum 'Other'>")
        logging.getLogger("torch.other").warning(notice, "<enum 'KernelPreference'>")
    assert [(r.name, r.getMessage().split(" ")[2]) for r in caplog.records] == [
        (quiet.PYTREE_LOGGER, "cannot"), ("torch.other", "is")], "only the notice, only from torch's _pytree"


def test_torchao_is_importable_again_after_a_cli_command() -> None:
    had = sys.modules.get("torchao", 0)
    if had not in (0, None):
        pytest.skip("torchao already imported in this test process")
    with quiet.torchao_kept_out():
        with pytest.raises(ImportError):
            import torchao  # noqa: F401
    assert "torchao" not in sys.modules


@pytest.mark.parametrize(("config", "on"), [
    ({"fsdp": {"float8": {"enabled": True}}}, True), ({"fsdp": {"float8": {"enabled": False}}}, False),
    ({"fsdp": {}}, False), ({}, False), ({"kind": "LlamaFineTune", "spec": {"fsdp": {"float8": {"enabled": True}}}}, True),
    ({"fsdp": {"float8": "garbled"}}, True), ([], True),
])
def test_float8_is_read_from_the_config(config: object, on: bool) -> None:
    assert quiet.float8_enabled(config) is on
