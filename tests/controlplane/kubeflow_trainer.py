"""Kubeflow Trainer v2 and JobSet on the test control plane: the real TrainJob controller and
webhooks (github.com/kubeflow/trainer/v2) and the real JobSet controller and webhooks
(sigs.k8s.io/jobset), built by tests/controlplane/build (tests/controlplane/trainer/go.mod) and
installed as Trainer's manifests/overlays/manager installs them: namespace `kubeflow-system` for
Trainer (its ServiceAccount, the ClusterRole of manifests/base/rbac and its binding, the empty
Secret `kubeflow-trainer-webhook-cert` its rotator fills, the TrainJob, TrainingRuntime and
ClusterTrainingRuntime CRDs, the defaulter and validator webhook configurations), JobSet's
config/default in `jobset-system` (namePrefix `jobset-`: the ClusterRole, the Role on its
certificate Secret, the Secret, the JobSet CRD, its webhook configurations, pods' included), and
the torch-distributed ClusterTrainingRuntime of manifests/base/runtimes, which llamaft's TrainJobs
name.

Where they differ from those Deployments: as every controller manager here
(tests/controlplane/webhook_controller.py: a process, webhooks at a URL, the certificate Secret
copied into its folder), and
- each reads the upstream manager configuration with its ports moved to free ones on loopback,
  metrics off and leader election off;
- the JobSet CRD is applied without config/components/crd's conversion-webhook patch: it serves one
  version (v1alpha2), so the API server never calls a conversion webhook;
- the runtime's image stays upstream's (pytorch/pytorch); llamaft's TrainJob sets the trainer's
  image, which is what our kubelet runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.controlplane.cluster import HOST
from tests.controlplane.webhook_controller import Obj, WebhookController


def _configuration(upstream: Obj, **overrides: Any) -> Obj:
    """`upstream` with each top-level section in `overrides` merged over its own."""
    out = dict(upstream)
    for section, values in overrides.items():
        out[section] = {**(out.get(section) or {}), **values}
    return out


class JobSetController(WebhookController):
    """JobSet's controller manager (module doc)."""

    name = "jobset"
    namespace = "jobset-system"
    service_account = "jobset-controller-manager"
    secret = "jobset-webhook-server-cert"
    service = "jobset-webhook-service"
    webhook_configurations = ("ValidatingWebhookConfiguration/jobset-validating-webhook-configuration",
                              "MutatingWebhookConfiguration/jobset-mutating-webhook-configuration")

    @property
    def manifests(self) -> Path:
        return self.plane.binaries.jobset_manifests

    def install(self) -> None:
        (role,) = self.manifest(self.manifests, "role.yaml")
        (secrets_role,) = self.manifest(self.manifests, "manager_secrets_role.yaml")
        prefixed = [{**r, "metadata": {**r["metadata"], "name": f"jobset-{r['metadata']['name']}"}} for r in (role, secrets_role)]
        self.install_identity([prefixed[0]], [prefixed[1]], labels={"app.kubernetes.io/name": "jobset"})
        (crd,) = self.manifest(self.manifests, "jobset.x-k8s.io_jobsets.yaml")
        self.apply_crd(crd)
        for configuration in self.manifest(self.manifests, "manifests.yaml"):
            self.install_webhooks(configuration, f"jobset-{configuration['metadata']['name']}")

    def argv(self) -> list[str]:
        (upstream,) = self.manifest(self.manifests, "controller_manager_config.yaml")
        config = self.root / "controller_manager_config.yaml"
        config.write_text(yaml.safe_dump(_configuration(
            upstream, leaderElection={"leaderElect": False}, webhook={"port": self.webhook_port},
            health={"healthProbeBindAddress": f"{HOST}:{self.probe_port}"}, metrics={"bindAddress": "0"})), encoding="utf-8")
        return [str(self.plane.binaries.jobset), f"--config={config}", "--zap-log-level=2"]


class TrainerController(WebhookController):
    """Kubeflow Trainer's controller manager (module doc); needs JobSet's CRD (its scheme) and the
    JobSet controller to run what it creates."""

    name = "trainer"
    namespace = "kubeflow-system"
    service_account = "kubeflow-trainer-controller-manager"
    secret = "kubeflow-trainer-webhook-cert"
    service = "kubeflow-trainer-controller-manager"
    webhook_configurations = ("ValidatingWebhookConfiguration/validator.trainer.kubeflow.org",
                              "MutatingWebhookConfiguration/defaulter.trainer.kubeflow.org")
    RUNTIME = "torch-distributed"

    @property
    def manifests(self) -> Path:
        return self.plane.binaries.trainer_manifests

    def install(self) -> None:
        (role,) = self.manifest(self.manifests, "role.yaml")
        self.install_identity([role], labels={"app.kubernetes.io/name": "trainer"})
        for kind in ("trainjobs", "trainingruntimes", "clustertrainingruntimes"):
            (crd,) = self.manifest(self.manifests, f"trainer.kubeflow.org_{kind}.yaml")
            self.apply_crd(crd)
        # manifests/base/webhook with its patches: the configurations' names, the validators'
        # objectSelector (a label that opts an object out of validation).
        names = {"MutatingWebhookConfiguration": "defaulter.trainer.kubeflow.org",
                 "ValidatingWebhookConfiguration": "validator.trainer.kubeflow.org"}
        opt_out = {"matchExpressions": [{"key": "trainer.kubeflow.org/webhook-validation", "operator": "NotIn",
                                         "values": ["disabled"]}]}
        for configuration in self.manifest(self.manifests, "manifests.yaml"):
            if configuration["kind"] == "ValidatingWebhookConfiguration":
                for webhook in configuration["webhooks"][:2]:
                    webhook["objectSelector"] = opt_out
            self.install_webhooks(configuration, names[configuration["kind"]])

    def start(self) -> TrainerController:
        super().start()
        # The runtime after the webhook is up: the validator of ClusterTrainingRuntimes admits it.
        (runtime,) = self.manifest(self.manifests, "torch_distributed.yaml")
        self.apply(runtime)
        return self

    def argv(self) -> list[str]:
        (upstream,) = self.manifest(self.manifests, "controller_manager_config.yaml")
        config = self.root / "controller_manager_config.yaml"
        config.write_text(yaml.safe_dump(_configuration(
            upstream, leaderElection={"leaderElect": False}, webhook={"port": self.webhook_port},
            health={"healthProbeBindAddress": f"{HOST}:{self.probe_port}"}, metrics={"bindAddress": "0"})),
            encoding="utf-8")
        return [str(self.plane.binaries.trainer_controller_manager), f"--config={config}"]
