# SPDX-License-Identifier: Apache-2.0
"""Striping against a real lossd (CPU backend): put_weights split over several connections,
fetch_gradients by byte range, the reset that drops the accumulator, a failure half way, and
the default rule for how many stripes a transfer gets."""

import numpy as np
import pytest

import lossd

# Odd: stripes and ranges fall mid-row.
BT, H, V = 24, 40, 1003


def problem(seed, dtype="fp32", bias=True):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BT, H)).astype(np.float32)
    # Logits of a few units: a softmax neither flat nor one-hot.
    w = (rng.standard_normal((V, H)) * (2.0 / np.sqrt(H))).astype(np.float32)
    b = (rng.standard_normal(V) * 0.5).astype(np.float32) if bias else None
    t = rng.integers(0, V, BT)
    if dtype == "bf16":
        x, w = lossd.BF16Array.from_float(x), lossd.BF16Array.from_float(w)
        b = lossd.BF16Array.from_float(b) if bias else None
    elif dtype == "fp16":
        x, w = x.astype(np.float16), w.astype(np.float16)
        b = b.astype(np.float16) if bias else None
    return x, w, b, t


def bits(a):
    """The raw bytes of an output (BF16Array or ndarray), for bit-for-bit comparisons."""
    a = a.bits if isinstance(a, lossd.BF16Array) else np.asarray(a)
    return np.ascontiguousarray(a).view(np.uint8)


def assert_same_bits(name, got, want):
    g, w = bits(got), bits(want)
    assert g.shape == w.shape, "%s: %s bytes, expected %s" % (name, g.shape, w.shape)
    diff = np.flatnonzero(g.ravel() != w.ravel())
    assert diff.size == 0, "%s: %d of %d bytes differ, first at byte %d" % (
        name, diff.size, w.size, diff[0])


