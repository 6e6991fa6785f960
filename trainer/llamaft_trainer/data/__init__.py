"""The data wing: records -> token ids with the loss masked (encoding) -> a token store built once
per run (prepare, store) -> packed blocks or examples padded per batch -> a distributed,
seed-deterministic, resumable loader (batching)."""
