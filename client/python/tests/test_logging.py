# SPDX-License-Identifier: Apache-2.0
"""lossd's log as an operator reads it (service/log.h): the start-up line, a WARNING per refused
call naming method, peer, code and message, JSON lines that stay valid with a client's quotes
and newlines, the rate limit on a burst of refusals, the access log, and drain and stop."""

import json
import re
import signal
import subprocess

import numpy as np
import pytest

import lossd
from lossd_servers import find_lossd_binary, free_port
from conftest import LossdProcess  # noqa: F401  (the same waiting helper as the other tests)

# A weight handle a client chose: quotes, a backslash and a newline, echoed in the refusal.
HOSTILE_HANDLE = 'no"such\\handle\nWARNING forged line'


def small_problem():
    rng = np.random.default_rng(7)
    return (rng.standard_normal((4, 8)).astype(np.float32),
            rng.standard_normal((16, 8)).astype(np.float32), rng.integers(0, 16, 4))


class Server:
    """lossd with stdout and stderr apart: the stdout line stays plain, the log is stderr."""

    def __init__(self, tmp_path, flags):
        self.port = free_port()
        self.out_path, self.err_path = tmp_path / "stdout", tmp_path / "stderr"
        self.proc = subprocess.Popen(
            [find_lossd_binary(), "--address=127.0.0.1", "--port=%d" % self.port, "--backend=cpu",
             "--metrics_port=0", "--drain_seconds=2"] + flags,
            stdout=open(self.out_path, "wb"), stderr=open(self.err_path, "wb"))
        with lossd.Client("127.0.0.1:%d" % self.port, timeout=2.0) as c:
            for _ in range(600):
                try:
                    if c.health() == "SERVING":
                        break
                except lossd.LossdError:
                    pass
                assert self.proc.poll() is None, self.err_path.read_text()
                import time
                time.sleep(0.1)
        self.address = "127.0.0.1:%d" % self.port

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=30) == 0
        return self.err_path.read_text()

    def refuse_compute(self, n=1):
        with lossd.Client(self.address, timeout=30) as c:
            x, _, t = small_problem()
            for _ in range(n):
                with pytest.raises(lossd.LossdError) as e:
                    c.compute(x, HOSTILE_HANDLE, t)
            return e.value


def test_text_log_names_start_refusals_access_and_stop(tmp_path):
    srv = Server(tmp_path, ["--access_log", "--max_bt=4096"])
    with lossd.Client(srv.address, timeout=30) as c:
        r = c.compute(*small_problem())
        assert np.isfinite(r.loss)
    err = srv.refuse_compute(n=30)  # a burst: 5 lines a second per method and code
    log = srv.stop()
    out = srv.out_path.read_text()
    assert re.match(r"lossd \S+ listening on port %d \(backend cpu, device " % srv.port, out), out
    start = [l for l in log.splitlines() if " INFO lossd: started " in l]
    assert len(start) == 1, log
    for want in ("backend=cpu", "port=%d " % srv.port, "version=", "weight_cache_bytes=",
                 "memory_budget_bytes=",
                 'flags="--access_log=true --address=127.0.0.1 --backend=cpu --drain_seconds=2'
                 ' --max_bt=4096 --metrics_port=0 --port=%d"' % srv.port):
        assert want in start[0], (want, start[0])
    warnings = [l for l in log.splitlines() if " WARNING lossd: call failed " in l]
    code = err.code.name
    assert 1 <= len(warnings) <= 5, log
    assert ("method=Compute peer=ipv4:127.0.0.1:" in warnings[0] and " code=%s " % code
            in warnings[0]), warnings[0]
    # The client's newline is escaped: no line of the log starts with the forged text.
    assert 'no\\"such\\\\handle\\nWARNING forged line' in warnings[0], warnings[0]
    assert not any(l.startswith("WARNING forged") for l in log.splitlines()), log
    # Every refusal is either a line or counted in one (the rest summarised at stop).
    suppressed = sum(int(n) for n in re.findall(
        r"WARNING lossd: .*method=Compute .*suppressed=(\d+)", log))
    assert len(warnings) + suppressed == 30, log
    assert " WARNING lossd: calls failed, lines suppressed method=Compute code=%s " % code in log, log
    ok = [l for l in log.splitlines() if " INFO lossd: call method=Compute " in l and "code=OK" in l]
    assert len(ok) == 1, log
    m = re.search(r"latency_ms=([0-9.]+) bytes_in=(\d+) bytes_out=(\d+)", ok[0])
    assert m and float(m.group(1)) > 0, ok[0]
    # x (4x8 fp32), W (16x8 fp32) and targets (4 int64) in; dx and dW (fp32) out.
    assert int(m.group(2)) == (4 * 8 + 16 * 8) * 4 + 4 * 8, ok[0]
    assert int(m.group(3)) == (4 * 8 + 16 * 8) * 4, ok[0]
    refused = [l for l in log.splitlines() if " INFO lossd: call method=Compute " in l
               and " code=%s " % code in l]
    assert len(refused) == 30, log  # the access log is not rate-limited
    assert re.search(r"INFO lossd: draining signal=15 drain_seconds=2", log), log
    assert re.search(r"INFO lossd: stopped drained_ms=\d+", log), log


def test_json_lines_are_valid_and_carry_client_strings_exactly(tmp_path):
    srv = Server(tmp_path, ["--log_format=json"])
    err = srv.refuse_compute()
    log = srv.stop()
    lines = [json.loads(l) for l in log.splitlines()]  # every line is one JSON object
    assert [l["msg"] for l in lines if l["level"] == "INFO"][-3:] == [
        "started", "draining", "stopped"], lines
    warn = [l for l in lines if l["level"] == "WARNING"]
    assert len(warn) == 1, lines
    w = warn[0]
    assert (w["msg"], w["method"], w["code"]) == ("call failed", "Compute", err.code.name), w
    assert w["peer"].startswith("ipv4:127.0.0.1:"), w
    assert HOSTILE_HANDLE in w["message"], w
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$", w["time"]), w


def test_bad_log_format_is_refused(tmp_path):
    r = subprocess.run([find_lossd_binary(), "--log_format=xml", "--metrics_port=0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "INVALID_ARGUMENT: --log_format must be text or json, got 'xml'" in r.stderr
