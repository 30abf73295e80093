"""vLLM's objects as the connector sees them, without vLLM.

Each class carries the attribute names of its vLLM namesake
(``vllm/v1/request.py`` ``Request``, ``vllm/v1/core/sched/output.py``
``SchedulerOutput``/``NewRequestData``/``CachedRequestData``,
``vllm/v1/outputs.py`` ``KVConnectorOutput``, ``vllm/v1/kv_cache_interface.py``
``KVCacheConfig``/``KVCacheGroupSpec`` and the specs, ``vllm/config``'s
``KVTransferConfig``), only the fields the connector reads.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Any, Optional


def link(parent: bytes, tokens: list[int], extra: bytes) -> bytes:
    """kvmesh's chained block hash (kvcore.HashTokens): SHA-256 of the
    parent's length and bytes, the token count and tokens (uint32 LE) and
    the extra bytes (the salt)."""
    h = hashlib.sha256()
    h.update(struct.pack("<I", len(parent)) + parent)
    h.update(struct.pack("<I", len(tokens)) + struct.pack(f"<{len(tokens)}I", *tokens))
    h.update(extra)
    return h.digest()


class Request:
    """vLLM's Request: ids, tokens, computed tokens, block hashes."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], max_tokens: int,
                 hash_block_size: int, salt: bytes, kv_transfer_params: Optional[dict] = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.max_tokens = max_tokens
        self.num_computed_tokens = 0
        self.kv_transfer_params = kv_transfer_params
        self.block_hashes: list[bytes] = []
        self._hbs, self._salt = hash_block_size, salt
        self._extend()

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def append_output(self, token: int) -> None:
        self.output_token_ids.append(token)
        self._extend()

    def _extend(self) -> None:
        toks = self.all_token_ids
        while len(self.block_hashes) < len(toks) // self._hbs:
            i = len(self.block_hashes)
            parent = self.block_hashes[i - 1] if i else b""
            self.block_hashes.append(link(parent, toks[i * self._hbs:(i + 1) * self._hbs], self._salt))


@dataclass
class KVCacheBlocks:
    """vLLM's KVCacheBlocks, reduced to its block ids per group."""

    ids: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.ids


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[Optional[tuple[list[int], ...]]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: Any = None


@dataclass
class KVConnectorOutput:
    finished_sending: Optional[set[str]] = None
    finished_recving: Optional[set[str]] = None
    invalid_block_ids: set[int] = field(default_factory=set)
    kv_connector_worker_meta: Any = None
    failed_recving: set[str] = field(default_factory=set)  # vLLM after 2026-08-22


@dataclass
class MLAAttentionSpec:
    block_size: int
    page_size_bytes: int


@dataclass
class FullAttentionSpec:
    block_size: int
    page_size_bytes: int


@dataclass
class MambaSpec:
    block_size: int
    page_size_bytes: int


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: Any


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec]


@dataclass
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    engine_id: str
    kv_connector_extra_config: dict[str, Any]
    kv_connector_module_path: str = "kvmesh_vllm.connector"


@dataclass
class CacheConfig:
    block_size: int


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


@dataclass
class VllmConfig:
    kv_transfer_config: KVTransferConfig
    cache_config: CacheConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
