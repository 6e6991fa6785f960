"""Names of the LlamaFineTune resource, shared by the CRD generator, the operator and the CLI."""

GROUP = "llamaft.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LlamaFineTune"
PLURAL = "llamafinetunes"
SINGULAR = "llamafinetune"
SHORT_NAMES = ["finetune", "finetunes", "lft"]
CATEGORIES = ["all", "llamaft"]
CRD_NAME = f"{PLURAL}.{GROUP}"

MAX_ATTEMPTS = 999
"""Run attempts one LlamaFineTune may use (bounded so that derived names stay within 63 characters)."""
INCARNATION_TOKEN_LENGTH = 4
"""Characters of the object's uid in each attempt's job name: a re-applied CR never meets its
predecessor's job."""
MAX_NAME_LENGTH = 63 - len(f"-{'x' * INCARNATION_TOKEN_LENGTH}-{MAX_ATTEMPTS}") - len("-worker-4095")
"""Longest metadata.name: the training operator names a Service `<job>-worker-<index>` (a DNS-1035
label, at most 63 characters) with job `<name>-<uid token>-<attempt>` and up to 4096 workers."""
