"""The sharding plan applied to the model: FSDP2, FSDP1, DDP or none, torch.compile and activation
checkpointing (parallelize), float8 linears (float8). Below every wing but process."""
