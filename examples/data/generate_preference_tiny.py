"""Generate preference-tiny.jsonl: preference pairs made from samsum-tiny.jsonl (deterministic).

Each record's prompt is the samsum prompt of a dialogue, `chosen` its own summary and `rejected`
the summary of another dialogue of the set (one of a different kind, so it names other people,
places or things): a tiny model learns to prefer the right one within a few dozen DPO steps.
Run: python examples/data/generate_preference_tiny.py > examples/data/preference-tiny.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SOURCE = Path(__file__).with_name("samsum-tiny.jsonl")
PROMPT = "Summarize this dialog:\n{dialogue}\n---\nSummary:\n"


def main() -> None:
    records = [json.loads(line) for line in SOURCE.read_text().splitlines() if line.strip()]
    rng = random.Random(20261204)
    for i, record in enumerate(records):
        other = records[(i + 1 + 3 * rng.randrange(len(records) // 3)) % len(records)]
        print(json.dumps({"id": f"pref-{i:04d}", "prompt": PROMPT.format(dialogue=record["dialogue"]),
                          "chosen": record["summary"], "rejected": other["summary"]}))


if __name__ == "__main__":
    main()
