"""What the lossd client's calls return: plain dataclasses, no I/O.

lossd.client re-exports every name here; import them from lossd (or lossd.client).
"""

import dataclasses
from typing import Any, Optional

import numpy as np

from lossd._proto import pb


@dataclasses.dataclass
class ComputeResult:
    """What one Compute returned. Tensors not asked for (or not sent) are None."""

    loss: float  # mean or sum; with reduction none the sum of the per-token loss
    z_loss: float  # same reduction as loss
    accuracy: float  # fraction of non-ignored tokens whose argmax is the target
    tokens: int  # non-ignored tokens
    compute_seconds: float
    backend: str
    accumulated_micro_batches: int
    wall_seconds: float = 0.0  # client-side, the whole call
    bytes_sent: int = 0  # tensor data bytes
    bytes_received: int = 0  # tensor data bytes
    instance: str = ""  # the server instance that computed
    dx: Any = None  # (BT, H) grad dtype
    dw: Any = None  # (V, H) grad dtype
    db: Any = None  # (V) grad dtype
    lse: Optional[np.ndarray] = None  # (BT) fp32
    per_token_loss: Optional[np.ndarray] = None  # (BT) fp32, reduction none
    per_token_z_loss: Optional[np.ndarray] = None  # (BT) fp32, reduction none
    predictions: Optional[np.ndarray] = None  # (BT) int64
    # Gradients holding NaN or Inf after the call ("dx", "dw", "db"); with an accumulator,
    # "dw"/"db" mean its sum, which then refuses further use until a reset fetch or a drop.
    nonfinite: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class WeightHandle:
    """A weight (and optional bias) uploaded with put_weights. Pass it as `w` to compute."""

    handle: str
    bytes: int
    v: int
    h: int
    dtype: str
    has_bias: bool
    stripes: int = 1  # streams (connections) the upload was split over

    def __str__(self):
        return self.handle


@dataclasses.dataclass
class Gradients:
    """A server-side accumulator's contents (fp32)."""

    dw: np.ndarray  # (V, H) fp32
    db: Optional[np.ndarray]  # (V) fp32, None when no bias was used
    micro_batches: int
    tokens: int
    instance: str
    stripes: int = 1  # range streams (connections) the fetch was split over
    ranges: int = 1  # ranged fetches it took (more than stripes where the server's budget is small)


@dataclasses.dataclass
class ServerInfo:
    version: str
    instance: str
    backend: str
    device: str
    memory_total_bytes: int
    memory_budget_bytes: int
    memory_in_use_bytes: int
    weight_cache_budget_bytes: int
    weight_cache_bytes: int
    max_part_bytes: int
    max_bt: int
    max_h: int
    max_v: int
    max_in_flight: int
    accumulators: int
    features: list = dataclasses.field(default_factory=list)  # see require_feature


@dataclasses.dataclass
class StateEntry:
    """One weight handle or accumulator of the caller's, as Client.list_state reports it."""

    kind: str  # "weights" or "accumulator"
    name: str  # the weight handle or the accumulator's name
    bytes: int  # server memory it holds
    last_used_unix_ms: int  # created, or last named by a call
    micro_batches: int = 0  # accumulators: micro-batches summed since the last reset


_STATE_KINDS = {pb.STATE_WEIGHTS: "weights", pb.STATE_ACCUMULATOR: "accumulator"}
