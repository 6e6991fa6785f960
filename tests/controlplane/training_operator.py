"""The Kubeflow training operator on the test control plane: the real PyTorchJob controller and its
validating webhook, built from github.com/kubeflow/training-operator (tests/controlplane/kubeflow)
and installed as its standalone overlay installs it (manifests/overlays/standalone): namespace
`kubeflow`, the ServiceAccount, the ClusterRole of manifests/base/rbac and its binding, the empty
Secret that its certificate rotator fills, the PyTorchJob CRD, and the
ValidatingWebhookConfiguration whose CA bundle the rotator injects (failurePolicy Fail: a PyTorchJob
is admitted only if the webhook says yes).

Where it differs from the Deployment of that overlay, and why: as every controller manager here
(tests/controlplane/webhook_controller.py: a process, webhooks at a URL, the certificate Secret
copied into its folder), and
- only the PyTorchJob scheme is enabled (`--enable-scheme=pytorchjob`): the other job kinds' CRDs
  are not installed, and so only the PyTorchJob webhook is registered.
"""

from __future__ import annotations

from pathlib import Path

from tests.controlplane.cluster import HOST
from tests.controlplane.webhook_controller import WebhookController

NAMESPACE = "kubeflow"
NAME = "training-operator"
WEBHOOK_CONFIGURATION = "validator.training-operator.kubeflow.org"


class TrainingOperator(WebhookController):
    """The training operator of one control plane (module doc). `start()`, then `stop()`."""

    name = NAME
    namespace = NAMESPACE
    service_account = NAME
    secret = "training-operator-webhook-cert"
    service = NAME
    """`--webhook-service-name`: the rotator's certificate is for `training-operator.kubeflow.svc`."""
    webhook_configurations = (f"ValidatingWebhookConfiguration/{WEBHOOK_CONFIGURATION}",)

    @property
    def manifests(self) -> Path:
        return self.plane.binaries.training_operator_manifests

    def install(self) -> None:
        (role,) = self.manifest(self.manifests, "role.yaml")
        self.install_identity([role], labels={"app": NAME, "control-plane": "kubeflow-training-operator"})
        (crd,) = self.manifest(self.manifests, "kubeflow.org_pytorchjobs.yaml")
        self.apply_crd(crd)
        # manifests/base/webhook with the overlay's patch (name, Service), the PyTorchJob webhook only.
        (configuration,) = self.manifest(self.manifests, "manifests.yaml")
        self.install_webhooks(configuration, WEBHOOK_CONFIGURATION, keep=lambda w: "pytorchjobs" in w["rules"][0]["resources"])

    def argv(self) -> list[str]:
        return [
            f"MY_POD_NAMESPACE={NAMESPACE}", f"MY_POD_NAME={NAME}-0",  # env: the rotator's certificate names
            str(self.plane.binaries.training_operator),
            "--enable-scheme=pytorchjob",
            f"--webhook-server-port={self.webhook_port}",
            "--metrics-bind-address=0",  # off: nothing scrapes it here
            f"--health-probe-bind-address={HOST}:{self.probe_port}",
        ]
