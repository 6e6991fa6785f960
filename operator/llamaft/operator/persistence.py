"""kopf's own records on a LlamaFineTune, and the creation's records written in one patch.

kopf keeps two records on each object it handles: its handlers' progress and the diff base (the
object's essence as last handled, from which `on.update(field="spec")` gets `old`). The CRD's
status schema is structural, so kopf's status fields would be pruned: both live in annotations
under `llamaft.io/`.

On a new object kopf writes twice, and each write comes back as a watch event that goes through
every handler: the first cycle only adds the finalizer (a JSON patch guarded by the
resourceVersion; kopf/_core/reactor/processing.py: process_resource_causes, then
kopf/_cogs/clients/patching.py: patch_obj), the next one handles the creation, which has no
handler here, and stores the diff base (processing.py: process_changing_cause). `record_creation`
adds the diff base that second cycle would store to the first one's JSON patch, as one more of
kopf's patch functions, so one write carries both: the next cycle finds the creation's essence
stored and nothing changed (kopf's NOOP cause), as after kopf's own second write. When the guarded
patch meets a newer version, kopf keeps its functions, ours too, for the next cycle.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast

import kopf

from llamaft.api import resource

PREFIX = "llamaft.io"
FINALIZER = f"{PREFIX}/finalizer"
SPEC_FIELD = "spec"
"""The one field a changing handler watches (`handlers.spec_changed`): kopf adds its handlers'
fields to the essence (processing.py: _detect_causes, `extra_fields`)."""


def _under(field: str | Iterable[str], stanzas: tuple[str, ...]) -> bool:
    first = field.split(".", 1)[0] if isinstance(field, str) else next(iter(field), "")
    return first in stanzas


class SpecEssenceStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's annotation diff base with the same essence, built with less copying, on every watch
    event of every LlamaFineTune. kopf's `DiffBaseStorage.build` (kopf/_cogs/configs/diffbase.py)
    deep-copies the whole body (status, managedFields and all) only to delete those stanzas: here
    they are left out before the copy, and what the essence keeps of the metadata (labels and
    annotations) and the body's kind and owners (which name the keys:
    conventions.CollisionEvadingConvention.mark_key) go in as they are. It then copies each
    handler field again over the copy it already holds: a field under a stanza the essence keeps
    whole (the spec) is left to that first copy. A handler field under metadata or status takes
    kopf's own path.

    kopf builds the essence of every object it watches, on every event, but only a kind with
    changing or spawning handlers uses it (processing.py: _detect_causes hands `old`, `new` and
    `diff` to those causes only). Here that is the LlamaFineTune alone: the children's watch
    events (each PyTorchJob's whole pod template among them) get an empty essence, nothing copied."""

    def build(self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None) -> kopf.BodyEssence:
        if body.get("kind") and body.get("apiVersion") != resource.API_VERSION:
            return cast(kopf.BodyEssence, {})
        fields = list(extra_fields or ())
        if any(_under(field, ("metadata", "status", "apiVersion", "kind")) for field in fields):
            return super().build(body=body, extra_fields=fields)
        meta = body.get("metadata") or {}
        slim = {key: value for key, value in body.items() if key not in ("metadata", "status")}
        slim["metadata"] = {key: meta[key] for key in ("labels", "annotations", "ownerReferences") if key in meta}
        return super().build(body=kopf.Body(cast(kopf.RawBody, slim)))


class ProgressAnnotations(kopf.AnnotationsProgressStorage):
    """kopf's annotation progress storage, whose `clear` (the essence less kopf's progress
    annotations, twice per watch event of every LlamaFineTune: processing.py, _detect_causes)
    copies only what it changes. kopf's (kopf/_cogs/configs/progress.py:
    AnnotationsProgressStorage.clear, ProgressStorage.clear) deep-copies the whole essence, spec
    and all, then drops the annotations and empty stanzas with its conventions' in-place helpers,
    which reassign metadata's keys and the top level's and mutate nothing below: a copy of those
    two dicts is enough, the rest is shared with the essence given (a fresh one each time, which
    kopf only compares, stores or hands to the handlers, as it does this one)."""

    def clear(self, *, essence: kopf.BodyEssence) -> kopf.BodyEssence:
        cleared = cast(dict[str, Any], dict(essence))
        meta = cleared.get("metadata")
        if isinstance(meta, dict):
            meta = cleared["metadata"] = dict(meta)
        annotations = (meta or {}).get("annotations") or {}
        keys = {key for key in annotations if self.prefix and key.startswith(f"{self.prefix}/")}
        self.remove_annotations(cast(kopf.BodyEssence, cleared), keys)
        self.remove_empty_stanzas(cast(kopf.BodyEssence, cleared))
        return cast(kopf.BodyEssence, cleared)


PROGRESS = ProgressAnnotations(prefix=PREFIX)
DIFFBASE = SpecEssenceStorage(prefix=PREFIX, key="last-handled-spec")


def configure(settings: kopf.OperatorSettings) -> None:
    """Where kopf keeps its records on a LlamaFineTune (start-up)."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = PROGRESS
    settings.persistence.diffbase_storage = DIFFBASE


def creation_essence(body: kopf.Body) -> kopf.BodyEssence:
    """The essence kopf stores once a creation is handled: its diff base's, less its own
    progress annotations (processing.py: _detect_causes, `new`)."""
    return PROGRESS.clear(essence=DIFFBASE.build(body=body, extra_fields=[SPEC_FIELD]))


def record_creation(body: kopf.Body, patch: kopf.Patch) -> None:
    """On a LlamaFineTune's creation event (before kopf adds its finalizer): the diff base goes
    into the same guarded write as the finalizer. Nothing when the object already has the
    finalizer or a diff base (kopf then handles the creation in this cycle, or did), or is
    being deleted."""
    meta: Mapping[str, Any] = body.get("metadata") or {}
    if FINALIZER in (meta.get("finalizers") or []) or meta.get("deletionTimestamp") or DIFFBASE.fetch(body=body) is not None:
        return
    stored = kopf.Patch()
    DIFFBASE.store(body=body, patch=stored, essence=creation_essence(body))
    annotations = dict(stored.get("metadata", {}).get("annotations") or {})

    def add_diff_base(raw: kopf.RawBody) -> None:
        raw.setdefault("metadata", {}).setdefault("annotations", {}).update(annotations)

    patch.fns.append(add_diff_base)
