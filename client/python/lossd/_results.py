# SPDX-License-Identifier: Apache-2.0
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
    logp: Optional[np.ndarray] = None  # (BT) fp32, kind logprob: log p(target) at T
    entropy: Optional[np.ndarray] = None  # (BT) fp32, kind logprob with want_entropy
    # Gradients holding NaN or Inf after the call ("dx", "dw", "db"); with an accumulator,
    # "dw"/"db" mean its sum, which then refuses further use until a reset fetch or a drop.
    nonfinite: list = dataclasses.field(default_factory=list)
    # With a hosted head: the version computed against, and whether this call's dW/db went
    # into the step (False: its (rank, micro_batch) key was already there, a retry).
    head_version: int = 0
    head_added: bool = False
    # Kind policy: Liger's mean-KL metric (0 when beta is 0) and clip fraction.
    kl: float = 0.0
    clip_fraction: float = 0.0
    # A two-phase log-prob's forward (keep_ms): the ticket its backward names (compute(ticket=))
    # and when the server drops it (Unix ms); "" and 0 otherwise.
    ticket: str = ""
    ticket_expires_unix_ms: int = 0


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
    # The backend's compute path ("cpu", or the CUDA path and its chunk rows); "" from an
    # older server.
    compute_path: str = ""


@dataclasses.dataclass
class StateEntry:
    """One weight handle, accumulator or hosted head of the caller's, as Client.list_state
    reports it."""

    kind: str  # "weights", "accumulator", "head" or "ticket"
    name: str  # the weight handle's, the accumulator's, the head's name or the ticket
    bytes: int  # server memory it holds
    last_used_unix_ms: int  # created, or last named by a call
    # Accumulators: micro-batches summed since the last reset; heads: Computes added to the
    # current step.
    micro_batches: int = 0
    version: int = 0  # heads: steps completed


_STATE_KINDS = {pb.STATE_WEIGHTS: "weights", pb.STATE_ACCUMULATOR: "accumulator",
                pb.STATE_HEAD: "head", pb.STATE_TICKET: "ticket"}


@dataclasses.dataclass
class HeadInfo:
    """A hosted head as the server describes it (create_head, head_info)."""

    name: str
    v: int
    h: int
    has_bias: bool
    compute_dtype: str  # the compute copy's: X's dtype
    optimizer: Any  # an OptimizerConfig with every default filled in
    version: int  # steps completed
    optimizer_step: int  # AdamW's `step`; SGD: > 0 once the momentum buffer holds a value
    bytes: int  # server memory it holds
    contributions: int  # Computes added to the current step
    tokens: int  # their non-ignored tokens
    ranks_waiting: int  # ranks that have called Step for the current version
    instance: str
    last_used_unix_ms: int
    created: bool = True  # create_head: False when the same head at the same version was there
    # A head group's {"members": [...], "member": m, "id": ...} (None: one server); rank r's
    # Computes and Steps go to members[r % len(members)].
    group: Any = None


@dataclasses.dataclass
class StepResult:
    """What one Step (one phase of it) returned; every rank of the step gets the same."""

    version: int  # the head's version after the call: +1 once applied or skipped
    grad_norm: float  # L2 norm of the summed gradient (W and bias), before any clipping
    finite: bool  # the summed gradient holds no NaN or Inf
    applied: bool  # the update ran (False: a reduce phase, or a skipped step)
    clip_coef: float  # the factor the gradient was multiplied by (1: none)
    contributions: int  # Computes in the step
    tokens: int
    step_seconds: float  # the phase's run on the server's device
    instance: str


@dataclasses.dataclass
class HeadExport:
    """A head's state at one version (export_head): what create_head / import_head take to
    make it again. tensors: {name: ndarray}, names as HEAD_TENSOR_NAMES (master_w,
    master_bias, exp_avg_w, ..., copy_w, copy_bias), fp32 except the copy (the compute dtype,
    a BF16Array for bf16)."""

    name: str
    version: int
    optimizer_step: int
    optimizer: Any  # OptimizerConfig
    compute_dtype: str
    tensors: dict
    instance: str = ""
    ranges: int = 1  # ExportHead calls it took
