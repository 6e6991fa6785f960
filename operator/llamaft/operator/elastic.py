"""(spec, status, pods, clock) -> the number of workers an elastic run asks for. Pure functions.

An elastic run (`spec.cluster.elastic`) shrinks instead of waiting, and grows back:

- **Shrink.** When a pod of the current attempt stays unschedulable (PodScheduled False with
  reason Unschedulable: the scheduler found no node with room, as kube-scheduler writes it when a
  scheduling cycle fails) for `elastic.shrinkAfterSeconds`, the run goes on with the largest
  worker count that (a) the scheduler placed (the attempt's size less its unschedulable pods), (b)
  the capacity planner fits (fewer ranks hold bigger FSDP shards, and with
  training.globalBatchSize each rank runs more micro-steps: the planner's per-rank memory is the
  verdict), and (c) is at least `elastic.minWorkers`. When no such count exists the pods keep
  waiting, and status.workers says why (NoSmallerSizeFits).
- **Grow back.** A run below spec.cluster.workers asks for them again once it has trained
  `elastic.growBackAfterSeconds` at its smaller size and reached a checkpoint step
  (`checkpointing.everyNSteps`) beyond the one it was at when it shrank, so the larger attempt
  resumes from a checkpoint made at the smaller size and loses no steps. The operator cannot see
  the nodes (it has no RBAC for them): the try is the probe. If the pods find room, the run is
  back at its size; if not, the shrink rule takes it back down after `shrinkAfterSeconds`.

How a size change is carried out is the backend's (`JobBackend.scalable`): a PyTorchJob is elastic
in place (its Worker replicas are patched; torchrun's rendezvous admits between minReplicas and
maxReplicas nodes and restarts the worker group when the membership changes), a TrainJob's node
count is immutable, so each size change is a new attempt from the newest checkpoint (lifecycle).
Neither spends the retry budget: a resize is not a failure.

With Kueue (`scheduling.queueName`) the pods are not created until Kueue admits the whole job: its
partial admission (PodSet.minCount) covers batch/v1 Jobs and MPIJobs only (kueue
keps/420-partial-admission), so Kueue never admits fewer PyTorchJob or TrainJob workers by itself.
The operator asks for fewer instead (`shrink_queued`): when the job's Workload has had no quota
reserved (condition QuotaReserved False, as Kueue's scheduler leaves a workload that does not fit:
kubernetes-sigs/kueue pkg/scheduler/scheduler.go, requeueAndUpdate ->
workload.UnsetQuotaReservationWithCondition, reason Pending, with the flavor assigner's
"insufficient unused quota ..." message; the condition keeps its lastTransitionTime while it stays
False, as apimeta.SetStatusCondition does) for
`elastic.shrinkAfterSeconds`, the run asks for one worker fewer, down to the largest count the planner
fits, and again after each further timeout, down to `elastic.minWorkers`. Kueue's job reconciler
rewrites a suspended job's Workload when the job's pod counts change and it holds no quota
(pkg/controller/jobframework/reconciler.go, ensureOneWorkload: `toUpdate`), so each smaller size
queues again at once. Kueue's message names the resource short, not the workers: one worker at a
time is the probe that needs no parsing of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.api.status import WorkerCounts
from llamaft.operator.timestamps import parse_time

AS_SPECIFIED = "AsSpecified"
SHRUNK = "Shrunk"
NO_SMALLER_SIZE_FITS = "NoSmallerSizeFits"
GROWING_BACK = "GrowingBack"


@dataclass(frozen=True)
class Placement:
    """What the scheduler made of the current attempt's pods."""

    unschedulable: int = 0
    """Pods not bound to a node whose PodScheduled condition is False with reason Unschedulable."""
    since: datetime | None = None
    """The earliest of those conditions' lastTransitionTime (the scheduler writes it once per pod)."""
    message: str = ""
    """The scheduler's message on the oldest of them (`0/3 nodes are available: ...`)."""


def _index(pod: Mapping[str, Any], index_label: str) -> int | None:
    value = str(((pod.get("metadata") or {}).get("labels") or {}).get(index_label, ""))
    return int(value) if value.isdigit() else None


def placement(pods: Sequence[Mapping[str, Any]], index_label: str | None = None, size: int | None = None) -> Placement:
    """Count the pods the scheduler could not place. A pod is unschedulable while it is Pending,
    unbound (no spec.nodeName) and its PodScheduled condition says False/Unschedulable: the
    condition kube-scheduler's failure handler writes (pkg/scheduler/schedule_one.go,
    handleSchedulingFailure -> updatePod with reason v1.PodReasonUnschedulable). A pod being deleted
    no longer counts, nor one whose replica index (`index_label`) is `size` or more: a job just
    scaled down in place still shows the pods its controller is about to remove."""
    count, since, message = 0, None, ""
    for pod in pods:
        meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp") or spec.get("nodeName") or status.get("phase", "Pending") != "Pending":
            continue
        index = _index(pod, index_label) if index_label is not None else None
        if size is not None and index is not None and index >= size:
            continue
        cond = next((c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), None)
        if cond is None or cond.get("status") != "False" or cond.get("reason") != "Unschedulable":
            continue
        count += 1
        at = parse_time(cond.get("lastTransitionTime"))
        if at is not None and (since is None or at < since):
            since, message = at, str(cond.get("message") or "")
    return Placement(count, since, message)


