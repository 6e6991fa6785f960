"""The typed LlamaFineTune API (pydantic v2): the single source of truth for the spec."""

from llamaft.api.resource import API_VERSION, GROUP, KIND, PLURAL, VERSION
from llamaft.api.spec import LlamaFineTuneSpec, TrainingJobConfig
from llamaft.api.status import Condition, LlamaFineTuneStatus, Phase

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "VERSION",
    "Condition",
    "LlamaFineTuneSpec",
    "LlamaFineTuneStatus",
    "Phase",
    "TrainingJobConfig",
]
