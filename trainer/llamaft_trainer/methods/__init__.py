"""What each `training.method` adds to the loop: SFT's chunked cross-entropy (sft); DPO's loss (dpo),
its pairs in the token store and in a stream (dpo_pairs, dpo_stream), its reference
log-probabilities (dpo_reference) and its micro-step (dpo_step). A new method (GRPO) goes here."""
