# SPDX-License-Identifier: Apache-2.0
"""TLS, mutual TLS and bearer tokens from the client's side, against a lossd started with
--tls_cert/--tls_key/--tls_client_ca/--auth_tokens_file and certificates made at test time."""


import numpy as np
import pytest

import lossd
from conftest import LossdProcess, find_lossd_binary
from lossd_servers import make_test_pki

TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    make_test_pki(d, ["client"])
    (d / "tokens").write_text("# bearer tokens\n%s\n" % TOKEN)
    return d


@pytest.fixture(scope="module")
def secure_server(pki, tmp_path_factory):
    tls = dict(tls_ca_file=str(pki / "ca.pem"), tls_cert_file=str(pki / "client.pem"),
               tls_key_file=str(pki / "client.key"), auth_token=TOKEN)
    srv = LossdProcess(find_lossd_binary(), str(tmp_path_factory.mktemp("sec") / "lossd.log"),
                       extra_flags=["--tls_cert=%s" % (pki / "server.pem"),
                                    "--tls_key=%s" % (pki / "server.key"),
                                    "--tls_client_ca=%s" % (pki / "ca.pem"),
                                    "--auth_tokens_file=%s" % (pki / "tokens")],
                       client_kwargs=tls, host="localhost")
    yield srv, tls
    srv.stop()


def small_problem():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((4, 8)).astype(np.float32),
            rng.standard_normal((16, 8)).astype(np.float32), rng.integers(0, 16, 4))


def test_mutual_tls_with_token(secure_server):
    srv, tls = secure_server
    with lossd.Client(srv.address, timeout=30, **tls) as c:
        assert c.health() == "SERVING"
        r = c.compute(*small_problem())
        assert np.isfinite(r.loss) and r.dx.shape == (4, 8)


def test_missing_or_wrong_token_is_unauthenticated(secure_server):
    srv, tls = secure_server
    for token in (None, "wrong"):
        kw = dict(tls, auth_token=token)
        with lossd.Client(srv.address, timeout=30, **kw) as c:
            assert c.health() == "SERVING"  # health checks need no token
            with pytest.raises(lossd.UnauthenticatedError) as e:
                c.server_info()
            assert e.value.code.name == "UNAUTHENTICATED" and e.value.method == "ServerInfo"


def test_no_client_certificate_or_plaintext_fails(secure_server):
    srv, tls = secure_server
    no_cert = {k: v for k, v in tls.items() if k not in ("tls_cert_file", "tls_key_file")}
    with lossd.Client(srv.address, timeout=10, **no_cert) as c:
        with pytest.raises(lossd.UnavailableError):
            c.server_info()
    with lossd.Client(srv.address, timeout=10, auth_token=TOKEN) as c:  # plaintext
        with pytest.raises(lossd.UnavailableError):
            c.server_info()


def test_tls_options_validated():
    with pytest.raises(lossd.InvalidArgumentError):
        lossd.Client("localhost:1", tls_cert_file="c.pem")  # key missing
