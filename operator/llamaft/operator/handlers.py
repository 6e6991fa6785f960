"""kopf's registry: which events reach which module. Each handler hands off in a few lines.

    kopf run --standalone -m llamaft.operator.handlers --all-namespaces   (or: llamaft operator)

- start-up and shutdown (`startup`): kopf's settings, the memo's shared state, the clients.
- a daemon per LlamaFineTune runs its lifecycle (`daemon`, one `step.Step` per look): it wakes on
  events of its children (the job, the trainer pods and the applied children, mapped to their
  owner by the `llamaft.io/finetune` label), on a spec change and, while a run is active, every
  sync interval to refresh progress. A finished run is not polled. A creation event starts the
  first step at once (`daemon.start_first_step`).
- the applied children's watches (`children`): kopf's index of them by owner, and drift (a hand
  edit or deletion) waking the owner to repair it.
- update of .spec (`spec_changes`): in place, a restart as a new attempt, or refused.
- delete (`deletion`, behind the finalizer): what the garbage collector cannot reach.

State lives where kopf keeps it (`state`): the operator's memo (settings, clients, registries)
shared by every object's memo, and the per-object keys that go with the object.
"""

from __future__ import annotations

from typing import Any

import kopf

from llamaft.api import resource
from llamaft.operator import children, daemon, deletion, persistence, spec_changes, startup
from llamaft.render.naming import LABEL_FINETUNE

RESOURCE = (resource.GROUP, resource.VERSION, resource.PLURAL)
CHILD_LABELS = {LABEL_FINETUNE: kopf.PRESENT}


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
    startup.configure(settings, memo, **kwargs)


@kopf.on.cleanup()
def shutdown(memo: kopf.Memo, **_: Any) -> None:
    startup.shutdown(memo)


@kopf.on.login()
def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    return startup.login(memo, **kwargs)


@kopf.daemon(*RESOURCE, cancellation_timeout=5.0)
async def run_lifecycle(name: str | None, namespace: str | None, memo: kopf.Memo, stopped: kopf.DaemonStopped,
                        logger: Any, children_by_owner: Any = None, **_: Any) -> None:
    """The object's lifecycle loop (`daemon.lifecycle_loop`)."""
    assert name is not None and namespace is not None
    await daemon.lifecycle_loop(name, namespace, memo, stopped, logger, children_by_owner)


@kopf.on.event("kubeflow.org", "v1", "pytorchjobs", labels={LABEL_FINETUNE: kopf.PRESENT})
@kopf.on.event("trainer.kubeflow.org", "v1alpha1", "trainjobs", labels={LABEL_FINETUNE: kopf.PRESENT})
@kopf.on.event("", "v1", "pods", labels={LABEL_FINETUNE: kopf.PRESENT, "app.kubernetes.io/component": "trainer"})
async def child_changed(type: str | None, body: kopf.Body, meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    """A job or trainer pod changed: its owner's lifecycle looks now. (This and the other event
    handlers are async: they only look at dicts, so they run on the loop instead of taking a trip
    through kopf's thread pool for every watch event.)"""
    daemon.wake_for_child(memo, type, body, meta)


@kopf.on.event("", "v1", "configmaps", labels=CHILD_LABELS, when=children.deleted)
@kopf.on.event("", "v1", "services", labels=CHILD_LABELS, when=children.deleted)
@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS, when=children.deleted)
@kopf.on.event("monitoring.coreos.com", "v1", "podmonitors", labels=CHILD_LABELS, when=children.deleted)
@kopf.on.event("monitoring.coreos.com", "v1", "prometheusrules", labels=CHILD_LABELS, when=children.deleted)
async def child_deleted(type: str | None, body: kopf.Body, meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    """A child llamaft applied was deleted by someone else: its owner re-creates it
    (`children.note_drift`). Its other changes reach `children_by_owner`."""
    children.note_drift(memo, type, body, meta)


@kopf.index("", "v1", "configmaps", labels=CHILD_LABELS)
@kopf.index("", "v1", "services", labels=CHILD_LABELS)
@kopf.index("apps", "v1", "deployments", labels=CHILD_LABELS)
@kopf.index("monitoring.coreos.com", "v1", "podmonitors", labels=CHILD_LABELS)
@kopf.index("monitoring.coreos.com", "v1", "prometheusrules", labels=CHILD_LABELS)
async def children_by_owner(resource: kopf.Resource, meta: kopf.Meta, body: kopf.Body | None = None,
                            memo: kopf.Memo | None = None, **_: Any) -> dict[tuple[str, str], Any]:
    """Every labelled child, by (namespace, owner name) (`children.index_entry`). kopf lists the
    indexed kinds before it runs any other handler or daemon (kopf/_core/reactor/processing.py:
    operator_indexed), so the index is complete at start; after that it follows the watches. It
    replaces five LISTs per new LlamaFineTune. kopf calls it on every version of a child but its
    deletion (kopf/_core/engines/indexing.py: index_resource), so it also notes a change someone
    else made (`children.note_drift`): one handler per child event, not two (each one a handler
    invocation and a log line of kopf's, per child of every new LlamaFineTune)."""
    if memo is not None and body is not None:
        children.note_drift(memo, None, body, meta)
    return children.index_entry(str(resource.kind), meta)


@kopf.on.event(*RESOURCE, when=daemon.finetune_event_matters)
async def finetune_seen(type: str | None, name: str | None, namespace: str | None, memo: kopf.Memo,
                        logger: Any, body: kopf.Body, patch: kopf.Patch | None = None, children_by_owner: Any = None,
                        **_: Any) -> None:
    """The per-phase gauge, from the phases the API server holds (every object is listed at
    startup, so the gauge is right after a restart too); a LlamaFineTune just created gets its
    first lifecycle step at once (`daemon.finetune_event`), and kopf's creation records go in
    its finalizer's write (`persistence.record_creation`). Not called for a change that leaves
    the phase as recorded (`daemon.finetune_event_matters`)."""
    if type == "ADDED" and patch is not None:
        persistence.record_creation(body, patch)
    if name and namespace:
        daemon.finetune_event(memo, type, namespace, name, logger, body, children_by_owner)


@kopf.on.update(*RESOURCE, field=persistence.SPEC_FIELD)
def spec_changed(body: kopf.Body, old: Any, new: Any, meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    spec_changes.spec_changed(body, old, meta, memo)


@kopf.on.delete(*RESOURCE)
def cleanup(body: kopf.Body, spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status, memo: kopf.Memo, **_: Any) -> None:
    deletion.deleted(body, spec, meta, status, memo)
