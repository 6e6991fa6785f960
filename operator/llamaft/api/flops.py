"""Training FLOPs per token, torchtitan's formula, written once: the planner's time estimate and the
trainer's MFU both count with it, so a plan's MFU and a run's are the same quantity.

    6 * N  +  12 * L * H * Q * T

N: parameters without the input embedding (each does a multiply-add forward, twice that backward:
6 FLOPs per token); L layers, H attention heads, Q head dim, T sequence length: the attention score
and value matmuls, which N does not count. Activation recomputation is not counted (MFU, not HFU).
"""

from __future__ import annotations


def flops_per_token(parameters: int, embedding_parameters: int, layers: int, q_dim: int, seq: int) -> float:
    """Training FLOPs per token of a decoder with `parameters` (of which `embedding_parameters` in
    the input embedding), `layers` layers whose attention is `q_dim` wide (heads x head dim), on
    sequences of `seq` tokens."""
    return 6.0 * (parameters - embedding_parameters) + 12.0 * layers * q_dim * seq
