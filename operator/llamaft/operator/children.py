"""The children a LlamaFineTune's spec describes (config, managed etcd, monitoring), server-side
applied and pruned, with events only for what changed: the part of a lifecycle step that keeps
them as the spec says, and the pure helpers the child watches use."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import kopf

from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.operator import observe, timestamps
from llamaft.operator.kube import ForeignObject, Kube, MonitoringUnavailable, owned_by
from llamaft.operator.settings import OperatorSettings
from llamaft.operator.state import Obj, now, object_state, operator_state, wake
from llamaft.render import objects
from llamaft.render.naming import LABEL_FINETUNE, Owner

PRUNABLE = ("ConfigMap", "Deployment", "Service", "PrometheusRule")
"""Kinds of the children the spec can stop wanting: the dashboard ConfigMap and the alerts
(monitoring.dcgm off), the managed etcd (rendezvous changed). The trainer's PodMonitor is always
wanted; the attempts' jobs are the lifecycle's to delete."""

CHILD_KINDS = ("ConfigMap", "Deployment", "Service", "PodMonitor", "PrometheusRule")


def live_versions(listed: Mapping[str, Sequence[Obj]]) -> dict[tuple[str, str], str]:
    """(kind, name) -> resourceVersion of the listed children (those that have one)."""
    return {(kind, str(o["metadata"]["name"])): str(o["metadata"]["resourceVersion"])
            for kind, objs in listed.items() for o in objs if (o.get("metadata") or {}).get("resourceVersion")}


def changed_children(after: Mapping[tuple[str, str], str], *before: Mapping[tuple[str, str], str]) -> list[str]:
    """The children a round of server-side applies changed, as "Kind name", in apply order.

    `after`: the resourceVersion each apply returned; `before`: versions each child was known to
    have had before it (what this process applied last, what the watch last showed). A server-side
    apply that changes nothing is not written and returns the version it found, one already seen;
    a write makes a new one. So an operator restarted mid-run, or a Deployment whose status alone
    moved its version, reports no "applied" (issue 24: events that say something happened when
    nothing did teach users to ignore events)."""
    return [f"{kind} {name}" for (kind, name), version in after.items()
            if not any(known.get((kind, name)) == version for known in before)]

def adopted(child: Obj, owner: Mapping[str, Any]) -> Obj:
    """The child with the LlamaFineTune as its controller owner (kopf.adopt mutates in place)."""
    kopf.adopt(child, owner=cast(kopf.Body, dict(owner)))
    return child

def note_drift(memo: kopf.Memo, type: str | None, body: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
    """A child llamaft applied changed in a way llamaft did not (a hand edit, a deletion): its
    owner's lifecycle applies the children again now. Our own applies are recognised by the
    resourceVersion they returned; the Deployment's status updates cost one no-op apply (which
    posts no event: changed_children)."""
    owner, namespace = (meta.get("labels") or {}).get(LABEL_FINETUNE), meta.get("namespace")
    if not owner or not namespace:
        return
    shared = operator_state(memo)
    applied = shared.applied.get((str(namespace), str(owner)))
    child = (str(body.get("kind")), str(meta.get("name")))
    if applied is None or child not in applied:
        return  # not (yet) applied by this operator: the owner's next apply covers it
    if type == "DELETED" or str(meta.get("resourceVersion")) != applied[child]:
        shared.drifted.add((str(namespace), str(owner)))
        wake(memo, str(namespace), str(owner))


def deleted(type: str | None, **_: Any) -> bool:
    """kopf's `when=` filter of the children's deletion handler (the index sees every other event)."""
    return type == "DELETED"


def index_entry(kind: str, meta: Mapping[str, Any]) -> dict[tuple[str, str], Obj]:
    """A labelled child by (namespace, owner name), as much of it as the first apply of an
    incarnation looks at: its name, owners and deletion (the previous incarnation's objects to wait
    for, this one's to prune), and its resourceVersion (whether an apply changed it)."""
    owner, namespace = (meta.get("labels") or {}).get(LABEL_FINETUNE), meta.get("namespace")
    if not owner or not namespace:
        return {}
    return {(str(namespace), str(owner)): {"kind": kind, "metadata": {
        "name": meta.get("name"), "deletionTimestamp": meta.get("deletionTimestamp"),
        # the version the watch last showed: an apply that returns it changed nothing (changed_children)
        **({"resourceVersion": meta["resourceVersion"]} if meta.get("resourceVersion") else {}),
        "ownerReferences": [{"uid": ref.get("uid")} for ref in meta.get("ownerReferences") or []]}}}


class ChildReconciler:
    """A lifecycle step's work on the children (`Step` is one): apply what the spec renders,
    prune what it no longer wants, wait for a previous incarnation's objects to go."""

    memo: kopf.Memo
    namespace: str
    name: str
    kube: Kube
    settings: OperatorSettings
    children_index: Mapping[tuple[str, str], Any] | None

    def event(self, obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        kopf.event(cast(kopf.Body, dict(obj)), type=type_, reason=reason, message=message)

    def _condition(self, obj: Obj, patch: Obj, type_: str, ok: bool, reason: str, message: str) -> None:
        patch["conditions"] = observe.set_condition(
            list(patch.get("conditions") or obj.get("status", {}).get("conditions") or []), type_, "True" if ok else "False",
            reason, message, obj["metadata"].get("generation"), timestamps.iso(now()))

    def _reconcile_children(self, obj: Obj, owner: Owner, spec: LlamaFineTuneSpec, patch: Obj,
                            force: bool = False, say: Callable[[str], None] | None = None) -> float | None:
        """Server-side apply the children the spec describes (config, managed etcd, monitoring) and
        prune the ones it no longer wants. Skipped when nothing changed since the last apply: the
        rendered children are the same and no child event reported a hand edit or deletion (see
        `children_by_owner`, `child_deleted`). Returns a requeue delay while the previous incarnation's objects go.
        `say`: who reports what was applied instead of a ChildrenApplied event of its own (a start
        says it in its JobCreated event: one event per start, each an API write and a watch event
        for every reader of events)."""
        key = (self.namespace, self.name)
        shared, own = operator_state(self.memo), object_state(self.memo)
        drifted = key in shared.drifted
        # The children derive from the spec (its generation), the incarnation and the settings only:
        # a step of an unchanged generation does not render them (the dashboard alone is a large JSON).
        source = (owner.uid, obj["metadata"].get("generation"))
        if not force and not drifted and own.children_source == source:
            return None
        wanted = [adopted(child, obj) for child in self._rendered_children(owner, spec, source)]
        digest = hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()
        if not force and not drifted and own.children_digest == digest:
            own.children_source = source
            return None
        shared.drifted.discard(key)
        # The first apply for this incarnation (in this process) looks at what carries its label:
        # the previous incarnation's objects to wait for, and what an earlier process applied for
        # it that the spec no longer wants. Later applies know what they applied (OperatorState.applied).
        listed: dict[str, list[Obj]] | None = None
        if own.owner_checked != owner.uid:
            listed = self._labelled_children()
            try:
                self._check_owners(wanted, listed, owner)
            except ForeignObject as exc:
                self._condition(obj, patch, "RendezvousReady", False, "PreviousIncarnation", str(exc))
                patch["message"] = f"waiting for the previous incarnation's objects to go: {exc}"
                return 1.0
            own.owner_checked = owner.uid
        applied: dict[tuple[str, str], str] = {}
        previous = shared.applied.get(key, {})
        # The versions each child is known to have had before this apply: what this process applied
        # last, and the live object's (kopf's index, or the listing), either possibly the older.
        seen = live_versions(self._indexed_children() if listed is None else listed)
        monitoring_missing: MonitoringUnavailable | None = None
        for child in wanted:
            kind, name = child["kind"], child["metadata"]["name"]
            try:
                live = self.kube.apply(self.namespace, child)
            except MonitoringUnavailable as exc:
                monitoring_missing = exc
                continue
            applied[(kind, name)] = str(live.get("metadata", {}).get("resourceVersion", ""))
        changed = changed_children(applied, previous, seen)
        pruned = self._prune(owner, set(applied) | {(c["kind"], c["metadata"]["name"]) for c in wanted}, listed, previous)
        shared.applied[key] = applied
        own.children_digest, own.children_source = digest, source
        if changed or pruned:
            what = (f"applied {', '.join(changed)}" if changed else "") + ("; " if changed and pruned else "") + \
                   (f"pruned {', '.join(pruned)}" if pruned else "")
            if drifted and not force:
                self.event(obj, "Normal", "DriftRepaired", what)
            elif say is not None:
                say(what)
            else:
                self.event(obj, "Normal", "ChildrenApplied", what)
        if monitoring_missing is not None:
            if not any(c.get("type") == "MonitoringReady" for c in obj.get("status", {}).get("conditions", [])):
                self.event(obj, "Warning", "MonitoringUnavailable",
                           f"{monitoring_missing}: install the Prometheus Operator for metrics and alerts")
            self._condition(obj, patch, "MonitoringReady", False, "PrometheusOperatorMissing", str(monitoring_missing))
        else:
            self._condition(obj, patch, "MonitoringReady", True, "MonitoringApplied",
                            "PodMonitor, alerts and dashboard are as the spec asks")
        return None

    def _rendered_children(self, owner: Owner, spec: LlamaFineTuneSpec, source: tuple[str, Any]) -> list[Obj]:
        """The children to apply: the ones this generation's validation rendered and checked
        (`validated`), handed over once (the memo does not keep them); rendered again only for a
        later apply of the same generation (a repair, the next attempt's start) or when there are
        none (a step that did not validate, e.g. in tests). Not copied: that render made them for
        this hand-over alone, and nothing else holds them once it is taken (adoption changes them)."""
        own = object_state(self.memo)
        handed, own.rendered = own.rendered, None
        if handed is not None and handed[0] == source:
            return handed[1]  # type: ignore[no-any-return]
        return objects.children(owner, spec, self.settings.etcd_image, dict(self.settings.dashboard_labels),
                                operator_state(self.memo).checks.config_texts(spec, spec.model_dump_json()))

    def _indexed_children(self) -> dict[str, list[Obj]]:
        """This LlamaFineTune's labelled children as kopf's index has them ({} without the index)."""
        if self.children_index is None:
            return {}
        entries = list(self.children_index.get((self.namespace, self.name), ()))
        return {kind: [e for e in entries if e["kind"] == kind] for kind in CHILD_KINDS}

    def _labelled_children(self) -> dict[str, list[Obj]]:
        """The objects of the child kinds that carry this LlamaFineTune's label, by kind: from kopf's
        index when the step has it (no request: kopf listed these kinds before any daemon ran and
        follows their watches), else listed (the kinds that can be pruned)."""
        if self.children_index is not None:
            # list() of the index's store copies it in one C call: safe beside the loop's updates.
            entries = list(self.children_index.get((self.namespace, self.name), ()))
            return {kind: [e for e in entries if e["kind"] == kind] for kind in CHILD_KINDS}
        return {kind: self.kube.list_children(self.namespace, kind, f"{LABEL_FINETUNE}={self.name}") for kind in PRUNABLE}

    def _check_owners(self, wanted: list[Obj], listed: Mapping[str, list[Obj]], owner: Owner) -> None:
        """ForeignObject when a child's name is taken by an object of another owner or one being
        deleted: the previous incarnation's, after a delete and re-apply (its objects carry the
        same label, so the kinds listed for pruning are checked from those lists; others by name)."""
        live = {(kind, o["metadata"]["name"]): o for kind, objs in listed.items() for o in objs}
        for child in wanted:
            kind, name = child["kind"], child["metadata"]["name"]
            if kind not in listed:
                self.kube.check_owner(self.namespace, child)
                continue
            current = live.get((kind, name))
            meta = (current or {}).get("metadata", {})
            if meta.get("ownerReferences") and not owned_by(current or {}, owner.uid):
                raise ForeignObject(f"{kind} {name} still belongs to {meta['ownerReferences'][0].get('uid')} (being deleted)")
            if meta.get("deletionTimestamp"):
                raise ForeignObject(f"{kind} {name} is being deleted")

    def _prune(self, owner: Owner, keep: set[tuple[str, str]], listed: Mapping[str, list[Obj]] | None,
               previous: Mapping[tuple[str, str], str]) -> list[str]:
        """Delete this incarnation's children that the spec no longer describes: monitoring turned
        off, the managed etcd after a switch to an external endpoint. Candidates: the listed objects
        with its label and owner uid, or (without a listing) what this process applied before."""
        if listed is not None:
            candidates = [(kind, live["metadata"]["name"]) for kind, objs in listed.items() if kind in PRUNABLE for live in objs
                          if owned_by(live, owner.uid) and not live["metadata"].get("deletionTimestamp")]
        else:
            candidates = [(kind, name) for kind, name in previous if kind in PRUNABLE]
        pruned = []
        for kind, name in candidates:
            if (kind, name) not in keep and self.kube.delete(self.namespace, kind, name):
                pruned.append(f"{kind} {name}")
        return pruned
