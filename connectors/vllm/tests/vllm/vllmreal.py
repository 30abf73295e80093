"""vLLM's own v1 scheduler driving the connector, on CPU.

:class:`VEngine` builds what vLLM's engine core builds for one engine —
vLLM's ``Scheduler`` (or ``AsyncScheduler``), its ``KVCacheManager`` with
prefix caching and chunked prefill, and the KV connector vLLM's
``KVConnectorFactory`` makes from a ``--kv-transfer-config`` (kvmesh alone,
or under vLLM's ``MultiConnector``) — and plays only the model runner: one
worker-side connector per rank, created by the same factory, KV caches laid
out as vLLM lays them out, each step run through vLLM's own
``KVConnectorModelRunnerMixin._get_kv_connector_output`` and the ranks'
outputs merged by vLLM's ``KVOutputAggregator``, then handed back to
``Scheduler.update_from_output``, as vLLM's own connector unit tests do.

The forward pass writes into every block the step completes the KV the
simulator's content function assigns to its chunk (``kvmesh_vllm.content``),
and before any request computes, every block of the prefix it attends over
is checked byte for byte on every rank: a block loaded wrong, or a block
whose load failed and that vLLM was not told to recompute, is a failure.

The module must be imported after ``vllm_cpu_shim`` (conftest.py does).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ParallelConfig, SchedulerConfig, VllmConfig)
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import set_forward_context
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,
                                        MLAAttentionSpec, SlidingWindowSpec)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

from kvmesh_vllm import content

DTYPE = torch.float16
LAYERS_PER_GROUP = 2
init_none_hash(sha256)


class _ModelConfig:
    """The few ModelConfig fields vLLM's scheduler path reads (vLLM's
    ModelConfig needs a model from a hub to build); anything else reads as
    unset."""

    def __init__(self, name: str, max_model_len: int) -> None:
        self.model = self.served_model_name = self.tokenizer = name
        self.max_model_len = max_model_len
        self.dtype = DTYPE
        self.skip_tokenizer_init = True
        self.runner_type = "generate"
        self.hf_config = self.hf_text_config = _HFConfig()
        self.architectures = list(_HFConfig.architectures)
        self.architecture = self.architectures[0]
        self.multimodal_config = None
        self.pooler_config = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("get_"):
            return lambda *a, **k: 0
        return None if name.endswith(("_config", "_size", "_len")) else False


class _HFConfig:
    model_type = "kvmesh-test"
    architectures = ["KVMeshTestForCausalLM"]

    def get_text_config(self) -> "_HFConfig":
        return self

    def __getattr__(self, name: str) -> Any:
        return None


def _layer_spec(grp: dict, page: int) -> Any:
    """One layer's vLLM KV-cache spec with the page size kvmesh's model
    gives the layer (the group's bytes per block over its layers)."""
    bs = grp["block_size"]
    kind = grp["kind"]
    if kind == "mla":
        return MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=page // (bs * 2), dtype=DTYPE)
    if kind == "full_attention":
        return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=page // (bs * 2 * 2), dtype=DTYPE)
    if kind == "sliding_window":
        return SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=page // (bs * 2 * 2), dtype=DTYPE,
                                 sliding_window=int(grp["window"]))
    if kind == "mamba":
        conv = page // 4  # [conv_state, ssm_state]: a quarter and three quarters of the page
        return MambaSpec(block_size=bs, shapes=((4, conv // 8), (8, (page - conv) // 16)), dtypes=(DTYPE, DTYPE),
                         mamba_cache_mode=grp.get("mamba_cache_mode") or "align")
    raise ValueError(f"group kind {kind!r}")


def layer_tensors(spec: Any, num_blocks: int) -> Any:
    """A layer's KV cache as vLLM allocates it on CPU: attention ``(2,
    num_blocks, block_size, heads, head)`` (K and V planes), MLA
    ``(num_blocks, block_size, head)``, Mamba ``[conv, ssm]`` state tensors
    each ``(num_blocks, ...)``."""
    if isinstance(spec, MambaSpec):
        return [torch.zeros((num_blocks, *s), dtype=DTYPE) for s in spec.shapes]
    if isinstance(spec, MLAAttentionSpec):
        return torch.zeros((num_blocks, spec.block_size, spec.head_size), dtype=DTYPE)
    return torch.zeros((2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size), dtype=DTYPE)


def kv_cache_config(model: dict, num_blocks: int) -> KVCacheConfig:
    """vLLM's KVCacheConfig for kvmesh's model spec: two layers per group."""
    groups = []
    for g, grp in enumerate(model["groups"]):
        page = grp["bytes_per_block"] // LAYERS_PER_GROUP
        prefix = "mixer" if grp["kind"] == "mamba" else "attn"
        names = [f"model.layers.{g * LAYERS_PER_GROUP + i}.{prefix}" for i in range(LAYERS_PER_GROUP)]
        spec = _layer_spec(grp, page)
        if spec.page_size_bytes != page:
            raise ValueError(f"group {g}: vLLM's spec pages {spec.page_size_bytes} bytes, want {page}")
        groups.append(KVCacheGroupSpec(names, spec))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def vllm_config(model: dict, kv_transfer: Optional[dict], *, block_size: int, max_model_len: int = 4096,
                max_num_batched_tokens: int = 256, max_num_seqs: int = 16, async_scheduling: bool = False,
                tp: int = 1, num_blocks: int = 64) -> VllmConfig:
    """The VllmConfig vLLM's engine would build (without a hub model)."""
    sched = SchedulerConfig(max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                            max_num_seqs=max_num_seqs, enable_chunked_prefill=True,
                            async_scheduling=async_scheduling, is_encoder_decoder=False)
    # A hybrid model with Mamba layers caches their state in vLLM's "align"
    # mode (prefix caching on): chunks end at block boundaries, so a state
    # at a boundary exists to save and to hit.
    mamba = [g.get("mamba_cache_mode") or "align" for g in model["groups"] if g["kind"] == "mamba"]
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=True,
                        **({"mamba_cache_mode": mamba[0]} if mamba else {}))
    cfg = VllmConfig(scheduler_config=sched, cache_config=cache, device_config=DeviceConfig("cpu"),
                     parallel_config=ParallelConfig(tensor_parallel_size=tp),
                     kv_transfer_config=KVTransferConfig(**kv_transfer) if kv_transfer else None)
    object.__setattr__(cfg, "model_config", _ModelConfig(model["name"], max_model_len))
    cache.num_gpu_blocks = num_blocks
    return cfg


@dataclass
class Stats:
    """What one engine's run measured."""

    requests: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason → count
    prompt_tokens: int = 0
    hit_tokens: int = 0  # tokens computed elsewhere when a request first ran (prefix cache + loads)
    external_tokens: int = 0  # tokens vLLM's scheduler counted as loaded by a connector
    blocks_checked: int = 0
    blocks_mismatched: int = 0
    steps: int = 0
    preemptions: int = 0
    failures: list[str] = field(default_factory=list)
    #: the connectors' counters as vLLM pulled them (get_kv_connector_stats)
    connector: dict[str, int] = field(default_factory=dict)


def _add_counts(into: dict[str, int], data: Any) -> None:
    """Adds a connector stats payload's counters (MultiConnector nests one
    per child) into ``into``."""
    if isinstance(data, dict):
        for k, v in data.items():
            if isinstance(v, bool):
                continue
            if isinstance(v, int):
                into[k] = into.get(k, 0) + v
            else:
                _add_counts(into, v)
    elif data is not None and hasattr(data, "data"):
        _add_counts(into, data.data)


class VEngine:
    """One vLLM engine on CPU: vLLM's scheduler and connectors, this class
    the model runner of every rank."""

    def __init__(self, mesh: dict, eng: dict, kv_transfer: dict, *, num_blocks: int = 64,
                 async_scheduling: bool = False, max_num_batched_tokens: int = 256, max_num_seqs: int = 16,
                 make_worker_rank: Optional[Callable[[int], None]] = None) -> None:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        self.mesh, self.eng = mesh, eng
        self.spec = mesh["model"]
        self.fp = mesh["fingerprint"]
        self.ranks = [w["rank"] for w in eng["gpuworkers"]]
        self.num_blocks = num_blocks
        self.kcc = kv_cache_config(self.spec, num_blocks)
        sbs, hbs, cache_bs = self._block_sizes(kv_transfer, num_blocks)
        self.block_size, self.hash_block_size = sbs, hbs
        self.cfg = vllm_config(self.spec, kv_transfer, block_size=cache_bs,
                               max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                               async_scheduling=async_scheduling, tp=len(self.ranks), num_blocks=num_blocks)
        cls = Scheduler
        if async_scheduling:
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler
            cls = AsyncScheduler
        self.hasher = get_request_block_hasher(hbs, sha256)
        self.workers: list[Any] = []
        self.kv: list[dict[str, Any]] = []
        self.sched = None
        try:
            self.sched = cls(vllm_config=self.cfg, kv_cache_config=self.kcc,
                             structured_output_manager=StructuredOutputManager(self.cfg),
                             block_size=sbs, hash_block_size=hbs, log_stats=True)
            for k in range(len(self.ranks)):
                os.environ["KVMESH_WORKER_RANK"] = str(k)
                conn = KVConnectorFactory.create_connector(self.cfg, KVConnectorRole.WORKER, self.kcc)
                self.workers.append(conn)
                caches = {name: layer_tensors(g.kv_cache_spec, num_blocks)
                          for g in self.kcc.kv_cache_groups for name in g.layer_names}
                conn.register_kv_caches(caches)
                self.kv.append(caches)
        except BaseException:
            self.close()
            raise
        finally:
            os.environ.pop("KVMESH_WORKER_RANK", None)
        self.connector = self.sched.connector
        self.aggregator = KVOutputAggregator(len(self.workers))
        self.stats = Stats()
        self.outputs: dict[str, list[int]] = {}  # request → the tokens it will sample
        self.done: dict[str, Any] = {}  # finished request → its finish reason
        self.checked: set[tuple[str, int]] = set()  # (request, num_computed) whose prefix was checked
        self._pending: deque = deque()  # (scheduler output, model runner output) not yet handed back
        #: Called before each step with the engine (tests break things with it).
        self.before_step: Optional[Callable[["VEngine"], None]] = None
        self.steps_seen: list[Any] = []

    def _block_sizes(self, kv_transfer: Optional[dict], num_blocks: int) -> tuple[int, int, int]:
        """(scheduler block size, hash block size, cache_config.block_size)
        as vLLM resolves them for the model. vLLM's cache block size is the
        scheduler's (the groups' LCM) where vLLM then still hashes every
        hash_block_size tokens (2026-08-22); the 2026-05-27 tree hashes at
        the scheduler's granularity unless a Mamba group's block is the
        cache block, so there the cache block is the Mamba group's."""
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        groups = self.spec["groups"]
        lcm = math.lcm(*(g["block_size"] for g in groups))
        mamba = [g["block_size"] for g in groups if g["kind"] == "mamba"]
        for cache_bs in dict.fromkeys([lcm, *mamba, groups[0]["block_size"]]):
            probe = vllm_config(self.spec, kv_transfer, block_size=cache_bs, tp=len(self.ranks), num_blocks=num_blocks)
            sbs, hbs = resolve_kv_cache_block_sizes(self.kcc, probe)
            if hbs == self.spec["hash_block_size"]:
                return sbs, hbs, cache_bs
        raise ValueError(f"vLLM hashes model {self.spec['name']} every {hbs} tokens, the mesh every "
                         f"{self.spec['hash_block_size']}")

    # ---- requests -------------------------------------------------------

    def add(self, request_id: str, prompt: list[int], outputs: list[int], cache_salt: Optional[str] = None,
            kv_transfer_params: Optional[dict] = None, trace_headers: Optional[dict] = None) -> Request:
        """Adds a request; ``trace_headers`` are the client's trace headers
        as vLLM keeps them with tracing on (``Request.trace_headers``)."""
        sp = SamplingParams(max_tokens=len(outputs), ignore_eos=True,
                            extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None)
        req = Request(request_id=request_id, prompt_token_ids=list(prompt), sampling_params=sp,
                      pooling_params=None, cache_salt=cache_salt, block_hasher=self.hasher,
                      trace_headers=trace_headers)
        if kv_transfer_params:
            req.kv_transfer_params = kv_transfer_params
        self.outputs[request_id] = list(outputs)
        self.sched.add_request(req)
        self.stats.requests += 1
        self.stats.prompt_tokens += len(prompt)
        return req

    def abort(self, *request_ids: str) -> None:
        """vLLM's abort: finish_requests(FINISHED_ABORTED)."""
        self.sched.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)
        for rid in request_ids:
            self.done.setdefault(rid, "abort")

    # ---- the loop ---------------------------------------------------------

    def step(self) -> bool:
        """One engine-core step; False when nothing was scheduled."""
        if self.before_step is not None:
            self.before_step(self)
        so = self.sched.schedule()
        self.stats.steps += 1
        mro = self._execute(so)
        self._pending.append((so, mro))
        depth = 2 if self.cfg.scheduler_config.async_scheduling else 1
        # Async scheduling: vLLM schedules step N+1 before it hands back
        # step N's output (the engine core's batch queue).
        while len(self._pending) >= depth or (self._pending and so.total_num_scheduled_tokens == 0):
            pso, pmro = self._pending.popleft()
            outs = self.sched.update_from_output(pso, pmro)
            self._collect(outs)
        return so.total_num_scheduled_tokens > 0

    def drain(self) -> None:
        while self._pending:
            pso, pmro = self._pending.popleft()
            self._collect(self.sched.update_from_output(pso, pmro))

    def run(self, until: Callable[[], bool], deadline_s: float = 120.0) -> None:
        """Steps until ``until()`` (or fails after the deadline)."""
        end = time.monotonic() + deadline_s
        while not until():
            if not self.step():
                time.sleep(0.005)  # poll interval: waiting on kvmesh (lookups, loads, finishes)
            if time.monotonic() > end:
                self.drain()
                left = {rid: str(r.status) for rid, r in self.sched.requests.items()}
                raise TimeoutError(f"not done within {deadline_s:.0f} s; vLLM still holds {left}")

    def idle(self) -> bool:
        """Every request finished and freed (vLLM holds none)."""
        return not self._pending and not self.sched.requests and not self.sched.has_requests()

    def run_all(self, deadline_s: float = 120.0) -> None:
        self.run(self.idle, deadline_s)

    def _collect(self, outs: Any) -> None:
        for eco in (outs or {}).values():
            cps = getattr(getattr(eco, "scheduler_stats", None), "connector_prefix_cache_stats", None)
            if cps is not None:  # vLLM's own count of tokens a connector supplied
                self.stats.external_tokens += cps.hits + cps.preempted_hits
            _add_counts(self.stats.connector, getattr(getattr(eco, "scheduler_stats", None), "kv_connector_stats", None))
            for o in eco.outputs:
                if o.finish_reason is not None:
                    reason = str(o.finish_reason)
                    self.done[o.request_id] = reason
                    self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

    # ---- the model runner -----------------------------------------------

    def _execute(self, so: Any) -> ModelRunnerOutput:
        """Every rank runs the step: vLLM's connector context around the
        forward pass; the ranks' outputs merged as vLLM merges them."""
        self._check_prefixes(so)
        outputs = []
        for k, conn in enumerate(self.workers):
            kv_transfer_state._KV_CONNECTOR_AGENT = conn
            try:
                # GPUModelRunner.execute_model, before it updates its batch.
                conn.handle_preemptions(so.kv_connector_metadata)
                with set_forward_context(None, self.cfg):
                    if so.total_num_scheduled_tokens == 0:
                        out = KVConnectorModelRunnerMixin.kv_connector_no_forward(so, self.cfg)
                        outputs.append(out)
                        continue
                    with KVConnectorModelRunnerMixin._get_kv_connector_output(so) as kvo:
                        self._forward(k, so)
                outputs.append(self._runner_output(so, kvo))
            finally:
                kv_transfer_state._KV_CONNECTOR_AGENT = None
        return self.aggregator.aggregate(outputs)

    def _runner_output(self, so: Any, kvo: Any) -> ModelRunnerOutput:
        ids = sorted(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.sched.requests[rid]
            if req.num_computed_tokens >= req.num_tokens:  # schedule() counted the step's tokens
                outs = self.outputs[rid]
                sampled.append([outs[min(len(req.output_token_ids), len(outs) - 1)]])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled, kv_connector_output=kvo)

    def block_ids(self, rid: str) -> tuple[list[int], ...]:
        return self.sched.kv_cache_manager.get_block_ids(rid)

    def _forward(self, rank: int, so: Any) -> None:
        """The forward pass of one rank: the KV of every block a scheduled
        request completes, as the simulator's content function gives it."""
        for rid, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            # vLLM's schedule() already counted the step's tokens computed.
            end = req.num_computed_tokens
            start = end - n
            table = self.block_ids(rid)
            for g, grp in enumerate(self.spec["groups"]):
                bs = grp["block_size"]
                for p in range(start // bs, end // bs):
                    if (p + 1) * bs <= start or p >= len(table[g]) or table[g][p] == 0:
                        continue
                    h = self._hash(req, g, p)
                    if h is not None:
                        self.write_block(rank, g, table[g][p], h)

    def _hash(self, req: Request, g: int, p: int) -> Optional[str]:
        bs = self.spec["groups"][g]["block_size"]
        i = (p + 1) * bs // self.hash_block_size - 1
        return req.block_hashes[i].hex() if i < len(req.block_hashes) else None

    def _check_prefixes(self, so: Any) -> None:
        """Before a request computes for the first time in an allocation,
        every block of the prefix it attends over (loaded by a connector or
        hit in the prefix cache) holds its chunk's KV, on every rank."""
        firsts = [(nr.req_id, nr.num_computed_tokens) for nr in so.scheduled_new_reqs]
        cr = so.scheduled_cached_reqs
        resumed = set(getattr(cr, "resumed_req_ids", None) or ())
        flags = getattr(cr, "resumed_from_preemption", None)
        for i, rid in enumerate(cr.req_ids):
            if rid in resumed or (flags is not None and flags[i]):
                firsts.append((rid, cr.num_computed_tokens[i]))
        for rid, computed in firsts:
            if (rid, computed) in self.checked:
                continue
            self.checked.add((rid, computed))
            req = self.sched.requests[rid]
            self.stats.hit_tokens += computed
            table = self.block_ids(rid)
            for g, grp in enumerate(self.spec["groups"]):
                bs = grp["block_size"]
                last = computed // bs  # blocks [0, last) are whole and attended over
                for p in range(last):
                    if p >= len(table[g]) or table[g][p] == 0:
                        continue  # a null block: this group does not need the position (Mamba, window)
                    h = self._hash(req, g, p)
                    for rank in range(len(self.workers)):
                        self.stats.blocks_checked += 1
                        if not self.check_block(rank, g, table[g][p], h):
                            self.stats.blocks_mismatched += 1
                            self.stats.failures.append(
                                f"{rid}: group {g} block {table[g][p]} (position {p}) on rank {rank} "
                                f"does not hold its chunk's KV at its first step (computed {computed})")

    # ---- content ----------------------------------------------------------

    def _regions(self, rank: int, group: int, block: int) -> list[np.ndarray]:
        out = []
        for name in self.kcc.kv_cache_groups[group].layer_names:
            layer = self.kv[rank][name]
            for t in layer if isinstance(layer, list) else [layer]:
                planes = [t[block]] if t.shape[0] == self.num_blocks else [t[0][block], t[1][block]]
                out.extend(p.reshape(-1).view(torch.uint8).numpy() for p in planes)
        return out

    def write_block(self, rank: int, group: int, block: int, hash_hex: str) -> None:
        sr = content.store_rank(self.spec, group, self.ranks[rank])
        content.fill_regions(self._regions(rank, group, block), self.fp, group, sr, hash_hex)

    def check_block(self, rank: int, group: int, block: int, hash_hex: Optional[str]) -> bool:
        if hash_hex is None:
            return False
        sr = content.store_rank(self.spec, group, self.ranks[rank])
        want = content.block_content(self.fp, group, sr, hash_hex, self.spec["groups"][group]["bytes_per_block"])
        return bool(np.array_equal(np.concatenate(self._regions(rank, group, block)), want))

    def connector_counts(self) -> dict[str, int]:
        """Every connector counter so far: those vLLM pulled with each
        step's stats, plus what it has not pulled yet."""
        rest = self.connector.get_kv_connector_stats() if self.connector is not None else None
        _add_counts(self.stats.connector, rest)
        return self.stats.connector

    def close(self) -> None:
        if self.sched is not None:
            self.sched.shutdown()
        for w in self.workers:
            w.shutdown()
