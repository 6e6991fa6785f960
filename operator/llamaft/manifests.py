"""Reading LlamaFineTune YAML files (`llamaft plan`, `llamaft run --local`): the same safe parser
as `llamaft validate` (llamaft.api.documents: size, nesting and alias limits, encodings, YAML read
as kubectl reads it), so every command judges a file alike."""

from __future__ import annotations

from typing import Any

from llamaft.api import resource
from llamaft.api.documents import Document, load_finetune, read_documents

__all__ = ["Document", "is_finetune", "load_finetune", "read_documents"]


def is_finetune(body: Any) -> bool:
    return isinstance(body, dict) and body.get("kind") == resource.KIND
