# SPDX-License-Identifier: Apache-2.0
"""Hosted heads in the lossd client (feature "hosted_head"): the server keeps an LM head's fp32
master weights, its optimizer state and a compute copy; Computes naming the head add their
dW/db into its current step, and Step applies the summed gradient once.

HeadMethods holds the head RPCs (CreateHead, Step, ExportHead, GetHeadInfo, DropHead) that
lossd.Client inherits; OptimizerConfig is the optimizer a head is created with. Never imports
torch (lossd.nn converts torch optimizer state) and never retries a call.
"""

import dataclasses
import threading
from typing import Optional

import grpc
import numpy as np

from lossd import errors
from lossd._proto import pb
from lossd._results import HeadExport, HeadInfo, StepResult
from lossd._transfer import parts
from lossd.tensors import FLOAT_DTYPES, dtype_name, from_wire, parse_dtype, to_wire

# The head's tensors by wire id, in the order an import sends them (and an export lists them).
HEAD_TENSORS = (
    (pb.TENSOR_HEAD_MASTER_W, "master_w"),
    (pb.TENSOR_HEAD_MASTER_BIAS, "master_bias"),
    (pb.TENSOR_HEAD_EXP_AVG_W, "exp_avg_w"),
    (pb.TENSOR_HEAD_EXP_AVG_BIAS, "exp_avg_bias"),
    (pb.TENSOR_HEAD_EXP_AVG_SQ_W, "exp_avg_sq_w"),
    (pb.TENSOR_HEAD_EXP_AVG_SQ_BIAS, "exp_avg_sq_bias"),
    (pb.TENSOR_HEAD_MAX_EXP_AVG_SQ_W, "max_exp_avg_sq_w"),
    (pb.TENSOR_HEAD_MAX_EXP_AVG_SQ_BIAS, "max_exp_avg_sq_bias"),
    (pb.TENSOR_HEAD_COPY_W, "copy_w"),
    (pb.TENSOR_HEAD_COPY_BIAS, "copy_bias"),
)
HEAD_TENSOR_NAMES = tuple(n for _, n in HEAD_TENSORS)
_ID_OF = {n: t for t, n in HEAD_TENSORS}
_NAME_OF = {t: n for t, n in HEAD_TENSORS}

_KINDS = {"sgd": pb.OPTIMIZER_SGD, "adamw": pb.OPTIMIZER_ADAMW}
_PHASES = {"full": pb.STEP_FULL, "reduce": pb.STEP_REDUCE, "apply": pb.STEP_APPLY}

# Bytes of one ExportHead range: the server copies a range into host memory at once, so this
# bounds what an export holds there (and it shrinks further where the server's budget is
# smaller, as fetch_gradients does).
DEFAULT_EXPORT_RANGE_BYTES = 64 << 20


def _group_spec(group):
    """A HeadGroupSpec from create_head's `group` dict (lossd checks its values)."""
    if not isinstance(group, dict) or set(group) - {"members", "member", "id"}:
        raise errors.InvalidArgumentError(
            "group must be a dict of members, member and id, got %r" % (group,))
    return pb.HeadGroupSpec(members=[str(m) for m in group.get("members", ())],
                            member=int(group.get("member", 0)), id=str(group.get("id", "")))


