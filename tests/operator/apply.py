"""Server-side apply as the emulator does it: the parts the operator relies on.

The API server's rules (https://kubernetes.io/docs/reference/using-api/server-side-apply/), kept:
- an apply (PATCH, Content-Type application/apply-patch+yaml, fieldManager required) creates the
  object when it does not exist;
- the manager owns exactly the fields its applied configuration sets; fields it owned before and no
  longer sets are removed from the object (unless another manager also owns them);
- fields it sets are merged into the live object; fields owned by other managers are left alone,
  unless they conflict: a different value owned by another manager is a 409 Conflict without
  `force=true`, and with force the applier takes the field over;
- ownership is recorded in metadata.managedFields (operation Apply, fieldsType FieldsV1);
- an apply that changes nothing is not a write: resourceVersion stays, no watch event.
Simplified: every list is atomic (the API server merges some lists by key, e.g. containers by name);
non-apply writes do not record ownership (their fields count as owned by nobody, so an apply
overwrites them, as `force` would).
"""

from __future__ import annotations

import copy
import datetime
from typing import Any

Obj = dict[str, Any]
Path = tuple[str, ...]
SERVER_FIELDS = {("apiVersion",), ("kind",), ("metadata", "name"), ("metadata", "namespace")}


class ApplyConflict(Exception):
    """Fields another manager owns with a different value (409 without force)."""

    def __init__(self, manager: str, paths: list[Path]) -> None:
        self.manager, self.paths = manager, paths
        fields = ", ".join("." + ".".join(p) for p in paths)
        super().__init__(f'Apply failed with {len(paths)} conflict(s): conflict with "{manager}": {fields}')


def leaf_paths(value: Any, prefix: Path = ()) -> set[Path]:
    """Every field the configuration sets (dicts recurse; lists and scalars are leaves)."""
    if isinstance(value, dict) and value:
        out: set[Path] = set()
        for key, child in value.items():
            out |= leaf_paths(child, (*prefix, str(key)))
        return out
    return {prefix} if prefix else set()


def to_fields_v1(paths: set[Path]) -> Obj:
    root: Obj = {}
    for path in sorted(paths):
        node = root
        for part in path:
            node = node.setdefault(f"f:{part}", {})
    return root


def from_fields_v1(fields: Obj, prefix: Path = ()) -> set[Path]:
    out: set[Path] = set()
    for key, child in fields.items():
        if not key.startswith("f:"):
            continue
        path = (*prefix, key[2:])
        out |= from_fields_v1(child, path) if child else {path}
    return out


def _get(obj: Any, path: Path) -> tuple[bool, Any]:
    for part in path:
        if not isinstance(obj, dict) or part not in obj:
            return False, None
        obj = obj[part]
    return True, obj


def _remove(obj: Obj, path: Path) -> None:
    parents = [obj]
    for part in path[:-1]:
        child = parents[-1].get(part)
        if not isinstance(child, dict):
            return
        parents.append(child)
    parents[-1].pop(path[-1], None)
    for depth in range(len(path) - 1, 0, -1):  # drop maps left empty by the removal
        if parents[depth] == {}:
            parents[depth - 1].pop(path[depth - 1], None)


def _merge(live: Any, config: Any) -> Any:
    if isinstance(live, dict) and isinstance(config, dict):
        out = dict(live)
        for key, value in config.items():
            out[key] = _merge(live.get(key), value)
        return out
    return copy.deepcopy(config)


def owners(obj: Obj) -> dict[str, set[Path]]:
    return {entry["manager"]: from_fields_v1(entry.get("fieldsV1") or {})
            for entry in obj.get("metadata", {}).get("managedFields") or [] if entry.get("operation") == "Apply"}


def apply(live: Obj | None, config: Obj, manager: str, force: bool) -> Obj:
    """The object after `manager` applies `config` to `live` (None: it does not exist yet)."""
    base: Obj = copy.deepcopy(live) if live is not None else {}
    managed = owners(base)
    mine_before = managed.pop(manager, set())
    wanted = leaf_paths(config) - SERVER_FIELDS
    wanted = {p for p in wanted if p[:2] != ("metadata", "managedFields")}
    conflicts: dict[str, list[Path]] = {}
    for other, paths in managed.items():
        for path in paths & wanted:
            if _get(base, path) != _get(config, path):
                conflicts.setdefault(other, []).append(path)
    if conflicts and not force:
        other, paths = next(iter(conflicts.items()))
        raise ApplyConflict(other, sorted(paths))
    if force:
        managed = {other: paths - wanted for other, paths in managed.items()}
    still_owned = set().union(*managed.values()) if managed else set()
    for path in sorted(mine_before - wanted - still_owned, key=len, reverse=True):
        _remove(base, path)
    result: Obj = _merge(base, {k: v for k, v in config.items() if k != "status"})
    entries = [e for e in (base.get("metadata", {}).get("managedFields") or []) if e.get("operation") != "Apply"]
    for other, paths in managed.items():
        if paths:
            entries.append(_entry(other, paths, base, other_time=True))
    entries.append(_entry(manager, wanted, base, api_version=str(config.get("apiVersion") or base.get("apiVersion") or "")))
    result.setdefault("metadata", {})["managedFields"] = entries
    if live is not None and _without_times(result) == _without_times(live):
        return live  # a no-op apply is not a write
    return result


def _entry(manager: str, paths: set[Path], live: Obj, other_time: bool = False, api_version: str | None = None) -> Obj:
    """A manager's managedFields entry. Its apiVersion is the one the manager applied with (the
    config's: on a create `live` is empty), else the one its entry already had: an entry that
    changed with nothing else would make the next identical apply a write."""
    previous = next((e for e in live.get("metadata", {}).get("managedFields") or [] if e.get("manager") == manager), {})
    when = previous.get("time") if other_time else None
    version = api_version if api_version is not None else str(previous.get("apiVersion") or live.get("apiVersion", ""))
    return {"manager": manager, "operation": "Apply", "apiVersion": version,
            "time": when or datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "fieldsType": "FieldsV1", "fieldsV1": to_fields_v1(paths)}


def _without_times(obj: Obj) -> Obj:
    out = copy.deepcopy(obj)
    for entry in out.get("metadata", {}).get("managedFields") or []:
        entry.pop("time", None)
    return out
