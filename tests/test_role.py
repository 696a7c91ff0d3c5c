"""cluster/role.py: every role worker implements the RoleWorker protocol (issue 31), so the
node can treat them alike; a unit-test NodeContext needs no node."""

from __future__ import annotations

import inspect

import pytest

from mooncaked.cluster.cpp.cpp_node import CppStageWorker
from mooncaked.cluster.decode_worker import DecodeWorker
from mooncaked.cluster.prefill_worker import PrefillWorker
from mooncaked.cluster.role import NodeContext, RoleStatus, RoleWorker
from mooncaked.config import load_settings
from mooncaked.wire.messages import Release

PROTOCOL_METHODS = [n for n, v in vars(RoleWorker).items()
                    if callable(v) and not n.startswith("_")]


@pytest.mark.parametrize("cls, side", [(PrefillWorker, "prefill"), (DecodeWorker, "decode"),
                                       (CppStageWorker, "prefill")])
def test_every_role_worker_implements_the_protocol(cls, side):
    assert cls.side == side
    assert set(PROTOCOL_METHODS) == {"handlers", "pending", "queued", "stalled", "info",
                                     "status", "release_held", "close"}
    for name in PROTOCOL_METHODS:
        want = inspect.signature(getattr(RoleWorker, name))
        got = inspect.signature(getattr(cls, name))
        assert list(got.parameters) == list(want.parameters), (cls.__name__, name)


def test_a_prefill_worker_on_a_bare_context_serves_node_prefill_and_holds_nothing():
    w = PrefillWorker(NodeContext("p0", "127.0.0.1:1", load_settings(None, {})))
    assert list(w.handlers()) == ["node.prefill"] and w.handlers()["node.prefill"] == w.handle
    assert (w.pending(), w.queued(), w.stalled(), w.info()) == ({}, (), None, None)
    assert w.status() == RoleStatus()
    assert w.release_held(Release("nobody")) is False
