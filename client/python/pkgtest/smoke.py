# SPDX-License-Identifier: Apache-2.0
"""Checks an installed lossd package against a live lossd: run with the interpreter of the
virtual environment it was installed into, from outside the checkout.

Usage: python smoke.py LOSSD_BINARY
It asserts that the package imported is the installed one (its descriptor inside it, no
grpcio-tools needed), then starts lossd on the CPU backend and calls ServerInfo, health,
Compute (checked against a float64 numpy reference with the fp32 tolerances of
client/python/tests/conftest.py), PutWeights (the handle's Compute bit-identical to the inline
one), FetchGradients through an accumulator, and a refused Compute (exact error class and
message). Prints the versions it ran on; exits non-zero on any failure.
"""

import importlib.util
import os
import socket
import subprocess
import sys

import numpy as np

# conftest.py's fp32 rows: TOLERANCES["fp32"] and SCALAR_RTOL["fp32"].
RTOL, ATOL, SCALAR_RTOL = 1e-4, 1e-5, 1e-5
BT, H, V = 47, 31, 123


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference(x, w, t):
    """Mean cross-entropy of x w^T against t, its dX and dW, in float64."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    z = x @ w.T
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    loss = -np.log(p[np.arange(len(t)), t]).mean()
    g = p
    g[np.arange(len(t)), t] -= 1.0
    g /= len(t)
    return loss, g @ w, g.T @ x


def assert_close(name, got, ref):
    err = np.abs(got.astype(np.float64) - ref)
    bound = ATOL * np.abs(ref).max() + RTOL * np.abs(ref)
    bad = int((err > bound).sum())
    assert bad == 0, "%s: %d of %d elements out of tolerance, worst %g" % (
        name, bad, ref.size, float(err.max()))


def main():
    binary = sys.argv[1]
    import google.protobuf
    import grpc
    import lossd
    from lossd.v1 import lossd_pb2

    here = os.path.dirname(os.path.abspath(lossd.__file__))
    assert "site-packages" in here, "imported %s, not the installed package" % here
    assert os.path.isfile(os.path.join(here, "v1", "lossd.binpb")), "no descriptor in the wheel"
    assert importlib.util.find_spec("grpc_tools") is None, "grpcio-tools is installed"
    assert lossd_pb2.ComputeRequest.__module__ == "lossd.v1.lossd_pb2"
    print("smoke: python %s, grpcio %s, protobuf %s, numpy %s" % (
        sys.version.split()[0], grpc.__version__, google.protobuf.__version__, np.__version__))

    port = free_port()
    server = subprocess.Popen([binary, "--backend=cpu", "--port=%d" % port, "--metrics_port=0",
                               "--drain_seconds=1"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT)
    try:
        with lossd.Client("127.0.0.1:%d" % port, timeout=60) as c:
            c.wait_for_ready(timeout=60)
            assert c.server_info().backend == "cpu"
            assert c.health() == "SERVING"

            rng = np.random.default_rng(23)
            x = rng.standard_normal((BT, H)).astype(np.float32)
            w = (rng.standard_normal((V, H)) * 3.0 / np.sqrt(H)).astype(np.float32)
            t = rng.integers(0, V, size=BT).astype(np.int64)
            r = c.compute(x, w, t)
            loss, dx, dw = reference(x, w, t)
            assert abs(r.loss - loss) <= SCALAR_RTOL * abs(loss), (r.loss, loss)
            assert r.tokens == BT, r.tokens
            assert_close("dx", r.dx, dx)
            assert_close("dw", r.dw, dw)

            h = c.put_weights(w)
            rh = c.compute(x, h, t)
            assert rh.loss == r.loss and np.array_equal(rh.dx, r.dx) and np.array_equal(rh.dw, r.dw)
            c.compute(x, h, t, accumulator="smoke")
            c.compute(x, h, t, accumulator="smoke")
            g = c.fetch_gradients("smoke", reset=True)
            assert g.micro_batches == 2, g.micro_batches
            assert_close("accumulated dw", g.dw, 2 * dw)
            c.drop_weights(h)

            bad = t.copy()
            bad[5] = V + 7
            try:
                c.compute(x, w, bad)
                raise AssertionError("a target outside [0, V) was accepted")
            except lossd.InvalidArgumentError as e:
                assert str(V + 7) in str(e), str(e)
            assert c.health() == "SERVING"
    finally:
        server.terminate()
        server.wait(timeout=30)
    print("smoke: OK")


if __name__ == "__main__":
    main()
