"""etcd over TLS with client certificates (issue 19, blocker 2): a real etcd serving
https with --client-cert-auth, certificates made with openssl; the coordinator with
cluster.etcd_ca_file / etcd_cert_file / etcd_key_file registers, elects and reads back,
and without a client certificate it is refused. Plus the node's /health decision
(cluster/health.py) in each state, and the token file rules."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
import types
from pathlib import Path

import pytest

from mooncaked.wire.auth import authorized, load_token, write_token_file
from mooncaked.wire.errors import CoordinationError
from mooncaked.coord.etcd import EtcdCoordinator
from mooncaked.coord.etcd_server import etcd_binary
from mooncaked.cluster.health import node_health
from mooncaked.ports import free_port
from mooncaked.config import ClusterSettings, ConfigError


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by it."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
            "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
                      ("client", "extendedKeyUsage=clientAuth")):
        (d / f"{name}.ext").write_text(ext + "\n")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext",
                "-out", f"{name}.pem", cwd=d)


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory):
    if etcd_binary() is None or shutil.which("openssl") is None:
        pytest.skip("needs etcd (mooncaked/coord/install_etcd.sh) and openssl")
    d = tmp_path_factory.mktemp("pki")
    make_pki(d)
    cport = free_port()
    pport = free_port(exclude={cport})
    client, peer = f"https://127.0.0.1:{cport}", f"http://127.0.0.1:{pport}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
    log = (d / "etcd.log").open("wb")
    proc = subprocess.Popen([etcd_binary(), "--name", "t", "--data-dir", str(d / "data"),
                             "--listen-client-urls", client, "--advertise-client-urls", client,
                             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                             "--initial-cluster", f"t={peer}", "--cert-file", str(d / "server.pem"),
                             "--key-file", str(d / "server.key"), "--client-cert-auth",
                             "--trusted-ca-file", str(d / "ca.pem")],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 30
        while b"ready to serve client requests" not in (d / "etcd.log").read_bytes():
            assert proc.poll() is None, (d / "etcd.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "etcd did not start"
            time.sleep(0.1)   # poll for etcd's readiness line
        yield client, d
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def settings(client: str, d: Path, cert: bool = True) -> ClusterSettings:
    return ClusterSettings(backend="etcd", etcd_endpoints=[client], op_timeout_s=3.0,
                           etcd_ca_file=str(d / "ca.pem"),
                           etcd_cert_file=str(d / "client.pem") if cert else "",
                           etcd_key_file=str(d / "client.key") if cert else "",
                           key_prefix="/tls-test/")


def test_etcd_over_tls_with_a_client_certificate(tls_etcd):
    client, d = tls_etcd

    async def run():
        async with EtcdCoordinator(settings(client, d)) as coord:
            await coord.register("n1", {"role": "cache"})
            await coord.put("k", {"v": 1})
            lead = await coord.campaign("n1")
            return (list(await coord.members()), await coord.get("k"), lead.node_id,
                    await coord.leader())
    members, value, lead, leader = asyncio.run(run())
    assert members == ["n1"] and value == {"v": 1} and lead == leader == "n1"


def test_etcd_over_tls_refuses_a_client_without_certificate(tls_etcd):
    client, d = tls_etcd

    async def run():
        async with EtcdCoordinator(settings(client, d, cert=False)):
            pass
    with pytest.raises(CoordinationError):
        asyncio.run(run())


def test_health_decision_in_each_state():
    coord = types.SimpleNamespace(session_alive=True)
    node = types.SimpleNamespace(node_id="d0", role="decode", leader_id="p0", draining=False,
                                 view=object(), coord=coord,
                                 settings=types.SimpleNamespace(
                                     cluster=types.SimpleNamespace(backend="etcd")))
    assert node_health(node) == (200, {"status": "ok", "node": "d0", "role": "decode",
                                       "leader": "p0"})
    coord.session_alive = False        # an etcd outage past the lease
    status, body = node_health(node)
    assert (status, body["status"]) == (503, "coordinator_unreachable")
    coord.session_alive, node.leader_id = True, None
    assert node_health(node)[1]["status"] == "no_conductor"
    node.draining = True
    assert node_health(node)[1] == {"status": "draining", "node": "d0", "role": "decode",
                                    "leader": None, "reason": "d0 is draining"}


def test_token_file_rules(tmp_path):
    path = tmp_path / "t" / "token"
    token = write_token_file(path)
    assert oct(path.stat().st_mode & 0o777) == "0o600" and len(token) >= 32
    assert write_token_file(path) == token            # never overwritten
    cs = ClusterSettings(backend="etcd", token_file=str(path))
    assert load_token(cs) == token
    with pytest.raises(ConfigError, match="cluster.token_file"):
        load_token(ClusterSettings(backend="etcd"))
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ConfigError, match="at least"):
        load_token(ClusterSettings(backend="etcd", token_file=str(short)))
    assert authorized({"Authorization": f"Bearer {token}"}, token, "peer", "x")
    assert not authorized({"Authorization": f"Bearer {token[:-1]}x"}, token, "peer", "x")
    assert not authorized({}, token, "peer", "x")


def test_repeated_warnings_are_rate_limited(caplog):
    import logging

    from mooncaked.log import get_logger
    from mooncaked.lograte import RateLimitedLog

    limited = RateLimitedLog(get_logger("mooncaked.test.rate"), window_s=3600)
    with caplog.at_level(logging.WARNING, logger="mooncaked.test.rate"):
        for _ in range(300):                  # an outage failing every call
            limited.warning("heartbeat", "coord_heartbeat_failed", error="unreachable")
        limited.warning("other", "campaign_failed", error="unreachable")
    assert [r.getMessage() for r in caplog.records] == ["coord_heartbeat_failed",
                                                        "campaign_failed"]
    limited.window_s = 0.0                    # the window has passed: the next line counts
    with caplog.at_level(logging.WARNING, logger="mooncaked.test.rate"):
        limited.warning("heartbeat", "coord_heartbeat_failed", error="unreachable")
    assert caplog.records[-1].fields["repeats"] == 299
