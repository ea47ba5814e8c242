# SPDX-License-Identifier: Apache-2.0
"""The numpy-level lossd client: one method per RPC of lossd.v1.Loss, plus health checks.

Tensors go out as TensorPart messages of at most `part_bytes` bytes each, in byte order, and
come back the same way; the client checks every reply against the wire contract (order,
offsets, sizes) and raises a LossdError subclass for any failure. It never converts dtypes
behind the caller's back: bf16 travels as bf16 (see lossd.tensors.BF16Array).

The transfer machinery lives in lossd._transfer (parts, striping, receivers), a compute's
request and reply in lossd._compute, a fetch's streams in lossd._fetch, the weights' upload in
lossd._weights, and the result types in lossd._results; the names users and tests import from here are re-exported below.
"""

import collections
import dataclasses
import itertools
import threading
import time

import grpc

from lossd import errors
from lossd._async import AsyncCalls
from lossd._compute import (Inputs, ReplyReader, check_out, compute_requests, result_of,
                            returned_outputs, set_options, set_outputs, set_outputs_of)
from lossd._fetch import fetch_striped, fetch_whole
from lossd._heads import HeadMethods, OptimizerConfig, init_head_state
from lossd._kinds import (DistillOptions, PolicyOptions, policy_features,  # noqa: F401
                          set_kind, verl_policy_options)
from lossd._proto import pb, pb_grpc
from lossd._results import (  # noqa: F401 - re-exported: lossd.client.X stays importable
    _STATE_KINDS, ComputeResult, Gradients, HeadExport, HeadInfo, ServerInfo, StateEntry,
    StepResult, WeightHandle)
from lossd._transfer import (  # noqa: F401 - re-exported, as above
    MAX_FETCH_RANGES, Assembler, StripeGroup, fetch_ranges_within)
from lossd._transfer import parts as _parts  # the name tests import
from lossd._two_phase import TicketInputs, check_keep_ms
from lossd._weights import WeightMethods
from lossd._wire import compute_call


# Data bytes per TensorPart message (the wire contract's default bound).
DEFAULT_PART_BYTES = 4 << 20
# Channel message limits: parts of 16 MiB and more must fit (gRPC's default receive limit is
# 4 MiB).
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20
# Per-call deadline unless the caller says otherwise (the C++ client's default too).
DEFAULT_TIMEOUT_S = 600.0
# Striping's default rule (stripes=0): tensors of at least this many bytes go over
# min(connections, DEFAULT_MAX_STRIPES) connections at once; one connection tops out near
# 4.5 GB/s, four give 3-6x.
DEFAULT_AUTO_STRIPE_BYTES = 64 << 20
DEFAULT_MAX_STRIPES = 4
_MAX_STRIPES = 64  # the server's limit per upload
_REMEMBERED_ACCUMULATORS = 1024  # accumulator instances a client keeps (see _acc_instances)


def _open_channels(target, connections, max_message_bytes, tls_server_name, channel_options,
                   credentials):
    """`connections` channels to `target`, each its own TCP connection."""
    opts = [("grpc.max_receive_message_length", int(max_message_bytes)),
            ("grpc.max_send_message_length", int(max_message_bytes))]
    if tls_server_name:
        opts.append(("grpc.ssl_target_name_override", tls_server_name))
    if int(connections) > 1:
        # A private subchannel pool per channel: otherwise gRPC shares one connection.
        opts.append(("grpc.use_local_subchannel_pool", 1))
    opts += list(channel_options or [])
    channels = []
    for _ in range(int(connections)):
        if credentials is not None:
            channels.append(grpc.secure_channel(target, credentials, options=opts))
        else:
            channels.append(grpc.insecure_channel(target, options=opts))
    return channels


def _read_file(path):
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


