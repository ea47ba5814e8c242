# SPDX-License-Identifier: Apache-2.0
"""Fixtures: a real lossd server (CPU backend, free port) for the whole session, a client for
it, and the comparison helper with one tolerance table per dtype.

The binary is $LOSSD_BIN, else $(bazel info bazel-bin)/service/lossd. Without one the server tests
are skipped, unless LOSSD_BIN is set (then a missing binary is a failure). On a GPU host,
LOSSD_TEST_BACKEND=cuda runs the server on its CUDA backend and LOSSD_TEST_DEVICE=cuda puts the
torch tests' tensors on the GPU (defaults: cpu, cpu).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

import lossd  # noqa: E402
from lossd_servers import find_lossd_binary, free_port  # noqa: E402,F401

BACKEND = os.environ.get("LOSSD_TEST_BACKEND", "cpu")

# One tolerance table per dtype: |got - ref| <= atol * max|ref| + rtol * |ref|, element-wise.
# fp32: fp32 accumulation over short sums. fp16/bf16: logits and outputs rounded to the
# input dtype (2^-11 and 2^-8 relative), errors scaling with |logit| ~ 3-10.
TOLERANCES = {
    # fp64: float64 against float64, the same formulas in another order of operations.
    "fp64": dict(rtol=1e-12, atol=1e-15),
    "fp32": dict(rtol=1e-4, atol=1e-5),
    "fp16": dict(rtol=1e-2, atol=2e-3),
    "bf16": dict(rtol=5e-2, atol=1.5e-2),
}
# Scalars (loss, z-loss, accuracy) against the float64 reference.
SCALAR_RTOL = {"fp32": 1e-5, "fp16": 5e-3, "bf16": 3e-2}


class LossdProcess:
    """One lossd server on loopback; stopped with SIGTERM (graceful drain) at teardown."""

    def __init__(self, binary, log_path, extra_flags=(), client_kwargs=None, host="127.0.0.1"):
        self.port = free_port()
        self.address = "%s:%d" % (host, self.port)
        self.client_kwargs = dict(client_kwargs or {})
        self.log_path = log_path
        self.log = open(log_path, "wb")
        cmd = [binary, "--port=%d" % self.port, "--backend=%s" % BACKEND, "--metrics_port=0",
               "--drain_seconds=2"] + list(extra_flags)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.wait_serving(60.0)

    def log_tail(self, n=3000):
        self.log.flush()
        try:
            return Path(self.log_path).read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def wait_serving(self, timeout):
        deadline = time.monotonic() + timeout
        with lossd.Client(self.address, timeout=2.0, **self.client_kwargs) as c:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError("lossd exited with %s at start:\n%s" % (
                        self.proc.returncode, self.log_tail()))
                try:
                    if c.health() == "SERVING":
                        return
                except lossd.LossdError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("lossd not SERVING after %.0f s:\n%s" % (
                        timeout, self.log_tail()))
                time.sleep(0.1)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="session")
def lossd_server(tmp_path_factory):
    binary = find_lossd_binary()
    srv = LossdProcess(binary, str(tmp_path_factory.mktemp("lossd") / "lossd.log"))
    yield srv
    srv.stop()
    assert srv.proc.returncode == 0, "lossd exit status %s after SIGTERM:\n%s" % (
        srv.proc.returncode, srv.log_tail())


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """Three replicas on 127.0.0.1-3 and one port for the replica pool's tests
    (pool_cluster.py); each test calls ensure_all, as one may leave a replica killed."""
    from pool_cluster import Cluster

    c = Cluster(tmp_path_factory.mktemp("pool"))
    yield c
    c.stop()


@pytest.fixture(scope="session")
def client(lossd_server):
    with lossd.Client(lossd_server.address, timeout=120.0) as c:
        yield c


def assert_close(name, got, ref, dtype):
    """Element-wise check against the float64 reference; the message names the worst element."""
    tol = TOLERANCES[dtype]
    g = lossd.tensors.to_float64(got)
    r = lossd.tensors.to_float64(ref)
    assert g.shape == r.shape, "%s: shape %s, expected %s" % (name, g.shape, r.shape)
    assert np.all(np.isfinite(g)), "%s: %d non-finite values" % (name, np.sum(~np.isfinite(g)))
    scale = float(np.max(np.abs(r))) if r.size else 0.0
    err = np.abs(g - r)
    bound = tol["atol"] * scale + tol["rtol"] * np.abs(r)
    bad = err > bound
    if np.any(bad):
        worst = np.unravel_index(int(np.argmax(err - bound)), err.shape)
        rel = err / np.maximum(np.abs(r), 1e-30)
        pytest.fail("%s (%s): %d of %d mismatches; worst at %s got %.7g ref %.7g; max abs err "
                    "%.3g, max rel err %.3g; tolerance rtol=%g atol=%g*%.3g" % (
                        name, dtype, int(bad.sum()), bad.size, tuple(int(i) for i in worst),
                        g[worst], r[worst], float(err.max()), float(rel.max()), tol["rtol"],
                        tol["atol"], scale))


# Relative rounding of a stored logit per input dtype (the server rounds X W^T + b to it).
LOGIT_EPS = {"fp32": 2.0 ** -23, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}


def assert_predictions(pred, z_ref, dtype, ignored=None):
    """Every row's predicted class is in range and, by the float64 logits, within the rounding
    of the stored logits of the row's maximum: ties and near-ties may go either way, a wrong
    pick may not. ignored: (BT) bool, rows that must predict -1 (the torch module's Liger
    convention); the other rows are checked as above."""
    pred = np.asarray(pred).reshape(-1)
    z = np.asarray(z_ref, dtype=np.float64)
    if ignored is not None:
        ignored = np.asarray(ignored).reshape(-1)
        assert ignored.any(), "predictions: the check of ignored rows needs an ignored row"
        wrong = pred[ignored] != -1
        assert not wrong.any(), "predictions: %d ignored rows predict %s, not -1" % (
            int(wrong.sum()), pred[ignored][wrong][:5].tolist())
        pred, z = pred[~ignored], z[~ignored]
    assert pred.shape == (z.shape[0],), "predictions: shape %s for %d rows" % (pred.shape,
                                                                              z.shape[0])
    assert np.all((pred >= 0) & (pred < z.shape[1])), "a prediction outside [0, V)"
    top = z.max(axis=1)
    scale = np.abs(z).max(axis=1)
    bound = 2 * LOGIT_EPS[dtype] * scale + 1e-5 * (1 + scale)
    picked = z[np.arange(z.shape[0]), pred]
    bad = picked < top - bound
    assert not np.any(bad), "%d rows predict a class whose logit is below the row's maximum " \
        "by more than rounding (first: row %d picks %d, %.6g against %.6g)" % (
            int(bad.sum()), int(np.argmax(bad)), int(pred[np.argmax(bad)]),
            float(picked[np.argmax(bad)]), float(top[np.argmax(bad)]))


def assert_accuracy(acc, pred, t, ignore_index):
    """The accuracy is the fraction of the non-ignored rows whose prediction is the target
    (the predictions themselves are checked by assert_predictions)."""
    pred, t = np.asarray(pred).reshape(-1), np.asarray(t).reshape(-1)
    valid = t != ignore_index
    want = float(((pred == t) & valid).sum()) / max(int(valid.sum()), 1)
    assert abs(float(acc) - want) <= 1e-6, "accuracy %.7g, the predictions give %.7g" % (
        float(acc), want)


def assert_scalar(name, got, ref, dtype, abs_floor=1e-6):
    rtol = SCALAR_RTOL[dtype]
    assert np.isfinite(got), "%s is %r" % (name, got)
    assert abs(got - ref) <= rtol * abs(ref) + abs_floor, "%s (%s): got %.8g, ref %.8g, rel err " \
        "%.3g > %g" % (name, dtype, got, ref, abs(got - ref) / max(abs(ref), 1e-30), rtol)
