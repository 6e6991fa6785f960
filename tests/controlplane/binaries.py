"""Where the test control plane's binaries are: built by tests/controlplane/build from the pinned
Go modules, once per machine (the script keys its cache by the pins and the toolchain).

`.ci/run` starts the build beside pytest; a test that needs the binaries runs the same script,
which waits on the running build's lock (and then only prints the folder). A contributor who
runs one control-plane test on a fresh machine gets them built that way, with the build's
progress on stderr. A test that asks for them is in the slow tier (tests/tiers.py).
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.tiers import starts_processes

BUILD = Path(__file__).resolve().parent / "build"


@dataclass(frozen=True)
class Binaries:
    folder: Path

    @property
    def kube_apiserver(self) -> Path:
        return self.folder / "kube-apiserver"

    @property
    def kube_controller_manager(self) -> Path:
        return self.folder / "kube-controller-manager"

    @property
    def kube_scheduler(self) -> Path:
        return self.folder / "kube-scheduler"

    @property
    def helm(self) -> Path:
        return self.folder / "helm"

    @property
    def training_operator(self) -> Path:
        return self.folder / "training-operator"

    @property
    def training_operator_manifests(self) -> Path:
        """manifests/base of the training-operator module it was built from (CRD, RBAC, webhook)."""
        return self.folder / "training-operator-manifests"

    @property
    def trainer_controller_manager(self) -> Path:
        return self.folder / "trainer-controller-manager"

    @property
    def trainer_manifests(self) -> Path:
        """manifests/base of the Kubeflow Trainer module it was built from (CRDs, RBAC, webhooks,
        configuration, the torch-distributed runtime)."""
        return self.folder / "trainer-manifests"

    @property
    def jobset(self) -> Path:
        return self.folder / "jobset"

    @property
    def jobset_manifests(self) -> Path:
        """config/components of the JobSet module it was built from (CRD, RBAC, webhooks, configuration)."""
        return self.folder / "jobset-manifests"

    @property
    def kueue(self) -> Path:
        return self.folder / "kueue"

    @property
    def kueue_manifests(self) -> Path:
        """config/components of the Kueue module it was built from (CRDs, RBAC, webhooks, configuration)."""
        return self.folder / "kueue-manifests"


class BuildFailed(RuntimeError):
    """tests/controlplane/build failed; the message carries the end of its log."""


@starts_processes
@functools.cache
def binaries() -> Binaries:
    """The built binaries (building them first when this machine has none for today's pins)."""
    if shutil.which("go") is None:
        raise BuildFailed("the control plane's tests need Go to build kube-apiserver and its peers "
                          "(tests/controlplane/kubernetes/go.mod names the version); install it and rerun")
    done = subprocess.run(["bash", str(BUILD)], stdout=subprocess.PIPE, stderr=sys.stderr, text=True, check=False)
    if done.returncode != 0:
        raise BuildFailed(f"tests/controlplane/build exited {done.returncode} (its log is above)")
    return Binaries(Path(done.stdout.strip()))
