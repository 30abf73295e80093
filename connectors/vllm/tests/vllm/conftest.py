"""The tests that put vLLM's own scheduler in charge of the connector.

They run vLLM's real v1 ``Scheduler`` (its ``KVCacheManager``, prefix
caching, chunked prefill, async scheduling), ``KVConnectorFactory``,
``MultiConnector`` and model-runner connector code from an upstream vLLM
source tree (the vLLM source pack: vLLM cannot be installed here), on CPU,
against a running mesh. ``e2e/vllm_scheduler_test.go``
(``TestVLLMScheduler``) starts the mesh and runs this directory once per
vLLM tree, with the pack's environment (``setup.sh``) and:

``KVMESH_VLLM_TREE``
    the tree's name (the scenarios' report names it);
``KVMESH_MESH_FILE``
    the mesh (mesh.json, as for tests/mesh);
``KVMESH_VLLM_REPORT``
    where the scenario table is written at the end.

Without a vLLM tree on the path the tests skip with one line, unless
``KVMESH_REQUIRE_VLLM=1``.
"""

import os
from pathlib import Path

import pytest

try:
    import vllm_cpu_shim  # noqa: F401  (before anything imports torch or vllm)
    import vllm  # noqa: F401
    HAVE_VLLM_TREE = bool(os.environ.get("VLLM_SRC"))
except ImportError as e:  # pragma: no cover - without the pack
    HAVE_VLLM_TREE, _WHY = False, str(e)
else:
    _WHY = "VLLM_SRC is not set"

_ROWS: list[dict] = []


def pytest_collection_modifyitems(config, items):
    if HAVE_VLLM_TREE:
        return
    msg = (f"no vLLM source tree ({_WHY}): run through `go test -run TestVLLMScheduler ./e2e/`, "
           "which sets it up from the vLLM source pack")
    if os.environ.get("KVMESH_REQUIRE_VLLM") == "1":
        raise pytest.UsageError(msg + " (KVMESH_REQUIRE_VLLM=1)")
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.skip(reason=msg))


@pytest.fixture(scope="session")
def scenario_rows() -> list[dict]:
    """Rows of the scenario table: each test adds its scenario's figures."""
    return _ROWS


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("KVMESH_VLLM_REPORT")
    if not path or not _ROWS:
        return
    cols = ["scenario", "result", "requests", "finished", "hit_tokens", "external_tokens", "blocks_checked",
            "blocks_mismatched", "saves", "ledger"]
    cols += sorted({k for r in _ROWS for k in r} - set(cols))  # a scenario's own figures
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in _ROWS)) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols)]
    lines += ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols) for r in _ROWS]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def pytest_configure(config):
    """Registers the connector as its vLLM plugin does, and the test P/D
    connector's module path."""
    if not HAVE_VLLM_TREE:
        return
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    for d in (here, os.path.join(os.path.dirname(here), "mesh")):
        if d not in sys.path:
            sys.path.insert(0, d)
    from kvmesh_vllm import plugin
    plugin.register()