@pytest.fixture
def client_for(lossd_server):
    made = []

    def make(connections, stripes, **kw):
        c = lossd.Client(lossd_server.address, timeout=60.0, connections=connections,
                         stripes=stripes, part_bytes=3000, response_part_bytes=2000, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_striped_upload_computes_bit_identically_to_inline_weights(client_for, dtype):
    x, w, b, t = problem(1, dtype)
    c = client_for(4, 4)
    handle = c.put_weights(w, b)
    assert handle.stripes == 4
    elem = 4 if dtype == "fp32" else 2
    assert handle.bytes == elem * (V * H + V)
    try:
        by_handle = c.compute(x, handle, t, want_db=True, want_lse=True)
        inline = c.compute(x, w, t, bias=b, want_db=True, want_lse=True)
        assert np.isfinite(inline.loss)
        assert np.float32(by_handle.loss).tobytes() == np.float32(inline.loss).tobytes()
        for name in ("dx", "dw", "db", "lse"):
            assert getattr(inline, name) is not None, name
            assert_same_bits(name, getattr(by_handle, name), getattr(inline, name))
    finally:
        c.drop_weights(handle)


def test_uneven_stripes_without_bias(client_for):
    x, w, _, t = problem(2, "bf16", bias=False)
    c = client_for(3, 3)
    handle = c.put_weights(w)
    assert handle.stripes == 3
    by_handle = c.compute(x, handle, t)
    inline = c.compute(x, w, t)
    assert_same_bits("dx", by_handle.dx, inline.dx)
    assert_same_bits("dw", by_handle.dw, inline.dw)
    c.drop_weights(handle)


def test_a_failure_half_way_raises_its_error_and_leaves_no_handle(client_for):
    x, w, b, t = problem(3)
    w = w.copy()
    w[-1, -3] = np.nan  # in the last stripe's range
    c = client_for(4, 4)
    before = c.server_info()
    with pytest.raises(lossd.InvalidArgumentError) as e:
        c.put_weights(w, b)
    assert "non-finite value (nan)" in e.value.message
    after = c.server_info()
    assert after.weight_cache_bytes == before.weight_cache_bytes
    # The same upload without the NaN works on the same client.
    w[-1, -3] = 0.25
    handle = c.put_weights(w, b)
    assert handle.stripes == 4
    assert c.server_info().weight_cache_bytes == before.weight_cache_bytes + handle.bytes
    c.drop_weights(handle)


def accumulate(c, name, *problems):
    for x, w, b, t in problems:
        c.compute(x, w, t, bias=b, accumulator=name, want_dx=False)


@pytest.mark.parametrize("bias", [True, False])
def test_striped_fetch_equals_a_whole_fetch_bit_for_bit(client_for, bias):
    name = "py-stripes-%s" % bias
    whole_client = client_for(1, 1)
    accumulate(whole_client, name, problem(4, bias=bias), problem(5, bias=bias))
    whole = whole_client.fetch_gradients(name)
    assert whole.stripes == 1 and whole.micro_batches == 2
    assert np.any(whole.dw != 0)
    assert (whole.db is not None) == bias
    for stripes in (2, 3, 4):
        g = client_for(4, stripes).fetch_gradients(name)
        assert g.stripes == stripes
        assert (g.micro_batches, g.tokens, g.instance) == (whole.micro_batches, whole.tokens,
                                                           whole.instance)
        assert g.dw.dtype == np.float32 and g.dw.shape == (V, H)
        assert_same_bits("dw", g.dw, whole.dw)
        if bias:
            assert_same_bits("db", g.db, whole.db)
        else:
            assert g.db is None
    whole_client.drop_accumulator(name)


def test_striped_reset_drops_the_accumulator_after_the_last_range(client_for):
    a, b = problem(6), problem(7)
    c, whole_client = client_for(4, 4), client_for(1, 1)
    accumulate(c, "py-ref", a)
    only_a = whole_client.fetch_gradients("py-ref", reset=True)
    assert only_a.micro_batches == 1

    accumulate(c, "py-acc", a, b)
    whole = whole_client.fetch_gradients("py-acc")
    g = c.fetch_gradients("py-acc", reset=True)
    assert g.stripes == 4 and g.micro_batches == 2
    assert_same_bits("dw", g.dw, whole.dw)
    assert_same_bits("db", g.db, whole.db)
    with pytest.raises(lossd.NotFoundError):
        c.fetch_gradients("py-acc")
    # The next compute naming it starts from zero.
    accumulate(c, "py-acc", a)
    after = c.fetch_gradients("py-acc", reset=True)
    assert after.micro_batches == 1 and after.tokens == only_a.tokens
    assert_same_bits("dw", after.dw, only_a.dw)
    assert_same_bits("db", after.db, only_a.db)
    whole_client.drop_accumulator("py-ref")


def test_striped_fetch_of_a_missing_accumulator_is_not_found(client_for):
    with pytest.raises(lossd.NotFoundError):
        client_for(4, 4).fetch_gradients("py-nobody", reset=True)


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    """A server whose memory budget holds a compute below but not its whole dW | db."""
    from conftest import LossdProcess, find_lossd_binary

    srv = LossdProcess(find_lossd_binary(), str(tmp_path_factory.mktemp("small") / "lossd.log"),
                       extra_flags=["--memory_budget_bytes=500000"])
    yield srv
    srv.stop()


@pytest.mark.parametrize("connections,stripes,reset,ranges", [
    (1, 1, False, 5), (1, 1, True, 5),  # whole fetch refused: ranges of <= 250000 bytes
    (4, 2, False, 5), (4, 2, True, 5),  # halves (515542 bytes) refused too
    (4, 4, False, 4),  # quarters fit
])
def test_a_fetch_larger_than_the_servers_memory_budget_comes_in_ranges_that_fit(
        client_for, small_server, connections, stripes, reset, ranges):
    """The server refuses a fetch whose host copy is larger than its whole memory budget;
    the client then fetches ranges of at most half of it, and they add up to the bytes of a
    whole fetch from a server with room. With reset the accumulator is dropped after."""
    h = 256  # fp32 dW | db of 1031084 bytes; a compute (fp32, by handle) needs less than 0.5 MB
    rng = np.random.default_rng(40 + stripes + reset)
    w = (rng.standard_normal((V, h)) * (2.0 / np.sqrt(h))).astype(np.float32)
    b = (rng.standard_normal(V) * 0.5).astype(np.float32)
    xs = [rng.standard_normal((BT, h)).astype(np.float32) for _ in range(2)]
    ts = [rng.integers(0, V, BT) for _ in range(2)]
    name = "py-budget-%d-%d-%d" % (connections, stripes, reset)

    def accumulate_into(c):
        handle = c.put_weights(w, b)
        for x, t in zip(xs, ts):
            c.compute(x, handle, t, accumulator=name, want_dx=False)
        return handle

    roomy = client_for(1, 1)
    roomy_handle = accumulate_into(roomy)
    whole = roomy.fetch_gradients(name, reset=True)
    assert whole.ranges == 1 and whole.micro_batches == 2
    assert np.any(whole.dw != 0) and np.any(whole.db != 0)
    roomy.drop_weights(roomy_handle)

    with lossd.Client(small_server.address, timeout=60.0, connections=connections,
                      stripes=stripes, part_bytes=1 << 16, response_part_bytes=1 << 15) as c:
        handle = accumulate_into(c)
        before = c.server_info().accumulators
        g = c.fetch_gradients(name, reset=reset)
        assert (g.stripes, g.ranges) == (stripes, ranges)
        if stripes < 4:
            assert g.ranges == lossd.client.fetch_ranges_within(4 * V * h + 4 * V, 500000,
                                                                stripes)
        assert (g.micro_batches, g.tokens) == (2, whole.tokens)
        assert_same_bits("dw", g.dw, whole.dw)
        assert_same_bits("db", g.db, whole.db)
        assert c.server_info().accumulators == before - (1 if reset else 0)
        if not reset:
            c.drop_accumulator(name)
        c.drop_weights(handle)


def test_fetch_ranges_within():
    f = lossd.client.fetch_ranges_within
    assert f(1000, 1000, 1) == 0  # fits whole: refused for another reason
    assert f(1000, 999, 1) == 3  # 496 bytes (124 values) a range at most
    assert f(1000, 999, 2) == 0  # two ranges of 500 already fit
    assert f(1000, 400, 2) == 5  # 200 bytes a range
    assert f(1000, 100, 8) == 21  # 48 bytes a range
    assert f(1000, 7, 1) == 0  # not two values
    assert f(1000, 8, 1) == 250  # one value a range
    assert f(8 << 30, 256 << 10, 1) == lossd.client.MAX_FETCH_RANGES
    assert f(8 << 30, (256 << 10) - 8, 1) == 0  # too many


@pytest.mark.parametrize("connections,threshold,put_stripes,fetch_stripes", [
    (1, 1, 1, 1),  # one connection: off
    (6, 1, 4, 4),  # at most 4
    (3, 1, 3, 3),  # at most connections
    (4, 4 * V * H + 4 * V + 1, 1, 1),  # below the threshold
    (4, lossd.client.DEFAULT_AUTO_STRIPE_BYTES, 1, 1),  # the default 64 MiB
])
def test_default_rule(client_for, connections, threshold, put_stripes, fetch_stripes):
    x, w, b, t = problem(8)
    c = client_for(connections, 0, auto_stripe_bytes=threshold)
    handle = c.put_weights(w, b)
    assert handle.stripes == put_stripes
    c.compute(x, handle, t, accumulator="py-rule", want_dx=False)
    g = c.fetch_gradients("py-rule", reset=True)
    assert g.stripes == fetch_stripes and g.micro_batches == 1
    c.drop_weights(handle)
    if fetch_stripes > 1:
        with pytest.raises(lossd.NotFoundError):
            c.fetch_gradients("py-rule")
    else:
        c.drop_accumulator("py-rule")


def test_stripes_need_as_many_connections():
    with pytest.raises(lossd.InvalidArgumentError, match="connections"):
        lossd.Client("127.0.0.1:1", connections=2, stripes=3)
    with pytest.raises(lossd.InvalidArgumentError):
        lossd.Client("127.0.0.1:1", connections=100, stripes=65)
    with pytest.raises(lossd.InvalidArgumentError):
        lossd.Client("127.0.0.1:1", stripes=-1)
    lossd.Client("127.0.0.1:1", connections=64, stripes=64).close()
