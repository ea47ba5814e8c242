# SPDX-License-Identifier: Apache-2.0
"""The numpy client against a real lossd (CPU backend), compared with a float64 numpy reference
of the math in core/loss_problem.h."""

import zlib

import numpy as np
import pytest

import lossd
from conftest import BACKEND, assert_accuracy, assert_close, assert_predictions, assert_scalar

# Odd shapes: nothing a multiple of 8.
BT, H, V = 47, 31, 123


def reference(x, w, t, b=None, cw=None, ignore_index=-100, reduction="mean", eps=0.0, zs=0.0,
              softcap=0.0, grad_output=None, grad_scale=1.0):
    """Float64 loss and gradients. Returns dict(loss, z_loss, per_token, per_token_z, lse,
    pred, acc, tokens, dx, dw, db)."""
    X, W = lossd.tensors.to_float64(x), lossd.tensors.to_float64(w)
    t = np.asarray(t, dtype=np.int64)
    z = X @ W.T + (0.0 if b is None else lossd.tensors.to_float64(b))
    if softcap:
        z = softcap * np.tanh(z / softcap)
    n_rows, nv = z.shape
    valid = t != ignore_index
    ts = np.where(valid, t, 0)
    m = z.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
    p = np.exp(z - lse[:, None])
    c = np.ones(nv) if cw is None else np.asarray(cw, dtype=np.float64)
    wt = c[ts] * valid
    rows = np.arange(n_rows)
    nll = wt * (lse - z[rows, ts])
    smooth = (c[None, :] * (lse[:, None] - z)).sum(axis=1) / nv * valid
    ce = (1 - eps) * nll + eps * smooth
    zl = zs * lse ** 2 * valid
    onehot = np.zeros_like(z)
    onehot[rows, ts] = 1.0
    d_ce = ((1 - eps) * wt[:, None] * (p - onehot)
            + eps * valid[:, None] * (c.sum() / nv * p - c[None, :] / nv))
    d_zl = 2 * zs * (lse * valid)[:, None] * p
    if reduction == "mean":
        den, n = wt.sum(), valid.sum()
        inv_den = 1.0 / den if den > 0 else 0.0
        inv_n = 1.0 / n if n > 0 else 0.0
        loss, z_loss = ce.sum() * inv_den + zl.sum() * inv_n, zl.sum() * inv_n
        g = (d_ce * inv_den + d_zl * inv_n) * grad_scale
    elif reduction == "sum":
        loss, z_loss = (ce + zl).sum(), zl.sum()
        g = (d_ce + d_zl) * grad_scale
    else:
        go = np.ones(n_rows) if grad_output is None else np.asarray(grad_output, np.float64)
        loss, z_loss = (ce + zl).sum(), zl.sum()
        g = (d_ce + d_zl) * go[:, None]
    if softcap:
        g = g * (1 - (z / softcap) ** 2)
    pred = z.argmax(axis=1)
    n_valid = valid.sum()
    acc = float(((pred == t) & valid).sum()) / n_valid if n_valid else 0.0
    return dict(loss=loss, z_loss=z_loss, per_token=ce + zl, per_token_z=zl, lse=lse, pred=pred,
                acc=acc, tokens=int(n_valid), dx=g @ W, dw=g.T @ X, db=g.sum(axis=0), z=z)


