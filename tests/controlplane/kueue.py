"""Kueue on the test control plane: the real Kueue controller manager and its webhooks
(sigs.k8s.io/kueue, built by tests/controlplane/build from tests/controlplane/kueue/go.mod),
installed as its config/default installs it (namespace `kueue-system`, namePrefix `kueue-`: the
ServiceAccount, the ClusterRole and the Role on its certificate Secret with their bindings, the
empty Secret its rotator fills, its CRDs with their conversion webhooks, its webhook
configurations; its rotator injects the CA into all of them).

Where it differs from that Deployment: as every controller manager here
(tests/controlplane/webhook_controller.py: a process, webhooks at a URL, the certificate Secret
copied into its folder), and
- its configuration is upstream's with the ports moved to free ones on loopback, metrics and leader
  election off, and the integrations llamaft's jobs need: `kubeflow.org/pytorchjob`,
  `trainer.kubeflow.org/trainjob` and the `jobset.x-k8s.io/jobset` it builds on (upstream lists
  every framework, pods and Deployments too);
- only the webhooks of Kueue's own kinds and of those integrations are installed: the pod,
  Deployment and StatefulSet webhooks (Fail policy, every namespace but kube-system) would admit
  every pod of the test cluster through a framework this configuration leaves off;
- the visibility API server (feature VisibilityOnDemand, a fixed port of its own) is off: nothing
  here asks for pending workloads;
- the CRDs' conversion webhooks (config/components/crd's patches) are URLs too.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.controlplane.cluster import HOST
from tests.controlplane.webhook_controller import Obj, WebhookController

FRAMEWORKS = ["kubeflow.org/pytorchjob", "trainer.kubeflow.org/trainjob", "jobset.x-k8s.io/jobset"]
OWN_GROUP = "kueue.x-k8s.io"
JOB_RESOURCES = {"pytorchjobs", "trainjobs", "jobsets"}


def _kept(webhook: Obj) -> bool:
    """A webhook of Kueue's own kinds or of an integration in FRAMEWORKS."""
    rule = webhook["rules"][0]
    return OWN_GROUP in rule["apiGroups"] or bool(JOB_RESOURCES & set(rule["resources"]))


class KueueController(WebhookController):
    """Kueue's controller manager (module doc)."""

    name = "kueue"
    namespace = "kueue-system"
    service_account = "kueue-controller-manager"
    secret = "kueue-webhook-server-cert"
    service = "kueue-webhook-service"
    webhook_configurations = ("ValidatingWebhookConfiguration/kueue-validating-webhook-configuration",
                              "MutatingWebhookConfiguration/kueue-mutating-webhook-configuration")

    @property
    def manifests(self) -> Path:
        return self.plane.binaries.kueue_manifests

    def install(self) -> None:
        roles = [self.manifest(self.manifests, name)[0] for name in ("role.yaml", "manager_secrets_role.yaml")]
        role, secrets_role = ({**r, "metadata": {**r["metadata"], "name": f"kueue-{r['metadata']['name']}"}} for r in roles)
        self.install_identity([role], [secrets_role], labels={"app.kubernetes.io/name": "kueue"})
        (kustomization,) = self.manifest(self.manifests, "crd-kustomization.yaml")
        converted = {Path(patch["path"]).name for patch in kustomization.get("patches") or []}
        for path in sorted(self.manifests.glob("kueue.x-k8s.io_*.yaml")):
            (crd,) = self.manifest(self.manifests, path.name)
            patch = f"webhook_in_{crd['spec']['names']['plural']}.yaml"
            if patch in converted:  # the conversion webhook, at the URL that reaches this process
                (patched,) = self.manifest(self.manifests, patch)
                conversion = patched["spec"]["conversion"]
                path_ = conversion["webhook"]["clientConfig"].pop("service")["path"]
                conversion["webhook"]["clientConfig"]["url"] = f"https://{self.service_host}:{self.webhook_port}{path_}"
                crd["spec"]["conversion"] = conversion
            self.apply_crd(crd)
        for configuration in self.manifest(self.manifests, "manifests.yaml"):
            self.install_webhooks(configuration, f"kueue-{configuration['metadata']['name']}", keep=_kept)

    def argv(self) -> list[str]:
        (upstream,) = self.manifest(self.manifests, "controller_manager_config.yaml")
        config = {**upstream,
                  "namespace": self.namespace,
                  "health": {**upstream.get("health", {}), "healthProbeBindAddress": f"{HOST}:{self.probe_port}"},
                  "metrics": {**upstream.get("metrics", {}), "bindAddress": "0"},
                  "webhook": {**upstream.get("webhook", {}), "port": self.webhook_port},
                  "leaderElection": {**upstream.get("leaderElection", {}), "leaderElect": False},
                  "integrations": {**upstream.get("integrations", {}), "frameworks": FRAMEWORKS}}
        path = self.root / "controller_manager_config.yaml"
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
        return [str(self.plane.binaries.kueue), f"--config={path}", "--feature-gates=VisibilityOnDemand=false"]
