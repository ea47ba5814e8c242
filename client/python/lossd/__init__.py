# SPDX-License-Identifier: Apache-2.0
"""lossd: client for the lossd fused linear + cross-entropy service.

    import lossd
    with lossd.Client("localhost:50051") as c:
        r = c.compute(x, w, targets)          # numpy / BF16Array / torch tensors
        r.loss, r.dx, r.dw

PyTorch users: lossd.nn.LossdFusedLinearCrossEntropyLoss (imports torch on first use).
Many replicas: lossd.connect_pool("dns:///lossd-headless:50051", rank=r) (lossd.pool).
"""

from lossd.errors import (  # noqa: F401
    AbortedError,
    AlreadyExistsError,
    ArgumentAssertionError,
    CancelledError,
    ClientClosedError,
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    HeadLostError,
    InternalError,
    InvalidArgumentError,
    LossdError,
    NotFoundError,
    OutOfRangeError,
    PermissionDeniedError,
    ProtocolError,
    ResourceExhaustedError,
    StepLostError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
    UnknownError,
    WeightsChangedError,
)
from lossd.tensors import BF16Array, bf16, bf16_bits_to_float, float_to_bf16_bits  # noqa: F401
from lossd.client import (  # noqa: F401
    DEFAULT_PART_BYTES,
    Client,
    ComputeResult,
    Gradients,
    HeadExport,
    HeadInfo,
    DistillOptions,
    OptimizerConfig,
    PolicyOptions,
    ServerInfo,
    StateEntry,
    StepResult,
    WeightHandle,
    connect,
    verl_policy_options,
)

from lossd.pool import PoolStats, PoolWeights, ReplicaPool, connect_pool  # noqa: F401,E402

__version__ = "0.1.0"
