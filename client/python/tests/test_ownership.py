"""State ownership and List against a lossd started with two bearer tokens: a weight handle
and an accumulator belong to the token that made them; the other token is refused
(PERMISSION_DENIED) for every use, fetch and drop, and list_state shows each token its own."""

import time

import numpy as np
import pytest

import lossd
from conftest import LossdProcess, find_lossd_binary

TOKENS = ("owner-token-a", "owner-token-b")


@pytest.fixture(scope="module")
def two_token_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("own")
    (d / "tokens").write_text("%s\n%s\n" % TOKENS)
    srv = LossdProcess(find_lossd_binary(), str(d / "lossd.log"),
                       extra_flags=["--auth_tokens_file=%s" % (d / "tokens")],
                       client_kwargs=dict(auth_token=TOKENS[0]))
    yield srv
    srv.stop()


def problem(seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((6, 8)).astype(np.float32),
            rng.standard_normal((16, 8)).astype(np.float32), rng.integers(0, 16, 6))


def test_state_belongs_to_its_token(two_token_server):
    addr = two_token_server.address
    with lossd.Client(addr, timeout=30, auth_token=TOKENS[0]) as a, \
            lossd.Client(addr, timeout=30, auth_token=TOKENS[1]) as b:
        a.require_feature("owned_state")
        x, w, t = problem(1)
        h = a.put_weights(w)
        a.compute(x, h, t, accumulator="a-acc")
        a.compute(x, h, t, accumulator="a-acc")
        denied_h = "weight handle '%s' belongs to another credential" % h.handle
        denied_a = "accumulator 'a-acc' belongs to another credential"
        with pytest.raises(lossd.PermissionDeniedError, match=denied_h):
            b.compute(x, h, t)
        with pytest.raises(lossd.PermissionDeniedError, match=denied_h):
            b.drop_weights(h)
        with pytest.raises(lossd.PermissionDeniedError, match=denied_a):
            b.compute(x, w, t, accumulator="a-acc")
        with pytest.raises(lossd.PermissionDeniedError, match=denied_a):
            b.fetch_gradients("a-acc", reset=True)
        with pytest.raises(lossd.PermissionDeniedError, match=denied_a):
            b.drop_accumulator("a-acc")

        mine = {(e.kind, e.name): e for e in a.list_state()}
        assert set(mine) == {("weights", h.handle), ("accumulator", "a-acc")}
        assert mine[("weights", h.handle)].bytes == w.nbytes
        acc = mine[("accumulator", "a-acc")]
        assert acc.bytes == w.nbytes and acc.micro_batches == 2 and acc.last_used_unix_ms > 0
        assert b.list_state() == []

        # The owner's state is untouched by the refusals.
        g = a.fetch_gradients("a-acc", reset=True)
        assert g.micro_batches == 2 and np.all(np.isfinite(g.dw))
        a.drop_accumulator("a-acc")
        a.drop_weights(h)
        assert a.list_state() == []


def test_without_auth_state_is_anyones(client):
    x, w, t = problem(2)
    h = client.put_weights(w)
    client.compute(x, h, t, accumulator="open-acc")
    names = {e.name for e in client.list_state()}
    assert {h.handle, "open-acc"} <= names
    with lossd.Client(client.target, timeout=30) as other:
        other.compute(x, h, t, accumulator="open-acc")
        assert other.fetch_gradients("open-acc").micro_batches == 2
        other.drop_accumulator("open-acc")
        other.drop_weights(h)


def test_idle_state_is_dropped_after_the_ttl_and_logged(tmp_path):
    srv = LossdProcess(find_lossd_binary(), str(tmp_path / "lossd.log"),
                       extra_flags=["--state_idle_ttl=400ms"])
    try:
        with lossd.Client(srv.address, timeout=30) as c:
            x, w, t = problem(3)
            h = c.put_weights(w)
            c.compute(x, h, t, accumulator="idle-acc")
            assert {e.name for e in c.list_state()} == {h.handle, "idle-acc"}
            deadline = time.time() + 10
            while c.list_state() and time.time() < deadline:
                time.sleep(0.05)
            assert c.list_state() == []
            with pytest.raises(lossd.NotFoundError):
                c.fetch_gradients("idle-acc")
        log = srv.log_tail(20000)
        assert "lossd: dropped weight handle %s (%d bytes, idle " % (h.handle, w.nbytes) in log
        assert "lossd: dropped accumulator idle-acc (" in log
        assert "unused for longer than --state_idle_ttl=400ms" in log
    finally:
        srv.stop()
