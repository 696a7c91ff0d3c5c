"""The systemd files (issue 19, blocker 3): the GPU/RDMA drop-in uses only DeviceAllow=
forms systemd accepts (globs only in char-/block- group names), and the unit with its
drop-ins passes `systemd-analyze verify` with no warning about our files; the example
settings pass `mooncaked config --check`. systemd itself cannot run here: that the nodes
start under it is the manual check in docs/cluster.md."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SYSTEMD = REPO / "systemd"
BIN = Path(sys.executable).parent


def test_device_allow_lines_are_valid_forms():
    lines = [ln.split("=", 1)[1].split()[0]
             for ln in (SYSTEMD / "examples" / "gpu-rdma.conf").read_text().splitlines()
             if ln.startswith("DeviceAllow=")]
    assert "char-nvidia*" in lines and "char-infiniband_verbs" in lines
    for spec in lines:
        if spec.startswith("/dev/"):
            assert not re.search(r"[*?\[]", spec), f"{spec}: globs are not allowed in paths"
        else:
            assert re.fullmatch(r"(char|block)-[\w*?.-]+", spec), spec
    unit = (SYSTEMD / "mooncaked@.service").read_text()
    assert "DeviceAllow=/dev/nvidia*" not in unit


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed")
def test_unit_and_dropins_pass_systemd_analyze_verify(tmp_path):
    unit = (SYSTEMD / "mooncaked@.service").read_text()
    # verify checks that ExecStart's binary exists: point it at this environment's one
    unit = re.sub(r"^ExecStart=\S+", f"ExecStart={BIN / 'mooncaked'}", unit, flags=re.M)
    (tmp_path / "mooncaked@.service").write_text(unit)
    drop = tmp_path / "mooncaked@.service.d"
    drop.mkdir()
    for name in ("gpu-rdma.conf", "etcd-local.conf"):
        shutil.copy(SYSTEMD / "examples" / name, drop / name)
    out = subprocess.run(["systemd-analyze", "verify", "--man=no",
                          str(tmp_path / "mooncaked@decode1.service")],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "SYSTEMD_UNIT_PATH": f"{tmp_path}:"})
    ours = [ln for ln in (out.stdout + out.stderr).splitlines()
            if "mooncaked" in ln and "etcd.service" not in ln]
    assert out.returncode == 0 and not ours, out.stdout + out.stderr


def test_example_settings_pass_config_check():
    for f in sorted((SYSTEMD / "examples").glob("*.toml")):
        out = subprocess.run([str(BIN / "mooncaked"), "config", "--check", str(f)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, (f.name, out.stderr)
