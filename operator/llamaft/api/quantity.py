"""Kubernetes quantities (`80Gi`, `141G`, `96`, `500m`) as numbers, for the planner's memory and
the trainers' CPU share."""

from __future__ import annotations

import re

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_FACTORS = {
    None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}


def quantity_value(text: str) -> float:
    """The number a quantity stands for (bytes for a size, cores for a CPU count)."""
    match = _QUANTITY.match(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. 80Gi, 8 or 500m)")
    return float(match.group(1)) * _FACTORS[match.group(2)]


def parse_quantity(text: str) -> int:
    """Bytes of a Kubernetes quantity (`80Gi`, `1000Gi`, `141G`)."""
    return int(quantity_value(text))