@dataclasses.dataclass
class OptimizerConfig:
    """The optimizer a hosted head steps with: torch.optim.SGD or torch.optim.AdamW
    (foreach=False, fused=False), with torch's arguments. None takes torch's default (lr
    1e-3; weight_decay SGD 0, AdamW 0.01; betas (0.9, 0.999); eps 1e-8). The bias is a
    parameter group of its own with bias_weight_decay (default 0)."""

    kind: str = "adamw"  # "sgd" | "adamw"
    lr: Optional[float] = None
    weight_decay: Optional[float] = None
    bias_weight_decay: float = 0.0
    momentum: float = 0.0  # SGD
    dampening: float = 0.0  # SGD
    nesterov: bool = False  # SGD
    betas: Optional[tuple] = None  # AdamW (beta1, beta2)
    eps: Optional[float] = None  # AdamW
    amsgrad: bool = False  # AdamW

    @classmethod
    def sgd(cls, lr=None, momentum=0.0, dampening=0.0, weight_decay=None, nesterov=False,
            bias_weight_decay=0.0):
        return cls("sgd", lr=lr, momentum=momentum, dampening=dampening,
                   weight_decay=weight_decay, nesterov=nesterov,
                   bias_weight_decay=bias_weight_decay)

    @classmethod
    def adamw(cls, lr=None, betas=None, eps=None, weight_decay=None, amsgrad=False,
              bias_weight_decay=0.0):
        return cls("adamw", lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                   amsgrad=amsgrad, bias_weight_decay=bias_weight_decay)

    @classmethod
    def of(cls, value):
        """An OptimizerConfig from one, a kind name ("sgd", "adamw"), a dict of its fields,
        or None (AdamW with torch's defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(kind=value)
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise errors.InvalidArgumentError(
                    "optimizer: unknown field(s) %s (fields: %s)" % (
                        ", ".join(unknown), ", ".join(f.name for f in dataclasses.fields(cls))))
            return cls(**value)
        raise errors.InvalidArgumentError(
            "optimizer must be an OptimizerConfig, 'sgd', 'adamw' or a dict, got %r" % (value,))

    def check(self):
        """Client-side checks with messages naming the field (the server checks again)."""
        if self.kind not in _KINDS:
            raise errors.InvalidArgumentError(
                "optimizer.kind must be 'sgd' or 'adamw', got %r" % (self.kind,))
        for name in ("lr", "weight_decay", "bias_weight_decay", "momentum", "dampening", "eps"):
            v = getattr(self, name)
            if v is not None and not float(v) >= 0.0:
                raise errors.InvalidArgumentError(
                    "optimizer.%s must be >= 0, got %r" % (name, v))
        if self.betas is not None:
            if len(self.betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in self.betas):
                raise errors.InvalidArgumentError(
                    "optimizer.betas must be two values in [0, 1), got %r" % (self.betas,))
        if self.kind == "sgd" and self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise errors.InvalidArgumentError(
                "optimizer: nesterov needs momentum > 0 and dampening 0 (as torch.optim.SGD), "
                "got momentum %r, dampening %r" % (self.momentum, self.dampening))
        return self

    def state_names(self):
        """The optimizer's state tensors of one parameter, by the suffix-less names of
        HEAD_TENSOR_NAMES: AdamW exp_avg, exp_avg_sq (+ max_exp_avg_sq with amsgrad); SGD
        with momentum exp_avg (torch's momentum_buffer)."""
        if self.kind == "adamw":
            return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self.amsgrad else [])
        return ["exp_avg"] if self.momentum else []

    def to_proto(self):
        self.check()
        m = pb.OptimizerConfig(kind=_KINDS[self.kind],
                               bias_weight_decay=float(self.bias_weight_decay),
                               momentum=float(self.momentum), dampening=float(self.dampening),
                               nesterov=bool(self.nesterov), amsgrad=bool(self.amsgrad))
        for name in ("lr", "weight_decay", "eps"):
            if getattr(self, name) is not None:
                setattr(m, name, float(getattr(self, name)))
        if self.betas is not None:
            m.beta1, m.beta2 = float(self.betas[0]), float(self.betas[1])
        return m

    @classmethod
    def from_proto(cls, m):
        kind = {v: k for k, v in _KINDS.items()}.get(m.kind, "unspecified(%d)" % m.kind)
        opt = lambda f: getattr(m, f) if m.HasField(f) else None  # noqa: E731
        betas = None
        if m.HasField("beta1") or m.HasField("beta2"):
            betas = (m.beta1 if m.HasField("beta1") else 0.9,
                     m.beta2 if m.HasField("beta2") else 0.999)
        return cls(kind=kind, lr=opt("lr"), weight_decay=opt("weight_decay"),
                   bias_weight_decay=m.bias_weight_decay, momentum=m.momentum,
                   dampening=m.dampening, nesterov=m.nesterov, betas=betas, eps=opt("eps"),
                   amsgrad=m.amsgrad)


