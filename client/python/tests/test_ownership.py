# SPDX-License-Identifier: Apache-2.0
"""State ownership, List and the idle TTL against lossd: a weight handle and an accumulator
belong to the credential that made them (a bearer token, or a verified client certificate);
another one is refused (PERMISSION_DENIED) for every use, fetch and drop, and list_state shows
each its own. Without auth state is anyone's; --state_idle_ttl drops what is left idle."""

import time

import numpy as np
import pytest

import lossd
from conftest import LossdProcess, find_lossd_binary
from lossd_servers import make_test_pki

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


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory):
    """lossd with mutual TLS and no tokens: the client certificate is the credential."""
    d = tmp_path_factory.mktemp("mtls-own")
    make_test_pki(d, ["alice", "bob"], ca_name="lossd-owner-ca")

    def client_kwargs(who):
        return dict(tls_ca_file=str(d / "ca.pem"), tls_cert_file=str(d / ("%s.pem" % who)),
                    tls_key_file=str(d / ("%s.key" % who)))

    srv = LossdProcess(find_lossd_binary(), str(d / "lossd.log"),
                       extra_flags=["--tls_cert=%s" % (d / "server.pem"),
                                    "--tls_key=%s" % (d / "server.key"),
                                    "--tls_client_ca=%s" % (d / "ca.pem")],
                       client_kwargs=client_kwargs("alice"), host="localhost")
    yield srv, client_kwargs
    srv.stop()


def test_state_belongs_to_its_client_certificate(mtls_server):
    srv, kw = mtls_server
    with lossd.Client(srv.address, timeout=30, **kw("alice")) as a, \
            lossd.Client(srv.address, timeout=30, **kw("bob")) as b:
        x, w, t = problem(4)
        h = a.put_weights(w)
        a.compute(x, h, t, accumulator="alice-acc")
        with pytest.raises(lossd.PermissionDeniedError,
                           match="accumulator 'alice-acc' belongs to another credential"):
            b.fetch_gradients("alice-acc")
        with pytest.raises(lossd.PermissionDeniedError, match="belongs to another credential"):
            b.drop_weights(h)
        assert {e.name for e in a.list_state()} == {h.handle, "alice-acc"}
        assert b.list_state() == []
        assert a.fetch_gradients("alice-acc").micro_batches == 1
        a.drop_accumulator("alice-acc")
        a.drop_weights(h)
