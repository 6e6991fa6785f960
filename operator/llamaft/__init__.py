"""llamaft: the LlamaFineTune API, the `llamaft` CLI and the kopf operator (no torch here).

The source folder is `operator/`; it is installed under this name so that it never shadows the
standard library's `operator` module.
"""

__version__ = "0.1.0"