def _head_info(m, created=True):
    return HeadInfo(name=m.name, v=int(m.w.shape[0]) if len(m.w.shape) == 2 else 0,
                    h=int(m.w.shape[1]) if len(m.w.shape) == 2 else 0, has_bias=m.has_bias,
                    compute_dtype=dtype_name(m.compute_dtype),
                    optimizer=OptimizerConfig.from_proto(m.optimizer), version=m.version,
                    optimizer_step=m.optimizer_step, bytes=m.bytes,
                    contributions=m.contributions, tokens=m.tokens,
                    ranks_waiting=m.ranks_waiting, instance=m.instance,
                    last_used_unix_ms=m.last_used_unix_ms, created=created,
                    group={"members": list(m.group.members), "member": m.group.member,
                           "id": m.group.id} if len(m.group.members) > 1 else None)


def _state_parts(optimizer, state, has_bias):
    """[(wire id, fp32 array)] of an import's optimizer state, in wire order, every tensor the
    optimizer has checked present (and none other)."""
    want = []
    for s in optimizer.state_names():
        want.append(s + "_w")
        if has_bias:
            want.append(s + "_bias")
    given = dict(state)
    missing = [n for n in want if given.get(n) is None]
    extra = sorted(n for n in given if n not in want and given[n] is not None)
    if missing or extra:
        raise errors.InvalidArgumentError(
            "state: the %s optimizer%s needs exactly %s; %s" % (
                optimizer.kind, " (amsgrad)" if optimizer.amsgrad else "",
                ", ".join(want) or "no tensors",
                "missing " + ", ".join(missing) if missing else "unexpected " + ", ".join(extra)))
    out = []
    for n in HEAD_TENSOR_NAMES:
        if n in want:
            _, shape, arr = to_wire(given[n], "state[%r]" % n, (pb.DTYPE_FP32,))
            out.append((_ID_OF[n], arr, shape))
    return out


class _ExportRange:
    """Receives one ExportHead stream (bytes [begin, end) of the head's concatenation) into
    the result arrays, checking the parts' tensors, order and offsets against the header."""

    def __init__(self, layout, begin, end):
        # [(wire id, start byte in the concatenation, bytes, byte view or None, element bytes)]
        self.layout = layout
        self.next, self.end = begin, end

    def add(self, part):
        for tid, start, nbytes, view, _ in self.layout:
            if start <= self.next < start + nbytes or (nbytes == 0 and start == self.next):
                break
        else:
            raise errors.ProtocolError("part past the range's end %d" % self.end,
                                       method="ExportHead")
        if part.tensor != tid or part.offset != self.next - start:
            raise errors.ProtocolError(
                "part of tensor %d at offset %d, expected tensor %d at offset %d" % (
                    part.tensor, part.offset, tid, self.next - start), method="ExportHead")
        n = len(part.data)
        if part.offset + n > nbytes or self.next + n > self.end:
            raise errors.ProtocolError(
                "tensor %d: part [%d, %d) runs past its %d bytes or the range's end" % (
                    tid, part.offset, part.offset + n, nbytes), method="ExportHead")
        if view is not None:
            view[part.offset:part.offset + n] = part.data
        self.next += n

    def finish(self):
        if self.next != self.end:
            raise errors.ProtocolError("export range ended at byte %d of [.., %d)" % (
                self.next, self.end), method="ExportHead")


