"""Checkpoints: sharded DCP checkpoints with atomic completion, keep-last-K and resume (dcp), and the
Hugging Face export at the end of a run (export)."""