@dataclass(frozen=True)
class QuotaWait:
    """The job's Kueue Workload while Kueue reserves it no quota."""

    since: datetime | None
    """Its QuotaReserved condition's lastTransitionTime (when it last became False)."""
    message: str = ""
    """Kueue's reason on that condition (`couldn't assign flavors to pod set worker: ...`)."""


WORKLOAD_JOB_UID = "kueue.x-k8s.io/job-uid"
"""The label Kueue puts on a job's Workloads (pkg/controller/constants: JobUIDLabel)."""


def quota_wait(workloads: Sequence[Mapping[str, Any]]) -> QuotaWait | None:
    """The wait of the job's Workload (the one not being deleted) when its QuotaReserved condition is
    False: None when Kueue reserved quota, or has not looked at it yet (no such condition)."""
    for workload in workloads:
        if (workload.get("metadata") or {}).get("deletionTimestamp"):
            continue
        conditions = (workload.get("status") or {}).get("conditions") or []
        cond = next((c for c in conditions if c.get("type") == "QuotaReserved"), None)
        if cond is not None and cond.get("status") == "False":
            return QuotaWait(parse_time(cond.get("lastTransitionTime")), str(cond.get("message") or ""))
    return None


def unschedulable_indices(pods: Sequence[Mapping[str, Any]], index_label: str) -> list[int]:
    """The replica indices (label `index_label`) of the pods `placement` counts as unschedulable:
    scaling a job down in place removes its highest indices, so it helps only when these are
    among them."""
    out = []
    for pod in pods:
        if placement([pod]).unschedulable:
            index = _index(pod, index_label)
            out.append(-1 if index is None else index)
    return out


def current_workers(spec: LlamaFineTuneSpec, workers: WorkerCounts) -> int:
    """The workers the run asks for now: status.workers.current within the elastic range (a spec
    change may have moved the range under it), else spec.cluster.workers."""
    elastic, wanted = spec.cluster.elastic, spec.cluster.workers
    if elastic is None or workers.current is None or workers.reason not in (SHRUNK, NO_SMALLER_SIZE_FITS):
        return wanted
    return max(elastic.min_workers, min(workers.current, wanted))


@dataclass(frozen=True)
class Resize:
    """A change of the run's size (or why it cannot shrink)."""

    workers: int
    """The size to run with (unchanged for NoSmallerSizeFits)."""
    reason: str
    """Shrunk, GrowingBack or NoSmallerSizeFits (status.workers.reason and the event's reason)."""
    message: str

    @property
    def resizes(self) -> bool:
        return self.reason != NO_SMALLER_SIZE_FITS


Fits = Callable[[int], str | None]
"""The capacity planner on `n` workers: None when it fits (or cannot tell), else why not."""


def shrink(spec: LlamaFineTuneSpec, current: int, placed: Placement, now: datetime, fits: Fits,
           attempt_start: datetime | None = None) -> Resize | None:
    """The shrink rule (module docstring); None while nothing is due.

    The clock starts no earlier than `attempt_start` + cluster.terminationGracePeriodSeconds: the
    pods of the attempt before hold their room until they are gone (kube-scheduler counts a
    terminating pod's requests), so a new attempt's pods may wait for that long without the run
    lacking capacity."""
    elastic = spec.cluster.elastic
    if elastic is None or placed.unschedulable == 0 or placed.since is None:
        return None
    since = placed.since
    if attempt_start is not None:
        since = max(since, attempt_start + timedelta(seconds=spec.cluster.termination_grace_period_seconds))
    if now - since < timedelta(seconds=elastic.shrink_after_seconds):
        return None
    # No figure that changes from one look to the next: an unchanged decision writes nothing.
    pending = f"{placed.unschedulable} of {current} worker pod(s) unschedulable for over {elastic.shrink_after_seconds}s"
    scheduler = f" ({placed.message})" if placed.message else ""
    top = current - placed.unschedulable
    if top < elastic.min_workers:
        return Resize(current, NO_SMALLER_SIZE_FITS,
                      f"{pending}{scheduler}; the scheduler placed {max(top, 0)}, fewer than elastic.minWorkers "
                      f"{elastic.min_workers}: waiting for room (lower minWorkers to run on fewer)")
    return _largest_fitting(spec, current, top, f"{pending}{scheduler}", fits)


