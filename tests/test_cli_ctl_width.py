"""`mooncake ctl` tables piped into another program do not wrap at 80 columns (issue 18,
fault 7): each row is one line and long cells (URLs) stay whole."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from mooncaked.cli.ctl import _cost_model_origin, _print_conductor


def test_piped_table_keeps_one_line_per_row_and_whole_urls():
    url = "http://very-long-host-name.example.internal.cluster.local:18000/some/long/path/v1"
    script = textwrap.dedent(f"""
        from mooncaked.cli.ctl import _table
        _table("nodes", ["node", "role", "health", "api", "control", "transfer"],
               [["prefill-0-" + "x" * 30, "prefill", "ok", {url!r}, {url!r} + "/c", "t"],
                ["decode-0", "decode", "ok", {url!r}, "-", None]])
    """)
    # stdout is a pipe, as in `mooncake ctl nodes | grep ...`; COLUMNS as a terminal had it
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=60, env={**os.environ, "COLUMNS": "80"}).stdout
    lines = out.splitlines()
    rows = [ln for ln in lines if "prefill-0-" in ln or "decode-0" in ln]
    assert len(rows) == 2, out
    assert url in rows[0] and url + "/c" in rows[0] and url in rows[1]
    assert max(len(ln) for ln in lines) > 80   # it took the width it needed


def test_node_admission_table_says_when_a_node_checks_nothing():
    """A decode node without a TBT SLO (conductor.tbt_slo_s = inf, the default) checks
    nothing: its row says so instead of "not calibrated yet"; an active one shows its counts."""
    script = textwrap.dedent("""
        from mooncaked.cli.ctl import _node_admission_table
        idle = {"mode": "enforce", "active": False, "admitted": 0, "rejected": 0,
                "shadow_rejected": 0, "calibrated": False, "decode_step_prediction": {}}
        busy = {"mode": "enforce", "active": True, "admitted": 5, "rejected": 2,
                "shadow_rejected": 0, "calibrated": True,
                "decode_step_prediction": {"median_abs_rel_error": 0.07}}
        _node_admission_table({"nodes": {"d0": {"status": {"admission": idle}},
                                          "d1": {"status": {"admission": busy}},
                                          "p0": {"status": {"admission": None}}}})
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    d0 = next(ln for ln in out.splitlines() if " d0 " in f" {ln} ")
    d1 = next(ln for ln in out.splitlines() if " d1 " in f" {ln} ")
    assert "inactive (no TBT SLO)" in d0 and "not calibrated" not in d0 and "shadow" not in d0
    assert "7.0%" in d1 and "yes" in d1 and "inactive" not in d1
    assert " p0 " not in out


def test_conductor_lines_say_each_thing_once(capsys):
    """The cost model's name, origin and source are not repeated ("default [default] from
    built-in default", a fresh user's finding), and admission without an SLO says it checks
    nothing, as the node table does."""
    assert _cost_model_origin({"name": "default", "source": "default",
                               "meta": {"origin": "built-in default"}}) == "built-in default"
    assert _cost_model_origin({"name": "h100", "source": "profile",
                               "meta": {"origin": "file /x/cost.json"}}) == \
        "h100 from file /x/cost.json [profile]"
    status = {"leader": "c0", "policy": "kvcache", "placed": 3, "rejected": {},
              "indexed_keys": 0, "cost_model": {"name": "default", "source": "default",
                                                "meta": {"origin": "built-in default"}},
              "admission": {"mode": "enforce", "admitted": 3, "rejected": 0,
                            "shadow_rejected": 0, "shadow_rejected_by_reason": {}},
              "slo": {"ttft_s": None, "tbt_s": float("inf")}}
    _print_conductor(status)
    out = capsys.readouterr().out
    assert "cost model: built-in default, refits: prefill 0, decode 0" in out, out
    assert "admission: enforce, inactive (no TTFT or TBT SLO), admitted 3" in out, out
    _print_conductor({**status, "slo": {"ttft_s": 2.0, "tbt_s": None}})
    out = capsys.readouterr().out
    assert "admission: enforce, admitted 3, rejected 0" in out, out
