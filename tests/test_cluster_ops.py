"""Operating a cluster (issue 19): the control plane is apart from the public API and needs
the cluster token; drain / undrain and what /health and a 503 say about it; duplicate node
ids; a request's `request_done` log line; config checks and ctl's exit codes.

One cluster for the module (cache c1, prefill p1, decode d1; local backend). Tests that
change a node's state put it back before they return.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import pytest
import torch
from cluster_harness import wait_until

from mooncaked.cluster.launcher import LocalCluster, NodeSpec, control_call
from mooncaked.config import Settings
from mooncaked.daemon import _build
from mooncaked.engine.llm_engine import LLMEngine
from mooncaked.ports import free_port
from mooncaked.kernels import cpu_isa

BIN = Path(sys.executable).parent
READY_TIMEOUT_S = 300.0
WAIT_S = 90.0     # generous: the suite shares two cores with other work
MODEL = "SmolLM2-135M-Instruct.Q4_1"


def http(method: str, url: str, body: dict | None = None, headers: dict | None = None
         ) -> tuple[int, dict]:
    """(status, JSON body) of one request; HTTP errors are answers too."""
    req = urllib.request.Request(url, method=method, headers={"Content-Type": "application/json",
                                                              **(headers or {})},
                                 data=orjson.dumps(body) if body is not None else None)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, orjson.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, orjson.loads(raw or b"{}")
        except orjson.JSONDecodeError:
            return e.code, {"raw": raw.decode(errors="replace")}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ops")
    settings = {"cluster.lease_ttl_s": 2.0, "cluster.heartbeat_interval_s": 0.5,
                "cluster.poll_interval_s": 0.1, "cluster.drain_timeout_s": 5.0,
                "engine.kv_cache_bytes": 32 << 20, "store.dram_bytes": 32 << 20,
                # the start-up profile's whole plan even when three model loads and the
                # rest of the suite share two cores (about 7 s alone on this CPU)
                "engine.startup_profile_s": 30.0,
                # finite, so d1's TBT check runs (and calibrates), yet never refuses here
                "conductor.tbt_slo_s": 60.0}
    cl = LocalCluster(tmp / "c", [NodeSpec("cache", "c1"), NodeSpec("prefill", "p1"),
                                  NodeSpec("decode", "d1")], settings=settings)
    with cl:
        yield cl


@pytest.fixture(autouse=True)
def healthy(request):
    """Before each cluster test: every node answers /health 200 (a previous test's drain or
    leader change has settled)."""
    if "cluster" in request.fixturenames:
        cl = request.getfixturevalue("cluster")
        wait_until(lambda: all(http("GET", f"{cl.api_url(n)}/health")[0] == 200
                               for n in ("c1", "p1", "d1")), WAIT_S, "every node healthy")
    yield


def complete(cl: LocalCluster, prompt: str = "Hello", max_tokens: int = 4) -> tuple[int, dict]:
    return http("POST", f"{cl.api_url('c1')}/v1/completions",
                {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def test_public_port_serves_no_control_route(cluster):
    for nid in ("c1", "p1", "d1"):
        status, _ = http("POST", f"{cluster.api_url(nid)}/control/node.status", {})
        assert status == 404, nid
        status, _ = http("POST", f"{cluster.api_url(nid)}/internal/decode", {})
        assert status == 404, nid
    # ...while the control plane, on its own port, answers with the token
    assert control_call(cluster.control("p1"), "node.status")["node"] == "p1"
    assert cluster.control("p1") != f"127.0.0.1:{cluster.ports['p1']}"


def test_control_call_without_token_is_refused_and_logged(cluster):
    addr = cluster.control("d1")
    status, body = http("POST", f"http://{addr}/control/node.drain", {})
    assert status == 401 and body["error"]["type"] == "Unauthorized"
    status, _ = http("POST", f"http://{addr}/control/node.status", {},
                     headers={"Authorization": "Bearer " + "x" * 43})
    assert status == 401
    status, _ = http("POST", f"http://{addr}/internal/decode", {})
    assert status == 401
    with pytest.raises(RuntimeError, match="Unauthorized"):
        control_call(addr, "node.status", token="not-the-cluster-token")
    st = control_call(addr, "node.status")
    assert st["draining"] is False               # the refused drain did nothing
    wait_until(lambda: "control_call_refused" in cluster.log_tail("d1", 200_000), WAIT_S,
               "d1 to log the refused call")
    line = next(ln for ln in cluster.log_tail("d1", 200_000).splitlines()
                if "control_call_refused" in ln)
    assert orjson.loads(line)["reason"] == "no cluster token"


def test_request_done_line_names_nodes_and_tokens(cluster):
    status, body = complete(cluster, "Tell me about the moon", 5)
    assert status == 200, body
    rid = body["id"]

    def line():
        for ln in cluster.log_tail("c1", 400_000).splitlines():
            if '"request_done"' in ln and rid.split("-", 1)[-1] in ln:
                return orjson.loads(ln)
        return None
    ev = wait_until(line, WAIT_S, "c1's request_done line")
    assert (ev["prefill"], ev["decode"]) == ("p1", "d1")
    assert ev["output_tokens"] == body["usage"]["completion_tokens"]
    assert ev["prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert ev["ttft_s"] > 0 and ev["status"] == "finished"


def test_drain_names_the_node_and_undrain_restores_it(cluster):
    r = control_call(cluster.control("p1"), "node.drain")
    assert r["draining"] is True
    try:
        status, body = http("GET", f"{cluster.api_url('p1')}/health")
        assert status == 503 and body["status"] == "draining"
        assert body["reason"] == "p1 is draining"
        # The only prefill node drains: a request's 503 says so (once the conductor knows).
        def refused():
            s, b = complete(cluster)
            return (s, b) if s == 503 else None
        s, b = wait_until(refused, WAIT_S, "a 503 while p1 drains")
        assert "p1 is draining" in b["error"]["message"], b
        assert control_call(cluster.control("p1"), "node.status")["conductor"] is False
    finally:
        r = control_call(cluster.control("p1"), "node.undrain")
    assert r["draining"] is False
    wait_until(lambda: http("GET", f"{cluster.api_url('p1')}/health")[0] == 200, WAIT_S,
               "p1 healthy again")
    wait_until(lambda: complete(cluster)[0] == 200, WAIT_S, "requests served again")


def test_duplicate_node_id_is_refused_while_the_first_holds_it(cluster):
    pid = cluster.procs["c1"].pid
    port = free_port()
    cmd = [str(BIN / "mooncaked"), "serve", "--config", str(cluster.workdir / "c1.toml"),
           "--role", "cache", "--node-id", "c1", "--port", str(port),
           "--set", f"cluster.rpc_port={free_port(exclude={port})}"]
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "node id 'c1' is in use by pid" in out.stderr
    # it waited about one lease TTL (2 s) for a dead holder, not forever
    assert time.monotonic() - t0 < 60
    st = control_call(cluster.control("c1"), "node.status")
    assert st["pid"] == pid and http("GET", f"{cluster.api_url('c1')}/health")[0] == 200


def test_config_check_runs_cross_field_checks_and_serve_prints_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[cluster]\nlease_ttl_s = 5.0\nheartbeat_interval_s = 3.0\n")
    out = subprocess.run([str(BIN / "mooncaked"), "config", "--check", str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"{bad}: cluster.heartbeat_interval_s:" in out.stderr
    out = subprocess.run([str(BIN / "mooncaked"), "serve", "--config", str(bad), "--role",
                          "cache"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert "cluster.heartbeat_interval_s" in out.stderr
    etcd = tmp_path / "etcd.toml"
    etcd.write_text('[node]\nrole = "decode"\n[cluster]\nbackend = "etcd"\n')
    out = subprocess.run([str(BIN / "mooncaked"), "config", "--check", str(etcd)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cluster.token_file" in out.stderr
    gpu = tmp_path / "gpu.toml"
    gpu.write_text('[model]\ndevice = "gpu"\n')
    out = subprocess.run([str(BIN / "mooncaked"), "config", "--check", str(gpu)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "model.device: 'gpu': expected cpu, cuda or cuda:N" in out.stderr
    broken = tmp_path / "broken.toml"
    broken.write_text("[model\n")
    out = subprocess.run([str(BIN / "mooncaked"), "config", "--check", str(broken)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"{broken}: invalid TOML" in out.stderr     # no key
    nan = tmp_path / "nan.toml"
    nan.write_text("[conductor]\nadmission_holdout = nan\n")       # passes < and > alike
    out = subprocess.run([str(BIN / "mooncaked"), "config", "--check", str(nan)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "admission_holdout: nan is not a number" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_without_a_gpu_is_one_log_line_before_the_weights_load(caplog):
    """model.device=cuda passes the config check but not a CPU-only torch: the engine
    refuses it before loading weights, and serve logs model_load_failed and exits 1
    (daemon._build returns None) instead of a traceback."""
    settings = Settings()
    settings.model.device = "cuda"
    with caplog.at_level(logging.ERROR):
        assert _build(settings, lambda: LLMEngine(settings)) is None
    rec = next(r for r in caplog.records if r.getMessage() == "model_load_failed")
    assert "model.device='cuda', but torch.cuda.is_available() is false" in rec.fields["error"]
    assert not rec.exc_info                               # one line, no traceback
    assert _build(settings, lambda: 7) == 7


def test_ctl_without_a_cluster_exits_nonzero(tmp_path):
    out = subprocess.run([str(BIN / "mooncake"), "ctl", "status", "--backend", "local",
                          "--state-dir", str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "no cluster found" in out.stderr


def test_metrics_label_every_series_with_node_and_role(cluster):
    assert complete(cluster)[0] == 200
    leader = control_call(cluster.control("c1"), "node.status")["leader"]
    for nid, role in (("c1", "cache"), ("p1", "prefill"), ("d1", "decode")):
        with urllib.request.urlopen(f"{cluster.api_url(nid)}/metrics", timeout=30) as r:
            text = r.read().decode()
        samples = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
        assert samples
        unlabelled = [ln for ln in samples
                      if f'node="{nid}"' not in ln or f'role="{role}"' not in ln]
        assert not unlabelled, unlabelled[:5]
        assert f'mooncaked_node_draining{{node="{nid}",role="{role}"}} 0.0' in text
        assert f'mooncaked_node_healthy{{node="{nid}",role="{role}"}} 1.0' in text
        assert "mooncaked_kv_transfer_bytes_total" in text
        assert ("mooncaked_conductor_placed_total" in text) == (nid == leader), nid
    with urllib.request.urlopen(f"{cluster.api_url('p1')}/metrics", timeout=30) as r:
        text = r.read().decode()
    assert 'mooncaked_store_blocks{node="p1",role="prefill",tier="dram"}' in text
    pushed = [ln for ln in text.splitlines()
              if ln.startswith("mooncaked_kv_transfer_total") and 'kind="pushed"' in ln]
    assert pushed and float(pushed[0].rsplit(" ", 1)[1]) >= 1


def test_published_cost_model_is_used_by_the_leader_without_a_leader_change(cluster):
    import asyncio

    from mooncaked.conductor.cost_model import CostModel, PolyModel, TransferModel
    from mooncaked.config import load_settings

    model = CostModel(prefill=PolyModel(((0, 0), (1, 0)), (0.2, 0.003)),
                      decode=PolyModel(((0, 0),), (0.05,)), transfer=TransferModel(1e9),
                      kv_bytes_per_token=46080, name="published-by-test", meta={"source": "fit"})
    from mooncaked.conductor.cost_store import publish
    from mooncaked.coord.factory import make_coordinator
    settings = load_settings(cluster.write_ctl_config())
    leader = control_call(cluster.control("c1"), "node.status")["leader"]

    async def publish_model():
        async with make_coordinator(settings.cluster) as coord:
            await publish(coord, model, "/elsewhere/cost_model.json")
    asyncio.run(publish_model())

    def in_use():
        st = control_call(cluster.control(leader), "conductor.status")
        cm = st.get("cost_model") or {}
        return cm if cm.get("name") == "published-by-test" else None
    cm = wait_until(in_use, WAIT_S, "the leader to take the published cost model")
    assert "coordinator key cost_model" in cm["meta"]["origin"]
    assert "/elsewhere/cost_model.json" in cm["meta"]["origin"]
    assert control_call(cluster.control("c1"), "node.status")["leader"] == leader


def test_transfer_port_in_use_names_the_port():
    import asyncio
    import socket

    from mooncaked.config import TransferSettings
    from mooncaked.transfer import TransferEngine

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        engine = TransferEngine(TransferSettings(host="127.0.0.1", port=port, backend="tcp"),
                                node_id="t")
        with pytest.raises(OSError, match=f"127.0.0.1:{port} \\(transfer.host/transfer.port\\)"):
            asyncio.run(engine.start())


def test_each_node_reports_its_cpu_isa_and_kernel_paths(cluster):
    """issue 30: the serve log's start-up `numerics` line, the registered model record and
    `mooncake ctl status` say which dtype model.dtype = auto chose and which variants run."""
    want_dtype = "float32"     # auto on every CPU (model/numerics.py)
    state = ["-c", str(cluster.write_ctl_config())]
    out = subprocess.run([str(BIN / "mooncake"), "ctl", "status", "--json", *state],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    view = orjson.loads(out.stdout)
    for nid in ("p1", "d1"):
        k = view["nodes"][nid]["info"]["model"]["kernels"]
        assert (k["cpu"], k["isa"]) == (cpu_isa.cpu_name(), cpu_isa.isa_level()), nid
        assert (k["dtype"], k["requested_dtype"]) == (want_dtype, "auto"), nid
        assert k["decode_path"] == "per-op-torch" or k["decode_path"].startswith("fused-")
        assert k["prefill_path"] in ("sdpa", "sdpa-aligned", "cpu_prefill-avx512_bf16")
        # bf16 prompt projections only where the CPU has native bf16, int8 activations on
        # other x86 levels (model/numerics.py)
        assert k["prompt_matmul"] in {"avx512_bf16": ("float32", "bfloat16"), "avx2": ("float32", "int8"),
                                      "avx512_vnni": ("float32", "int8")}.get(cpu_isa.isa_level(),
                                                                             ("float32",)), nid
        assert view["nodes"][nid]["info"]["model"]["dtype"] == want_dtype
        line = next(orjson.loads(ln) for ln in cluster.log_path(nid).read_text().splitlines()
                    if '"numerics"' in ln)
        assert {f: line[f] for f in k if f in line} == {f: k[f] for f in k if f in line}
        assert {"cpu", "isa", "decode_path", "prefill_path", "dtype"} <= set(line)
    out = subprocess.run([str(BIN / "mooncake"), "ctl", "status", *state],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    table = out.stdout[out.stdout.index("kernels"):]
    assert cpu_isa.isa_level() in table and f"{want_dtype} (auto)" in table
    assert (f"{k['prompt_matmul']} matmuls" in table) == (k["prompt_matmul"] != "float32")


def test_cost_model_is_calibrated_by_the_startup_profiles_before_any_request(cluster):
    """issue 33: this cluster starts with the built-in default cost model and no
    calibration cached (a fresh state dir). Each model node profiled its engine before it
    registered (engine/startup_profile.py), so the conductor took p1's prefill steps and
    d1's decode steps from their member records before it could place anything on them:
    both kinds reached conductor.admission_warmup from the profiles (`warmed_by`, which no
    served step changes afterwards), within the profile's bounds; d1's own TBT check too."""
    from mooncaked.conductor.refit import STARTUP_PROFILE
    from mooncaked.engine.startup_profile import DECODE_BATCHES, DECODE_STEPS_PER_BATCH, PREFILL_PLAN

    leader = control_call(cluster.control("c1"), "node.status")["leader"]
    st = control_call(cluster.control(leader), "conductor.status")
    cm, warmup = st["cost_model"], st["admission"]["warmup_steps"]
    assert cm["warmed_by"] == {"prefill": STARTUP_PROFILE, "decode": STARTUP_PROFILE}, cm
    assert cm["profile_steps"]["prefill"] >= warmup and cm["profile_steps"]["decode"] >= warmup
    profiles = st["startup_profiles"]
    assert sorted(profiles) == ["d1", "p1"]
    for nid, p in profiles.items():
        assert 0 < p["seconds"] <= p["budget_s"] + 1.0, (nid, p)
    assert profiles["p1"]["decode_steps"] == 0
    assert warmup <= profiles["p1"]["prefill_steps"] <= len(PREFILL_PLAN) + 1
    assert profiles["d1"]["prefill_steps"] == 0
    assert warmup <= profiles["d1"]["decode_steps"] <= len(DECODE_BATCHES) * DECODE_STEPS_PER_BATCH
    d1 = control_call(cluster.control("d1"), "node.status")
    assert d1["startup_profile"] == profiles["d1"]
    assert d1["admission"]["calibrated"] and d1["admission"]["calibrated_by"] == STARTUP_PROFILE
    out = subprocess.run([str(BIN / "mooncake"), "ctl", "status", "-c",
                          str(cluster.write_ctl_config())],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("startup profiles: "))
    assert "p1 " in line and "d1 " in line and "prefill" in line
    for nid, p in profiles.items():     # a contended profile says so (and was not cached)
        assert 0 < p["cpu_share"] <= 1 and p["contended"] == (p["cpu_share"] < 0.7), (nid, p)
    assert line.count("contended, not cached") == sum(
        p["contended"] and not p["cached"] for p in profiles.values())
    assert "calibrated by: prefill " in out.stdout


def test_api_node_reports_observed_ttfts_and_tbts_to_the_conductor(cluster):
    """issue 33: c1's front end sends the TTFT and the TBT it saw for each request in its
    next report (NodeReport.ttfts, .tbts); the conductor scores its end-to-end TTFT
    prediction with them and learns its TBT factor; the decode node learns its own from
    the TBT its stream sent."""
    def samples() -> tuple[int, int, int]:
        leader = control_call(cluster.control("c1"), "node.status")["leader"]
        st = control_call(cluster.control(leader), "conductor.status")
        d1 = control_call(cluster.control("d1"), "node.status")["admission"]
        return (st["ttft_e2e_prediction_compute_only"]["samples"],
                st["cost_model"]["observed_tbts"], d1["tbt_factor"]["observed_tbts"])
    before = samples()
    status, body = complete(cluster, "The capital of France is", 4)    # " Paris.\n\n"
    assert status == 200 and body["usage"]["completion_tokens"] >= 2, body
    wait_until(lambda: all(a > b for a, b in zip(samples(), before)), WAIT_S,
               "the conductor to get c1's TTFT and TBT, and d1 its stream's TBT", samples)
