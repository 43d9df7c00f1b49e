"""The ranking every op and backend uses, stated once: larger value first, equal values (-0.0 and
+0.0 included) by the lower index, NaN above every number.

torch.sort alone does not state it on every device: on CUDA (torch 2.11, an H100), a stable
descending sort of a float32 row holding NaN put the NaN last, where the CPU sort puts it first,
so the reference chose other experts on the GPU than on the CPU (`make gpu-check`, the fuzz test
of topk_softmax). The order is built here from what every device's sort agrees on: NaN is sorted
as +inf and then moved before the real +inf values by a second stable sort of the NaN flags, and
-0.0 is folded into +0.0 (a radix sort orders -0.0 below +0.0).
"""

import torch


def descending_order(values: torch.Tensor, dim: int = -1, *, nan_last: bool = False) -> torch.Tensor:
    """int64 indices of `values` along `dim` by descending value, equal values by the lower index,
    NaN above every number (nan_last=True: below every number, e.g. a NaN priority fills last).
    Any floating dtype, any device; the same order on every device."""
    nan = torch.isnan(values)
    key = torch.where(nan, float("-inf") if nan_last else float("inf"), values + 0.0)  # + 0.0: -0 -> +0
    order = torch.sort(key, dim=dim, descending=True, stable=True).indices
    # NaN and the real +inf (-inf with nan_last) tie above; a stable sort of the NaN flags puts the
    # NaNs first (last), each class keeping its order by index.
    flags = torch.gather(nan, dim, order).to(torch.uint8)
    regroup = torch.sort(flags, dim=dim, descending=not nan_last, stable=True).indices
    return torch.gather(order, dim, regroup)
