"""Trainer pods' failure evidence kept from the watch, for the pods that are deleted with it.

A lifecycle step reads an attempt's pods by listing them. Some disruptions delete the pod that
carries their evidence: an eviction through the Eviction API (a drain), the scheduler's
preemption and the taint manager's deletion (a lost node, then PodGC) add a DisruptionTarget
condition and delete the pod gracefully, and it is gone seconds later. A step that lists after
that (a busy operator, a step already running when the condition was added) finds no pod to
explain the attempt's end, and the attempt is recorded with a lesser cause (the peers' "Killed",
the job's "JobFailed") and without the node to avoid.

The pod watch (`daemon.wake_for_child`) sees every version of a trainer pod, the last one in its
DELETED event. Each version that carries such evidence (`failures.erasable`) is kept here, and a
step adds the kept pods its list no longer has (`recall`): the same evidence the pod showed,
judged by the same `failures.classify`. A kept pod belongs to one job (the backend's pod
selector, and created no earlier than the job: a LlamaFineTune deleted and created again reuses
its attempts' job names), so it can only explain its own attempt. The state is in memory (the
operator's memo): an operator restarted in between knows what the API server still has.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from llamaft.operator import failures

Obj = Mapping[str, Any]
Key = tuple[str, str]

MAX_PODS_PER_OWNER = 64
"""Kept pods per LlamaFineTune, newest last: a gang's worth of evictions, bounded whatever happens."""


def selector_matches(selector: str, labels: Mapping[str, Any] | None) -> bool:
    """Whether `labels` satisfy an equality-based label selector ("k=v,k2=v2", as the backends'
    pod selectors are written)."""
    labels = labels or {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, sep, value = term.partition("=")
        if not sep or labels.get(key.strip()) != value.strip():
            return False
    return True


def _kept(pod: Obj) -> dict[str, Any]:
    """What of a pod the failure classification and the recall read: its identity, labels,
    creation and deletion times, node and status."""
    meta = pod.get("metadata") or {}
    return {
        "kind": "Pod",
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "labels", "creationTimestamp", "deletionTimestamp")
                     if k in meta},
        "spec": {"nodeName": (pod.get("spec") or {}).get("nodeName")},
        "status": dict(pod.get("status") or {}),
    }


class PodEvidence:
    """(namespace, LlamaFineTune name) -> the kept pods by uid. The watch writes on the event loop
    and the steps read in the operator's threads, hence the lock."""

    def __init__(self, max_per_owner: int = MAX_PODS_PER_OWNER) -> None:
        self._lock = threading.Lock()
        self._pods: dict[Key, OrderedDict[str, dict[str, Any]]] = {}
        self._max = max_per_owner

    def keep(self, key: Key, pod: Obj) -> bool:
        """Keep this version of the pod if it carries evidence its deletion would erase; returns
        whether it was kept. A later version of a kept pod replaces it (its DELETED event is the last)."""
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        if not uid or not failures.erasable(pod):
            return False
        with self._lock:
            pods = self._pods.setdefault(key, OrderedDict())
            pods[uid] = _kept(pod)
            pods.move_to_end(uid)
            while len(pods) > self._max:
                pods.popitem(last=False)
        return True

    def recall(self, key: Key, selector: str, job: Obj | None, listed: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The listed pods, then the kept pods of `job` that the list no longer has. Kept pods of
        other jobs (earlier attempts, an earlier incarnation's) are dropped."""
        if job is None:
            return list(listed)
        # RFC 3339 UTC timestamps (the API server's) order as strings.
        created = str((job.get("metadata") or {}).get("creationTimestamp") or "")
        present = {str((p.get("metadata") or {}).get("uid")) for p in listed}
        with self._lock:
            pods = self._pods.get(key)
            if not pods:
                return list(listed)
            mine = {uid: p for uid, p in pods.items() if selector_matches(selector, p["metadata"].get("labels"))
                    and str(p["metadata"].get("creationTimestamp") or "") >= created}
            if len(mine) < len(pods):
                self._pods[key] = OrderedDict(mine)
        return [*listed, *(p for uid, p in mine.items() if uid not in present)]

    def forget(self, key: Key) -> None:
        """The LlamaFineTune is gone."""
        with self._lock:
            self._pods.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(p) for p in self._pods.values())
