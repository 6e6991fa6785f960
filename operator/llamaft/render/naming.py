"""Names and labels of everything the operator creates for a LlamaFineTune.

Names derive from the CR's name (at most `resource.MAX_NAME_LENGTH` characters, DNS-1035; enforced
by the CRD), so they are stable across operator restarts: finding an object by name is how
reconciliation stays idempotent. Attempts' job names also carry a token of the CR's uid, so a CR
deleted and re-applied at once (a new uid) never meets the job its predecessor is still deleting.
"""

from __future__ import annotations

from dataclasses import dataclass

from llamaft.api.resource import INCARNATION_TOKEN_LENGTH

MANAGED_BY = "llamaft-operator"
LABEL_FINETUNE = "llamaft.io/finetune"
LABEL_ATTEMPT = "llamaft.io/attempt"
ETCD_CLIENT_PORT = 2379
C10D_PORT = 29400
CONFIG_MOUNT = "/etc/llamaft"
CONFIG_FILE = "config.json"
SPEC_FILE = "spec.json"
"""The whole LlamaFineTune spec beside the trainer's config: what the trackers log as the run's parameters."""


@dataclass(frozen=True)
class Owner:
    """The identity of a LlamaFineTune, as the pure functions need it."""

    name: str
    namespace: str
    uid: str = ""

    @property
    def token(self) -> str:
        """The incarnation token: the start of the uid (empty when rendering without a cluster)."""
        return self.uid.replace("-", "")[:INCARNATION_TOKEN_LENGTH]

    def job_name(self, attempt: int) -> str:
        """One PyTorchJob per attempt and incarnation: a resubmission never races the deletion of
        the last attempt's job, and a re-applied CR never meets its predecessor's."""
        return f"{self.name}-{self.token}-{attempt}" if self.token else f"{self.name}-{attempt}"

    def rendezvous_id(self, attempt: int) -> str:
        """Unique per run attempt (never torch's shared default "none"), stable for that attempt."""
        return f"{self.namespace}-{self.name}-{self.uid[:8] or 'local'}-{attempt}"

    @property
    def config_map(self) -> str:
        return f"{self.name}-config"

    @property
    def etcd(self) -> str:
        return f"{self.name}-etcd"

    def labels(self, component: str) -> dict[str, str]:
        return {
            "app.kubernetes.io/name": "llamaft",
            "app.kubernetes.io/instance": self.name,
            "app.kubernetes.io/component": component,
            "app.kubernetes.io/managed-by": MANAGED_BY,
            LABEL_FINETUNE: self.name,
        }
