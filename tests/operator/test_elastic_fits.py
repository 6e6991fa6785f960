"""The elastic shrink's memory check as the operator wires it (issue 39): `Step._fits` asks the
real capacity planner about the smaller size (`elastic.sized`), and one step of a running attempt
with an unschedulable pod acts on its verdict.

test_elastic.py tests the decision with injected `fits` functions, and the simulated clusters run
CPU-only workers (gpusPerWorker 0), where the planner cannot refuse; neither would notice a `_fits`
that always said yes. Here the GPU spec is one where halving the world doubles each rank's FSDP
shard past the GPU's memory, so the step must refuse to shrink (NoSmallerSizeFits, in the
planner's words), and, beside it, one where the smaller size fits and the step shrinks in place.
No processes, no kopf runtime: a Step over a recording client."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.api.validation import validate_spec
from llamaft.operator import elastic
from llamaft.operator.settings import OperatorSettings
from llamaft.operator.state import new_memo
from llamaft.operator.step import Step
from llamaft.planner import Admission, admission
from llamaft.render.backends import backend_for

from tests.operator.conftest import tiny_spec
from tests.operator.test_elastic import INDEX, pending
from tests.operator.test_evidence import JOB, OWNER, RunningJobKube, pod
from tests.operator.test_operator_scale import RecordingKube

SCHEDULER = "0/2 nodes are available: 1 Insufficient nvidia.com/gpu."


class ShrinkKube(RunningJobKube, RecordingKube):
    """A running two-worker attempt (test_evidence's job and pods) whose other calls are recorded
    (test_operator_scale): the job patch a shrink in place writes, the status patch, the children."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        RunningJobKube.__init__(self, OWNER, pods)
        RecordingKube.__init__(self)

    def written(self, name: str) -> list[Any]:
        return [args for call, args in self.calls if call == name]


def elastic_spec(gpus_per_worker: int) -> dict[str, Any]:
    """Llama-2-7B on H100s, two workers, allowed down to one."""
    return tiny_spec(cluster={"workers": 2, "gpusPerWorker": gpus_per_worker, "gpuModel": "H100", "elastic": {
        "minWorkers": 1, "maxWorkers": 2, "shrinkAfterSeconds": 60, "growBackAfterSeconds": 300}})


def verdicts(spec: LlamaFineTuneSpec) -> tuple[Admission, Admission]:
    """The planner on the spec's two workers and on one."""
    return admission(spec), admission(elastic.sized(spec, 1))


def step_once(spec: dict[str, Any]) -> tuple[Step, ShrinkKube, list[tuple[str, str, str]]]:
    """One step of attempt 1, started ten minutes ago (well within the stall timeout): worker 0
    runs, worker 1 has been unschedulable for five (past the attempt's termination grace period and
    shrinkAfterSeconds)."""
    now = datetime.now(UTC)
    running = pod(f"{JOB}-worker-0", "a")
    running["metadata"]["labels"][INDEX] = "0"
    kube = ShrinkKube([running, pending(1, since=now - timedelta(minutes=5), message=SCHEDULER)])
    step = Step(new_memo(OperatorSettings(), kube=kube), "default", "x", logger=None)
    events: list[tuple[str, str, str]] = []
    step.event = lambda obj, type_, reason, message: events.append((type_, reason, message))  # type: ignore[method-assign]
    started = (now - timedelta(minutes=10)).isoformat().replace("+00:00", "Z")
    obj = {"apiVersion": "llamaft.io/v1alpha1", "kind": "LlamaFineTune",
           "metadata": {"name": "x", "namespace": "default", "uid": OWNER.uid, "generation": 1}, "spec": spec,
           "status": {"phase": "Running", "attempt": 1, "jobName": JOB, "backend": "PyTorchJob",
                      "attemptStartTime": started}}
    step._run(obj)
    return step, kube, events


def workers_written(kube: ShrinkKube) -> dict[str, Any]:
    [(_, patch)] = kube.written("patch_finetune_status")
    return dict(patch["workers"])


def test_no_shrink_when_one_worker_would_run_out_of_gpu_memory() -> None:
    """One GPU per worker: two ranks fit, one rank holding the whole model's shards does not."""
    spec = elastic_spec(gpus_per_worker=1)
    two, one = verdicts(validate_spec(spec))
    assert two.fits is True, two.message
    assert one.fits is False and one.message.startswith("will not fit"), one.message

    step, kube, events = step_once(spec)

    assert kube.written("patch_job") == [], "no scale patch: the run keeps its size"
    assert kube.written("create_job") == [] and kube.written("delete_job") == []
    workers = workers_written(kube)
    assert (workers["current"], workers["reason"]) == (2, elastic.NO_SMALLER_SIZE_FITS), workers
    assert f"1: {one.message}" in workers["message"] and SCHEDULER in workers["message"], workers["message"]
    assert [(t, r) for t, r, _ in events if r == elastic.NO_SMALLER_SIZE_FITS] == [("Warning", elastic.NO_SMALLER_SIZE_FITS)]
    assert step.own.sized_capacity == {(1, 1): one.message}, "the verdict is cached per generation and size"


def test_the_run_shrinks_when_the_smaller_size_fits() -> None:
    """Two GPUs per worker: one worker's two ranks fit as well, so the job is scaled to one in place."""
    spec = elastic_spec(gpus_per_worker=2)
    two, one = verdicts(validate_spec(spec))
    assert two.fits is True and one.fits is True, (two.message, one.message)

    step, kube, events = step_once(spec)

    assert kube.written("patch_job") == [(JOB, backend_for("PyTorchJob").scale_patch(1), "PyTorchJob")]
    workers = workers_written(kube)
    assert (workers["current"], workers["reason"]) == (1, elastic.SHRUNK), workers
    assert [(t, r) for t, r, _ in events if r == elastic.SHRUNK] == [("Warning", elastic.SHRUNK)]
    assert step.own.sized_capacity == {(1, 1): None}
