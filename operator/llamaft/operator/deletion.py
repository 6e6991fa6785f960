"""A LlamaFineTune deleted: what the garbage collector cannot reach (an external etcd's
rendezvous state) and this operator's own bookkeeping."""

from __future__ import annotations

import kopf

from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.operator import rendezvous
from llamaft.operator.state import measured, object_lock, operator_state, settings_of
from llamaft.render.naming import Owner


def deleted(body: kopf.Body, spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status, memo: kopf.Memo) -> None:
    """Every child (jobs and their pods, config, etcd, monitoring) has this LlamaFineTune as its
    controller owner, so the garbage collector removes them once it is gone. What garbage
    collection cannot reach is done here: the rendezvous state in an external etcd
    (spec.rendezvous.endpoint), and this operator's own bookkeeping. A re-applied CR of the same
    name meets its predecessor's children only while the collector works; it waits for them
    (ForeignObject) and never adopts them. Checkpoints stay."""
    namespace, name = str(meta["namespace"]), str(meta["name"])
    settings = settings_of(memo)
    with measured("delete"), object_lock(memo):
        owner = Owner(name, namespace, meta.get("uid", ""))
        try:
            parsed: LlamaFineTuneSpec | None = LlamaFineTuneSpec.model_validate(dict(spec))
        except ValueError:
            parsed = None
        attempt = int(status.get("attempt") or 0)
        if parsed is not None and parsed.rendezvous.endpoint is not None and attempt:
            try:
                rendezvous.reset_attempts(settings, operator_state(memo).http, owner, parsed, [attempt], lambda r, m: None)
            except rendezvous.RendezvousResetError as exc:
                kopf.warn(body, reason="RendezvousResetFailed", message=f"left rendezvous state behind: {exc}")
        operator_state(memo).applied.pop((namespace, name), None)
        operator_state(memo).drifted.discard((namespace, name))
        kopf.info(body, reason="Deleted", message="the garbage collector removes the jobs, etcd, config and monitoring "
                  "(all owned by this LlamaFineTune); checkpoints are kept")