def make_inputs(dtype, bt=BT, h=H, v=V, seed=0, bias=False):
    """Random inputs whose logits have std ~3 (a softmax that is not flat)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((bt, h)).astype(np.float32)
    w = (rng.standard_normal((v, h)) * 3.0 / np.sqrt(h)).astype(np.float32)
    b = rng.standard_normal(v).astype(np.float32) if bias else None
    t = rng.integers(0, v, size=bt).astype(np.int64)
    conv = {"fp32": lambda a: a, "fp16": lambda a: a.astype(np.float16),
            "bf16": lossd.BF16Array.from_float}[dtype]
    return conv(x), conv(w), (None if b is None else conv(b)), t


CASES = {
    "plain": {},
    "bias": {"bias": True},
    "class_weights": {"cw": True},
    "label_smoothing": {"eps": 0.2},
    "class_weights_and_smoothing": {"cw": True, "eps": 0.3},
    "z_loss": {"zs": 0.05},
    "softcap": {"softcap": 2.0},
    "sum": {"reduction": "sum"},
    "none_grad_output": {"reduction": "none", "go": True},
    "none_default_grad_output": {"reduction": "none"},
    "ignore_index": {"ignore": True},
    "ignore_index_is_a_class": {"ignore_index": 7},
    "int32_targets": {"int32": True},
    "grad_scale": {"grad_scale": 0.37},
    "grad_dtype_fp32": {"grad_fp32": True},
    "chunk_rows": {"chunk_rows": 5},
    "everything": {"bias": True, "cw": True, "eps": 0.1, "zs": 0.02, "softcap": 3.0,
                   "ignore": True, "grad_scale": 1.7},
}


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_compute_matches_reference(client, dtype, case):
    o = CASES[case]
    x, w, b, t = make_inputs(dtype, bias=o.get("bias", False), seed=zlib.crc32(case.encode()) % 1000)
    rng = np.random.default_rng(1)
    ignore_index = o.get("ignore_index", -100)
    if o.get("ignore"):
        t[rng.random(BT) < 0.3] = ignore_index
    if "ignore_index" in o:
        t[:5] = ignore_index  # make sure the class is there to be ignored
    cw = rng.uniform(0.2, 2.0, V).astype(np.float32) if o.get("cw") else None
    go = rng.uniform(-1.0, 2.0, BT).astype(np.float32) if o.get("go") else None
    reduction = o.get("reduction", "mean")
    kw = dict(ignore_index=ignore_index, reduction=reduction, eps=o.get("eps", 0.0),
              zs=o.get("zs", 0.0), softcap=o.get("softcap", 0.0), grad_output=go,
              grad_scale=o.get("grad_scale", 1.0))
    ref = reference(x, w, t, b=b, cw=cw, **kw)
    targets = t.astype(np.int32) if o.get("int32") else t
    r = client.compute(x, w, targets, bias=b, class_weights=cw, grad_output=go,
                       ignore_index=ignore_index, reduction=reduction,
                       label_smoothing=kw["eps"], lse_square_scale=kw["zs"],
                       softcap=kw["softcap"] or None,
                       grad_dtype="fp32" if o.get("grad_fp32") else None,
                       grad_scale=o.get("grad_scale"), chunk_rows=o.get("chunk_rows", 0),
                       want_lse=True, want_z_loss=True, want_accuracy=True,
                       want_predictions=True)
    assert_scalar("loss", r.loss, ref["loss"], dtype)
    assert_scalar("z_loss", r.z_loss, ref["z_loss"], dtype)
    assert r.tokens == ref["tokens"]
    assert r.backend == BACKEND
    assert r.compute_seconds >= 0.0
    assert_close("lse", r.lse, ref["lse"], dtype)
    if reduction == "none":
        assert_close("per_token_loss", r.per_token_loss, ref["per_token"], dtype)
        assert_close("per_token_z_loss", r.per_token_z_loss, ref["per_token_z"], dtype)
    else:
        assert r.per_token_loss is None
    grad_dtype = "fp32" if o.get("grad_fp32") else dtype
    for name in ("dx", "dw"):
        got = getattr(r, name)
        assert (got.dtype if not isinstance(got, lossd.BF16Array) else "bf16") == {
            "fp32": np.float32, "fp16": np.float16, "bf16": "bf16"}[grad_dtype], name
        assert_close(name, got, ref[name], dtype)
    if b is not None:
        assert_close("db", r.db, ref["db"], dtype)
    else:
        assert r.db is None
    assert r.predictions.dtype == np.int64
    assert_predictions(r.predictions, ref["z"], dtype)
    assert_accuracy(r.accuracy, r.predictions, t, ignore_index)


def test_all_ignored_gives_zero_not_nan(client):
    x, w, b, t = make_inputs("fp32", bias=True)
    t[:] = -100
    for reduction in ("mean", "sum", "none"):
        r = client.compute(x, w, t, bias=b, reduction=reduction, lse_square_scale=0.1)
        assert r.loss == 0.0 and r.z_loss == 0.0 and r.tokens == 0, reduction
        for name in ("dx", "dw", "db"):
            g = getattr(r, name)
            assert np.all(g == 0.0), "%s %s: %s" % (reduction, name, g[g != 0][:5])


def test_outputs_not_asked_are_not_sent(client):
    x, w, _, t = make_inputs("fp32")
    r = client.compute(x, w, t, want_dx=False, want_dw=False)
    assert r.dx is None and r.dw is None and r.db is None and r.lse is None
    assert r.predictions is None
    ref = reference(x, w, t)
    assert_scalar("loss", r.loss, ref["loss"], "fp32")


def test_same_request_twice_is_bit_identical(client):
    x, w, b, t = make_inputs("bf16", bias=True)
    r1 = client.compute(x, w, t, bias=b, label_smoothing=0.1, want_lse=True)
    r2 = client.compute(x, w, t, bias=b, label_smoothing=0.1, want_lse=True)
    assert r1.loss == r2.loss
    for name in ("dx", "dw", "db", "lse"):
        a, c = getattr(r1, name), getattr(r2, name)
        a = a.bits if isinstance(a, lossd.BF16Array) else a
        c = c.bits if isinstance(c, lossd.BF16Array) else c
        np.testing.assert_array_equal(a, c, err_msg=name)


def test_overlap_on_and_off_give_the_same_bits(lossd_server):
    """Overlapped (the default: a preliminary summary, dX while X still arrives, the final
    summary last) and not: the same bits, with inline weights and by handle with an
    accumulator, in small chunks and parts so that many chunks overlap."""
    x, w, b, t = make_inputs("bf16", bias=True)
    with lossd.Client(lossd_server.address, part_bytes=512, response_part_bytes=1100,
                      timeout=60) as c:
        assert c.overlap
        on = c.compute(x, w, t, bias=b, chunk_rows=3, want_lse=True)
        off = c.compute(x, w, t, bias=b, chunk_rows=3, want_lse=True, overlap=False)
        assert on.loss == off.loss and on.tokens == off.tokens
        for name in ("dx", "dw", "db", "lse"):
            a, o = getattr(on, name), getattr(off, name)
            a = a.bits if isinstance(a, lossd.BF16Array) else a
            o = o.bits if isinstance(o, lossd.BF16Array) else o
            np.testing.assert_array_equal(a, o, err_msg=name)
        h = c.put_weights(w, b)
        for acc, ov in (("py-ov-on", True), ("py-ov-off", False)):
            for _ in range(2):
                r = c.compute(x, h, t, chunk_rows=3, accumulator=acc, overlap=ov)
                assert r.dw is None
        g_on = c.fetch_gradients("py-ov-on", reset=True)
        g_off = c.fetch_gradients("py-ov-off", reset=True)
        np.testing.assert_array_equal(g_on.dw, g_off.dw)
        np.testing.assert_array_equal(g_on.db, g_off.db)
        assert g_on.micro_batches == g_off.micro_batches == 2
        c.drop_weights(h)


def test_tiny_parts_give_the_same_bits(lossd_server):
    """part_bytes=7 sends one-element parts (rounded down to whole elements) for Compute and
    PutWeights; replies come in 1027-byte parts (the server's floor is 1024) that split
    elements. Same bits as big parts."""
    x, w, b, t = make_inputs("fp32", bt=9, h=40, v=60, bias=True)
    with lossd.Client(lossd_server.address, timeout=60) as big:
        ref = big.compute(x, w, t, bias=b)
    with lossd.Client(lossd_server.address, part_bytes=7, response_part_bytes=1027,
                      timeout=60) as small:
        got = small.compute(x, w, t, bias=b)
        h = small.put_weights(w, b)
        by_handle = small.compute(x, h, t)
        small.drop_weights(h)
    for r in (got, by_handle):
        assert r.loss == ref.loss
        for name in ("dx", "dw", "db"):
            np.testing.assert_array_equal(getattr(r, name), getattr(ref, name), err_msg=name)


def test_parts_hold_whole_elements_in_byte_order():
    from lossd._proto import pb
    from lossd.client import _parts

    for arr, part_bytes, want in ((np.arange(10, dtype=np.float32), 7, 4),
                                  (np.arange(10, dtype=np.int64), 7, 8),
                                  (lossd.float_to_bf16_bits(np.arange(9.0)), 7, 6),
                                  (np.arange(1000, dtype=np.float32), 4 << 20, 4000)):
        parts = list(_parts(pb.TENSOR_X, arr, part_bytes))
        assert all(len(p.data) == want for p in parts[:-1]), (arr.dtype, part_bytes)
        assert all(len(p.data) % arr.itemsize == 0 for p in parts)
        assert [p.offset for p in parts] == list(range(0, arr.nbytes, want))
        assert b"".join(p.data for p in parts) == arr.tobytes()


def test_multi_part_tensors_default_part_size(client):
    """W and dW of about 5 MiB travel in more than one 4 MiB part."""
    x, w, _, t = make_inputs("fp32", bt=64, h=256, v=5200, seed=3)
    assert w.nbytes > lossd.DEFAULT_PART_BYTES
    r = client.compute(x, w, t)
    ref = reference(x, w, t)
    assert_scalar("loss", r.loss, ref["loss"], "fp32")
    assert_close("dx", r.dx, ref["dx"], "fp32")
    assert_close("dw", r.dw, ref["dw"], "fp32")


def test_weight_handle(client):
    x, w, b, t = make_inputs("bf16", bias=True, seed=5)
    inline = client.compute(x, w, t, bias=b)
    h = client.put_weights(w, b)
    assert h.handle and h.has_bias and (h.v, h.h, h.dtype) == (V, H, "bf16")
    assert h.bytes >= w.nbytes + b.nbytes
    info = client.server_info()
    assert info.weight_cache_bytes >= w.nbytes
    r = client.compute(x, h, t)
    assert r.loss == inline.loss
    np.testing.assert_array_equal(r.dx.bits, inline.dx.bits)
    np.testing.assert_array_equal(r.dw.bits, inline.dw.bits)
    np.testing.assert_array_equal(r.db.bits, inline.db.bits)
    r2 = client.compute(x, h.handle, t, want_db=True)  # a bare handle string works too
    assert r2.loss == inline.loss and r2.db is not None
    with pytest.raises(lossd.InvalidArgumentError):
        client.compute(x, h, t, bias=b)  # the handle already carries a bias
    client.drop_weights(h)
    with pytest.raises(lossd.NotFoundError) as e:
        client.compute(x, h, t)
    assert e.value.code.name == "NOT_FOUND" and h.handle in e.value.message
    assert e.value.method == "Compute"


def test_accumulator(client):
    name = "test-acc"
    dw_sum = db_sum = 0.0
    tokens = 0
    h = None
    for i in range(3):
        x, w, b, t = make_inputs("fp32", bias=True, seed=10 + i)
        if h is None:
            w0, b0 = w, b
            h = client.put_weights(w0, b0)
        t[:i] = -100
        ref = reference(x, w0, t, b=b0, grad_scale=1.0 / 3)
        dw_sum, db_sum, tokens = dw_sum + ref["dw"], db_sum + ref["db"], tokens + ref["tokens"]
        r = client.compute(x, h, t, grad_scale=1.0 / 3, accumulator=name)
        assert r.dw is None and r.db is None, "dW and db stay on the server"
        assert r.accumulated_micro_batches == i + 1
        assert_close("dx", r.dx, ref["dx"], "fp32")
    g = client.fetch_gradients(name, reset=True, response_part_bytes=1100)
    assert g.micro_batches == 3 and g.tokens == tokens
    assert g.dw.dtype == np.float32 and g.db.dtype == np.float32
    assert_close("accumulated dw", g.dw, dw_sum, "fp32")
    assert_close("accumulated db", g.db, db_sum, "fp32")
    assert g.instance == client.server_info().instance
    g0 = client.fetch_gradients(name)
    assert g0.micro_batches == 0 and np.all(g0.dw == 0) and np.all(g0.db == 0)
    client.drop_accumulator(name)
    with pytest.raises(lossd.NotFoundError) as e:
        client.fetch_gradients(name)
    assert name in e.value.message
    client.drop_weights(h)


def test_overflowed_accumulator_is_reported_and_refused_until_reset(client):
    x, w, _, t = make_inputs("fp32", seed=5)
    client.require_feature("nonfinite_outputs")
    ok = client.compute(x, w, t, reduction="sum", accumulator="inf-acc")
    assert ok.nonfinite == []
    r = client.compute(x, w, t, reduction="sum", grad_scale=3e38, accumulator="inf-acc")
    assert "dw" in r.nonfinite and r.accumulated_micro_batches == 2
    refused = r"accumulator 'inf-acc' holds a non-finite sum: micro-batch 2 \(a Compute at"
    with pytest.raises(lossd.FailedPreconditionError, match=refused):
        client.fetch_gradients("inf-acc")
    with pytest.raises(lossd.FailedPreconditionError, match=refused):
        client.compute(x, w, t, reduction="sum", accumulator="inf-acc")
    with pytest.raises(lossd.FailedPreconditionError, match="returned nothing and zeroed it"):
        client.fetch_gradients("inf-acc", reset=True)
    again = client.compute(x, w, t, reduction="sum", accumulator="inf-acc")
    assert again.accumulated_micro_batches == 1 and again.nonfinite == []
    g = client.fetch_gradients("inf-acc")
    assert g.micro_batches == 1 and np.all(np.isfinite(g.dw))
    # Without an accumulator the overflowed dW comes back, named.
    plain = client.compute(x, w, t, reduction="sum", grad_scale=3e38)
    assert "dw" in plain.nonfinite and not np.all(np.isfinite(np.asarray(plain.dw)))
    client.drop_accumulator("inf-acc")


def test_accumulator_shape_must_match(client):
    x, w, _, t = make_inputs("fp32", seed=2)
    client.compute(x, w, t, accumulator="shape-acc")
    x2, w2, _, t2 = make_inputs("fp32", v=V + 1, seed=2)
    with pytest.raises(lossd.LossdError) as e:
        client.compute(x2, w2, t2, accumulator="shape-acc")
    assert e.value.code.name in ("INVALID_ARGUMENT", "FAILED_PRECONDITION")
    client.drop_accumulator("shape-acc")


def test_server_errors_carry_code_and_message(client):
    x, w, _, t = make_inputs("fp32")
    with pytest.raises(lossd.InvalidArgumentError) as e:
        client.compute(x, w[:, :-1], t)  # H differs
    assert e.value.code.name == "INVALID_ARGUMENT" and e.value.method == "Compute"
    assert str(H) in e.value.message and str(H - 1) in e.value.message
    bad = t.copy()
    bad[3] = V  # out of range
    with pytest.raises(lossd.InvalidArgumentError) as e:
        client.compute(x, w, bad)
    assert str(V) in e.value.message
    with pytest.raises(lossd.InvalidArgumentError):
        client.compute(x, w, t[:-1])  # BT differs
    with pytest.raises(lossd.InvalidArgumentError):
        client.compute(x, w, t, label_smoothing=1.5)
    with pytest.raises(lossd.InvalidArgumentError):
        client.compute(x.astype(np.float16), w, t)  # dtypes differ
    nan_x = x.copy()
    nan_x[2, 3] = np.nan
    with pytest.raises(lossd.InvalidArgumentError) as e:
        client.compute(nan_x, w, t)
    assert "nan" in e.value.message.lower()
    with pytest.raises(lossd.NotFoundError):
        client.drop_weights("no-such-handle")
    with pytest.raises(lossd.NotFoundError):
        client.fetch_gradients("no-such-accumulator")


def test_client_side_validation(client):
    x, w, _, t = make_inputs("fp32")
    with pytest.raises(lossd.InvalidArgumentError) as e:
        client.compute(x.astype(np.float64), w, t)
    assert "float64" in str(e.value) and isinstance(e.value, ValueError)
    with pytest.raises(lossd.InvalidArgumentError) as e:
        client.compute(x.view(np.uint16), w, t)
    assert "lossd.bf16" in str(e.value)
    with pytest.raises(lossd.InvalidArgumentError):
        client.compute(x, w, t, reduction="avg")
    with pytest.raises(lossd.InvalidArgumentError):
        client.compute(x, w, t, grad_output=np.ones(BT, np.float32))  # mean takes grad_scale
    with pytest.raises(lossd.InvalidArgumentError):
        lossd.Client("127.0.0.1:1", part_bytes=0)


def test_deadline(client):
    x, w, _, t = make_inputs("fp32", bt=256, h=256, v=4000)
    with pytest.raises(lossd.DeadlineExceededError) as e:
        client.compute(x, w, t, timeout=1e-4)
    assert e.value.code.name == "DEADLINE_EXCEEDED" and isinstance(e.value, TimeoutError)
    client.compute(x[:4], w[:8], t[:4] % 8)  # the server is still fine


def test_unreachable_server_is_unavailable():
    with lossd.Client("127.0.0.1:1", timeout=5) as c:
        with pytest.raises(lossd.UnavailableError):
            c.server_info()


def test_server_info_and_health(client):
    assert client.health() == "SERVING"
    info = client.server_info()
    assert info.backend == BACKEND and info.instance and info.version
    assert info.max_part_bytes >= 1 and info.max_bt > 0 and info.max_h > 0 and info.max_v > 0
    assert info.memory_budget_bytes > 0
    assert "refuse_unknown_fields" in info.features
    # The backend's compute path: the CPU backend's name, or the CUDA path and its chunk rows.
    if BACKEND == "cpu":
        assert info.compute_path == "cpu"
    else:
        assert info.compute_path.startswith(("reference-exp", "row-chunk")), info.compute_path


def test_a_closed_client_raises_its_own_error(lossd_server):
    c = lossd.Client(lossd_server.address, timeout=30)
    assert c.server_info().instance
    c.close()
    c.close()  # twice is harmless
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    for call in (c.server_info, c.health, lambda: c.compute(x, w, np.arange(4)),
                 lambda: c.put_weights(w), lambda: c.fetch_gradients("a"), c.list_state):
        with pytest.raises(lossd.ClientClosedError, match=r"lossd.Client \(target .+\) was closed"):
            call()
    # One type for all of them, still a ValueError (gRPC's own, which it replaces) and a
    # LossdError like every other failure of the client.
    assert issubclass(lossd.ClientClosedError, ValueError)
    assert issubclass(lossd.ClientClosedError, lossd.LossdError)


def test_require_feature(client):
    client.require_feature("refuse_unknown_fields")
    with pytest.raises(lossd.UnimplementedError,
                       match=r"the server \(lossd .+\) does not support 'from_the_future'"):
        client.require_feature("from_the_future")


def test_bf16_conversions_round_to_nearest_even():
    vals = np.array([1.0, -2.5, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -8 + 2 ** -20,
                     np.inf, -np.inf, 0.0, -0.0, 3.0e38], np.float32)
    bits = lossd.float_to_bf16_bits(vals)
    expect = np.array([0x3F80, 0xC020, 0x3F80, 0x3F82, 0x3F81, 0x7F80, 0xFF80, 0x0000, 0x8000,
                       0x7F62], np.uint16)
    np.testing.assert_array_equal(bits, expect)
    nan = lossd.float_to_bf16_bits(np.array([np.nan], np.float32))
    assert np.isnan(lossd.bf16_bits_to_float(nan))[0]
    back = lossd.bf16_bits_to_float(expect[:5])
    np.testing.assert_array_equal(back, [1.0, -2.5, 1.0, 1.0 + 2 ** -6, 1.0 + 2 ** -7])


def test_outputs_into_caller_buffers(client):
    x, w, b, t = make_inputs("bf16", bias=True, seed=8)
    ref = client.compute(x, w, t, bias=b, want_lse=True)
    dx = lossd.BF16Array(np.full((BT, H), 0xFFFF, np.uint16))  # poisoned: NaN bit patterns
    dw = np.full((V, H), 0xFFFF, np.uint16)
    lse = np.full(BT, np.nan, np.float32)
    r = client.compute(x, w, t, bias=b, want_lse=True, out={"dx": dx, "dw": dw, "lse": lse})
    assert r.dx.bits is dx.bits and r.dw.bits is dw and r.lse is lse
    np.testing.assert_array_equal(dx.bits, ref.dx.bits)
    np.testing.assert_array_equal(dw, ref.dw.bits)
    np.testing.assert_array_equal(lse, ref.lse)
    with pytest.raises(lossd.InvalidArgumentError):
        client.compute(x, w, t, bias=b, out={"dx": np.zeros((BT, H + 1), np.uint16)})
    with pytest.raises(lossd.InvalidArgumentError):
        client.compute(x, w, t, bias=b, out={"gradient": dw})


def test_caller_buffers_are_checked_before_anything_is_sent(client):
    """The right bytes in the wrong dtype or shape, or a buffer for an output the call does
    not return, are refused before the Compute goes out: a micro-batch refused only after the
    server had added it to an accumulator would be added twice by a retry."""
    x, w, b, t = make_inputs("bf16", bias=True, seed=8)
    bad = {
        "int16 for bf16": {"dx": np.zeros((BT, H), np.int16)},
        "flat": {"dx": np.zeros(BT * H, np.uint16)},
        "fp16 for bf16": {"dx": np.zeros((BT, H), np.float16)},
        "dw with an accumulator": {"dw": np.zeros((V, H), np.uint16)},
        "lse not asked for": {"lse": np.zeros(BT, np.float32)},
        "read-only": {"dx": np.frombuffer(bytes(BT * H * 2), np.uint16).reshape(BT, H)},
        "Fortran order": {"dx": np.zeros((BT, H), np.uint16, order="F")},
        "strided": {"dx": np.zeros((BT, 2 * H), np.uint16)[:, ::2]},
        "read-only BF16Array": {"dx": lossd.BF16Array(
            np.frombuffer(bytes(BT * H * 2), np.uint16).reshape(BT, H))},
        "not a buffer": {"dx": [0] * (BT * H)},
    }
    for what, out in bad.items():
        with pytest.raises(lossd.InvalidArgumentError) as e:
            client.compute(x, w, t, bias=b, accumulator="out-check", out=out)
        assert "out[" in e.value.message, what
    with pytest.raises(lossd.NotFoundError):
        client.fetch_gradients("out-check")  # no call reached the server


def test_wait_for_ready_on_no_server_is_unavailable():
    from conftest import free_port

    with lossd.Client("127.0.0.1:%d" % free_port()) as c:
        with pytest.raises(lossd.UnavailableError, match="no connection"):
            c.wait_for_ready(0.5)


def test_empty_tensors_get_the_servers_error_naming_them(client):
    """Zero-size tensors travel like any other (no parts), and the server's refusal naming
    the shape comes back, not a failure inside the request stream."""
    _, w, _, _ = make_inputs("fp32", seed=10)
    with pytest.raises(lossd.InvalidArgumentError,
                       match=r"x.shape \[0, %d\] has a dimension <= 0" % H):
        client.compute(np.zeros((0, H), np.float32), w, np.zeros(0, np.int64))
    with pytest.raises(lossd.InvalidArgumentError,
                       match=r"w.shape \[0, %d\] has a dimension <= 0" % H):
        client.put_weights(np.zeros((0, H), np.float32))


def test_a_bare_handle_string_returns_db_when_its_weights_have_a_bias(client):
    x, w, b, t = make_inputs("fp32", bias=True, seed=11)
    h = client.put_weights(w, b)
    by_object = client.compute(x, h, t)
    by_string = client.compute(x, h.handle, t)
    assert by_object.db is not None and by_string.db is not None
    assert np.array_equal(by_string.db, by_object.db)
    client.drop_weights(h)
    h = client.put_weights(w)
    assert client.compute(x, h.handle, t).db is None  # asked for, but there is no bias
    # A buffer for a db that does not come is not left quietly unwritten.
    with pytest.raises(lossd.InvalidArgumentError, match="returned no db"):
        client.compute(x, h.handle, t, out={"db": np.zeros(V, np.float32)})
    client.drop_weights(h)


def test_client_side_measurements(client):
    x, w, b, t = make_inputs("fp32", bias=True, seed=9)
    r = client.compute(x, w, t, bias=b)
    assert r.bytes_sent == x.nbytes + w.nbytes + b.nbytes + t.nbytes
    assert r.bytes_received == r.dx.nbytes + r.dw.nbytes + r.db.nbytes
    assert r.wall_seconds >= r.compute_seconds > 0.0


def test_several_connections_metadata_and_wait_for_ready(lossd_server):
    x, w, _, t = make_inputs("fp32", seed=4)
    with lossd.Client(lossd_server.address, connections=3, wait_for_ready=True,
                      metadata=[("x-lossd-test", "1")], timeout=60) as c:
        c.wait_for_ready(10)  # the method, beside the option of the same name
        assert len(c._channels) == 3
        losses = {c.compute(x, w, t).loss for _ in range(4)}
        assert len(losses) == 1
        assert c.server_info().backend == BACKEND


def test_request_that_can_never_fit_is_resource_exhausted(tmp_path):
    """A server with a 4 MiB budget refuses a larger problem at once, naming the limit, while
    the client is still streaming its tensors; smaller requests still work after it."""
    from conftest import LossdProcess, find_lossd_binary

    srv = LossdProcess(find_lossd_binary(), str(tmp_path / "lossd.log"),
                       extra_flags=["--memory_budget_bytes=4194304"])
    try:
        with lossd.Client(srv.address, timeout=60, part_bytes=1 << 16) as c:
            x, w, _, t = make_inputs("fp32", bt=512, h=256, v=4096, seed=6)
            with pytest.raises(lossd.ResourceExhaustedError) as e:
                c.compute(x, w, t)
            assert e.value.code.name == "RESOURCE_EXHAUSTED"
            assert "4194304" in e.value.message or "4.0 MiB" in e.value.message or \
                "4 MiB" in e.value.message, e.value.message
            x, w, _, t = make_inputs("fp32", seed=6)
            assert np.isfinite(c.compute(x, w, t).loss)
    finally:
        srv.stop()


def test_a_first_compute_that_came_back_from_another_instance_is_refused(client):
    """Concurrent first computes into a new accumulator go out before its instance is known;
    one that comes back from another instance than the one already remembered raises (the
    sum is split), rather than pass."""
    x, w, _, t = make_inputs("fp32", seed=90)
    client._remember_instance("late-pin", "another-instance")  # a first compute came back
    real = client._acc_instance
    client._acc_instance = lambda name: ""  # this one went out before that
    try:
        with pytest.raises(lossd.FailedPreconditionError, match="concurrent first computes"):
            client.compute(x, w, t, accumulator="late-pin")
    finally:
        client._acc_instance = real
    client.drop_accumulator("late-pin")


def test_remembered_instances_forget_the_least_recently_used_first():
    c = lossd.Client("127.0.0.1:1")  # never called: the bookkeeping alone
    c._remember_instance("active", "i-1")
    for k in range(lossd.client._REMEMBERED_ACCUMULATORS - 1):
        c._remember_instance("old-%d" % k, "i-1")
    c._remember_instance("active", "i-1")  # used again: now the most recent
    c._remember_instance("one-more", "i-1")  # over the bound: the oldest goes
    assert c._acc_instance("active") == "i-1"
    assert c._acc_instance("old-0") == ""
    assert len(c._acc_instances) == lossd.client._REMEMBERED_ACCUMULATORS
    c.close()
