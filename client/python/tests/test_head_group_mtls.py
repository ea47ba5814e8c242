# SPDX-License-Identifier: Apache-2.0
"""A head group whose member 0 asks every caller for a client certificate (--tls_client_ca):
the other members present theirs to member 0's rendezvous (--head_group_tls_cert /
--head_group_tls_key) and the group forms and steps; without one, forming the group fails on
every member, naming the group, and nothing is created."""

import uuid

import numpy as np
import pytest

import lossd
from lossd_servers import (find_lossd_binary, free_port, make_test_pki, run_all, start_lossd,
                           stop_all, wait_serving)

V, H, BT = 29, 8, 6


def _all(fns):
    """Runs fns at once; an exception comes back in its function's place."""
    return run_all(fns, raise_first=False)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    make_test_pki(d, ["member", "trainer"])
    return d


def _group(pki, tmp, member_cert):
    """Two lossd on 127.0.0.1 asking callers for certificates; their members present
    member.pem to member 0 where member_cert. Yields (addresses, clients)."""
    binary = find_lossd_binary()
    procs, addrs, logs = [], [], []
    flags = ["--tls_cert=%s" % (pki / "server.pem"), "--tls_key=%s" % (pki / "server.key"),
             "--tls_client_ca=%s" % (pki / "ca.pem"), "--head_group_address=127.0.0.1",
             "--head_group_timeout=4s", "--head_group_tls_ca=%s" % (pki / "ca.pem")]
    if member_cert:
        flags += ["--head_group_tls_cert=%s" % (pki / "member.pem"),
                  "--head_group_tls_key=%s" % (pki / "member.key")]
    tls = dict(tls_ca_file=str(pki / "ca.pem"), tls_cert_file=str(pki / "trainer.pem"),
               tls_key_file=str(pki / "trainer.key"))
    for m in range(2):
        port = free_port()
        addrs.append("127.0.0.1:%d" % port)
        logs.append(open(str(tmp / ("member-%d.log" % m)), "wb"))
        procs.append(start_lossd(binary, port, logs[-1], *flags))
    clients = [lossd.Client(a, timeout=60.0, **tls) for a in addrs]
    try:
        for p, a, c in zip(procs, addrs, clients):
            wait_serving(p, a, client=c)
        return procs, addrs, clients, logs
    except BaseException:
        _stop(procs, clients, logs)
        raise


_stop = stop_all


def test_members_with_client_certificates_form_and_step_the_group(pki, tmp_path):
    procs, addrs, clients, logs = _group(pki, tmp_path, member_cert=True)
    try:
        rng = np.random.default_rng(3)
        w = (rng.standard_normal((V, H)) * 0.3).astype(np.float32)
        name, gid = "mtls-%s" % uuid.uuid4().hex[:8], "g-%s" % uuid.uuid4().hex
        infos = _all([lambda m=m: clients[m].create_head(
            name, w, optimizer="sgd", group={"members": addrs, "member": m, "id": gid})
            for m in range(2)])
        for m, info in enumerate(infos):
            assert not isinstance(info, Exception), info
            assert info.created and info.group == {"members": addrs, "member": m, "id": gid}
        for r in range(2):
            x = rng.standard_normal((BT, H)).astype(np.float32)
            t = rng.integers(0, V, BT)
            clients[r].compute(x, None, t, head=name, head_version=0, rank=r, micro_batch=0)
        steps = _all([lambda r=r: clients[r].step(name, 0, rank=r, world_size=2)
                      for r in range(2)])
        for s in steps:
            assert not isinstance(s, Exception), s
            assert s.version == 1 and s.applied and s.contributions == 2
        assert steps[0].grad_norm == steps[1].grad_norm > 0
    finally:
        _stop(procs, clients, logs)


def test_a_member_without_a_client_certificate_cannot_join(pki, tmp_path):
    procs, addrs, clients, logs = _group(pki, tmp_path, member_cert=False)
    try:
        w = np.full((V, H), 0.25, np.float32)
        name, gid = "nocert-%s" % uuid.uuid4().hex[:8], "g-%s" % uuid.uuid4().hex
        got = _all([lambda m=m: clients[m].create_head(
            name, w, optimizer="sgd", group={"members": addrs, "member": m, "id": gid})
            for m in range(2)])
        for m, e in enumerate(got):
            assert isinstance(e, lossd.LossdError), "member %d: %r" % (m, e)
            assert "forming the group of head '%s'" % name in str(e), str(e)
        # Nothing was created: the head is on neither member.
        for c in clients:
            with pytest.raises(lossd.NotFoundError):
                c.head_info(name)
    finally:
        _stop(procs, clients, logs)
