"""`mooncake up` keeps its nodes' logs when it deletes its temporary work directory."""

from __future__ import annotations

from mooncaked.cli.up import clean_workdir


def _workdir(tmp_path):
    work = tmp_path / "mooncake-up-x"
    (work / "state" / "p1" / "kvstore").mkdir(parents=True)
    (work / "state" / "p1" / "kvstore" / "kv-1.dat").write_bytes(b"\0" * 4096)
    (work / "etcd").mkdir()
    (work / "cluster.toml").write_text("[cluster]\n")
    (work / "token").write_text("secret")
    (work / "p1.log").write_text('{"event":"stopped"}\n')
    (work / "d1.log").write_text('{"event":"model_load_failed"}\n')
    (work / "c1.log").write_text("")  # a node that never wrote: nothing to keep
    return work


def test_logs_are_kept_and_the_rest_removed(tmp_path):
    work = _workdir(tmp_path)
    kept = clean_workdir(work, keep_logs=True)
    assert [p.name for p in kept] == ["d1.log", "p1.log"]
    assert sorted(p.name for p in work.iterdir()) == ["d1.log", "p1.log"]
    assert (work / "d1.log").read_text() == '{"event":"model_load_failed"}\n'


def test_rm_logs_removes_everything(tmp_path):
    work = _workdir(tmp_path)
    assert clean_workdir(work, keep_logs=False) == []
    assert not work.exists()


def test_nothing_to_keep_removes_the_directory(tmp_path):
    work = tmp_path / "empty-run"
    (work / "coord").mkdir(parents=True)
    assert clean_workdir(work, keep_logs=True) == []
    assert not work.exists()
