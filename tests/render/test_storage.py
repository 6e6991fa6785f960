"""render.storage: a run whose results would live only in the worker container is refused, judged on
the rendered pod template (the spec's claim, a URI, or a volume the overrides mount), for both job
backends; checkpointing.discardWithPod accepts the loss. Pure: no cluster."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import pytest
from llamaft.api.spec import Backend
from llamaft.api.validation import validate_spec
from llamaft.render import admission, desired, schemas, storage
from llamaft.render.naming import Owner

OWNER = Owner("run", "team", "0f5e1c2a-1111-2222-3333-444455556666")
BASE: dict[str, Any] = {
    "model": {"source": "meta-llama/Llama-2-7b-hf"},
    "dataset": {"format": "samsum", "source": "knkarthick/samsum"},
    "cluster": {"workers": 1, "gpusPerWorker": 8},
}
CLAIM = {"directory": "/checkpoints/run", "volumeClaim": "results"}
CKPT = "spec.checkpointing.directory"
BOARD = "spec.tracking.tensorboard.directory"
WANDB = "spec.tracking.wandb.mode"


def overrides(volume: dict[str, Any] | None, at: str, working_dir: str | None = None,
              read_only: bool = False) -> dict[str, Any]:
    """podTemplateOverrides mounting `volume` (named `results`) at `at` in the trainer container."""
    container: dict[str, Any] = {"name": "pytorch"}
    if volume is not None:
        container["volumeMounts"] = [{"name": "results", "mountPath": at, **({"readOnly": True} if read_only else {})}]
    if working_dir is not None:
        container["workingDir"] = working_dir
    spec: dict[str, Any] = {"containers": [container]}
    if volume is not None:
        spec["volumes"] = [{"name": "results", **volume}]
    return {"cluster": {"podTemplateOverrides": {"spec": spec}}}


def case(checkpointing: dict[str, Any] | None = None, **more: Any) -> dict[str, Any]:
    spec = {**BASE, **({"checkpointing": checkpointing} if checkpointing is not None else {})}
    for key, value in more.items():
        spec[key] = {**spec.get(key, {}), **value}
    return spec


PVC = {"persistentVolumeClaim": {"claimName": "mine"}}
WANDB_OFFLINE = {"wandb": {"project": "p", "mode": "offline"}}
# (case, spec, the fields refused and a phrase of the first message)
TABLE: list[tuple[str, dict[str, Any], list[str], str]] = [
    ("the default directory, nothing mounted", case(), [CKPT], "the container's own filesystem"),
    ("a volumeClaim at the directory", case(CLAIM), [], ""),
    ("an s3:// URI", case({"directory": "s3://bucket/run"}), [], ""),
    ("a gs:// URI", case({"directory": "gs://bucket/run"}), [], ""),
    ("file:// is a local path", case({"directory": "file:///checkpoints"}), [CKPT], "own filesystem"),
    ("memory:// is in the process", case({"directory": "memory://run"}), [CKPT], "in-memory"),
    ("a relative path", case({"directory": "./runs/x"}), [CKPT], "relative path"),
    ("discardWithPod accepts the loss", case({"discardWithPod": True}), [], ""),
    ("discardWithPod with trackers too", case({"discardWithPod": True, "directory": "s3://b/r"},
                                              tracking={**WANDB_OFFLINE, "tensorboard": {"directory": "/tb"}}), [], ""),
    ("no export: only checkpoints are named", case({"exportHuggingFace": False}), [CKPT], "/checkpoints: the checkpoints would"),
    ("overrides mount a claim there", case(**overrides(PVC, "/checkpoints")), [], ""),
    ("overrides mount nfs on a parent", case({"directory": "/data/run"}, **overrides({"nfs": {"server": "n", "path": "/x"}}, "/data")),
     [], ""),
    ("overrides mount a claim read-only", case(**overrides(PVC, "/checkpoints", read_only=True)), [CKPT],
     "mounted read-only"),
    ("overrides mount a hostPath", case(**overrides({"hostPath": {"path": "/mnt/ckpt"}}, "/checkpoints")), [], ""),
    ("overrides mount a CSI volume", case(**overrides({"csi": {"driver": "gcsfuse.csi.storage.gke.io"}}, "/checkpoints")), [], ""),
    ("overrides mount an emptyDir", case(**overrides({"emptyDir": {}}, "/checkpoints")), [CKPT], "an emptyDir, deleted with the pod"),
    ("overrides mount a generic ephemeral volume", case(**overrides({"ephemeral": {"volumeClaimTemplate": {"spec": {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}}}, "/checkpoints")),
     [CKPT], "generic ephemeral volume"),
    ("overrides mount a configMap", case(**overrides({"configMap": {"name": "c"}}, "/checkpoints")), [CKPT], "configMap"),
    ("an emptyDir deeper than the claim wins", case({**CLAIM, "directory": "/checkpoints"},
                                                     **overrides({"emptyDir": {}}, "/checkpoints/run")), [], ""),
    ("the directory under an emptyDir inside the claim", case({**CLAIM, "directory": "/checkpoints"},
                                                               tracking={"tensorboard": {"directory": "/checkpoints/tmp/tb"}},
                                                               **overrides({"emptyDir": {}}, "/checkpoints/tmp")),
     [BOARD], "'results' mounted at /checkpoints/tmp"),
    ("a relative path in a working directory on a claim",
     case({"directory": "runs/x"}, **overrides(PVC, "/work", working_dir="/work")), [], ""),
    ("a relative path in a working directory on no volume",
     case({"directory": "runs/x"}, **overrides(None, "", working_dir="/work")), [CKPT], "own filesystem"),
    ("tensorboard outside the claim", case(CLAIM, tracking={"tensorboard": {"directory": "/tmp/tb"}}), [BOARD],
     "TensorBoard event files"),
    ("tensorboard under the claim by default", case(CLAIM, tracking={"tensorboard": {}}), [], ""),
    ("tensorboard to a URI", case(CLAIM, tracking={"tensorboard": {"directory": "s3://b/tb"}}), [], ""),
    ("tensorboard by default under a URI directory", case({"directory": "s3://b/r"}, tracking={"tensorboard": {}}), [], ""),
    ("W&B offline under a URI directory writes local files", case({"directory": "s3://b/r"}, tracking=WANDB_OFFLINE),
     [WANDB], "W&B writes local files only"),
    ("W&B offline on the claim", case(CLAIM, tracking=WANDB_OFFLINE), [], ""),
    ("W&B online under a URI directory", case({"directory": "s3://b/r"}, tracking={"wandb": {
        "project": "p", "apiKeySecret": {"name": "w", "key": "k"}}}), [], ""),
    ("one cause, one problem: trackers under a lost directory", case(tracking={**WANDB_OFFLINE, "tensorboard": {}}),
     [CKPT], "the checkpoints and the final export"),
]


@pytest.mark.parametrize(("name", "body", "fields", "phrase"), TABLE, ids=[row[0] for row in TABLE])
def test_results_that_would_live_only_in_the_container(name: str, body: dict[str, Any], fields: list[str],
                                                       phrase: str) -> None:
    spec = validate_spec(body)
    template = desired.pod_template(OWNER, spec, 1)
    errors = storage.lost_with_pod(spec, template)
    assert [e.path for e in errors] == fields, [str(e) for e in errors]
    if errors:
        assert phrase in errors[0].message, errors[0].message
        assert "discardWithPod: true" in errors[0].message


def test_the_message_names_the_fields_and_the_fixes() -> None:
    [error] = storage.lost_with_pod(validate_spec(case()), desired.pod_template(OWNER, validate_spec(case()), 1))
    assert str(error).startswith("spec.checkpointing.directory: /checkpoints: the checkpoints and the final export would "
                                 "be written to the container's own filesystem")
    for fix in ("spec.checkpointing.volumeClaim", "s3://bucket/run", "spec.checkpointing.discardWithPod: true",
                "podTemplateOverrides"):
        assert fix in error.message


@pytest.mark.parametrize("backend", [Backend.PYTORCH_JOB, Backend.TRAIN_JOB])
def test_admission_refuses_it_for_both_backends(backend: Backend) -> None:
    """child_errors (llamaft validate, render) and checked_children (the operator) judge the job's
    own pod template: an override's persistent volume counts for either job kind."""
    lost = validate_spec(case())
    errors = admission.child_errors(lost, "run", "team", backend=backend)
    assert [e.path for e in errors] == [CKPT], errors
    assert [e.path for e in admission.checked_children(OWNER, lost, backend=backend).errors] == [CKPT]
    for kept in (case(CLAIM), case(**overrides(PVC, "/checkpoints")), case({"discardWithPod": True})):
        assert admission.child_errors(validate_spec(kept), "run", "team", backend=backend) == []
        assert admission.checked_children(OWNER, validate_spec(kept), backend=backend).errors == []


