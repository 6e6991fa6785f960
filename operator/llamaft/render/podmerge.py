"""`cluster.podTemplateOverrides` merged into the worker pod template with Kubernetes'
strategic-merge semantics (what `kubectl patch --type strategic` does to a pod template).

Lists that Kubernetes merges by a key are merged by that key, so an override that names the
`pytorch` container patches it instead of adding a second one; every other list replaces, maps
merge recursively, scalars replace. The merge keys are the PodSpec's `patchMergeKey`s:

| list | merge key |
| --- | --- |
| containers, initContainers, ephemeralContainers, volumes, imagePullSecrets, env, resourceClaims | name |
| volumeMounts | mountPath |
| volumeDevices | devicePath |
| ports (of a container) | containerPort |
| hostAliases | ip |

`$patch: delete` in a keyed entry removes that entry, as in a strategic-merge patch.
"""

from __future__ import annotations

import copy
from typing import Any

MERGE_KEYS: dict[str, str] = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name", "volumes": "name",
    "imagePullSecrets": "name", "env": "name", "resourceClaims": "name", "volumeMounts": "mountPath",
    "volumeDevices": "devicePath", "ports": "containerPort", "hostAliases": "ip",
}
DIRECTIVE = "$patch"


def strategic_merge(base: Any, patch: Any, field: str | None = None) -> Any:
    """`base` with `patch` applied; neither argument is modified."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)  # as in a merge patch: null removes the field
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = _without_directives(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        return _merge_list(base, patch, MERGE_KEYS[field], field)
    return _without_directives(patch)


def _merge_list(base: list[Any], patch: list[Any], key: str, field: str) -> list[Any]:
    out = [copy.deepcopy(item) for item in base]
    for entry in patch:
        if not isinstance(entry, dict) or key not in entry:
            out.append(_without_directives(entry))  # no key: cannot match, added as is (validation names it)
            continue
        index = next((i for i, item in enumerate(out) if isinstance(item, dict) and item.get(key) == entry[key]), None)
        if entry.get(DIRECTIVE) == "delete":
            if index is not None:
                out.pop(index)
            continue
        if index is None:
            out.append(_without_directives(entry))
        else:
            out[index] = strategic_merge(out[index], {k: v for k, v in entry.items() if k != DIRECTIVE}, field)
    return out


def _without_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_directives(v) for k, v in value.items() if k != DIRECTIVE}
    if isinstance(value, list):
        return [_without_directives(v) for v in value]
    return copy.deepcopy(value)
