"""Readable PyTorch implementations of every op: the specification (loops are fine here)."""

from moe_kernels.reference.topk_softmax import topk_softmax

__all__ = ["topk_softmax"]
from moe_kernels.reference.balanced_assignment import balanced_assignment  # noqa: E402

__all__ += ["balanced_assignment"]
from moe_kernels.reference.gumbel_matching import gumbel_matching  # noqa: E402

__all__ += ["gumbel_matching"]
from moe_kernels.reference.sinkhorn import sinkhorn  # noqa: E402

__all__ += ["sinkhorn"]
from moe_kernels.reference.skip_sample import skip_sample  # noqa: E402

__all__ += ["skip_sample"]