def owns_the_wait(spec: LlamaFineTuneSpec, current: int, placed: Placement, now: datetime, fits: Fits,
                  attempt_start: datetime | None = None) -> bool:
    """Whether the shrink rule, not the stall deadline, decides about this attempt's wait: a worker
    is unschedulable, the scheduler placed at least elastic.minWorkers, and the shrink is either
    not due yet or due and resizing. A step cannot advance while a worker waits for a node, so
    runPolicy.progressDeadlineSeconds would otherwise restart the attempt as Stalled, spending a
    retry on a wait the shrink ends (a shrinkAfterSeconds longer than the deadline, or both due at
    one look after the operator was away). When no smaller size can run (minWorkers reached, or
    the planner fits none), the deadline applies as for any run."""
    elastic = spec.cluster.elastic
    if elastic is None or placed.unschedulable == 0 or current - placed.unschedulable < elastic.min_workers:
        return False
    resize = shrink(spec, current, placed, now, fits, attempt_start)
    return resize is None or resize.resizes


def shrink_queued(spec: LlamaFineTuneSpec, current: int, wait: QuotaWait | None, now: datetime, fits: Fits,
                  last_resize: datetime | None = None) -> Resize | None:
    """The shrink rule for a job Kueue holds (module docstring): one worker fewer once its Workload
    has waited for quota `elastic.shrinkAfterSeconds`, counted from the last resize too (Kueue
    rewrites the Workload of a resized job, and a condition that stays False keeps its time)."""
    elastic = spec.cluster.elastic
    if elastic is None or wait is None or wait.since is None:
        return None
    since = wait.since if last_resize is None else max(wait.since, last_resize)
    if now - since < timedelta(seconds=elastic.shrink_after_seconds):
        return None
    pending = f"Kueue has reserved no quota for {current} worker(s) for over {elastic.shrink_after_seconds}s"
    kueue = f" ({wait.message})" if wait.message else ""
    if current - 1 < elastic.min_workers:
        return Resize(current, NO_SMALLER_SIZE_FITS,
                      f"{pending}{kueue}; {current} is elastic.minWorkers: waiting in the queue (lower minWorkers "
                      "to run on fewer)")
    return _largest_fitting(spec, current, current - 1, f"{pending}{kueue}", fits)


def _largest_fitting(spec: LlamaFineTuneSpec, current: int, top: int, pending: str, fits: Fits) -> Resize:
    """The largest size from `top` down to elastic.minWorkers that the planner fits (Shrunk), else
    NoSmallerSizeFits with each size's refusal."""
    elastic = spec.cluster.elastic
    assert elastic is not None
    refused = []
    for n in range(top, elastic.min_workers - 1, -1):
        why = fits(n)
        if why is None:
            return Resize(n, SHRUNK, f"{pending}: shrinking to {n} worker(s) (elastic.minWorkers "
                          f"{elastic.min_workers}); it grows back to {spec.cluster.workers} at a checkpoint "
                          f"{elastic.grow_back_after_seconds}s or more from now")
        refused.append(f"{n}: {why}")
    return Resize(current, NO_SMALLER_SIZE_FITS,
                  f"{pending}; no size from {top} down to elastic.minWorkers {elastic.min_workers} fits "
                  f"in memory ({'; '.join(refused)}): waiting for room")


def grow(spec: LlamaFineTuneSpec, current: int, workers: WorkerCounts, step: int | None, now: datetime) -> Resize | None:
    """The grow-back rule (module docstring); None while nothing is due."""
    elastic, wanted = spec.cluster.elastic, spec.cluster.workers
    if elastic is None or current >= wanted or step is None:
        return None
    since = parse_time(workers.last_resize_time)
    if since is not None and now - since < timedelta(seconds=elastic.grow_back_after_seconds):
        return None
    every = spec.checkpointing.every_n_steps
    if step // every <= (workers.last_resize_step or 0) // every:
        return None
    return Resize(wanted, GROWING_BACK, f"ran on {current} worker(s) since step {workers.last_resize_step or 0}; "
                  f"at the checkpoint of step {step // every * every} asking for {wanted} again (spec.cluster.workers)")


def sized(spec: LlamaFineTuneSpec, workers: int) -> LlamaFineTuneSpec:
    """The spec with cluster.workers = `workers`: what an attempt of that size renders and plans."""
    if workers == spec.cluster.workers:
        return spec
    return spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"workers": workers})})


def status(spec: LlamaFineTuneSpec, base: WorkerCounts, current: int, reason: str, message: str | None,
           now: str, step: int | None, resized: bool) -> WorkerCounts:
    """status.workers with the size fields set (the pod counts kept from `base`)."""
    update: dict[str, Any] = {"current": current, "desired": spec.cluster.workers, "reason": reason}
    if message is not None:
        update["message"] = message[:2048]
    if resized:
        update.update(last_resize_time=now, last_resize_step=step)
    return base.model_copy(update=update)
