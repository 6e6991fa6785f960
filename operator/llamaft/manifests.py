"""Reading LlamaFineTune YAML files: many documents per file, each located for error messages."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from llamaft.api import resource
from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.api.validation import FieldError, SpecInvalid, validate_resource


@dataclass(frozen=True)
class Document:
    """One YAML document of a file, with where it came from."""

    source: str
    index: int
    body: Any

    @property
    def label(self) -> str:
        return self.source if self.index == 0 else f"{self.source}#{self.index}"


def read_documents(path: str | Path) -> Iterator[Document]:
    """Every non-empty document of a YAML file; a YAML syntax error becomes a SpecInvalid."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        bodies = [b for b in yaml.safe_load_all(text) if b is not None]
    except yaml.YAMLError as exc:
        raise SpecInvalid([FieldError(str(path), f"not valid YAML: {exc}")]) from None
    for index, body in enumerate(bodies):
        yield Document(str(path), index, body)


def is_finetune(body: Any) -> bool:
    return isinstance(body, dict) and body.get("kind") == resource.KIND


def load_finetune(path: str | Path) -> tuple[dict[str, Any], LlamaFineTuneSpec]:
    """The single LlamaFineTune of a file, validated; raises SpecInvalid otherwise."""
    docs = [d for d in read_documents(path) if is_finetune(d.body)]
    if len(docs) != 1:
        raise SpecInvalid([FieldError(str(path), f"expected exactly one {resource.KIND}, found {len(docs)}")])
    body = docs[0].body
    return body, validate_resource(body)
