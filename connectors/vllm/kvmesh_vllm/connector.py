"""``KVMeshConnector``: the class vLLM loads.

Pass it to ``vllm serve`` with::

    --kv-transfer-config '{"kv_connector": "KVMeshConnector",
                           "kv_connector_module_path": "kvmesh_vllm.connector",
                           "kv_role": "kv_both", "engine_id": "decode-0",
                           "kv_connector_extra_config": {"kvmesh.model": "...", ...}}'

(the README lists every setting). vLLM builds one instance in its scheduler
process (role SCHEDULER) and one in each worker (role WORKER); each
delegates to :class:`~kvmesh_vllm.scheduler.SchedulerSide` or
:class:`~kvmesh_vllm.worker.WorkerSide`. The method names and signatures
are vLLM's ``KVConnectorBase_V1`` (``vllm/distributed/kv_transfer/
kv_connector/v1/base.py``), with ``SupportsHMA``'s
``request_finished_all_groups`` for hybrid models.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from . import config as cfg
from . import contract as c
from . import transport
from ._vllm import (HAVE_VLLM, Capabilities, KVConnectorBase_V1, KVConnectorRole, KVConnectorTransferResults, SupportsHMA,
                    block_sizes, capabilities)
from .errors import KVMeshConfigError, MeshUnreachableError, UnsupportedLayoutError
from .metadata import KVMeshConnectorMetadata
from .model import KIND_FULL, KIND_MAMBA, KIND_MLA, KIND_SLIDING_WINDOW, Group, ModelSpec
from .scheduler import SchedulerSide
from .stats import COUNTERS, ConnectorStats
from .worker import WorkerSide

log = logging.getLogger(__name__)

#: The longest shutdown waits for the last step records to be acknowledged.
SHUTDOWN_FLUSH_S = 5.0


#: vLLM's KV-cache specs kvmesh stores (vllm/v1/kv_cache_interface.py),
#: by exact class: other attention types (chunked local, cross, sinks,
#: encoder-only) have other hit and save rules and are refused.
SPEC_KINDS = {
    "FullAttentionSpec": KIND_FULL,
    "MLAAttentionSpec": KIND_MLA,
    "SlidingWindowSpec": KIND_SLIDING_WINDOW,
    "MambaSpec": KIND_MAMBA,
}


def model_from_kv_cache_config(name: str, kv_cache_config: Any, hash_block_size: int) -> ModelSpec:
    """vLLM's KV-cache groups as kvmesh's model spec. A group's bytes per
    block are its layers' together: vLLM's ``page_size_bytes`` is one
    layer's page, and every layer of a group holds one."""
    groups = []
    for i, g in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        spec = g.kv_cache_spec
        kind_name = type(spec).__name__
        kind = SPEC_KINDS.get(kind_name)
        if kind is None:
            raise UnsupportedLayoutError(
                f"KV-cache group {i}: spec {kind_name} is not one kvmesh stores (supported: {', '.join(sorted(SPEC_KINDS))})")
        layers = max(len(getattr(g, "layer_names", None) or ()), 1)
        groups.append(Group(kind, int(spec.block_size), int(spec.page_size_bytes) * layers,
                            int(getattr(spec, "sliding_window", 0) or 0)))
    if not groups:
        raise UnsupportedLayoutError("vLLM's KVCacheConfig has no KV-cache groups")
    return ModelSpec(name=name, hash_block_size=hash_block_size, groups=tuple(groups))


def _parallel(vllm_config: Any) -> tuple[int, int, int]:
    """(tp size, pp size, this worker's rank index tp + tp_size·pp)."""
    pc = getattr(vllm_config, "parallel_config", None)
    tp = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        if int(getattr(pc, name, 1) or 1) > 1:
            raise UnsupportedLayoutError(f"{name} {getattr(pc, name)}: context parallelism is not supported by this connector")
    if HAVE_VLLM:  # pragma: no cover - inside vLLM
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        try:
            return tp, pp, get_tensor_model_parallel_rank() + tp * get_pp_group().rank_in_group
        except (AssertionError, AttributeError):
            pass  # the scheduler process has no parallel state
    return tp, pp, int(os.environ.get("KVMESH_WORKER_RANK", "0"))


class KVMeshConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector for kvmesh."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
        self.settings = cfg.load(extra, engine_id=str(getattr(ktc, "engine_id", "") or ""),
                                 role=str(getattr(ktc, "kv_role", "kv_both") or "kv_both"),
                                 served_model=cfg.served_model_name(vllm_config))
        if kv_cache_config is None:
            raise KVMeshConfigError("vLLM passed no KVCacheConfig: this connector needs vLLM ≥ 0.11 (the three-argument constructor)")
        self.model = model_from_kv_cache_config(self.settings.model, kv_cache_config,
                                                block_sizes(kv_cache_config, vllm_config)[1])
        # What this vLLM's scheduler accepts (read from its source): the
        # scheduler side's concern only, so workers skip it.
        self.capabilities: Optional[Capabilities] = None
        self.model.validate()
        tp, pp, rank_index = _parallel(vllm_config)
        self.stats = ConnectorStats()
        self._scheduler: Optional[SchedulerSide] = None
        self._worker: Optional[WorkerSide] = None
        tls = dict(ca_file=self.settings.ca_file, cert_file=self.settings.cert_file, key_file=self.settings.key_file)
        if role == KVConnectorRole.SCHEDULER:
            lookup = transport.HTTPClient(self.settings.lookup_url, token=self.settings.token,
                                          timeout=self.settings.lookup_timeout_s,
                                          retry_deadline=self.settings.lookup_deadline_s, **tls)
            self._producer = transport.StepProducer(
                {**self.settings.kafka, "message.timeout.ms": int(self.settings.publish_timeout_s * 1000)},
                topic=c.TOPIC_ENGINE_STEPS)
            self._reach(lambda: transport.HTTPClient(self.settings.lookup_url, timeout=self.settings.lookup_timeout_s,
                                                     retry_deadline=self.settings.start_deadline_s, **tls).request("GET", "/healthz"),
                        f"the lookup service at {self.settings.lookup_url}")
            self._reach(lambda: self._producer.check(timeout=self.settings.start_deadline_s), "Kafka")
            self.capabilities = capabilities()
            loads = self.capabilities.external_mamba_hits or all(g.kind != KIND_MAMBA for g in self.model.groups)
            if not loads:
                log.warning("this vLLM's scheduler refuses a connector's tokens for Mamba layers (its aligned "
                            "split asserts none): kvmesh saves this model's KV but loads none")
            self._scheduler = SchedulerSide(self.settings, self.model, lookup, self._publish, self.stats,
                                            poll=self._producer.poll, pipeline_stages=pp, loads=loads)
        else:
            if rank_index >= tp * pp:
                raise UnsupportedLayoutError(f"worker rank {rank_index} outside TP {tp} × PP {pp}")
            if len(self.settings.gpuworker_urls) != tp * pp:
                raise KVMeshConfigError(
                    f"kvmesh.gpuworker_urls lists {len(self.settings.gpuworker_urls)} gpuworkers; vLLM runs "
                    f"TP {tp} × PP {pp} = {tp * pp} ranks, each needs its own (in rank order: tp + {tp}·pp)")
            client = transport.HTTPClient(self.settings.gpuworker_url(rank_index), token=self.settings.token,
                                          retry_deadline=self.settings.start_deadline_s, **tls)
            feedback = transport.TopicConsumer(self.settings.kafka, c.TOPIC_ENGINE_FEEDBACK, key=self.settings.engine_id)
            self._reach(lambda: feedback.start(timeout=self.settings.start_deadline_s), "Kafka")
            layer_groups = {name: i for i, g in enumerate(kv_cache_config.kv_cache_groups) for name in g.layer_names}
            self._worker = WorkerSide(self.settings, self.model, rank_index, int(kv_cache_config.num_blocks),
                                      layer_groups, client, feedback, self.stats,
                                      rank={"tp": rank_index % tp, "pcp": 0, "dcp": 0, "pp": rank_index // tp})

    @staticmethod
    def _reach(call: Any, what: str) -> None:
        """Runs a start-up check; an unreachable part is a clear error now,
        not a failing cache path later."""
        try:
            call()
        except transport.TransportError as e:
            raise MeshUnreachableError(f"{what} is unreachable: {e}") from e

    def _publish(self, value: bytes, done: Any) -> None:
        self._producer.publish_async(self.settings.engine_id, value, done)

    # ---- scheduler side ------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """Tokens kvmesh can supply beyond ``num_computed_tokens`` (``None``: not yet)."""
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Records the request's allocation."""
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVMeshConnectorMetadata:
        """The step's metadata for the workers."""
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' output of a step."""
        self._sched().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Optional[dict[str, Any]]]:
        """A finished request: free its blocks after kvmesh's ``finished_sending``."""
        return self._sched().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, Optional[dict[str, Any]]]:
        """``request_finished`` of a hybrid model (every group's blocks)."""
        return self._sched().request_finished(request, block_ids)

    def last_decision(self, request_id: str) -> Optional[c.Decision]:
        """The lookup decision kvmesh answered for the request (for stats and tests)."""
        return self._sched().last_decision(request_id)

    def take_events(self) -> tuple:
        """kvmesh publishes its KV events itself (``kvmesh.kv.events``)."""
        return ()

    @property
    def requires_kv_delivery(self) -> bool:
        """A dropped save is a future miss, never wrong bytes: best effort."""
        return False

    # ---- worker side ---------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Registers the engine's KV memory with this rank's gpuworker."""
        self._work().register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """The step's metadata, at the start of the worker's step, before
        vLLM updates its batch (every vLLM since 2026-02): the blocks the
        step writes — those of requests preempted in this step's schedule()
        and handed to others included — stop holding their identity now.
        Nothing needs flushing: the sender's reads of a preempted request's
        blocks are checked against those records (block_not_held), never
        stored from overwritten bytes."""
        if self._worker is not None and isinstance(kv_connector_metadata, KVMeshConnectorMetadata):
            self._worker.begin_step(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """The step's metadata, before the forward pass: on a worker, the
        blocks the pass writes stop holding their old identity now, if
        handle_preemptions did not already (newer vLLM calls start_load_kv
        only after launching the pass)."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVMeshConnectorMetadata):
            self._worker.begin_step(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """kvmesh's gpuworkers load before a request is scheduled: nothing
        to start (the step began in bind_connector_metadata)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads land before a request is scheduled: nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """kvmesh's sender reads the registered memory itself: nothing to copy."""

    def wait_for_save(self) -> None:
        """After the forward pass: records the written blocks' identities."""
        self._work().wait_for_save()

    def build_connector_worker_meta(self) -> Any:
        """The steps whose identities this worker recorded."""
        return self._work().build_connector_worker_meta()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """Requests whose saves and loads kvmesh finished."""
        return self._work().get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Newer vLLM (after 2026-08-22) calls this instead of get_finished:
        the same finished requests, plus the hybrid model's failed loads as
        ``failed_recving`` (each also in ``finished_recving``), which vLLM
        recomputes or fails per its kv_load_failure_policy."""
        sending, recving, failed = self._work().transfer_results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose kvmesh load failed (a model of one KV-cache group;
        always empty for a hybrid one): vLLM recomputes from the first of
        them or fails the request, per its kv_load_failure_policy."""
        return self._work().get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> Optional["KVMeshConnectorStats"]:
        """The counters since the last call (None when all are zero)."""
        taken = self.stats.take()
        return None if taken.is_empty() else KVMeshConnectorStats(data=taken.data)

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> "KVMeshConnectorStats":
        """The stats object vLLM aggregates across workers."""
        return KVMeshConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: Any,
                           per_engine_labelvalues: Any) -> Any:
        """Prometheus counters ``vllm:kvmesh_<counter>`` (inside vLLM only)."""
        if not HAVE_VLLM:
            return None
        return _prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)  # pragma: no cover

    def shutdown(self) -> None:
        """Stops the connector's threads and clients. The last step records
        get at most SHUTDOWN_FLUSH_S (or kvmesh.publish_timeout_s, if
        shorter) to reach the brokers, so that a Kafka outage never holds
        vLLM's shutdown for long; records left are counted as publish
        failures (their requests fail closed in the mesh)."""
        if self._scheduler is not None:
            self._scheduler.shutdown()
            left = self._producer.flush(min(SHUTDOWN_FLUSH_S, self.settings.publish_timeout_s))
            if left:
                self.stats.add("publish_failures", left)
                log.warning("%d kvmesh step records not published at shutdown (Kafka unreachable?)", left)
            self._producer.close(timeout=0)
        if self._worker is not None:
            self._worker.shutdown()

    def reset_cache(self) -> Optional[bool]:
        """vLLM's reset_prefix_cache(reset_connector=True): forgets the
        lookup answers held for requests not yet allocated, so each is asked
        again (the store may have changed). The store pool itself is shared
        by every engine and is not this engine's to clear (operators use
        the admin API)."""
        if self._scheduler is None:
            return None
        self._scheduler.reset_lookups()
        return True

    def _sched(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side method called on the worker's connector"
        return self._scheduler

    def _work(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side method called on the scheduler's connector"
        return self._worker


if HAVE_VLLM:  # pragma: no cover - inside vLLM
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

    class KVMeshConnectorStats(KVConnectorStats):  # type: ignore[misc]
        """vLLM's connector stats holding kvmesh's counters."""

        def reset(self) -> None:
            self.data = {}

        def aggregate(self, other: Any) -> "KVMeshConnectorStats":
            for k, v in other.data.items():
                self.data[k] = self.data.get(k, 0) + v
            return self

        def reduce(self) -> dict[str, int]:
            return dict(sorted(self.data.items()))

        def is_empty(self) -> bool:
            return not any(self.data.values())

    class KVMeshPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
        """One counter family per kvmesh counter."""

        def __init__(self, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            # vLLM's base keeps the Counter class of its multiprocess-safe
            # metric types as _counter_cls (metrics.py).
            self._counters = {
                name: self.make_per_engine(self._counter_cls(name=f"vllm:kvmesh_{name}", documentation=doc, labelnames=labelnames))
                for name, doc in COUNTERS.items()
            }

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            for name, v in transfer_stats_data.items():
                if name in self._counters and v:
                    self._counters[name][engine_idx].inc(v)

    def _prom_metrics(*args: Any) -> Any:
        return KVMeshPromMetrics(*args)
else:
    class KVMeshConnectorStats(ConnectorStats):  # type: ignore[no-redef]
        """kvmesh's counters in vLLM's connector-stats shape."""

        def __init__(self, data: Optional[dict[str, Any]] = None) -> None:
            super().__init__(data)

    def _prom_metrics(*args: Any) -> Any:
        return None
