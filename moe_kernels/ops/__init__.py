"""The public ops. Each validates its arguments and asks moe_kernels.backends for a kernel."""

from moe_kernels.ops.topk_softmax import topk_softmax

__all__ = ["topk_softmax"]
from moe_kernels.ops.balanced_assignment import balanced_assignment  # noqa: E402

__all__ += ["balanced_assignment"]
from moe_kernels.ops.gumbel_matching import gumbel_matching  # noqa: E402

__all__ += ["gumbel_matching"]
from moe_kernels.ops.sinkhorn import sinkhorn  # noqa: E402

__all__ += ["sinkhorn"]
from moe_kernels.ops.skip_sample import skip_sample  # noqa: E402

__all__ += ["skip_sample"]
