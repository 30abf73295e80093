"""The ``--kv-transfer-config`` examples of connectors/vllm/README.md, as
the tests load them: a documented example vLLM refuses fails the tests."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[2] / "README.md"
#: The test P/D connector that stands in for NIXL (it cannot run here).
TEST_PD = "KVMeshTestPD"


def examples() -> dict[str, dict]:
    """The README's marked examples by name (alone, multiconnector)."""
    text = README.read_text(encoding="utf-8")
    out = {}
    for m in re.finditer(r"<!-- kv-transfer-config: (\w+)[^>]*-->\s*```(\w+)\n(.*?)```", text, re.S):
        name, lang, body = m.groups()
        if lang == "sh":
            body = re.search(r"--kv-transfer-config '(.*?)'", body, re.S).group(1)
        out[name] = json.loads(body)
    if set(out) != {"alone", "multiconnector"}:
        raise LookupError(f"{README}: marked --kv-transfer-config examples {sorted(out)}, want alone and multiconnector")
    return out


def for_mesh(example: dict, mesh: dict, eng: dict, pd_extra: dict | None = None, **kvmesh: Any) -> dict:
    """The example with the mesh's values in every kvmesh setting (the
    example's keys kept: nothing is added that the README does not show,
    beyond ``kvmesh`` overrides a test asks for) and, under MultiConnector,
    the test P/D connector in NIXL's place."""
    cfg = copy.deepcopy(example)
    values = {
        "kvmesh.engine_id": eng["engine_id"],
        "kvmesh.model": mesh["model"]["name"],
        "kvmesh.lookup_url": mesh["lookup_url"],
        "kvmesh.kafka_brokers": mesh["kafka"]["bootstrap"],
        "kvmesh.gpuworker_urls": [w["url"] for w in eng["gpuworkers"]],
    }
    if "engine_id" in cfg:
        cfg["engine_id"] = eng["engine_id"]
    for child in _kvmesh_configs(cfg):
        extra = child.setdefault("kv_connector_extra_config", {})
        for k in list(extra):
            if k in values:
                extra[k] = values[k]
        extra["kvmesh.token"] = eng["token"]
        extra.update({"kvmesh." + k: v for k, v in kvmesh.items()})
    for child in (cfg.get("kv_connector_extra_config") or {}).get("connectors") or ():
        if child["kv_connector"] == "NixlConnector":
            child["kv_connector"] = TEST_PD
            child["kv_connector_module_path"] = "pdchild"
            child["kv_connector_extra_config"] = dict(pd_extra or {})
    return cfg


def _kvmesh_configs(cfg: dict) -> list[dict]:
    if cfg["kv_connector"] == "KVMeshConnector":
        return [cfg]
    return [c for c in (cfg.get("kv_connector_extra_config") or {}).get("connectors") or ()
            if c["kv_connector"] == "KVMeshConnector"]
