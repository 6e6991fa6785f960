"""Live tensor bytes on CPU, where torch has no allocator statistics: a dispatch mode that sees
every aten op's outputs (autograd's backward too: the engine carries the mode to it) and follows
the lifetime of each new storage with a weak reference (torch keeps one Python object per storage,
so its finalizer runs when the last tensor using it goes: forward's saved activations, the
checkpoint caches, the gradients). `saved_tensors_hooks` cannot see activation checkpointing's
own storage (its hooks take over inside a checkpointed region), which is what these tests measure.

    with LiveBytes() as live:
        loss = f(x)
        after_forward = live.now
        loss.backward()
    live.peak  # the most bytes alive at once, counting only storages created inside the block
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under the mode and still alive (`now`), and their most
    (`peak`). `which(tensor)`: count only the storages of outputs it accepts (e.g. vocab-wide
    tensors, for the logits); a view or in-place op's output shares an input's storage and is
    not new."""

    def __init__(self, which: Callable[[torch.Tensor], bool] | None = None) -> None:
        super().__init__()
        self.which = which
        self.now = 0
        self.peak = 0
        self._alive: dict[int, weakref.ref[Any]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._alive or (self.which is not None and not self.which(t)):
                continue
            size = storage.nbytes()
            self._alive[key] = weakref.ref(storage, lambda _, k=key, n=size: self._freed(k, n))
            self.now += size
            self.peak = max(self.peak, self.now)
        return out

    def _freed(self, key: int, size: int) -> None:
        self._alive.pop(key, None)
        self.now -= size
