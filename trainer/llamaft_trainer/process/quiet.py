"""A first screen that shows only what matters: torchao stays out of processes that do not use it,
and torch's known-harmless Enum deprecation notice is silenced where it is logged.

Why: transformers imports torchao whenever it is installed (transformers 5.24,
`quantizers/quantizer_torchao.py`: `if is_torchao_available(): from torchao.prototype.safetensors
...`, reached from `integrations/finegrained_fp8.py` by every model import), and torchao 0.18's import
logs `Failed to load .../torchao/_C_mxfp8...so` (an extension built for another Python, and sm90's
cutlass kernels on a CPU machine) and makes torch 2.13 log two `torch/utils/_pytree.py ... is an
Enum subclass ... deprecated` warnings (torchao registers its `KernelPreference` and
`ScaleCalculationMode` enums as pytree constants). None of it concerns a run without
`spec.fsdp.float8`, which is every CPU run and most GPU runs; the import also costs each worker
about half a second.

- `keep_torchao_out()`: `sys.modules["torchao"] = None`, the import system's documented way to make
  a module unimportable for this process (docs.python.org/3/reference/import.html, "The module
  cache": None in sys.modules makes the import raise ModuleNotFoundError); `importlib.util.find_spec`
  then answers None, so transformers' and peft's `is_torchao_available()` are False and nothing
  imports it. Only for processes that will not use float8 (float8.py imports torchao when it is on);
  `torchao_kept_out()` for one command of the CLI.
- `silence_known_warnings()`: a logging filter on torch's `torch.utils._pytree` logger that drops
  exactly that Enum-deprecation message (a float8 run still imports torchao); every other record of
  that logger, and every other logger, is untouched. (It is a `logging` record, not a
  `warnings.warn`, so `warnings.filterwarnings` cannot reach it.)

Standard library only: it runs before torch and transformers are imported.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TORCHAO = "torchao"
PYTREE_LOGGER = "torch.utils._pytree"
PYTREE_ENUM_NOTICE = re.compile(
    r"^<enum '\w+'> is an Enum subclass and is now natively supported by torch\.compile as an opaque value type\. "
    r"Calling register_constant\(\) on Enum subclasses is deprecated and will be an error in a future release\.$"
)
"""torch 2.13 `torch/utils/_pytree.py` `_private_register_pytree_node`'s warning, whole."""


class _DropMessage(logging.Filter):
    """Drops the records whose whole message matches `pattern`; lets every other record through."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.match(record.getMessage()) is None


def silence_known_warnings() -> None:
    """Install the filter for torch's Enum-deprecation notice (idempotent)."""
    logger = logging.getLogger(PYTREE_LOGGER)
    if not any(isinstance(f, _DropMessage) and f.pattern is PYTREE_ENUM_NOTICE for f in logger.filters):
        logger.addFilter(_DropMessage(PYTREE_ENUM_NOTICE))


def keep_torchao_out() -> bool:
    """Make torchao unimportable in this process unless it is already imported; True when it now
    is. Call before transformers or peft is imported, only where float8 is off."""
    if sys.modules.get(TORCHAO) is not None:
        return False
    sys.modules[TORCHAO] = None  # type: ignore[assignment]
    return True


@contextlib.contextmanager
def torchao_kept_out() -> Iterator[None]:
    """torchao unimportable for the block (a command of the `llamaft` CLI that loads transformers
    for no float8 work: make-tiny-model, plan --exact), importable again after it, so that a later
    float8 run in the same process (a test session) imports it as usual. transformers keeps its
    answer (`is_torchao_available()` is cached) and so never imports it itself."""
    blocked = keep_torchao_out()
    try:
        yield
    finally:
        if blocked and TORCHAO in sys.modules and sys.modules[TORCHAO] is None:
            del sys.modules[TORCHAO]


def float8_enabled(config: Any) -> bool:
    """Whether a trainer config document (TrainingJobConfig's JSON, or a whole LlamaFineTune) turns
    float8 on. Anything it cannot read counts as on: torchao is then imported as before, and the
    trainer's own reading of the config reports what is wrong with it."""
    if not isinstance(config, dict):
        return True
    body = config.get("spec") if config.get("kind") == "LlamaFineTune" else config
    fsdp = body.get("fsdp", {}) if isinstance(body, dict) else None
    float8 = fsdp.get("float8", {}) if isinstance(fsdp, dict) else None
    if not isinstance(float8, dict):
        return True
    return float8.get("enabled", False) is not False


def prepare_trainer(config_path: str | None) -> None:
    """The trainer process's first lines: the known notices silenced, and torchao kept out when the
    config (`--config`, JSON as the operator's ConfigMap writes it) leaves float8 off."""
    silence_known_warnings()
    if config_path is None:
        return
    try:
        config = json.loads(Path(config_path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # YAML or unreadable: main.load_config reads it (and reports a problem)
    if not float8_enabled(config):
        keep_torchao_out()


def config_argument(argv: list[str], default: str | None) -> str | None:
    """The value of `--config` (`--config X` or `--config=X`) in argv, else `default`."""
    for index, arg in enumerate(argv):
        if arg == "--config" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return default
