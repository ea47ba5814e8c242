# SPDX-License-Identifier: Apache-2.0
"""End to end: a real Prometheus server scrapes a real lossd every second, with lossd's alert and
recording rules loaded; the test makes calls with the Python client and reads the metrics
back through Prometheus's HTTP API.

Needs: the lossd binary ($LOSSD_BIN, else $(bazel info bazel-bin)/service/lossd), the `prometheus`
binary (Debian package prometheus; $PROMETHEUS_BIN overrides), and the Python client's
dependencies. Run: pytest tests/prometheus/test_prometheus.py --junitxml=prometheus.xml
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "client" / "python"))
sys.path.insert(0, str(REPO / "client" / "python" / "tests"))

import lossd  # noqa: E402
from lossd_servers import find_lossd_binary as lossd_binary, free_port  # noqa: E402

BT, H, V = 64, 32, 100


def prometheus_binary():
    p = os.environ.get("PROMETHEUS_BIN") or shutil.which("prometheus")
    if not p:
        pytest.fail("prometheus not found: apt-get install prometheus (or set PROMETHEUS_BIN)")
    return p


class Proc:
    def __init__(self, name, cmd, log_dir):
        self.name = name
        self.log_path = Path(log_dir) / ("%s.log" % name)
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def tail(self):
        self.log.flush()
        return self.log_path.read_bytes()[-3000:].decode(errors="replace")

    def check_alive(self):
        if self.proc.poll() is not None:
            raise RuntimeError("%s exited with %s:\n%s" % (self.name, self.proc.returncode,
                                                           self.tail()))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def wait_for(what, fn, timeout, procs=()):
    """Polls fn() until it returns a truthy value; fails naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        for p in procs:
            p.check_alive()
        try:
            last = fn()
            if last:
                return last
        except (OSError, ValueError, lossd.LossdError) as e:
            last = e
        time.sleep(0.25)
    logs = "\n".join("--- %s log ---\n%s" % (p.name, p.tail()) for p in procs)
    pytest.fail("timed out after %.0f s waiting for %s (last: %r)\n%s" % (timeout, what, last, logs))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prom")
    grpc_port, metrics_port, prom_port = free_port(), free_port(), free_port()
    srv = Proc("lossd", [lossd_binary(), "--port=%d" % grpc_port, "--backend=cpu",
                         "--metrics_port=%d" % metrics_port, "--metrics_address=127.0.0.1",
                         "--drain_seconds=2"], tmp)
    rules = sorted(str(p) for p in (REPO / "deploy" / "prometheus" / "rules").glob("*.yml"))
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "900ms",
                   "evaluation_interval": "1s"},
        "rule_files": rules,
        "scrape_configs": [{
            "job_name": "lossd",
            "static_configs": [{"targets": ["127.0.0.1:%d" % metrics_port],
                                "labels": {"namespace": "e2e", "pod": "lossd-e2e"}}],
        }],
    }
    cfg_path = tmp / "prometheus.yml"
    cfg_path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    prom = Proc("prometheus", [prometheus_binary(), "--config.file=%s" % cfg_path,
                               "--storage.tsdb.path=%s" % (tmp / "data"),
                               "--web.listen-address=127.0.0.1:%d" % prom_port,
                               "--log.level=warn"], tmp)
    procs = (srv, prom)
    api = "http://127.0.0.1:%d" % prom_port
    client = lossd.Client("127.0.0.1:%d" % grpc_port, timeout=60)
    try:
        wait_for("lossd SERVING", lambda: client.health(timeout=2) == "SERVING", 60, procs)
        wait_for("Prometheus ready",
                 lambda: urllib.request.urlopen(api + "/-/ready", timeout=2).status == 200,
                 60, procs)
        yield dict(api=api, client=client, procs=procs, metrics_port=metrics_port)
    finally:
        client.close()
        prom.stop()
        srv.stop()


def query(api, expr):
    """Instant query; returns {frozenset(labels): float}."""
    url = api + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise ValueError("query %s: %s" % (expr, body))
    return {frozenset(s["metric"].items()): float(s["value"][1]) for s in body["data"]["result"]}


def scalar(api, expr):
    res = query(api, expr)
    return next(iter(res.values())) if res else None