class HeadMethods:
    """The hosted-head RPCs of lossd.Client (a mixin: it uses the client's stubs, deadlines
    and feature check). The client remembers the server instance each head lives on and names
    it in every call, so a restarted server (which lost its heads) refuses them rather than
    answer for another head of the same name."""

    def _head_instance(self, head):
        with self._heads_lock:
            return self._head_instances.get(head, "")

    def _check_head_compute(self, w, bias, accumulator, head, head_version, rank, micro_batch,
                            timeout):
        """The ComputeHeader's head fields ({} without a head), checked: a head's compute names
        no weight of its own (the head's compute copy is the weight: X in its compute dtype)
        and carries its version and key, and the server must know heads (an older one would
        refuse the fields, or, older still, ignore them). head_version: the version computed
        against (HeadInfo / StepResult.version): an older one is refused, the next one waits
        while this step is pending. (rank, micro_batch): the idempotency key, unique within
        the rank's step: a Compute whose key the step holds (a retry) is answered but not
        added again. Data-parallel averaging is grad_scale (1/world_size, as DDP divides):
        dX comes back scaled alike."""
        if head is None:
            if w is None:
                raise errors.InvalidArgumentError(
                    "w is None: give W, a weight handle, or a head")
            return {}
        given = [n for n, v in (("w", w), ("bias", bias)) if v is not None]
        if accumulator:
            given.append("accumulator")
        if given:
            raise errors.InvalidArgumentError(
                "head given with %s: a head's compute uses the head's weights and adds to its "
                "step (pass w=None, no bias, no accumulator)" % ", ".join(given))
        if head_version is None or micro_batch is None:
            raise errors.InvalidArgumentError(
                "head needs head_version (the version computed against) and micro_batch (with "
                "rank, the key that keeps a retry from adding twice); got %r and %r" % (
                    head_version, micro_batch))
        if int(rank) < 0 or int(micro_batch) < 0 or int(head_version) < 0:
            raise errors.InvalidArgumentError(
                "rank, micro_batch and head_version must be >= 0, got %r, %r, %r" % (
                    rank, micro_batch, head_version))
        self.require_feature("hosted_head", timeout=timeout)
        return dict(head=str(head), head_version=int(head_version), rank=int(rank),
                    micro_batch=int(micro_batch), head_instance=self._head_instance(str(head)))

    def _remember_head(self, head, instance):
        if instance:
            with self._heads_lock:
                self._head_instances[head] = instance

    def _head_rpc(self, method, request, timeout):
        self.require_feature("hosted_head", timeout=timeout)
        kw = self._call_kwargs(timeout)
        try:
            return getattr(self._stub, method)(request, **kw)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, method, kw) from None

    def create_head(self, name, w, bias=None, *, optimizer=None, compute_dtype=None, state=None,
                    version=0, optimizer_step=0, group=None, timeout=None):
        """Creates hosted head `name` from W (V, H) and an optional bias (V): fp32, or bf16 /
        fp16 (the fp32 master is then their upcast). Returns its HeadInfo.

        optimizer: an OptimizerConfig, "sgd" / "adamw" or a dict of its fields (default AdamW
          with torch's defaults). compute_dtype: the compute copy's dtype, which must be the
          dtype of the X every Compute sends (default: w's).
        state: None (a fresh optimizer), or {name: fp32 array} with exactly the optimizer's
          state tensors (OptimizerConfig.state_names, suffixed _w and, with a bias, _bias), as
          an export holds them or lossd.nn.head_state_from_torch makes them from a torch
          optimizer. version: steps completed so far; optimizer_step: AdamW's `step`, or for
          SGD with momentum > 0 once its momentum buffer holds a value.
        Creating a head that exists with the same shape, optimizer and version changes nothing
        (HeadInfo.created False: an import repeated); another version is AlreadyExistsError.
        group: for a head served by S >= 2 lossd (docs/hosted_head.md "Head groups"), a dict
          {"members": [endpoint, ...], "member": this server's index, "id": the group's id};
          each member gets its own create_head (at once: each returns once all have joined).
        """
        self.require_feature("hosted_head", timeout=timeout)
        opt = OptimizerConfig.of(optimizer).check()
        wdt, wshape, warr = to_wire(w, "w", FLOAT_DTYPES)
        if len(wshape) != 2:
            raise errors.InvalidArgumentError("w must be (V, H), got shape %s" % (wshape,))
        cdt = wdt if compute_dtype is None else parse_dtype(compute_dtype)
        if cdt not in FLOAT_DTYPES:
            raise errors.InvalidArgumentError(
                "compute_dtype must be bf16, fp16 or fp32, got %r" % (compute_dtype,))
        if int(version) < 0 or int(optimizer_step) < 0:
            raise errors.InvalidArgumentError(
                "version and optimizer_step must be >= 0, got %r and %r" % (version,
                                                                           optimizer_step))
        header = pb.HeadHeader(name=str(name), w=pb.TensorSpec(dtype=wdt, shape=wshape),
                               compute_dtype=cdt, optimizer=opt.to_proto(),
                               version=int(version), optimizer_step=int(optimizer_step),
                               with_state=state is not None)
        if group is not None:
            header.group.CopyFrom(_group_spec(group))
        sends = [(pb.TENSOR_HEAD_MASTER_W, warr)]
        if bias is not None:
            bdt, bshape, barr = to_wire(bias, "bias", FLOAT_DTYPES)
            header.bias.CopyFrom(pb.TensorSpec(dtype=bdt, shape=bshape))
            sends.append((pb.TENSOR_HEAD_MASTER_BIAS, barr))
        if state is not None:
            for tid, arr, shape in _state_parts(opt, state, bias is not None):
                want = wshape if _NAME_OF[tid].endswith("_w") else (wshape[0],)
                if tuple(shape) != tuple(want):
                    raise errors.InvalidArgumentError("state[%r] has shape %s, expected %s" % (
                        _NAME_OF[tid], tuple(shape), tuple(want)))
                sends.append((tid, arr))
        part_bytes = self.part_bytes

        def requests():
            yield pb.CreateHeadRequest(header=header)
            for tid, arr in sends:
                for p in parts(tid, arr, part_bytes):
                    yield pb.CreateHeadRequest(part=p)

        r = self._head_rpc("CreateHead", requests(), timeout)
        self._remember_head(r.head.name, r.head.instance)
        return _head_info(r.head, created=r.created)

    def import_head(self, export, name=None, *, group=None, timeout=None):
        """Creates a head from a HeadExport (export_head's, or a checkpoint's), under its own
        name or `name`: it resumes exactly where the export was taken. group: as create_head's
        (every member takes the whole export and keeps its slices)."""
        t = export.tensors
        opt = OptimizerConfig.of(export.optimizer)
        state = {}
        for s in opt.state_names():
            state[s + "_w"] = t.get(s + "_w")
            if t.get("master_bias") is not None:
                state[s + "_bias"] = t.get(s + "_bias")
        return self.create_head(name or export.name, t["master_w"], t.get("master_bias"),
                                optimizer=opt, compute_dtype=export.compute_dtype,
                                # An optimizer without state (SGD without momentum) sends
                                # none: the server refuses an empty state.
                                state=state if opt.state_names() else None,
                                version=export.version, optimizer_step=export.optimizer_step,
                                group=group, timeout=timeout)

    def step(self, head, version, *, rank=0, world_size=1, phase="full", lr=None,
             clip_coef=None, max_norm=None, skip=False, timeout=None):
        """One rank's Step of `head` at `version` (the version its Computes named): a barrier
        over world_size ranks; every rank gets the same StepResult once all have called.

        phase: "full" (reduce + apply), "reduce" (the summed gradient's norm and finiteness;
          nothing changes) or "apply" (after a reduce). lr: this step's learning rate (None:
          the head's). clip_coef: multiply the gradient by it (clipping over backbone + head,
          a GradScaler's unscale); max_norm: clip by the head's own norm instead. skip: drop
          the step's gradients, W unchanged (the version still advances).
        Every rank must pass the same arguments (FailedPreconditionError otherwise). The call
        waits for the other ranks up to the server's step timeout: give it a deadline above
        that (the client's default, 600 s, is)."""
        if phase not in _PHASES:
            raise errors.InvalidArgumentError(
                "phase must be 'full', 'reduce' or 'apply', got %r" % (phase,))
        if not 0 <= int(rank) < int(world_size):
            raise errors.InvalidArgumentError(
                "rank must be in [0, world_size), got rank %r, world_size %r" % (rank,
                                                                                 world_size))
        if clip_coef is not None and max_norm is not None:
            raise errors.InvalidArgumentError(
                "clip_coef %r and max_norm %r: give one (a trainer's coefficient, or the "
                "head's own clipping)" % (clip_coef, max_norm))
        req = pb.StepRequest(head=str(head), version=int(version), rank=int(rank),
                             world_size=int(world_size), phase=_PHASES[phase], skip=bool(skip),
                             head_instance=self._head_instance(str(head)))
        if lr is not None:
            req.lr = float(lr)
        if clip_coef is not None:
            req.clip_coef = float(clip_coef)
        if max_norm is not None:
            req.max_norm = float(max_norm)
        r = self._head_rpc("Step", req, timeout)
        self._remember_head(str(head), r.instance)
        return StepResult(version=r.version, grad_norm=r.grad_norm, finite=r.finite,
                          applied=r.applied, clip_coef=r.clip_coef,
                          contributions=r.contributions, tokens=r.tokens,
                          step_seconds=r.step_seconds, instance=r.instance)

    def head_info(self, head, *, timeout=None):
        """The head's HeadInfo (version, optimizer, bytes, the current step's counts)."""
        r = self._head_rpc("GetHeadInfo", pb.HeadRequest(head=str(head)), timeout)
        self._remember_head(r.name, r.instance)
        return _head_info(r)

    def drop_head(self, head, *, timeout=None):
        """Drops the head (its ranks waiting in Step are told NotFound). Forgets its instance
        whatever the server answers."""
        with self._heads_lock:
            self._head_instances.pop(str(head), None)
        self._head_rpc("DropHead", pb.HeadRequest(head=str(head)), timeout)

    def export_head(self, head, *, version=None, tensors=None,
                    range_bytes=DEFAULT_EXPORT_RANGE_BYTES, response_part_bytes=None,
                    timeout=None):
        """The head's master, bias, optimizer state and compute copy at a step boundary, as a
        HeadExport that import_head takes. Streamed in byte ranges of at most `range_bytes`
        (the server copies one range at a time), all naming one version (None: the current
        one, from head_info): a step in between makes the server refuse the later ranges
        (FailedPreconditionError), and the export is to be taken again. tensors: None (all), or
        the names (HEAD_TENSOR_NAMES) to fetch, e.g. ("copy_w", "copy_bias"): only their bytes
        travel, and the result holds only those the head has.
        A head group's head (HeadInfo.group): the members gather their slices into one whole
        export, which any group size (or one server) imports; every member is asked at once,
        each through a client of its own made with this client's settings (a client made on a
        channel of its own passes no TLS credentials to them)."""
        if int(range_bytes) < 4:
            raise errors.InvalidArgumentError("range_bytes must be >= 4, got %r" % range_bytes)
        info = self.head_info(head, timeout=timeout)
        if version is None:
            version = info.version
        rpb = self.response_part_bytes if response_part_bytes is None else response_part_bytes
        one = lambda: self._export_one(head, version, tensors, range_bytes, rpb,  # noqa: E731
                                       timeout)
        if info.group and len(info.group["members"]) > 1:
            return self._export_group(head, version, info.group, rpb, one, timeout)
        return one()

    def _export_group(self, head, version, group, rpb, one, timeout):
        """A group's export (docs/hosted_head.md "Head groups"): the first range of a version
        on each member gathers every member's slices (a collective), so every member is asked
        at once: this client's member streams the whole export (`one`), each other member
        gets a 4-byte look on a client of its own with this client's settings. Once this
        member's export is whole, every member took part; a look's error then says nothing
        more and is dropped, and this member's error is the one raised."""
        me = int(group["member"])
        threads = []

        def look(target):
            try:
                with self._group_peer(target) as c:
                    c._export_range(head, version, 0, 4, int(rpb), None, timeout)
            except Exception:  # noqa: BLE001 -- this member's export says what failed
                pass

        for m, target in enumerate(group["members"]):
            if m != me:
                threads.append(threading.Thread(target=look, args=(target,), daemon=True))
                threads[-1].start()
        try:
            return one()
        finally:
            for t in threads:
                t.join()

    def _group_peer(self, target):
        """A Client of another member of a head's group, with this client's settings and
        credentials (its own channel: close it)."""
        from lossd.client import Client  # lossd.client imports this module

        return Client(str(target), **self._peer_options)

    def import_head_into_group(self, export, members, group_id, name=None, *, timeout=None):
        """Imports a HeadExport into a new head group (a recovery: import the last export into
        a new group, or another group size): import_head on every member at once, each naming
        `members`, its index and `group_id` (a new id: a group is never reused). This client's
        target may be one of `members` or none of them; each member gets a client of its own.
        Returns the members' HeadInfos, in member order."""
        members = [str(m) for m in members]
        out, errs = [None] * len(members), [None] * len(members)

        def one(m):
            try:
                with self._group_peer(members[m]) as c:
                    out[m] = c.import_head(export, name, timeout=timeout, group={
                        "members": members, "member": m, "id": str(group_id)})
            except Exception as e:  # noqa: BLE001 -- raised below, the first member's first
                errs[m] = e

        threads = [threading.Thread(target=one, args=(m,), daemon=True)
                   for m in range(len(members))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for e in errs:
            if e is not None:
                raise e
        return out

    def _export_one(self, head, version, tensors, range_bytes, rpb, timeout):
        """export_head from this client's server alone."""
        # A 4-byte look: the header lists the concatenation's tensors, so their sizes.
        look = self._export_range(head, version, 0, 4, int(rpb), None, timeout)
        layout, arrays, total = self._export_layout(look, wanted=tensors)
        spans = [(start, start + nbytes, elem) for _, start, nbytes, view, elem in layout
                 if view is not None and nbytes > 0]
        max_bytes = int(range_bytes)
        try:
            n = self._export_ranges(head, version, layout, spans, max_bytes, look, int(rpb),
                                    timeout)
        except errors.ResourceExhaustedError as e:
            # Ranges of half the server's memory budget, as fetch_gradients falls back to.
            budget = self.server_info(timeout=timeout).memory_budget_bytes
            if budget // 2 < 4 or budget // 2 >= max_bytes:
                raise e from None
            n = self._export_ranges(head, version, layout, spans, budget // 2, look,
                                    int(rpb), timeout)
        h = look.head
        return HeadExport(name=h.name, version=h.version, optimizer_step=h.optimizer_step,
                          optimizer=OptimizerConfig.from_proto(h.optimizer),
                          compute_dtype=dtype_name(h.compute_dtype), tensors=arrays,
                          instance=look.instance, ranges=n + 1)

    @staticmethod
    def _export_layout(header, allocate=True, wanted=None):
        """(layout, {name: array}, total bytes) of an export header's concatenation; without
        `allocate` (a look) nothing is allocated and the parts are checked and dropped;
        `wanted`: the names to allocate (None: all)."""
        if len(header.tensors) != len(header.specs):
            raise errors.ProtocolError("export lists %d tensors but %d specs" % (
                len(header.tensors), len(header.specs)), method="ExportHead")
        layout, arrays, at = [], {}, 0
        for tid, spec in zip(header.tensors, header.specs):
            name = _NAME_OF.get(tid)
            if name is None or name in arrays or spec.dtype not in FLOAT_DTYPES:
                raise errors.ProtocolError("export lists tensor %d (%s) unexpectedly" % (
                    tid, dtype_name(spec.dtype)), method="ExportHead")
            shape = tuple(int(s) for s in spec.shape)
            elem = 4 if spec.dtype == pb.DTYPE_FP32 else 2
            nbytes = int(np.prod(shape, dtype=np.int64)) * elem
            view = None
            if allocate and (wanted is None or name in wanted):
                buf = bytearray(nbytes)
                arrays[name] = from_wire(spec.dtype, shape, buf)
                view = memoryview(buf)
            layout.append((tid, at, nbytes, view, elem))
            at += nbytes
        if wanted is not None:
            unknown = sorted(set(wanted) - set(HEAD_TENSOR_NAMES))
            if unknown:
                raise errors.InvalidArgumentError(
                    "tensors: unknown name(s) %s (names: %s)" % (
                        ", ".join(unknown), ", ".join(HEAD_TENSOR_NAMES)))
        return layout, arrays, at

    def _export_ranges(self, head, version, layout, spans, max_bytes, look, rpb, timeout):
        """The byte spans of the wanted tensors in ranges of at most max_bytes, each within
        one tensor and cut at its whole elements, one after another, each checked against the
        look's header (the same version, tensors and specs). Returns how many it took."""
        n = 0
        for begin, end, elem in spans:
            pieces = -(-(end - begin) // max(elem, max_bytes - max_bytes % elem))
            units = (end - begin) // elem
            for j in range(pieces):
                b = begin + elem * (units * j // pieces)
                e = begin + elem * (units * (j + 1) // pieces)
                if b < e:
                    self._export_range(head, version, b, e, rpb, (layout, look), timeout)
                    n += 1
        return n

    def _export_range(self, head, version, begin, end, rpb, into, timeout):
        """One ExportHead stream of bytes [begin, end); returns its header. into: None (a
        look: the parts are checked for order only and dropped) or (layout, look header)."""
        self.require_feature("hosted_head", timeout=timeout)
        req = pb.ExportHeadRequest(head=str(head), version=int(version),
                                   response_part_bytes=rpb, range_begin=begin, range_end=end,
                                   head_instance=self._head_instance(str(head)))
        header, recv = None, None
        kw = self._call_kwargs(timeout)
        try:
            for msg in self._stub.ExportHead(req, **kw):
                kind = msg.WhichOneof("kind")
                if kind == "header":
                    if header is not None:
                        raise errors.ProtocolError("two headers", method="ExportHead")
                    header = msg.header
                    if (header.range_begin, header.range_end) != (begin, end):
                        raise errors.ProtocolError("asked for bytes [%d, %d), got [%d, %d)" % (
                            begin, end, header.range_begin, header.range_end),
                            method="ExportHead")
                    if into is None:
                        layout, _, _ = self._export_layout(header, allocate=False)
                    else:
                        layout, look = into
                        if (header.head.SerializeToString() != look.head.SerializeToString()
                                or list(header.tensors) != list(look.tensors)):
                            raise errors.AbortedError(
                                "head %r changed between the ranges of its export (version "
                                "%d then %d): export it again" % (
                                    head, look.head.version, header.head.version),
                                method="ExportHead")
                    recv = _ExportRange(layout, begin, end)
                elif kind == "part":
                    if recv is None:
                        raise errors.ProtocolError("part before header", method="ExportHead")
                    recv.add(msg.part)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, "ExportHead", kw) from None
        if recv is None:
            raise errors.ProtocolError("no header in reply", method="ExportHead")
        recv.finish()
        self._remember_head(str(head), header.instance)
        return header


def init_head_state(client):
    """The per-client state HeadMethods uses (called from Client.__init__)."""
    client._head_instances = {}
    client._heads_lock = threading.Lock()


__all__ = ["HeadMethods", "OptimizerConfig", "HEAD_TENSOR_NAMES", "DEFAULT_EXPORT_RANGE_BYTES"]
