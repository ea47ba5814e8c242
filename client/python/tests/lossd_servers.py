# SPDX-License-Identifier: Apache-2.0
"""What the Python client tests and the Prometheus end-to-end test both need to start a real
lossd: a free loopback port and the lossd binary ($LOSSD_BIN, else
$(bazel info bazel-bin)/service/lossd; skipped without one unless LOSSD_BIN is set, then a
missing binary is a failure). find_built_binary finds the tests' other built tools alike. And
what the tests that start several lossd share: start_lossd, wait_serving, stop_all, and
run_all for calls that must run at once (a head group's members, a step's ranks)."""

import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_built_binary(env_var, package, name):
    """The executable $`env_var` names, else Bazel's build of //`package`:`name`; the test is
    skipped without one, unless `env_var` is set (then a missing binary is a failure)."""
    env = os.environ.get(env_var)
    if env:
        if not os.access(env, os.X_OK):
            pytest.fail("%s=%s is not an executable file" % (env_var, env))
        return env
    # The build keeps no bazel-bin link in the tree (.bazelrc): ask Bazel where its outputs are.
    try:
        out = subprocess.run(["bazel", "info", "bazel-bin"], cwd=REPO, capture_output=True,
                             text=True, timeout=120).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    cand = Path(out) / package / name if out else None
    if cand is not None and cand.is_file() and os.access(cand, os.X_OK):
        return str(cand)
    pytest.skip("no %s binary: build //%s:%s or set %s" % (name, package, name, env_var))


def find_lossd_binary():
    return find_built_binary("LOSSD_BIN", "service", "lossd")


def make_test_pki(d, clients, ca_name="lossd-test-ca"):
    """A throw-away CA in folder `d` (ca.pem, ca.key), a server certificate for localhost and
    127.0.0.1 (server.pem, server.key) and one client certificate per name in `clients`
    (<name>.pem, <name>.key, CN=<name>). Skips the test where openssl is not installed."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")

    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.pem", "-days", "1", "-subj", "/CN=%s" % ca_name)
    certs = [("server", "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                        "extendedKeyUsage=serverAuth\n")]
    certs += [(name, "extendedKeyUsage=clientAuth\n") for name in clients]
    for name, ext in certs:
        (Path(d) / ("%s.ext" % name)).write_text(ext)
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "%s.key" % name, "-out",
                "%s.csr" % name, "-subj", "/CN=%s" % name)
        openssl("x509", "-req", "-in", "%s.csr" % name, "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", "%s.pem" % name, "-days", "1", "-extfile",
                "%s.ext" % name)


def start_lossd(binary, port, log, *flags):
    """lossd on 127.0.0.1:`port` (the CPU backend, one thread, quick to drain and stop, no
    metrics port) with `flags` added, its output into the open file `log`."""
    return subprocess.Popen(
        [binary, "--address=127.0.0.1", "--port=%d" % port, "--metrics_port=0",
         "--backend=cpu", "--threads=1", "--drain_seconds=1", "--shutdown_grace=0", *flags],
        stdout=log, stderr=subprocess.STDOUT)


def wait_serving(proc, address=None, client=None, timeout=60.0):
    """Waits until the lossd `proc` answers SERVING, asked through `client` (one with TLS,
    say), else through a plain client of `address`; fails if it exits or the time runs out."""
    import lossd  # the Prometheus test imports this file without the client installed

    own = client is None
    c = lossd.Client(address, timeout=2.0) if own else client
    deadline = time.monotonic() + timeout
    try:
        while True:
            assert proc.poll() is None, "lossd on %s exited with %s" % (address, proc.returncode)
            try:
                if c.health() == "SERVING":
                    return
            except lossd.LossdError:
                pass
            assert time.monotonic() < deadline, "lossd on %s not serving" % address
            time.sleep(0.1)
    finally:
        if own:
            c.close()


def stop_all(procs, clients=(), logs=()):
    """Closes `clients`, stops `procs` (terminate, then kill after 15 s) and closes `logs`."""
    for c in clients:
        c.close()
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for log in logs:
        log.close()


def run_all(fns, raise_first=True):
    """Runs fns at once, each on a thread (a head group's members join together; a step's
    ranks meet at its barrier), and returns their results in order. An exception is
    re-raised (the first) where raise_first, else returned in its function's place."""
    out, errs = [None] * len(fns), []

    def run(i):
        try:
            out[i] = fns[i]()
        except Exception as e:  # noqa: BLE001 (re-raised or returned below)
            errs.append(e)
            out[i] = e

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errs and raise_first:
        raise errs[0]
    return out
