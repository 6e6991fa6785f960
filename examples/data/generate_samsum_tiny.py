"""Generate samsum-tiny.jsonl: small samsum-style dialogues with summaries (deterministic).

The dataset is shipped so that a fine-tune runs on a fresh machine with nothing downloaded.
Dialogues follow a few patterns a tiny model can learn, so the loss visibly goes down.
Run: python examples/data/generate_samsum_tiny.py > examples/data/samsum-tiny.jsonl
"""

from __future__ import annotations

import json
import random

NAMES = ["Anna", "Ben", "Chloe", "David", "Emma", "Frank", "Grace", "Hugo", "Iris", "Jack", "Kate", "Leo"]
PLACES = ["the cinema", "the park", "the library", "the station", "the gym", "the cafe", "the office", "the beach"]
TIMES = ["at 5", "at 6", "at 7", "at noon", "tomorrow", "on Friday", "on Monday", "tonight"]
ACTIVITIES = ["meet", "study", "have lunch", "play tennis", "watch a film", "go running", "work", "talk"]
ITEMS = ["the keys", "my charger", "the tickets", "a book", "the umbrella", "some milk", "the report", "a cake"]


def dialogue(rng: random.Random, i: int) -> dict[str, str]:
    a, b = rng.sample(NAMES, 2)
    kind = i % 3
    if kind == 0:
        act, place, time = rng.choice(ACTIVITIES), rng.choice(PLACES), rng.choice(TIMES)
        text = f"{a}: Do you want to {act} {time}?\n{b}: Sure, where?\n{a}: At {place}.\n{b}: Great, see you there."
        summary = f"{a} and {b} will {act} at {place} {time}."
    elif kind == 1:
        item, place = rng.choice(ITEMS), rng.choice(PLACES)
        text = f"{a}: Have you seen {item}?\n{b}: I left it at {place}.\n{a}: Thanks, I will get it."
        summary = f"{b} left {item} at {place}. {a} will get it."
    else:
        item, time = rng.choice(ITEMS), rng.choice(TIMES)
        text = f"{a}: Can you bring {item} {time}?\n{b}: Yes, no problem.\n{a}: Thank you!"
        summary = f"{b} will bring {item} to {a} {time}."
    return {"id": f"tiny-{i:04d}", "dialogue": text, "summary": summary}


def main() -> None:
    rng = random.Random(20261129)
    for i in range(320):
        print(json.dumps(dialogue(rng, i)))


if __name__ == "__main__":
    main()
