"""Shared pytest fixtures of the kvmesh vLLM connector's tests.

The unit tests need nothing but this package. The mesh tests
(``tests/mesh``) play a workload against a real kvmesh stack, which the Go
runner ``e2e/vllm_connector_test.go`` (``TestVLLMConnector``) starts and
describes in two files named by the environment:

``KVMESH_MESH_FILE``
    ``mesh.json``: the model spec, its fingerprint, the services' URLs,
    Kafka bootstrap, tokens, Redis URL, key prefix and the engines with
    their gpuworkers.
``KVMESH_WORKLOAD_FILE``
    ``workload.json``: the exact workload the Go simulator plays
    (``sim.PlanWorkload``).
``KVMESH_HARNESS_REPORT``
    Where the ``harness_report`` dict is written as JSON at session end.
``KVMESH_REQUIRE_MESH=1``
    A missing mesh or workload file fails the test instead of skipping it.
"""

import json
import os
import sys
from pathlib import Path

import pytest

# connectors/vllm, so that ``import kvmesh_vllm`` works without PYTHONPATH.
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]
if str(_PACKAGE_ROOT) not in sys.path:
    sys.path.insert(0, str(_PACKAGE_ROOT))

# The dict the mesh tests fill; written to KVMESH_HARNESS_REPORT at the end.
_REPORT: dict = {}


def _load_env_json(var: str) -> dict:
    """The JSON object in the file $var names; skip (or fail under
    KVMESH_REQUIRE_MESH=1) when the variable is unset."""
    path = os.environ.get(var)
    if not path:
        msg = f"{var} is not set: run the mesh tests through `go test -run TestVLLMConnector ./e2e/`"
        if os.environ.get("KVMESH_REQUIRE_MESH") == "1":
            pytest.fail(msg + " (KVMESH_REQUIRE_MESH=1)")
        pytest.skip(msg)
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="session")
def mesh() -> dict:
    """The stack the Go runner started (mesh.json)."""
    return _load_env_json("KVMESH_MESH_FILE")


@pytest.fixture(scope="session")
def workload() -> dict:
    """The workload to play (workload.json, a sim.WorkloadPlan)."""
    return _load_env_json("KVMESH_WORKLOAD_FILE")


@pytest.fixture(scope="session")
def harness_report() -> dict:
    """The harness report: tests put their figures in it; the Go runner
    reads it (requests_total, requests_ok, requests_failed, hit_rate,
    tokens_loaded, blocks_checked, blocks_mismatched, ledger_balanced,
    saves, multiconnector_saves_from_rejected)."""
    return _REPORT


def pytest_sessionfinish(session, exitstatus):
    """Write the harness report where KVMESH_HARNESS_REPORT says."""
    path = os.environ.get("KVMESH_HARNESS_REPORT")
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(_REPORT, f, indent=2, sort_keys=True, default=str)
    os.replace(tmp, path)
