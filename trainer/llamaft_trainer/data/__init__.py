"""The data wing: the formats (chat, preference), records from their source (records), records ->
token ids with the loss masked (encoding) -> a token store built once per run (prepare, store,
packing's block layout) -> packed blocks or examples padded per batch -> a distributed,
seed-deterministic, resumable loader (batching); a stream tokenized while training instead of the
store (streaming), one order for any world size (global_order), and `llamaft data preview`
(preview)."""