def test_prometheus_scrapes_lossd_and_counts_requests(stack):
    api, client, procs = stack["api"], stack["client"], stack["procs"]
    # The target is up and lossd's own gauges are there before any call.
    wait_for("up{job=lossd} == 1", lambda: scalar(api, 'up{job="lossd"}') == 1.0, 30, procs)
    wait_for("lossd_healthy == 1", lambda: scalar(api, "lossd_healthy") == 1.0, 30, procs)
    assert scalar(api, "lossd_memory_budget_bytes") > 0
    # What is running, and the process metrics every server exports.
    info = query(api, "lossd_build_info")
    assert len(info) == 1 and next(iter(info.values())) == 1.0, info
    labels = dict(next(iter(info)))
    assert labels["backend"] == "cpu" and labels["version"].count(".") == 2, labels
    assert labels["commit"] and labels["cuda_plugin"], labels
    assert scalar(api, "process_resident_memory_bytes") > (1 << 20)
    assert scalar(api, "process_open_fds") >= 3
    assert scalar(api, "process_max_fds") >= scalar(api, "process_open_fds")
    assert scalar(api, "process_cpu_seconds_total") > 0
    assert abs(scalar(api, "process_start_time_seconds") - time.time()) < 3600
    before = scalar(api, 'sum(lossd_requests_total{method="Compute", code="OK"})') or 0.0

    rng = np.random.default_rng(0)
    x = rng.standard_normal((BT, H)).astype(np.float32)
    w = (rng.standard_normal((V, H)) / np.sqrt(H)).astype(np.float32)
    t = rng.integers(0, V, BT)
    n_ok = 3
    for _ in range(n_ok):
        r = client.compute(x, w, t)
        assert np.isfinite(r.loss)
    with pytest.raises(lossd.InvalidArgumentError):
        client.compute(x, w[:, :-1], t)
    client.server_info()
    h = client.put_weights(w)
    client.compute(x, h, t)
    client.drop_weights(h)
    n_ok += 1

    def moved():
        now = scalar(api, 'sum(lossd_requests_total{method="Compute", code="OK"})') or 0.0
        return now - before >= n_ok

    wait_for("lossd_requests_total{Compute,OK} to move by %d" % n_ok, moved, 30, procs)
    assert scalar(api, 'sum(lossd_requests_total{method="Compute", code="OK"})') - before == n_ok
    wait_for("the INVALID_ARGUMENT call counted", lambda: (scalar(
        api, 'sum(lossd_requests_total{method="Compute", code="INVALID_ARGUMENT"})') or 0) >= 1,
        30, procs)
    for method in ("ServerInfo", "PutWeights", "DropWeights"):
        assert (scalar(api, 'sum(lossd_requests_total{method="%s", code="OK"})' % method)
                or 0) >= 1, method
    # Every Compute is timed by phase; tokens and FLOPs add up exactly.
    phases = query(api, 'sum by (phase) (lossd_request_duration_seconds_count{method="Compute"})')
    got_phases = {dict(k)["phase"] for k in phases}
    assert {"receive", "compute", "send", "total"} <= got_phases, got_phases
    assert scalar(api, 'sum(lossd_request_duration_seconds_count{method="Compute", '
                       'phase="total"})') >= n_ok
    assert scalar(api, "sum(lossd_tokens_total)") == n_ok * BT
    assert scalar(api, "sum(lossd_compute_flops_total)") == n_ok * 6 * BT * H * V
    assert scalar(api, "sum(lossd_bytes_received_total)") >= n_ok * x.nbytes
    assert scalar(api, "sum(lossd_bytes_sent_total)") >= n_ok * (x.nbytes + w.nbytes)
    assert scalar(api, "sum(lossd_requests_in_flight)") is not None
    for name in ("lossd_weight_cache_hits_total", "lossd_weight_cache_misses_total",
                 "lossd_accumulators", "lossd_memory_in_use_bytes", "lossd_weight_cache_bytes",
                 "lossd_heads", "lossd_head_bytes", "lossd_head_budget_bytes",
                 "lossd_tickets", "lossd_ticket_bytes", "lossd_tickets_expired_total",
                 "lossd_ticket_budget_bytes", "lossd_max_tickets"):
        assert query(api, name), "%s not scraped" % name


def test_rules_load_and_evaluate(stack):
    api, procs, client = stack["api"], stack["procs"], stack["client"]
    rng = np.random.default_rng(1)
    client.compute(rng.standard_normal((BT, H)).astype(np.float32),
                   rng.standard_normal((V, H)).astype(np.float32), rng.integers(0, V, BT))
    with urllib.request.urlopen(api + "/api/v1/rules", timeout=5) as r:
        groups = {g["name"]: g for g in json.load(r)["data"]["groups"]}
    assert {"lossd.alerts", "lossd.recording"} <= set(groups), set(groups)
    for g in groups.values():
        for rule in g["rules"]:
            assert rule.get("health") != "err", "rule %s: %s" % (rule["name"], rule.get("lastError"))
    # The recording rule over the live counters: tokens/s seen by the e2e namespace.
    wait_for("namespace:lossd_tokens:rate1m > 0",
             lambda: (scalar(api, 'namespace:lossd_tokens:rate1m{namespace="e2e"}') or 0) > 0,
             40, procs)
    with urllib.request.urlopen(api + "/api/v1/alerts", timeout=5) as r:
        firing = [a for a in json.load(r)["data"]["alerts"] if a["state"] == "firing"]
    assert not [a for a in firing if a["labels"]["alertname"] in (
        "LossdInstanceDown", "LossdUnhealthy")], firing
