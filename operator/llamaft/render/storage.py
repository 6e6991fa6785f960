"""Where a run's results go, judged on the rendered worker pod: on storage that outlives the pod,
or only in the container (lost with each pod).

The trainer writes its results to local paths taken from the spec (`result_paths`): the
checkpoints and the final export under `checkpointing.directory` (`<directory>/export`,
llamaft_trainer/main.py), TensorBoard event files under `tracking.tensorboard.directory` (default
`<directory>/tensorboard`) and a W&B offline run under `<directory>/wandb`
(llamaft_trainer/report/tracking.py `backends`). A path survives the pod only when it lies under a
volumeMount of the trainer container whose volume outlives the pod (`PERSISTENT`), or when it is
an fsspec URI the trainer writes through (`s3://`, `gs://`, ...). `lost_with_pod` names every
result path that does not, on its spec field, with the fixes; the operator refuses such a spec
at admission (render.admission) unless `checkpointing.discardWithPod` accepts the loss.

It reads the rendered template, not the spec's own fields, so that a persistent volume a user
mounts through `cluster.podTemplateOverrides` counts like `checkpointing.volumeClaim`, and an
override that replaces the claim's volume with an emptyDir does not. `llamaft run --local`
renders no pod and writes to the host: it never calls this. Pure: no API calls.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llamaft.api.spec import LlamaFineTuneSpec, WandbMode
from llamaft.api.validation import FieldError
from llamaft.render.trainjob import TEMPLATE_CONTAINER

# Kubernetes core/v1 VolumeSource (k8s.io/api/core/v1/types.go, v1.30; the `Volume` properties of
# kubernetes-validate's v1.30 schema): every source, by whether its data outlives the pod.
PERSISTENT = frozenset({
    "persistentVolumeClaim", "nfs", "hostPath", "csi", "awsElasticBlockStore", "azureDisk", "azureFile", "cephfs",
    "cinder", "fc", "flexVolume", "flocker", "gcePersistentDisk", "glusterfs", "iscsi", "photonPersistentDisk",
    "portworxVolume", "quobyte", "rbd", "scaleIO", "storageos", "vsphereVolume",
})
"""Network, node and claimed storage: what is written there stays when the pod goes. (`csi` is an
inline CSI volume: how long it lives is the driver's choice; the drivers used for results, such as
bucket mounts (gcsfuse, mountpoint-s3), keep the data.)"""
POD_LIFETIME = {
    "emptyDir": "an emptyDir, deleted with the pod",
    "ephemeral": "a generic ephemeral volume, whose claim is deleted with the pod",
    "configMap": "a configMap volume (read-only API data)",
    "secret": "a secret volume (read-only API data)",
    "downwardAPI": "a downwardAPI volume (read-only API data)",
    "projected": "a projected volume (read-only API data)",
    "gitRepo": "a gitRepo volume, a clone deleted with the pod",
}
"""Volumes whose content lives and dies with the pod, and how to say so."""
LOCAL_SCHEMES = ("file://", "local://")
"""fsspec's local filesystem: a path on the container's own filesystem, however it is written."""
IN_PROCESS_SCHEMES = ("memory://",)
"""fsspec's in-memory filesystem: gone with the process."""

DISCARD = "or set spec.checkpointing.discardWithPod: true to accept losing them"
CHECKPOINT_FIX = ("set spec.checkpointing.volumeClaim (a PersistentVolumeClaim, mounted at the directory), make "
                  "spec.checkpointing.directory an fsspec URI such as s3://bucket/run, mount a persistent volume there "
                  "through spec.cluster.podTemplateOverrides, " + DISCARD)


@dataclass(frozen=True)
class ResultPath:
    """One place the trainer writes results to: the spec field that sets it, the path as the
    trainer uses it, what goes there, how to keep it, whether the writer can write through a URI
    (W&B writes local files only: a URI there is a relative path in the container), and whether
    it is derived from checkpointing.directory (then the directory's own problem says it all)."""

    field: str
    path: str
    what: str
    fix: str
    uri_ok: bool = True
    derived: bool = False


