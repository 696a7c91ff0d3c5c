"""Shared fixtures (the bundled model's path, the shared trace, the run's one etcd and one
default server, one each per pytest-xdist worker: tests/cluster_harness.py) and the
suite's CI rule.

The CI rule: when the environment variable CI is set (to anything but "", "0", "false" or
"no"; `.ci/run` runs under CI=true), a test that skips FAILS instead, whatever skipped it:
pytest.skip in a test or fixture, a skipif mark, importorskip, or a module-level skip at
collection. So a missing etcd, pyverbs, shared trace or package is a red CI run, never a
quiet "s". The rule lives in the report hooks below, so a new test cannot forget it.

The one exception is hardware: `@pytest.mark.gpu(condition, reason=...)` (needs a GPU),
`@pytest.mark.rdma_devices(condition, reason=...)` (written for a host without RDMA
devices) and `@pytest.mark.cpu_isa("avx512_bf16")` (a kernel variant for an ISA level this
CPU lacks; kernels/cpu_isa.py) skip the test when the hardware is not there, and that skip,
with that reason, is allowed in CI; any other skip of the same test still fails there. The
run ends with a line saying which ISA levels' variants it tested and which it skipped. Locally (CI unset) every skip
stays a skip with its reason (`pytest -rs` lists them).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# The checkout's root must not be on the import path: its kernels/ (installed as
# mooncaked.kernels) would shadow the `kernels` package that transformers >= 5.25 imports
# ("cannot import name 'CUDAProperties' from 'kernels'"). `python -m pytest` puts the
# working directory first; drop it here, and children started from the root (a test's
# `python -m ...` with cwd at the root) do not prepend it either (PYTHONSAFEPATH).
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if p not in ("", ".") and Path(p).resolve() != _ROOT]
os.environ["PYTHONSAFEPATH"] = "1"

# Triton kernels run on the CPU interpreter in tests. Set before anything imports triton,
# so every kernel test runs in this process (the GPU check runs with --noconftest).
os.environ.setdefault("TRITON_INTERPRET", "1")

import cluster_harness  # noqa: E402 - after TRITON_INTERPRET is set

CI_SKIP_MARKERS = ("gpu", "rdma_devices", "cpu_isa")
_HARDWARE_SKIP = pytest.StashKey[str]()
_ISA_TESTED: dict[str, int] = {}   # ISA level -> tests run for it
_ISA_SKIPPED: dict[str, int] = {}  # ISA level -> tests skipped (this CPU lacks it)


def in_ci() -> bool:
    """True when the environment variable CI says this run is CI (then skips fail)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _skip_reason(longrepr) -> str:
    """The reason text of a skip report's longrepr ((file, line, reason) or a string)."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _ci_failure(where: str, longrepr) -> str:
    return (f"skipped under CI={os.environ.get('CI')!r}, which fails here (only a "
            f"{' or '.join(CI_SKIP_MARKERS)} marker's own skip may skip in CI): {where}: "
            f"{_skip_reason(longrepr)}")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skips a test whose gpu / rdma_devices marker's condition is true, or whose cpu_isa
    level this CPU lacks, remembering the reason so that the CI rule lets exactly this skip
    through."""
    from mooncaked.kernels import cpu_isa  # noqa: PLC0415 - after TRITON_INTERPRET is set

    for mark in item.iter_markers("cpu_isa"):
        if len(mark.args) != 1 or mark.args[0] not in cpu_isa.LEVELS:
            raise pytest.UsageError(f"{item.nodeid}: use @pytest.mark.cpu_isa(LEVEL), LEVEL one "
                                    f"of {cpu_isa.LEVELS}")
        level = mark.args[0]
        # counted from the setup report (pytest_runtest_logreport), which also reaches the
        # controller of a pytest-xdist run
        item.user_properties.append(("cpu_isa", (level, cpu_isa.has(level))))
        if not cpu_isa.has(level):
            reason = (f"needs ISA level {level}; this CPU runs {cpu_isa.isa_level()} "
                      f"({cpu_isa.cpu_name()})")
            item.stash[_HARDWARE_SKIP] = reason
            pytest.skip(reason)
    for name in ("gpu", "rdma_devices"):
        for mark in item.iter_markers(name):
            if not mark.args or "reason" not in mark.kwargs:
                raise pytest.UsageError(f"{item.nodeid}: use @pytest.mark.{name}(condition, "
                                        f"reason=...)")
            if mark.args[0]:
                item.stash[_HARDWARE_SKIP] = mark.kwargs["reason"]
                pytest.skip(mark.kwargs["reason"])


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Counts the tests of each ISA level that ran and that this CPU could not run."""
    if report.when != "setup":
        return
    for key, value in report.user_properties:
        if key == "cpu_isa":
            level, runs = value
            counts = _ISA_TESTED if runs else _ISA_SKIPPED
            counts[level] = counts.get(level, 0) + 1


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Under CI, turns the skip of a test (setup, call or teardown) into a failure, unless
    it is the skip of the test's own gpu / rdma_devices marker. xfails are left alone."""
    rep = yield
    if rep.skipped and in_ci() and not hasattr(rep, "wasxfail"):
        allowed = item.stash.get(_HARDWARE_SKIP, None)
        if allowed is None or _skip_reason(rep.longrepr) != allowed:
            rep.longrepr = _ci_failure(item.nodeid, rep.longrepr)
            rep.outcome = "failed"
    return rep


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """Under CI, turns a skip at collection (pytest.skip(allow_module_level=True), a
    module-level importorskip) into a collection error."""
    rep = yield
    if rep.skipped and in_ci():
        rep.longrepr = _ci_failure(collector.nodeid, rep.longrepr)
        rep.outcome = "failed"
    return rep


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Prints pytest-randomly's seed at the end of the run, also under -q (as .ci/run runs),
    whose header omits it: a shuffled failure is reproducible from the log. Also prints
    which ISA levels' kernel variants ran and which this CPU could not run."""
    if _ISA_TESTED or _ISA_SKIPPED:
        from mooncaked.kernels import cpu_isa  # noqa: PLC0415

        tested = ", ".join(f"{k} ({v} tests)" for k, v in sorted(_ISA_TESTED.items())) or "none"
        skipped = ", ".join(f"{k} ({v} tests)" for k, v in sorted(_ISA_SKIPPED.items())) or "none"
        terminalreporter.write_line(f"CPU kernel variants on {cpu_isa.cpu_name()} (level "
                                    f"{cpu_isa.isa_level()}): tested {tested}; skipped {skipped}")
    seed = getattr(config.option, "randomly_seed", None)
    if isinstance(seed, int) and config.pluginmanager.has_plugin("randomly"):
        terminalreporter.write_line(f"test order: --randomly-seed={seed} "
                                    "(rerun it with that option; file order: -p no:randomly)")


