"""``KVMeshTestPD``: a P/D connector standing in for NIXL (which cannot run
here) as MultiConnector's first child, built by vLLM's KVConnectorFactory
from ``kv_connector_module_path: pdchild``.

It claims, for a request whose ``kv_transfer_params`` carry
``test_pd_tokens``, that many tokens (less what vLLM computed), loads them
asynchronously by writing into its rank's registered KV caches the KV the
simulator's content function gives each complete chunk (as a prefill
engine would have computed), and reports the load finished on the next
step. Its settings (``kv_connector_extra_config``): ``spec`` (kvmesh's
model spec), ``fingerprint`` and ``ranks`` (the engine's worker ranks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

try:  # newer vLLM: HMA children declare it
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover
    SupportsHMA = object  # type: ignore[misc,assignment]

from kvmesh_vllm import content


@dataclass
class PDMeta(KVConnectorMetadata):
    """The step's loads: request → (hit tokens, per-group blocks, hashes)."""

    loads: dict[str, tuple[int, list[list[int]], list[str]]] = field(default_factory=dict)


class KVMeshTestPD(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.spec, self.fp = extra["spec"], extra["fingerprint"]
        self.rank = extra["ranks"][int(os.environ.get("KVMESH_WORKER_RANK", "0"))]
        self.hbs = int(self.spec["hash_block_size"])
        self.kcc = kv_cache_config
        self.pending: dict[str, tuple[int, list[list[int]], list[str]]] = {}
        self.chosen: set[str] = set()
        self.kv: dict[str, Any] = {}
        self.done: set[str] = set()
        self.loaded = 0  # tokens this child claimed and loaded

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        n = int((request.kv_transfer_params or {}).get("test_pd_tokens", 0))
        if request.request_id in self.chosen or n <= num_computed_tokens:
            return 0, False
        return n - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self.chosen.add(request.request_id)
            hit = int(request.kv_transfer_params["test_pd_tokens"])  # every token up to the claim
            self.pending[request.request_id] = (hit, [list(g) for g in blocks.get_block_ids()],
                                                [h.hex() for h in request.block_hashes])
            self.loaded += num_external_tokens

    def build_connector_meta(self, scheduler_output: Any) -> PDMeta:
        meta, self.pending = PDMeta(loads=self.pending), {}
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Optional[dict]]:
        self.chosen.discard(request.request_id)
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, Optional[dict]]:
        return self.request_finished(request, block_ids)

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.kv = kv_caches

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for rid, (hit, table, hashes) in meta.loads.items():
            for g, grp in enumerate(self.spec["groups"]):
                bs = grp["block_size"]
                for p in range(hit // bs):
                    if p < len(table[g]) and table[g][p] != 0:
                        h = hashes[(p + 1) * bs // self.hbs - 1]
                        sr = content.store_rank(self.spec, g, self.rank)
                        content.fill_regions(self._regions(g, table[g][p]), self.fp, g, sr, h)
            self.done.add(rid)

    def _regions(self, g: int, block: int) -> list:
        out = []
        for name in self.kcc.kv_cache_groups[g].layer_names:
            layer = self.kv[name]
            for t in layer if isinstance(layer, (list, tuple)) else [layer]:
                planes = [t[block]] if t.shape[0] == self.kcc.num_blocks else [t[0][block], t[1][block]]
                out.extend(p.reshape(-1).view(torch.uint8).numpy() for p in planes)
        return out

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        done, self.done = self.done, set()
        return None, done or None
