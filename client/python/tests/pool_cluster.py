# SPDX-License-Identifier: Apache-2.0
"""Three CPU lossd replicas on 127.0.0.1, 127.0.0.2 and 127.0.0.3, one port, named through an
injected resolver (a name resolving to the three), for the replica pool's tests. Each can be
killed (SIGKILL) and restarted on the same address and port (a new instance id)."""

import signal
import socket
import subprocess
import time

import lossd
from lossd_servers import find_lossd_binary

HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
NAME = "lossd-replicas.test"


def _port_free_on_all(port):
    socks = []
    try:
        for h in HOSTS:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((h, port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def common_free_port():
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if _port_free_on_all(port):
            return port
    raise RuntimeError("no port free on all of %s" % (HOSTS,))


class Cluster:
    def __init__(self, tmp_dir):
        self.binary = find_lossd_binary()
        self.dir = tmp_dir
        self.port = common_free_port()
        self.procs = {}
        self.logs = {}
        self.starts = 0
        for h in HOSTS:
            self.start(h)
        for h in HOSTS:
            self.wait_serving(h)

    def address(self, host):
        return "%s:%d" % (host, self.port)

    @property
    def addresses(self):
        return [self.address(h) for h in HOSTS]

    def resolver(self, host, port):
        """The injected resolver: NAME is the three replicas' addresses."""
        assert (host, port) == (NAME, self.port), (host, port)
        return list(HOSTS)

    def target(self):
        return "dns:///%s:%d" % (NAME, self.port)

    def host_of(self, address):
        return address.rsplit(":", 1)[0]

    def start(self, host):
        self.starts += 1
        log = open(str(self.dir / ("%s-%d.log" % (host, self.starts))), "wb")
        self.logs[host] = log
        self.procs[host] = subprocess.Popen(
            [self.binary, "--address=%s" % host, "--port=%d" % self.port, "--metrics_port=0",
             "--backend=cpu", "--threads=1", "--drain_seconds=1",
             # a restart here is a test's, not a rollout's: no endpoints to drop first
             "--shutdown_grace=0"],
            stdout=log, stderr=subprocess.STDOUT)

    def wait_serving(self, host, timeout=60.0):
        deadline = time.monotonic() + timeout
        with lossd.Client(self.address(host), timeout=2.0) as c:
            while True:
                if self.procs[host].poll() is not None:
                    raise RuntimeError("lossd on %s exited with %s" % (
                        host, self.procs[host].returncode))
                try:
                    if c.health() == "SERVING":
                        return c.server_info().instance
                except lossd.LossdError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("lossd on %s not serving after %.0f s" % (host, timeout))
                time.sleep(0.1)

    def instance(self, host):
        with lossd.Client(self.address(host), timeout=10.0) as c:
            return c.server_info().instance

    def kill(self, host):
        p = self.procs[host]
        p.send_signal(signal.SIGKILL)
        p.wait()

    def restart(self, host):
        """Stops the replica (SIGTERM, as a rolling restart does) and starts it again on the
        same address and port; returns the new instance id."""
        p = self.procs[host]
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        self.start(host)
        return self.wait_serving(host)

    def ensure_all(self):
        """Every replica running (a test that killed one leaves it dead)."""
        for h in HOSTS:
            if self.procs[h].poll() is not None:
                self.start(h)
                self.wait_serving(h)

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in self.logs.values():
            log.close()

