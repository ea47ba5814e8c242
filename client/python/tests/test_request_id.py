# SPDX-License-Identifier: Apache-2.0
"""The request id as a trainer and an operator meet it: every call sends a new x-request-id,
a failed call's LossdError names it (`request_id`, and in its text), and the server's log line
about that call names the same id; metadata that would fix one id for every call is refused."""

import re
import signal
import subprocess
import time

import numpy as np
import pytest

import lossd
from lossd_servers import find_lossd_binary, free_port

ID = re.compile(r"^[0-9a-f]{16}$")


@pytest.fixture
def server(tmp_path):
    port = free_port()
    err_path = tmp_path / "stderr"
    proc = subprocess.Popen(
        [find_lossd_binary(), "--port=%d" % port, "--backend=cpu", "--metrics_port=0",
         "--drain_seconds=1", "--access_log"],
        stdout=subprocess.DEVNULL, stderr=open(err_path, "wb"))
    address = "127.0.0.1:%d" % port
    with lossd.Client(address, timeout=2.0) as c:
        for _ in range(600):
            try:
                if c.health() == "SERVING":
                    break
            except lossd.LossdError:
                pass
            assert proc.poll() is None, err_path.read_text()
            time.sleep(0.1)
    yield address, err_path
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


def test_a_failed_calls_error_names_the_id_the_server_logged(server):
    address, err_path = server
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    t = rng.integers(0, 16, 4)
    ids = set()
    with lossd.Client(address, timeout=30) as c:
        for _ in range(2):
            with pytest.raises(lossd.NotFoundError) as e:
                c.compute(x, "no-such-handle", t)
            ids.add(e.value.request_id)
        with pytest.raises(lossd.NotFoundError) as drop:
            c.drop_weights("no-such-handle")
    assert len(ids) == 2, ids  # a new id each call
    for rid in ids | {drop.value.request_id}:
        assert ID.match(rid), rid
    drop_id = drop.value.request_id
    assert str(drop.value).endswith("(request_id %s)" % drop_id), str(drop.value)
    assert "request_id" not in drop.value.message  # the server's text stays as it was
    log = err_path.read_text()
    for rid in ids:
        warn = [l for l in log.splitlines()
                if " WARNING lossd: call failed method=Compute " in l and "request_id=%s" % rid in l]
        assert len(warn) == 1, log
    assert re.search(r"WARNING lossd: call failed method=DropWeights .* request_id=%s" % drop_id,
                     log), log


def test_an_error_without_an_answer_names_the_id_sent():
    with lossd.Client("127.0.0.1:%d" % free_port(), timeout=2.0) as c:
        with pytest.raises(lossd.UnavailableError) as e:
            c.server_info()
    assert ID.match(e.value.request_id or ""), str(e.value)
    assert "(request_id %s)" % e.value.request_id in str(e.value)


def test_metadata_may_not_fix_the_request_id():
    with pytest.raises(lossd.InvalidArgumentError, match="metadata x-request-id: the client "
                                                         "makes a new one for every call"):
        lossd.Client("127.0.0.1:1", metadata=[("x-request-id", "mine")])


def test_an_error_made_before_any_call_has_none():
    err = lossd.InvalidArgumentError("bad", method="compute")
    assert err.request_id is None
    assert str(err) == "compute: INVALID_ARGUMENT: bad"
