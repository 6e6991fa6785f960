"""The trainer's public surface: everything the `llamaft` package (the CLI, `llamaft run --local`,
the sweep) may use of the trainer, in one module (tests/test_architecture.py holds operator/ to it).

Why one module: the CLI and the trainer meet here and nowhere else, so the trainer's rooms can
move and split without the CLI noticing, and a reader sees at a glance what the outside relies on.
What it imports at once is the standard library and llamaft.api only (the termination report, the
exit codes, the log line, the local etcd, the quiet first screen), so `llamaft`'s start stays free of
torch; what needs torch or transformers (the tiny model, the data preview, the checkpoints) is a
function that imports its module when called.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from llamaft_trainer.process import termination
from llamaft_trainer.process.errors import EXIT_CONFIG_ERROR, ConfigError
from llamaft_trainer.process.local_etcd import LocalEtcd, free_port, parent_death_signal
from llamaft_trainer.process.quiet import silence_known_warnings, torchao_kept_out
from llamaft_trainer.report.logline import parse_event, read_events

if TYPE_CHECKING:
    from llamaft.api.spec import TrainingJobConfig

__all__ = [
    "EXIT_CONFIG_ERROR", "ConfigError", "LocalEtcd", "data_preview", "free_port",
    "latest_checkpoint", "make_tiny_model", "parent_death_signal", "parse_event", "read_events", "silence_known_warnings",
    "termination", "torchao_kept_out",
]


def make_tiny_model(out_dir: Path, dataset: Path, *, chat_template: str | None = None) -> Path:
    """`llamaft make-tiny-model`: a random-init tiny Llama and its tokenizer trained on `dataset`
    (tiny.py; imports transformers)."""
    from llamaft_trainer.tiny import build_tiny_llama as build

    return build(out_dir, dataset, chat_template=chat_template)


def data_preview(config: TrainingJobConfig, *, count: int, split: str, store: Path | None, as_json: bool,
                 colour: str, stream: TextIO, environ: Mapping[str, str]) -> str:
    """`llamaft data preview`: the first examples of a split exactly as the trainer will train on
    them, rendered as JSON or as text (`colour`: always, never or auto for `stream`). Raises
    ConfigError naming the field for bad input (data/preview.py; imports torch and transformers)."""
    from llamaft_trainer.data.preview import preview, render_json, render_text, use_colour

    result = preview(config, count=count, split=split, store=store)
    return render_json(result) if as_json else render_text(result, use_colour(colour, stream, environ))


def latest_checkpoint(directory: str) -> int | None:
    """The step of the newest complete checkpoint under `directory`, None when there is none
    (checkpoint/dcp.py; imports torch)."""
    from llamaft_trainer.checkpoint.dcp import Checkpointer

    return Checkpointer(directory, 1, 0).latest()
