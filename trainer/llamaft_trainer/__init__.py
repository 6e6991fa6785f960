"""llamaft's FSDP trainer: config -> model -> parallelize -> data -> train loop -> checkpoint/metrics.

Each stage is a wing of its own, in the style of pytorch/torchtitan (process, parallel, report,
sources, model, data, checkpoint, methods; imports point down that order); `main` wires them
together and is what torchrun runs on every node, `train` is the loop, and `public` is all that
the `llamaft` CLI may use of the trainer.
"""