class Client(AsyncCalls, HeadMethods, WeightMethods):
    """A connection to one lossd server (or a load-balanced name: see `channel_options`).
    Thread-safe: share one client among threads. The hosted-head methods (create_head, step,
    export_head, import_head, head_info, drop_head) are lossd._heads.HeadMethods'.

    target: "host:port" (any gRPC target, e.g. "dns:///lossd-headless:50051").
    part_bytes: data bytes per outgoing TensorPart (default 4 MiB; 1-4 MiB moves fastest),
      rounded down to whole elements of each tensor (at least one element).
    response_part_bytes: data bytes per reply part the server should use (0 = its default;
      at least 1024 otherwise, or the server refuses the call with INVALID_ARGUMENT).
    timeout: default deadline in seconds for every call (default 600; None = no deadline);
      each method takes its own `timeout` too.
    max_message_bytes: the channel's send and receive message limits.
    connections: channels to open, each its own TCP connection; calls round-robin over them
      (one connection tops out at a few GB/s).
    stripes: how many connections one put_weights / fetch_gradients is split over, each
      carrying a byte range on its own stream (four give 3-6x one). 0 = the default rule:
      min(connections, 4) for tensors of at least auto_stripe_bytes (64 MiB), else 1; 1 =
      never. At most `connections` (so with one connection striping is off).
    wait_for_ready: wait for the server to become reachable (until the deadline) instead of
      failing fast with UnavailableError.
    metadata: [(key, value)] added to every call; not x-request-id: the client sends a new one
      each call, which the server logs and every LossdError names (`request_id`).
    auth_token: a bearer token (servers started with --auth_tokens_file); sent as
      "authorization: Bearer <token>" metadata.
    tls_ca_file / tls_cert_file / tls_key_file: PEM files for TLS (servers started with
      --tls_cert): the CA that signed the server's certificate (None = the system roots), and a
      client certificate and key for mutual TLS (--tls_client_ca). tls=True turns TLS on with
      the system roots alone. tls_server_name overrides the name checked in the certificate.
    channel_options: extra gRPC channel arguments, e.g.
      [("grpc.lb_policy_name", "round_robin")] for client-side balancing over a headless
      Service.
    overlap: compute() overlaps transfer with compute (ComputeHeader.overlap): the server
      computes each chunk of rows as its part of X arrives and sends dX back while later
      chunks compute, so a call takes about max(transfer, compute) instead of their sum.
      The cost: once computing has started, a call that fails (cut off, a NaN in a late part
      of X) poisons the named accumulator, as a failed update always does. Per call:
      compute(overlap=...).
    credentials: grpc.ChannelCredentials (instead of the tls_* files); None = plaintext.
    max_in_flight: calls compute_async / call_async run at once (default 2; lossd._async).
    channel: an existing grpc.Channel to use instead (target and the above are then ignored).
    """

    def __init__(self, target="localhost:50051", *, part_bytes=DEFAULT_PART_BYTES,
                 response_part_bytes=0, timeout=DEFAULT_TIMEOUT_S,
                 max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES, connections=1, stripes=0,
                 auto_stripe_bytes=DEFAULT_AUTO_STRIPE_BYTES, wait_for_ready=False, metadata=None,
                 auth_token=None, tls=False,
                 tls_ca_file=None, tls_cert_file=None, tls_key_file=None, tls_server_name=None,
                 channel_options=None, credentials=None, channel=None, overlap=True, max_in_flight=2):
        if int(part_bytes) <= 0:
            raise errors.InvalidArgumentError("part_bytes must be positive, got %r" % part_bytes)
        if int(connections) < 1:
            raise errors.InvalidArgumentError("connections must be >= 1, got %r" % connections)
        if not 0 <= int(stripes) <= _MAX_STRIPES:
            raise errors.InvalidArgumentError(
                "stripes must be in [0, %d] (0 = the default rule), got %r" % (_MAX_STRIPES,
                                                                             stripes))
        n_channels = 1 if channel is not None else int(connections)
        if int(stripes) > n_channels:
            raise errors.InvalidArgumentError(
                "stripes=%d needs as many connections, got %d: each stripe is a stream on a "
                "connection of its own" % (int(stripes), n_channels))
        self.stripes = int(stripes)
        self.auto_stripe_bytes = int(auto_stripe_bytes)
        if int(part_bytes) > int(max_message_bytes) - 1024:
            raise errors.InvalidArgumentError(
                "part_bytes %d does not fit in max_message_bytes %d" % (part_bytes,
                                                                        max_message_bytes))
        self.target = target
        self.part_bytes = int(part_bytes)
        self.response_part_bytes = int(response_part_bytes)
        self.overlap = bool(overlap)
        self.timeout = timeout
        self._wait_ready = bool(wait_for_ready)  # not wait_for_ready: that is a method
        self.metadata = tuple(metadata or ())
        errors.refuse_request_id_in(self.metadata)
        if auth_token:
            self.metadata += (("authorization", "Bearer %s" % auth_token),)
        if (tls_cert_file is None) != (tls_key_file is None):
            raise errors.InvalidArgumentError("tls_cert_file and tls_key_file go together")
        if credentials is None and (tls or tls_ca_file or tls_cert_file):
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_file(tls_ca_file),
                private_key=_read_file(tls_key_file),
                certificate_chain=_read_file(tls_cert_file))
        # What a client of another member of a head group is made with (lossd._heads).
        self._peer_options = dict(
            part_bytes=part_bytes, response_part_bytes=response_part_bytes, timeout=timeout,
            max_message_bytes=max_message_bytes, metadata=self.metadata,
            channel_options=channel_options, credentials=credentials,
            tls_server_name=tls_server_name)
        self._own_channel = channel is None
        if channel is None:
            channels = _open_channels(target, connections, max_message_bytes, tls_server_name,
                                      channel_options, credentials)
        else:
            channels = [channel]
        self._channels = channels
        self.channel = channels[0]
        self._stubs = [pb_grpc.LossStub(c) for c in channels]
        for stub, c in zip(self._stubs, channels):
            stub.compute_wire = compute_call(c)  # Compute's parts encoded by hand (lossd._wire)
        self._next = itertools.count()
        self._next_lock = threading.Lock()
        # Accumulator name -> the server instance its sum began on (at most
        # _REMEMBERED_ACCUMULATORS, the least recently used forgotten first): later computes
        # and fetches name it, and a server of another instance refuses them.
        self._acc_instances = collections.OrderedDict()
        self._acc_lock = threading.Lock()
        self._features = None  # (version, frozenset of names) from the first server_info
        init_head_state(self)
        self.init_async(max_in_flight)
        self._closed = False

    # -- plumbing -----------------------------------------------------------------------

    def close(self):
        """Closes the channels this client opened (not one it was given). Later calls raise
        ClientClosedError; closing twice is harmless."""
        self._closed = True
        self.close_async()
        if self._own_channel:
            for c in self._channels:
                c.close()

    def _check_open(self, method):
        if self._closed:
            raise errors.ClientClosedError(
                "this lossd.Client (target %s) was closed; make a new one" % self.target,
                method=method)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def _stub(self):
        self._check_open(None)
        with self._next_lock:
            i = next(self._next)
        return self._stubs[i % len(self._stubs)]

    def _next_stubs(self, n):
        """n distinct stubs (n <= connections), taken round-robin."""
        self._check_open(None)
        with self._next_lock:
            first = next(self._next)
            for _ in range(n - 1):
                next(self._next)
        return [self._stubs[(first + i) % len(self._stubs)] for i in range(n)]

    def _acc_instance(self, accumulator):
        with self._acc_lock:
            return self._acc_instances.get(accumulator, "")

    def _remember_instance(self, accumulator, instance):
        """Pins the accumulator to the instance that computed (least recently used forgotten
        first). First computes into a new accumulator sent at once, before any of them came
        back, were not pinned: one that reached another instance raises here."""
        if not instance:
            return
        with self._acc_lock:
            known = self._acc_instances.get(accumulator)
            if known is not None:
                self._acc_instances.move_to_end(accumulator)
                if known != instance:
                    raise errors.FailedPreconditionError(
                        "accumulator %r began on server instance %r, but this compute was "
                        "added to one on instance %r (concurrent first computes reached "
                        "different replicas): the sum is split; drop the accumulator and redo "
                        "the step on one replica" % (accumulator, known, instance),
                        method="Compute")
                return
            if len(self._acc_instances) >= _REMEMBERED_ACCUMULATORS:
                self._acc_instances.popitem(last=False)
            self._acc_instances[accumulator] = instance

    def _stripes_for(self, nbytes):
        if self.stripes > 0:
            return self.stripes
        if nbytes < self.auto_stripe_bytes:
            return 1
        return min(len(self._stubs), DEFAULT_MAX_STRIPES)

    def _call_kwargs(self, timeout):
        """timeout: None = the client's default; a number of seconds; or float('inf'). With a
        new request id each call: the server logs it and every error names it."""
        t = self.timeout if timeout is None else timeout
        if t is not None and t == float("inf"):
            t = None
        return {"timeout": t, "wait_for_ready": self._wait_ready,
                "metadata": self.metadata + ((errors.REQUEST_ID_KEY, errors.new_request_id()),)}

    def _unary(self, method, request, timeout, stub=None, name=None):
        """One unary call (of the Loss service unless `stub`); a failure raises the LossdError
        naming `name` (else `method`) and the call's request id."""
        kw = self._call_kwargs(timeout)
        try:
            return getattr(stub or self._stub, method)(request, **kw)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, name or method, kw) from None

    def wait_for_ready(self, timeout=30.0):
        """Blocks until the channel connects; raises UnavailableError after `timeout` s."""
        self._check_open("connect")
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise errors.UnavailableError("no connection to %s within %.1f s" % (
                self.target, timeout), method="connect") from None

    def health(self, service="", timeout=None):
        """grpc.health.v1 Check: returns the status name, e.g. "SERVING"."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        self._check_open("Health.Check")
        stub = health_pb2_grpc.HealthStub(self.channel)
        resp = self._unary("Check", health_pb2.HealthCheckRequest(service=service), timeout,
                           stub=stub, name="Health.Check")
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    # -- RPCs ---------------------------------------------------------------------------

    def server_info(self, timeout=None):
        r = self._unary("ServerInfo", pb.ServerInfoRequest(), timeout)
        info = ServerInfo(**{f.name: getattr(r, f.name) for f in dataclasses.fields(ServerInfo)})
        info.features = list(info.features)
        return info

    def require_feature(self, name, *, timeout=None):
        """Returns when the server lists `name` in ServerInfo.features; else raises
        UnimplementedError naming the feature and the server's version. Asks server_info once
        and remembers the answer. Call it before sending a field the feature guards: an older
        server refuses (or, older still, ignores) a field it does not know."""
        known = self._features
        if known is None:
            info = self.server_info(timeout=timeout)
            known = self._features = (info.version, frozenset(info.features))
        if name not in known[1]:
            raise errors.UnimplementedError(
                "the server (lossd %s) does not support '%s' (not in its ServerInfo.features): "
                "upgrade the server to use it" % (known[0], name), method="require_feature")


    def fetch_gradients(self, accumulator, *, reset=False, response_part_bytes=None,
                        timeout=None):
        """Reads a server-side accumulator (fp32 dW and db); `reset` zeroes it after.

        Striped (see `stripes`; needs connections > 1): a one-value ranged fetch first learns
        the accumulator's size (one extra round trip), then byte ranges of dW | db are fetched
        at once, one stream per connection, straight into the result. Every range must report
        the micro_batches and tokens of the first look, else AbortedError (a compute added to
        the accumulator in between: fetch again). A ranged fetch cannot reset, so `reset` then
        drops the accumulator after the last range has arrived: the next compute naming it
        creates it again, zeroed, and until then fetching it raises NotFoundError rather than
        returning zeros. A compute adding to it while a striped reset is under way may be lost
        with it; a whole fetch resets atomically.

        A server refuses (ResourceExhaustedError) to copy more than its whole
        --memory_budget_bytes at once. Then the fetch asks for server_info and goes on in
        ranges of at most half that budget (fetch_ranges_within), one after another on each
        stream, with the same checks and the same reset-by-drop as striping.
        """
        rpb = self.response_part_bytes if response_part_bytes is None else response_part_bytes
        if self.stripes > 1 or (self.stripes == 0 and len(self._stubs) > 1):
            got = fetch_striped(self, accumulator, reset, int(rpb), timeout)
            if got is not None:
                return got
        return fetch_whole(self, accumulator, reset, rpb, timeout)

    def list_state(self, *, timeout=None):
        """The caller's own weight handles, accumulators and hosted heads (what its credential
        created; everything on a server that checks none), as StateEntry. Needs a server with
        the "list_state" feature (UnimplementedError naming it otherwise)."""
        self.require_feature("list_state", timeout=timeout)
        r = self._unary("List", pb.ListRequest(), timeout)
        return [StateEntry(kind=_STATE_KINDS.get(e.kind, str(e.kind)), name=e.name,
                           bytes=e.bytes, last_used_unix_ms=e.last_used_unix_ms,
                           micro_batches=e.micro_batches, version=e.version)
                for e in r.entries]

    def drop_accumulator(self, accumulator, *, timeout=None):
        """Drops a server-side accumulator. Also forgets its server instance, whatever the
        server answers: the next compute into that name may begin a new sum anywhere."""
        with self._acc_lock:
            self._acc_instances.pop(accumulator, None)
        self._unary("DropAccumulator", pb.DropAccumulatorRequest(accumulator=accumulator),
                    timeout)

    def compute(self, x, w, targets, *, bias=None, class_weights=None, grad_output=None,
                ignore_index=-100, reduction="mean", label_smoothing=0.0, lse_square_scale=0.0,
                softcap=None, grad_dtype=None, grad_scale=None, chunk_rows=0,
                token_scaling=False, want_dx=True, want_dw=True, want_db=None, want_lse=False,
                want_z_loss=False,
                want_accuracy=False, want_predictions=False, accumulator=None,
                response_part_bytes=None, out=None, timeout=None, overlap=None, head=None,
                head_version=None, rank=0, micro_batch=None, kind="cross_entropy",
                temperature=None, want_entropy=False, dlogp=None, dentropy=None,
                advantages=None, old_logp=None, ref_logp=None, policy=None, teacher_x=None,
                teacher_w=None, teacher_bias=None, distill=None, keep_ms=0, ticket=None,
                allow_nonfinite_loss=False, is_ratio=None, teacher_topk_ids=None,
                teacher_topk_logp=None):
        """Linear + cross-entropy (or another loss kind) forward and backward on the server.

        x: (BT, H) bf16 / fp16 / fp32 (BF16Array, numpy array, or torch tensor).
        w: (V, H) same dtype as x, or a WeightHandle (or its handle string) from put_weights.
        targets: (BT) int32 or int64 (any integer array is sent as int64).
        bias: (V), inline weights only (a handle carries its own bias).
        class_weights: (V) fp32, PyTorch's cross_entropy `weight`.
        grad_output: (BT) fp32 upstream gradient, reduction "none" only (default ones).
        reduction: "mean" | "sum" | "none". softcap: None or 0 = off.
        The option defaults are the server's, kept in one place (core/loss_problem.h).
        grad_dtype: None = the input dtype, or "fp32".
        grad_scale: upstream gradient of the scalar loss (mean, sum); default 1.
        chunk_rows: rows per chunk, 0 = the server chooses.
        token_scaling: Liger's use_token_scaling: each token's loss and gradient times its
          target's probability (servers listing the "token_scaling" feature).
        want_*: which outputs to return (the loss always is). want_db defaults to "a bias is
          in use" (for a bare handle string: asked for, and it comes if the handle has one).
          With `accumulator`, dW and db are added to that server-side fp32 accumulator
          (created on first use) instead of being returned. The client remembers the server
          instance of each accumulator it added to: a server of another instance
          (another replica behind a balancer, or this one restarted) then refuses the call
          (FailedPreconditionError) instead of starting a second, partial sum;
          drop_accumulator forgets it.
        out: {"dx": array, "dw": ..., "lse": ...} caller buffers (C-contiguous, writable, of
          the output's exact dtype and shape; a BF16Array or uint16 array for bf16) to
          receive outputs into without a copy; the result then holds those same arrays. A
          buffer that does not fit, or one for an output the call does not return, is refused
          before anything is sent.
        timeout: seconds (None = the client's default, float("inf") = none).
        overlap: None = the client's setting (see Client); off for a two-phase call.
        head: a hosted head's name, with w None: its compute copy is the weight, dW/db go into
          its step at head_version, and (rank, micro_batch) is the key that keeps a retry from
          adding twice (result.head_added); see HeadMethods._check_head_compute.
        kind: "cross_entropy", or (servers listing "loss_kind_<kind>"; lossd._kinds and
          docs/rl_losses.md) "logprob": result.logp (and with want_entropy result.entropy)
          at `temperature`, gradients of sum(dlogp * logp + dentropy * entropy) (fp32 (BT)
          each, absent = zeros); "policy": GRPO / PPO-clip (targets: ignore_index where the
          completion mask is 0; advantages, old_logp, ref_logp fp32 (BT); policy: a
          PolicyOptions or dict), result.kl and result.clip_fraction; "distill": JSD against
          the teacher (teacher_x (BT, Ht), teacher_w (V, Ht) or its WeightHandle, teacher_bias;
          distill: a DistillOptions or dict; targets only mark ignored rows and may be None),
          or instead of the teacher's head its top-k (servers listing "distill_topk"):
          teacher_topk_ids (BT, k) int32 or int64 and teacher_topk_logp (BT, k) fp32, the
          teacher's k most likely ids per row and their log-probs, distill.topk_tail saying
          what stands for the rest.
        keep_ms, ticket: the two-phase logprob (servers listing "logprob_two_phase";
          lossd._two_phase). A forward with keep_ms > 0 (and no upstream gradients, no
          gradients wanted) returns result.ticket, kept that long (result.ticket_expires_unix_ms);
          compute(None, None, None, kind="logprob", ticket=..., dlogp=, dentropy=) is its
          backward, sending nothing else (accumulator, grad_scale, grad_dtype and want_* may be
          given; for a ticket taken against a head, rank and micro_batch but not head). An
          expired, consumed or unknown ticket is NotFoundError, one of another server instance
          (a restart, another replica) FailedPreconditionError: send the one-phase call then.
        allow_nonfinite_loss: a loss that overflows fp32 from finite inputs comes back inf or
          NaN (result.nonfinite names the gradients holding NaN or Inf) instead of being
          refused; not into an accumulator or a head (servers listing "nonfinite_loss").
        is_ratio: kind "policy": fp32 (BT), finite and >= 0, each token's rollout correction
          (Liger's vllm_is_ratio) on its policy term (servers listing "policy_is_ratio").
        """
        t_start = time.perf_counter()
        keep_ms = check_keep_ms(keep_ms)
        if ticket is None:
            # A forward that keeps adds nothing to a head's step, so it needs no step key.
            head_fields = self._check_head_compute(
                w, bias, accumulator, head, head_version, rank,
                0 if keep_ms and micro_batch is None else micro_batch, timeout)
            inputs = Inputs(x, w, targets, bias, class_weights, grad_output, reduction)
        else:
            inputs = TicketInputs(ticket, kind, keep_ms, out, dict(
                x=x, w=w, targets=targets, bias=bias, class_weights=class_weights,
                grad_output=grad_output, advantages=advantages, old_logp=old_logp,
                ref_logp=ref_logp, policy=policy, teacher_x=teacher_x, teacher_w=teacher_w,
                teacher_bias=teacher_bias, distill=distill, head=head, is_ratio=is_ratio,
                teacher_topk_ids=teacher_topk_ids, teacher_topk_logp=teacher_topk_logp))
            head_fields = inputs.head_fields(head_version, rank, micro_batch)
        if keep_ms or ticket is not None:
            self.require_feature("logprob_two_phase", timeout=timeout)
        header = inputs.header
        set_kind(header, inputs.inline, kind=kind, temperature=temperature, policy=policy,
                 distill=distill, dlogp=dlogp, dentropy=dentropy, advantages=advantages,
                 old_logp=old_logp, ref_logp=ref_logp, teacher_x=teacher_x, teacher_w=teacher_w,
                 teacher_bias=teacher_bias, want_entropy=want_entropy, is_ratio=is_ratio,
                 teacher_topk_ids=teacher_topk_ids, teacher_topk_logp=teacher_topk_logp)
        if is_ratio is not None:
            self.require_feature("policy_is_ratio", timeout=timeout)
        if teacher_topk_ids is not None or teacher_topk_logp is not None:
            self.require_feature("distill_topk", timeout=timeout)
        for feature in policy_features(header):
            self.require_feature(feature, timeout=timeout)
        set_options(header, inputs.xdt, ignore_index=ignore_index, reduction=reduction,
                    label_smoothing=label_smoothing, lse_square_scale=lse_square_scale,
                    softcap=softcap, grad_dtype=grad_dtype, grad_scale=grad_scale,
                    chunk_rows=chunk_rows, token_scaling=token_scaling)
        if ticket is not None:
            inputs.finish(header, temperature, ignore_index)
        header.keep_ms = keep_ms
        if allow_nonfinite_loss:
            self.require_feature("nonfinite_loss", timeout=timeout)
            header.allow_nonfinite_loss = True
        set_outputs(header, inputs.has_bias, accumulator or head, want_dx=want_dx,
                    want_dw=want_dw, want_db=want_db, want_lse=want_lse, want_z_loss=want_z_loss,
                    want_accuracy=want_accuracy, want_predictions=want_predictions)
        if accumulator:
            header.accumulator = accumulator
            header.accumulator_instance = self._acc_instance(accumulator)
        header.MergeFrom(pb.ComputeHeader(**head_fields))
        rpb = self.response_part_bytes if response_part_bytes is None else response_part_bytes
        header.response_part_bytes = int(rpb)
        if overlap is None:  # a two-phase call is never overlapped (the server refuses it)
            overlap = self.overlap and not (keep_ms or ticket is not None)
        overlapped = bool(overlap)
        header.overlap = overlapped
        bytes_sent = sum(arr.nbytes for _, arr in inputs.inline)
        into = check_out(out, returned_outputs(header, inputs.xdt, inputs.xshape, inputs.wshape,
                                               inputs.has_bias))
        asm = Assembler("Compute", into)
        reader = ReplyReader(asm, overlapped)
        kw = self._call_kwargs(timeout)
        try:
            requests = compute_requests(header, inputs.inline, self.part_bytes)
            for msg in self._stub.compute_wire(requests, **kw):
                reader.add(msg)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, "Compute", kw) from None
        summary = reader.finish()
        tensors = asm.finish()
        res = result_of(summary, tensors, into, wall_seconds=time.perf_counter() - t_start,
                        bytes_sent=bytes_sent, bytes_received=asm.received)
        if accumulator:
            self._remember_instance(accumulator, summary.instance)
        if head is not None:
            self._remember_head(str(head), summary.instance)
        set_outputs_of(res, tensors)
        return res


def connect(target="localhost:50051", **kwargs) -> Client:
    """Client(target, **kwargs)."""
    return Client(target, **kwargs)


__all__ = ["Client", "ComputeResult", "WeightHandle", "Gradients", "ServerInfo", "StateEntry",
           "HeadInfo", "HeadExport", "StepResult", "OptimizerConfig", "PolicyOptions",
           "DistillOptions", "verl_policy_options", "connect",
           "DEFAULT_PART_BYTES"]
