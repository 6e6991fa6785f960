"""llamaft's FSDP trainer: config -> model -> parallelize -> data -> train loop -> checkpoint/metrics.

Each step is its own module, in the style of pytorch/torchtitan; `main` wires them together and is
what torchrun runs on every node.
"""
