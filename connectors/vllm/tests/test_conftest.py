"""The shared fixtures' rules (conftest.py): a mesh or workload file is read
when its variable names one, skipped when unset, a failure when unset under
KVMESH_REQUIRE_MESH=1; the harness report is written at session end."""

import json

import pytest

import conftest


def test_reads_the_file(tmp_path, monkeypatch):
    path = tmp_path / "mesh.json"
    path.write_text(json.dumps({"lookup_url": "http://127.0.0.1:1"}))
    monkeypatch.setenv("KVMESH_MESH_FILE", str(path))
    assert conftest._load_env_json("KVMESH_MESH_FILE") == {"lookup_url": "http://127.0.0.1:1"}


@pytest.mark.parametrize("require, outcome", [("", pytest.skip.Exception), ("1", pytest.fail.Exception)])
def test_unset(monkeypatch, require, outcome):
    monkeypatch.delenv("KVMESH_WORKLOAD_FILE", raising=False)
    monkeypatch.setenv("KVMESH_REQUIRE_MESH", require)
    with pytest.raises(outcome, match="KVMESH_WORKLOAD_FILE is not set"):
        conftest._load_env_json("KVMESH_WORKLOAD_FILE")


def test_report_written_at_session_end(tmp_path, monkeypatch):
    path = tmp_path / "harness-report.json"
    monkeypatch.setenv("KVMESH_HARNESS_REPORT", str(path))
    monkeypatch.setitem(conftest._REPORT, "requests_total", 3)
    conftest.pytest_sessionfinish(session=None, exitstatus=0)
    assert json.loads(path.read_text())["requests_total"] == 3
