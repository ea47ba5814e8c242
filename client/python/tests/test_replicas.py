# SPDX-License-Identifier: Apache-2.0
"""Two lossd replicas behind a balancer that spreads TCP connections, as a Kubernetes ClusterIP
Service does: a client with two connections reaches both. An accumulator's sum must not be
split between them: the replica that did not begin it refuses the compute, and the sum on the
other stays whole."""

import socket
import threading

import numpy as np
import pytest

import lossd
from conftest import LossdProcess, find_lossd_binary
from test_client import make_inputs


class ConnectionBalancer:
    """A loopback TCP proxy that sends its n-th accepted connection to backends[n % len]."""

    def __init__(self, backends):
        self.backends = list(backends)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.accepted = 0
        self.open = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return  # closed
            with self.lock:
                host, port = self.backends[self.accepted % len(self.backends)].rsplit(":", 1)
                self.accepted += 1
                upstream = socket.create_connection((host, int(port)))
                self.open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src, dst):
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self):
        self.sock.close()
        with self.lock:
            for s in self.open:
                s.close()


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory):
    binary = find_lossd_binary()
    d = tmp_path_factory.mktemp("replicas")
    a = LossdProcess(binary, str(d / "a.log"))
    b = LossdProcess(binary, str(d / "b.log"))
    yield a, b
    a.stop()
    b.stop()


def test_an_accumulator_is_not_split_between_replicas(two_replicas):
    a, b = two_replicas
    with lossd.Client(a.address) as ca, lossd.Client(b.address) as cb:
        ia, ib = ca.server_info().instance, cb.server_info().instance
    assert ia != ib
    balancer = ConnectionBalancer([a.address, b.address])
    try:
        # Two connections, one a replica; no striping, so each call is one stream on one.
        with lossd.Client(balancer.address, connections=2, stripes=1, timeout=60.0) as c:
            x, w, _, t = make_inputs("fp32", seed=31)
            first = c.compute(x, w, t, accumulator="rr-acc")  # connection 0
            assert first.accumulated_micro_batches == 1
            home = first.instance
            assert home in (ia, ib)
            with pytest.raises(lossd.FailedPreconditionError) as e:
                c.compute(x, w, t, accumulator="rr-acc")  # connection 1: the other replica
            assert "is not this server" in e.value.message and home in e.value.message
            again = c.compute(x, w, t, accumulator="rr-acc")  # connection 0 again
            assert again.instance == home and again.accumulated_micro_batches == 2
            # Stateless computes may go to either replica.
            plain = [c.compute(x, w, t).instance for _ in range(2)]
            assert sorted(plain) == sorted([ia, ib])
            assert balancer.accepted == 2
        # The sum is whole on its replica, and nothing of it is on the other.
        with lossd.Client(a.address if home == ia else b.address) as h:
            g = h.fetch_gradients("rr-acc", reset=True)
            assert g.micro_batches == 2 and g.instance == home
            assert np.all(np.isfinite(g.dw))
            h.drop_accumulator("rr-acc")
        with lossd.Client(b.address if home == ia else a.address) as other:
            with pytest.raises(lossd.NotFoundError):
                other.fetch_gradients("rr-acc")
    finally:
        balancer.close()