@pytest.fixture(scope="session")
def bundled_model():
    """Path of the bundled SmolLM2-135M-Instruct GGUF file."""
    from mooncaked.model.weights import bundled_model_path

    return bundled_model_path()


@pytest.fixture(scope="session")
def shared_trace() -> Path:
    """Path of the shared Mooncake conversation trace: ../shared/traces beside the checkout,
    or $MOONCAKE_TRACE_DIR. Skips without it (so fails under CI)."""
    from mooncaked.replay.trace import shared_trace_path

    path = shared_trace_path()
    if path is None:
        pytest.skip("shared conversation trace not found: put shared/ beside the checkout "
                    "(../shared/traces/conversation_trace.jsonl) or set MOONCAKE_TRACE_DIR")
    return path


@pytest.fixture(scope="session")
def default_server(tmp_path_factory):
    """The run's one `mooncaked serve --role all` with default settings, one per
    pytest-xdist worker (a free loopback port; cluster_harness.Server: url, proc, log). The API and replay modules share it, so
    a test leaves it as it found it: it never stops it or changes its settings, and a test
    that asserts on prefix hits or counters uses its own cache_salt or prompts and compares
    counters before and after. Stopped at the end of the run (SIGTERM, then SIGKILL)."""
    with cluster_harness.run_server(tmp_path_factory.mktemp("default_server")) as server:
        yield server


@pytest.fixture(scope="session")
def etcd(tmp_path_factory):
    """The run's one etcd, one per pytest-xdist worker (single member, free loopback
    ports; `.endpoint` is its client URL). Tests sharing it keep to a key prefix of their own (cluster_harness.etcd_prefix).
    Tests that stop, pause or restart etcd, or need TLS, start their own. Skips (fails
    under CI) when etcd is not installed."""
    if cluster_harness.etcd_binary() is None:
        pytest.skip("etcd is not installed (mooncaked/coord/install_etcd.sh)")
    with cluster_harness.run_etcd(tmp_path_factory.mktemp("etcd") / "data") as server:
        yield server
