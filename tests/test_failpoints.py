"""mooncaked/failpoints.py: off unless enabled; error, pause, skip and times semantics."""

from __future__ import annotations

import asyncio

import pytest

from mooncaked import failpoints


@pytest.fixture
def enabled(monkeypatch):
    monkeypatch.setenv(failpoints.ENV, "")
    yield
    for name in list(failpoints.status()):
        failpoints.set_action(name, "off")


def test_off_without_the_environment_variable(monkeypatch):
    monkeypatch.delenv(failpoints.ENV, raising=False)
    assert not failpoints.enabled()
    with pytest.raises(RuntimeError, match="MOONCAKED_FAILPOINTS"):
        failpoints.set_action("x", "error")
    failpoints.hit("x")                      # nothing set: passes
    assert failpoints.status() == {}


def test_error_fires_after_skip_for_times(enabled):
    failpoints.set_action("p", "error", skip=2, times=2)
    failpoints.hit("p")
    failpoints.hit("p")                      # two skipped
    for _ in range(2):
        with pytest.raises(failpoints.FailpointError, match="failpoint p"):
            failpoints.hit("p")
    failpoints.hit("p")                      # fired twice: passes again
    assert failpoints.status()["p"] == {"action": "error", "hits": 5, "fired": 2}
    failpoints.hit("other")                  # other points are unaffected


def test_pause_holds_until_set_again(enabled):
    async def run() -> list[str]:
        seen = []
        failpoints.set_action("q", "pause")

        async def waiter():
            await failpoints.ahit("q")
            seen.append("released")

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0)                 # let the waiter reach the point
        for _ in range(5):
            await asyncio.sleep(0)
        seen.append("still paused" if not task.done() else "ran through")
        # the control method without an action only reads: the point stays paused
        assert (await failpoints.control_handler({"name": "q"}))["failpoints"]["q"] == \
            {"action": "pause", "hits": 1, "fired": 1}
        await asyncio.sleep(0)
        assert not task.done()
        failpoints.hit("q")                    # a thread's hit never blocks on a pause
        failpoints.set_action("q", "off")
        await asyncio.wait_for(task, 5)
        return seen

    assert asyncio.run(run()) == ["still paused", "released"]


def test_pause_is_bounded(enabled):
    async def run() -> None:
        failpoints.set_action("r", "pause", max_pause_s=0.05)
        await failpoints.ahit("r")

    with pytest.raises(failpoints.FailpointError, match="paused longer"):
        asyncio.run(run())


def test_bad_specs_are_refused(enabled, monkeypatch):
    with pytest.raises(ValueError, match="unknown failpoint action"):
        failpoints.set_action("p", "explode")
    with pytest.raises(ValueError):
        failpoints.set_action("p", "error", times=0)
    monkeypatch.setenv(failpoints.ENV, "a=error;broken")
    with pytest.raises(ValueError, match="expected name=action"):
        failpoints.load_from_env()
    monkeypatch.setenv(failpoints.ENV, "a=error; b = pause")
    failpoints.load_from_env()
    assert {n: v["action"] for n, v in failpoints.status().items()} == {"a": "error",
                                                                       "b": "pause"}