def result_paths(spec: LlamaFineTuneSpec) -> list[ResultPath]:
    """Every path the trainer writes results to, as llamaft_trainer resolves them."""
    ckpt = spec.checkpointing
    root = ckpt.directory.rstrip("/")
    paths = [ResultPath("spec.checkpointing.directory", ckpt.directory,
                        "the checkpoints and the final export" if ckpt.export_hugging_face else "the checkpoints",
                        CHECKPOINT_FIX)]
    board = spec.tracking.tensorboard
    if board is not None:
        paths.append(ResultPath(
            "spec.tracking.tensorboard.directory", board.directory or f"{root}/tensorboard", "the TensorBoard event files",
            "leave it unset (under spec.checkpointing.directory), put it on a persistent volume or an fsspec URI such "
            "as s3://bucket/run/tensorboard, " + DISCARD, derived=board.directory is None))
    wandb = spec.tracking.wandb
    if wandb is not None and wandb.mode is WandbMode.OFFLINE:
        paths.append(ResultPath(
            "spec.tracking.wandb.mode", f"{root}/wandb", "the W&B offline run (under spec.checkpointing.directory)",
            "W&B writes local files only: give spec.checkpointing a volumeClaim and an absolute directory, use "
            "wandb.mode online, " + DISCARD, uri_ok=False, derived=True))
    return paths


def lost_with_pod(spec: LlamaFineTuneSpec, template: Mapping[str, Any]) -> list[FieldError]:
    """The result paths of `spec` that the worker pod `template` (as rendered, overrides merged)
    keeps only in the container, each on its spec field with the fixes; empty when every result
    outlives the pod, when checkpointing.discardWithPod accepts the loss, or when the template has
    no trainer container (the admission check reports that)."""
    if spec.checkpointing.discard_with_pod:
        return []
    pod = template.get("spec") if isinstance(template.get("spec"), Mapping) else {}
    assert isinstance(pod, Mapping)
    container = next((c for c in pod.get("containers") or [] if isinstance(c, Mapping)
                      and c.get("name") == TEMPLATE_CONTAINER), None)
    if container is None:
        return []
    volumes = {v.get("name"): v for v in pod.get("volumes") or [] if isinstance(v, Mapping)}
    mounts = [m for m in container.get("volumeMounts") or [] if isinstance(m, Mapping) and isinstance(m.get("mountPath"), str)]
    working_dir = container.get("workingDir") if isinstance(container.get("workingDir"), str) else None
    errors: list[FieldError] = []
    checkpoints_lost = False
    for result in result_paths(spec):
        if result.derived and checkpoints_lost:
            continue  # under checkpointing.directory, whose problem is already reported with its fixes
        where = _where(result, mounts, volumes, working_dir)
        checkpoints_lost = checkpoints_lost or (where is not None and result.field == "spec.checkpointing.directory")
        if where is not None:
            errors.append(FieldError(result.field, f"{result.path}: {result.what} would be written {where}: lost with "
                                     f"each pod, so no retry could resume and a finished run would leave nothing; "
                                     f"{result.fix}"))
    return errors


def _where(result: ResultPath, mounts: Sequence[Mapping[str, Any]], volumes: Mapping[Any, Mapping[str, Any]],
           working_dir: str | None) -> str | None:
    """Where `result` lands when that is inside the pod only (a phrase for the message), else None."""
    path = result.path
    if path.startswith(IN_PROCESS_SCHEMES):
        return "to fsspec's in-memory filesystem, inside the trainer process"
    for scheme in LOCAL_SCHEMES:
        if path.startswith(scheme):
            path = path[len(scheme):]
            break
    else:
        if "://" in path:
            if result.uri_ok:
                return None  # an fsspec URI: written to that storage
            path = path.replace("://", ":/")  # what pathlib makes of it: a relative path
    if not path.startswith("/"):
        if working_dir is None or not working_dir.startswith("/"):
            return ("to a relative path, in the container's working directory (on no volume: the container's own "
                    "filesystem)")
        path = posixpath.join(working_dir, path)
    path = posixpath.normpath(path)
    mount = _mount_of(path, mounts)
    if mount is None:
        return "to the container's own filesystem (no volume is mounted there)"
    volume = volumes.get(mount.get("name"))
    kind = next((k for k in (volume or {}) if k != "name"), None)
    if kind in PERSISTENT and mount.get("readOnly") is True:
        return (f"to the volume {mount.get('name')!r}, mounted read-only at {mount.get('mountPath')}: the trainer "
                "cannot write there (drop readOnly from that volumeMount)")
    if kind in PERSISTENT:
        return None
    described = POD_LIFETIME.get(kind or "", f"a {kind} volume, not one known to outlive the pod" if kind
                                  else "a volume the pod does not define")
    return f"to the volume {mount.get('name')!r} mounted at {mount.get('mountPath')}, {described}"


def _mount_of(path: str, mounts: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The volumeMount `path` is under (the deepest one: a mount hides what is beneath it)."""
    best: Mapping[str, Any] | None = None
    best_length = -1
    for mount in mounts:
        at = posixpath.normpath(str(mount["mountPath"]))
        inside = at == "/" or path == at or path.startswith(at + "/")
        if inside and len(at) > best_length:
            best, best_length = mount, len(at)
    return best
