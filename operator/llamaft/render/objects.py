"""The run's objects as a whole: its long-lived children (desired.py's config and etcd,
monitoring.py's objects) and one attempt's objects. Above both so neither imports the other."""

from __future__ import annotations

from typing import Any

from llamaft.api.spec import Backend, LlamaFineTuneSpec
from llamaft.render import desired
from llamaft.render.backends import backend_for
from llamaft.render.desired import ETCD_IMAGE
from llamaft.render.monitoring import monitoring_objects
from llamaft.render.naming import Owner

Obj = dict[str, Any]


def children(owner: Owner, spec: LlamaFineTuneSpec, etcd_image: str = ETCD_IMAGE,
             dashboard_labels: dict[str, str] | None = None, config_texts: tuple[str, str] | None = None) -> list[Obj]:
    """The run's long-lived children, reconciled by server-side apply: the config, the managed
    etcd and the monitoring objects. What is not in this list (monitoring turned off, etcd after a
    switch to c10d) is pruned. The attempts' PyTorchJobs are not here: each is created once.
    `config_texts`: desired.config_texts(spec), when the caller kept them."""
    objs = [desired.config_map(owner, spec, config_texts)]
    if desired.uses_managed_etcd(spec):
        objs += desired.etcd_objects(owner, etcd_image)
    return objs + monitoring_objects(owner, spec, dashboard_labels)


def desired_objects(owner: Owner, spec: LlamaFineTuneSpec, attempt: int, etcd_image: str = ETCD_IMAGE,
                    backend: Backend = Backend.PYTORCH_JOB) -> list[Obj]:
    """Everything one attempt of the run needs, in creation order (what `llamaft render` prints):
    the children, then the attempt's job as its backend renders it."""
    return [*children(owner, spec, etcd_image), backend_for(backend).render(owner, spec, attempt)]
