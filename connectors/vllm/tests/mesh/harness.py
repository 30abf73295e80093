"""Building engines on the mesh, and the save ledger.

:func:`build` makes what vLLM makes for one engine of ``mesh.json``: the
scheduler-side connector, one worker-side connector per rank with KV
tensors laid out as vLLM's paged KV cache (one tensor per layer, the block
dimension first), registered through ``register_kv_caches``, and an
:class:`~engine.Engine` driving them. :class:`Ledger` reads every save task
and transfer result of an engine from Kafka (a second, independent client
of kvmesh's contract: librdkafka) and checks that every save was answered.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from kvmesh_vllm import transport
from kvmesh_vllm.connector import KVMeshConnector
from kvmesh_vllm._vllm import KVConnectorRole
from kvmesh_vllm.model import KIND_FULL, ModelSpec

import fakevllm as fv
from engine import Engine, FakePD

SPEC_CLASSES = {"mla": fv.MLAAttentionSpec, "mamba": fv.MambaSpec}


def engine_of(mesh: dict, role: str) -> dict:
    """The mesh's engine of a role (decode, prefill)."""
    for e in mesh["engines"]:
        if e["role"] == role:
            return e
    raise LookupError(f"mesh.json has no {role} engine: {[e['role'] for e in mesh['engines']]}")


def extra_config(mesh: dict, eng: dict, **overrides: Any) -> dict:
    """The kv_connector_extra_config a user writes for this engine."""
    out = {
        "kvmesh.model": mesh["model"]["name"],
        "kvmesh.lookup_url": mesh["lookup_url"],
        "kvmesh.kafka_brokers": mesh["kafka"]["bootstrap"],
        "kvmesh.gpuworker_urls": [w["url"] for w in eng["gpuworkers"]],
        "kvmesh.token": eng["token"],
        "kvmesh.finish_timeout_s": 60,
        "kvmesh.load_timeout_s": 60,
    }
    out.update({("kvmesh." + k): v for k, v in overrides.items()})
    return out


