"""What a host read looks like in a CPU profile: the profiler events of a value read back to the
host or of an op whose output shape depends on the data (each a device sync on a GPU, and a graph
break or a failed CUDA-graph capture), and a profile of one call that counts them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

# `.item()` / `int(t)` / `float(t)` run _local_scalar_dense, `bool(t)` / `if t:` is_nonzero,
# boolean-mask indexing nonzero; `torch.equal` returns a Python bool.
SYNC_EVENTS = (
    "aten::item",
    "aten::_local_scalar_dense",
    "aten::is_nonzero",
    "aten::nonzero",
    "aten::nonzero_static",
    "aten::masked_select",
    "aten::equal",
    "Tensor.tolist",  # counted by sync_events
)
SYNC_PREFIXES = ("aten::unique", "aten::_unique")  # unique, _unique2, unique_dim, unique_consecutive


def sync_events(run: Callable[[], object]) -> tuple[object, Counter]:
    """(run()'s result, Counter of every profiler event name recorded while it ran). `.tolist()` of a
    CPU tensor dispatches no aten op, so its calls are counted as the event "Tensor.tolist"."""
    events = Counter()
    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        events["Tensor.tolist"] += 1
        return tolist(self)

    with mock.patch.object(torch.Tensor, "tolist", counted_tolist), profile(activities=[ProfilerActivity.CPU]) as prof:
        result = run()
    events.update(event.name for event in prof.events())
    return result, events


def syncs(events: Counter) -> dict[str, int]:
    """The host reads among `events`, by name."""
    return {n: c for n, c in sorted(events.items()) if n in SYNC_EVENTS or n.startswith(SYNC_PREFIXES)}
