"""Dialogues with samsum's spread of lengths, for benchmarks where the lengths are the point.

examples/data/samsum-tiny.jsonl is made for a tiny model to learn: every dialogue has 3 or 4
turns, so its examples are 64-80 tokens and padding a batch to its longest wastes about 5 %.
SAMSum's 16,369 conversations are "distributed uniformly into 4 groups based on the number of
utterances: 3-6, 7-12, 13-18 and 19-30", about 75 % between two people (its dataset card,
huggingface.co/datasets/Samsung/samsum; Gliwa et al. 2019, arXiv:1911.12237). Batches of such
examples padded to their longest waste a large share of their tokens, and that is what packing is
for. These records draw the utterance count the same way (a group uniformly, then a count
uniformly within it), two people in three of four dialogues, with samsum-tiny's names and phrases
(so the tiny model's tokenizer covers them) and a summary of one to three sentences.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Anna", "Ben", "Chloe", "David", "Emma", "Frank", "Grace", "Hugo", "Iris", "Jack", "Kate", "Leo"]
PLACES = ["the cinema", "the park", "the library", "the station", "the gym", "the cafe", "the office", "the beach"]
TIMES = ["at 5", "at 6", "at 7", "at noon", "tomorrow", "on Friday", "on Monday", "tonight"]
ACTIVITIES = ["meet", "study", "have lunch", "play tennis", "watch a film", "go running", "work", "talk"]
ITEMS = ["the keys", "my charger", "the tickets", "a book", "the umbrella", "some milk", "the report", "a cake"]

UTTERANCE_GROUPS = [(3, 6), (7, 12), (13, 18), (19, 30)]


def _line(rng: random.Random) -> str:
    return rng.choice([
        f"Do you want to {rng.choice(ACTIVITIES)} {rng.choice(TIMES)}?",
        f"Have you seen {rng.choice(ITEMS)}?",
        f"I left {rng.choice(ITEMS)} at {rng.choice(PLACES)}.",
        f"Can you bring {rng.choice(ITEMS)} {rng.choice(TIMES)}?",
        f"Sure, see you at {rng.choice(PLACES)} {rng.choice(TIMES)}.",
        "Yes, no problem.", "Thank you!", "Great, see you there.",
    ])


def record(rng: random.Random, i: int) -> dict[str, str]:
    people = rng.sample(NAMES, rng.choice([2, 2, 2, 3]))
    turns = rng.randint(*rng.choice(UTTERANCE_GROUPS))
    dialogue = "\n".join(f"{people[t % len(people)]}: {_line(rng)}" for t in range(turns))
    summary = " ".join(f"{rng.choice(people)} will {rng.choice(ACTIVITIES)} at {rng.choice(PLACES)} {rng.choice(TIMES)}."
                       for _ in range(rng.randint(1, 3)))
    return {"id": f"samsum-like-{i:04d}", "dialogue": dialogue, "summary": summary}


def write(path: Path, n: int = 400, seed: int = 1911) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps(record(rng, i)) + "\n" for i in range(n)))
    return path