def test_every_kubernetes_volume_source_is_classified() -> None:
    """Each VolumeSource of the oldest supported Kubernetes (kubernetes-validate's v1.30 schema) is
    known to outlive the pod or not; a source the table lacks would be refused as unknown."""
    schema = json.loads((resources.files("kubernetes_validate") / "kubernetes-json-schema"
                         / f"v{schemas.K8S_SCHEMA_VERSION}.0-local-strict" / "_definitions.json").read_text())
    sources = set(schema["$defs"]["io.k8s.api.core.v1.Volume"]["properties"]) - {"name"}
    assert sources == storage.PERSISTENT | set(storage.POD_LIFETIME)
    assert not storage.PERSISTENT & set(storage.POD_LIFETIME)


def test_the_operator_refuses_it_as_an_invalid_spec() -> None:
    """The operator's step (specs.validated -> Step._invalid, as for every admission refusal): the
    Valid condition False with the message, a Warning event naming the field, no job; a spec that
    accepts the loss starts."""
    from llamaft.operator.settings import OperatorSettings
    from llamaft.operator.state import new_memo
    from llamaft.operator.step import Step

    from tests.operator.test_operator_scale import RecordingKube

    class Kube(RecordingKube):
        def create_job(self, namespace: str, job: dict[str, Any]) -> dict[str, Any]:
            self.calls.append(("create_job", (job,)))
            return {**job, "metadata": {**job["metadata"], "resourceVersion": "1"}}

    def step_of(spec: dict[str, Any]) -> tuple[RecordingKube, list[tuple[Any, ...]]]:
        kube, events = Kube(), []
        step = Step(new_memo(OperatorSettings(), kube=kube), "team", "run", logger=None)
        step.event = lambda *args: events.append(args)  # type: ignore[method-assign]
        step.children_index = {}
        step._run({"apiVersion": "llamaft.io/v1alpha1", "kind": "LlamaFineTune", "status": {}, "spec": spec,
                   "metadata": {"name": "run", "namespace": "team", "uid": OWNER.uid, "generation": 1}})
        return kube, events

    kube, events = step_of(case())
    [(_, (_, patch))] = [call for call in kube.calls if call[0] == "patch_finetune_status"]
    valid = next(c for c in patch["conditions"] if c["type"] == "Valid")
    assert (valid["status"], valid["reason"], patch["phase"]) == ("False", "InvalidSpec", "Failed")
    assert "spec.checkpointing.directory: /checkpoints: the checkpoints" in valid["message"]
    assert [(e[1], e[2]) for e in events] == [("Warning", "InvalidSpec")]
    assert "discardWithPod" in events[0][3]
    assert "create_job" not in kube.names()
    kube, events = step_of(case({"discardWithPod": True}, rendezvous={"backend": "c10d"}))
    assert "create_job" in kube.names() and not [e for e in events if e[2] == "InvalidSpec"], events