def layer_shapes(group: dict, num_blocks: int) -> list[Any]:
    """Two float16 layers per group, shaped as vLLM's caches: MLA
    ``(num_blocks, block_size, dim)``, full attention ``(2, num_blocks,
    block_size, heads, head_dim)`` (K and V planes), Mamba a list of two
    state tensors ``[(num_blocks, conv…), (num_blocks, ssm…)]`` (a quarter
    and three quarters of the layer's bytes), as vLLM's MambaSpec
    allocates them. A shape is a tuple, or a list of tuples for a layer of
    several tensors."""
    per_layer = group["bytes_per_block"] // 2 // 2  # float16 elements per layer and block
    bs = group["block_size"]
    if group["kind"] == KIND_FULL:
        per_plane = per_layer // 2
        return [(2, num_blocks, bs, 1, per_plane // bs)] * 2
    if group["kind"] == "mamba" and per_layer % 4 == 0:
        conv = per_layer // 4
        return [[(num_blocks, 4, conv // 4), (num_blocks, 8, (per_layer - conv) // 8)]] * 2
    if per_layer % bs == 0:
        return [(num_blocks, bs, per_layer // bs)] * 2
    return [(num_blocks, per_layer)] * 2


def kv_cache_config(spec: dict, num_blocks: int) -> tuple[fv.KVCacheConfig, list[list[str]], dict[str, tuple]]:
    """vLLM's KVCacheConfig for the model spec, with the layers' shapes."""
    groups, names, shapes = [], [], {}
    for g, grp in enumerate(spec["groups"]):
        layer_names = []
        for i, shape in enumerate(layer_shapes(grp, num_blocks)):
            name = f"model.layers.{g * 2 + i}.{'attn' if grp['kind'] != 'mamba' else 'mixer'}"
            layer_names.append(name)
            shapes[name] = shape
        cls = SPEC_CLASSES.get(grp["kind"], fv.FullAttentionSpec)
        # vLLM's page_size_bytes is one layer's page: the group's bytes per
        # block over its layers.
        page = grp["bytes_per_block"] // len(layer_names)
        groups.append(fv.KVCacheGroupSpec(layer_names, cls(grp["block_size"], page)))
        names.append(layer_names)
    return fv.KVCacheConfig(num_blocks, groups), names, shapes


def vllm_config(mesh: dict, eng: dict, role: str = "kv_both", **overrides: Any) -> fv.VllmConfig:
    return fv.VllmConfig(
        kv_transfer_config=fv.KVTransferConfig("KVMeshConnector", role, eng["engine_id"], extra_config(mesh, eng, **overrides)),
        cache_config=fv.CacheConfig(mesh["model"]["hash_block_size"]),
        parallel_config=fv.ParallelConfig(tensor_parallel_size=len(eng["gpuworkers"])),
    )


@dataclass
class Built:
    """One engine's connectors, tensors and driver."""

    engine: Engine
    scheduler: KVMeshConnector
    workers: list[KVMeshConnector]
    salt: bytes
    model: ModelSpec

    def close(self) -> None:
        self.scheduler.shutdown()
        for w in self.workers:
            w.shutdown()


def build(mesh: dict, eng: dict, salt: bytes, num_blocks: int = 96, pd_child: bool = False,
          max_batch_tokens: int = 256, **overrides: Any) -> Built:
    """The connectors vLLM would build for ``eng``, registered with its gpuworkers."""
    spec = mesh["model"]
    cfg = vllm_config(mesh, eng, **overrides)
    kcc, layer_names, shapes = kv_cache_config(spec, num_blocks)
    sched = KVMeshConnector(cfg, KVConnectorRole.SCHEDULER, kcc)
    workers, tensors, ranks = [], [], []
    try:
        for k, w in enumerate(eng["gpuworkers"]):
            os.environ["KVMESH_WORKER_RANK"] = str(k)
            conn = KVMeshConnector(cfg, KVConnectorRole.WORKER, kcc)
            workers.append(conn)
            caches = {name: [torch.zeros(p, dtype=torch.float16) for p in shape] if isinstance(shape, list)
                      else torch.zeros(shape, dtype=torch.float16) for name, shape in shapes.items()}
            conn.register_kv_caches(caches)
            tensors.append(caches)
            ranks.append(w["rank"])
    except BaseException:
        for c in [sched, *workers]:
            c.shutdown()
        raise
    finally:
        os.environ.pop("KVMESH_WORKER_RANK", None)
    engine = Engine(sched.model, mesh["fingerprint"], spec, sched, workers, tensors, layer_names, num_blocks, ranks,
                    max_batch_tokens=max_batch_tokens, pd_child=FakePD() if pd_child else None)
    return Built(engine, sched, workers, salt, sched.model)


def request_of(built: Built, p: dict, prefix: str = "", params: Optional[dict] = None) -> fv.Request:
    return fv.Request(prefix + p["request_id"], p["prompt_token_ids"], len(p["output_token_ids"]),
                      built.model.hash_block_size, built.salt, kv_transfer_params=params)


@dataclass
class Ledger:
    """Every save task and transfer result of one engine since ``start``."""

    engine_id: str
    tasks: dict[str, dict] = field(default_factory=dict)
    results: dict[str, dict] = field(default_factory=dict)
    _consumers: list[Any] = field(default_factory=list)

    def start(self, kafka: dict) -> "Ledger":
        self._consumers = [transport.TopicConsumer(kafka, "kvmesh.save.tasks").start(),
                           transport.TopicConsumer(kafka, "kvmesh.transfer.results").start()]
        return self

    def read(self) -> None:
        for v in self._consumers[0].drain():
            if v.get("engine_id") == self.engine_id:
                self.tasks[v["task_id"]] = v
        for v in self._consumers[1].drain():
            if v.get("engine_id") == self.engine_id and v.get("kind") == "save":
                self.results.setdefault(v["task_id"], v)

    def settle(self, timeout: float = 30.0) -> bool:
        """Reads until every save task has its result (or the timeout)."""
        end = time.monotonic() + timeout
        while True:
            self.read()
            if self.tasks and all(t in self.results for t in self.tasks):
                return True
            if time.monotonic() > end:
                return False
            time.sleep(0.05)  # poll interval of a deadline-bounded wait

    def outcomes(self, request_ids: Optional[set[str]] = None) -> dict[str, int]:
        out = {"tasks": 0, "results": 0, "stored": 0, "existing": 0, "skipped": 0, "dead_lettered": 0, "failed": 0}
        for tid, t in self.tasks.items():
            if request_ids is not None and t["request_id"] not in request_ids:
                continue
            out["tasks"] += 1
            res = self.results.get(tid)
            if res is None:
                continue
            out["results"] += 1
            for g in res.get("groups") or ():
                for k in ("stored", "existing", "skipped", "dead_lettered", "failed"):
                    out[k] += int(g.get(k, 0))
        return out

    def malformed(self, groups: int, request_ids: Optional[set[str]] = None) -> list[str]:
        """Save tasks whose table could not be a scheduled snapshot: a
        table of the wrong width, or chunks beyond it (the seed's crash)."""
        bad = []
        for tid, t in self.tasks.items():
            if request_ids is not None and t["request_id"] not in request_ids:
                continue
            table = t.get("block_table") or []
            if len(table) != groups:
                bad.append(f"{tid}: table of {len(table)} groups")
                continue
            for gc in t.get("groups") or ():
                if gc["group"] >= len(table) or not table[gc["group"]] and gc.get("chunks"):
                    bad.append(f"{tid}: group {gc['group']} has chunks and no blocks")
        return bad

    def close(self) -> None:
        for c in self._consumers:
            c.close()


def redis_command(url: str, *args: str) -> Any:
    """One command to the mesh's Redis (RESP over a socket): the harness
    removes store keys with it to make kvmesh's loads fail."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port or 6379), timeout=5) as s:
        f = s.makefile("rwb")
        db = (u.path or "/0").lstrip("/") or "0"
        for cmd in (("SELECT", db), args):
            f.write(b"*%d\r\n" % len(cmd) + b"".join(b"$%d\r\n%s\r\n" % (len(a.encode()), a.encode()) for a in cmd))
        f.flush()
        out = None
        for _ in range(2):
            line = f.readline()
            if line[:1] == b"-":
                raise RuntimeError(line[1:].strip().decode())
            out = int(line[1:]) if line[:1] == b":" else line[1:].strip().decode()
        return out


def broker(mesh: dict, action: str) -> None:
    """Takes the mesh's Kafka broker away (action "stop") or brings it
    back ("start") through the test's broker control (mesh.json's
    control_url, served by TestVLLMScheduler)."""
    import urllib.request

    req = urllib.request.Request(f"{mesh['control_url']}/broker/{action}", method="POST", data=b"")
    with urllib.request.urlopen(req, timeout=30) as resp:
        if resp.status != 200:
            raise RuntimeError(f"broker {action}: HTTP {resp.status}")


def store_key(mesh: dict, group: int, hash_hex: str, rank: Optional[dict] = None) -> str:
    """The store key of a chunk (docs/contract.md, "Key format"), no tenant."""
    r = rank or {"tp": 0, "pcp": 0, "dcp": 0, "pp": 0}
    prefix = mesh.get("key_prefix")
    ns = (
        f"{mesh['model']['name']}@fp:{mesh['fingerprint']}"
        f"@tp_rank:{r['tp']}@pcp{r['pcp']}@dcp{r['dcp']}@pp_rank:{r['pp']}@group:{group}"
    )
    return f"{prefix + '@' if prefix else ''}{ns}@{hash_hex}"


def max_blocks(model: ModelSpec, plan: list[dict]) -> int:
    """The most blocks one request of the plan ever holds (every group)."""
    most = 0
    for p in plan:
        n = len(p["prompt_token_ids"]) + len(p["output_token_ids"])
        most = max(most, sum(-(-n // g.block_size) for g in model.groups))
    return most
