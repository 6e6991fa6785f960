"""Generate chat-tiny.jsonl: multi-turn conversations for `dataset.format: chat` (deterministic).

Each record is `{"id", "messages": [{role, content}, ...]}`, built from one samsum-tiny.jsonl
record: an optional system turn, then 1-3 user/assistant exchanges (summarise the dialogue, who
is talking, a follow-up on the messages). The answers follow from the dialogue, so a tiny model
fine-tuned on them visibly learns. No randomness: choices follow the record's index.
Run: python examples/data/generate_chat_tiny.py > examples/data/chat-tiny.jsonl
"""

from __future__ import annotations

import json
from pathlib import Path

SOURCE = Path(__file__).with_name("samsum-tiny.jsonl")
RECORDS = 256
SYSTEMS = [
    "You are a helpful assistant that summarises chats in one sentence.",
    "You read short conversations and answer questions about them.",
]
ASKS = [
    "Summarize this dialogue:\n{dialogue}",
    "What is this chat about?\n{dialogue}",
    "Give me a one-sentence summary of this conversation:\n{dialogue}",
]


def speakers(dialogue: str) -> list[tuple[str, str]]:
    """(speaker, text) per line of a `Name: text` dialogue."""
    return [(name.strip(), text.strip()) for name, _, text in (line.partition(":") for line in dialogue.splitlines())]


def conversation(i: int, record: dict[str, str]) -> dict[str, object]:
    lines = speakers(record["dialogue"])
    names = list(dict.fromkeys(name for name, _ in lines))
    messages: list[dict[str, str]] = []
    if i % 2 == 0:
        messages.append({"role": "system", "content": SYSTEMS[(i // 2) % len(SYSTEMS)]})
    messages.append({"role": "user", "content": ASKS[i % len(ASKS)].format(dialogue=record["dialogue"])})
    messages.append({"role": "assistant", "content": record["summary"]})
    exchanges = 1 + i % 3
    if exchanges >= 2:
        messages.append({"role": "user", "content": "Who is talking?"})
        messages.append({"role": "assistant", "content": " and ".join(names) + "."})
    if exchanges >= 3:
        if i % 2:
            messages.append({"role": "user", "content": "How many messages are there?"})
            messages.append({"role": "assistant", "content": f"There are {len(lines)} messages."})
        else:
            first, said = lines[0]
            messages.append({"role": "user", "content": f"What did {first} say first?"})
            messages.append({"role": "assistant", "content": f'{first} said: "{said}"'})
    return {"id": f"chat-{i:04d}", "messages": messages}


def main() -> None:
    with SOURCE.open(encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    for i, record in enumerate(records[:RECORDS]):
        print(json.dumps(conversation(i, record)))


if __name__ == "__main__":
    main()
