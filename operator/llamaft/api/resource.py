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
