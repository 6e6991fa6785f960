"""Errors the trainer reports before any GPU time is spent, and the exit codes of its processes."""


class ConfigError(ValueError):
    """The spec cannot run as written (missing tokenizer, unreadable path, bad field, ...).

    The message names the spec field and the fix; main() exits with EXIT_CONFIG_ERROR after the
    termination message says `retryable: false` (the operator's permanent failure) and, under
    torchrun, after closing the rendezvous so that the agent restarts nothing (process/restarts.py).
    """


EXIT_CONFIG_ERROR = 2
EXIT_FAILURE = 1
"""Any other failure (torchrun exits 1 for any failed worker anyway: the termination message says why)."""
EXIT_PREEMPTED = 143
"""128 + SIGTERM: stopped on SIGTERM (after a checkpoint when the grace period allowed one); retryable."""
EXIT_INTERRUPTED = 130
"""128 + SIGINT: a person stopped the run (Ctrl-C of `llamaft run --local`); saved like a SIGTERM stop."""
