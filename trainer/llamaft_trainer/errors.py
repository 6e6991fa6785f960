"""Errors the trainer reports before any GPU time is spent."""


class ConfigError(ValueError):
    """The spec cannot run as written (missing tokenizer, unreadable path, bad field, ...).

    The message names the spec field and the fix; main() exits with EXIT_CONFIG_ERROR, which the
    PyTorchJob's ExitCode restart policy treats as permanent (1-127), so nothing retries it.
    """


EXIT_CONFIG_ERROR = 2
