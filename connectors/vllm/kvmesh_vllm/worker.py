"""The worker side of the connector: KV memory, identities, finished reports.

vLLM calls these methods in every worker process (``KVConnectorRole.
WORKER``), one per rank. The rank's gpuworker moves the KV bytes itself —
loads write straight into the engine's KV memory, the sender's puts read
straight from it — so this side never copies a block. It:

- registers the engine's KV memory with its rank's gpuworker
  (``register_kv_caches``): CPU tensors are moved, in place, into a shared
  segment the gpuworker maps (``kvmem.Segment``); CUDA tensors are shared
  with CUDA IPC handles, the identity records staying in a small segment;
- keeps every block's identity record true (kvmesh's fail-closed rule):
  before the forward pass the records of the blocks the step writes go odd
  (no reader may take them), after it (``wait_for_save``) each records the
  chunk hash the block now holds;
- reports what kvmesh finished (``get_finished``, or ``get_transfer_results``
  where vLLM has it) and what failed to load, read from the engine's
  feedback topic, with time limits so that no request waits forever: for a
  model of one KV-cache group the blocks (``get_block_ids_with_load_errors``:
  vLLM recomputes from the first failed block or fails the request, per its
  ``kv_load_failure_policy``); for a hybrid model the requests, because
  vLLM's block-level path cannot name a block of one group among several
  (it raises ValueError up to 2026-08-22, RuntimeError after). Newer vLLM
  (``get_transfer_results``) takes them as ``failed_recving`` and applies
  its policy; older vLLM gets them in ``KVMeshWorkerMetadata.failed_loads``
  and the scheduler side sends the request back to its local prefix, so
  that vLLM recomputes the rest. A failed load is reported one way only:
  ``get_transfer_results`` takes it before the worker metadata is built.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from . import contract as c
from . import kvmem
from .errors import KVMeshError, MeshUnreachableError, ModelMismatchError, UnsupportedLayoutError
from .metadata import BlockWrite, KVMeshConnectorMetadata, KVMeshWorkerMetadata
from .model import ModelSpec, check_same_layout
from .stats import ConnectorStats

log = logging.getLogger(__name__)


@dataclass
class _Load:
    """A kvmesh load into this engine's blocks, until it is reported."""

    blocks: tuple[tuple[int, int], ...]
    deadline: float


@dataclass(frozen=True)
class LayerRegions:
    """How one layer's KV tensor maps onto blocks: its group, the byte
    size of each of its regions of one block, and whether its first
    dimension is K/V (vLLM's ``(2, num_blocks, ...)`` layout)."""

    group: int
    regions: tuple[int, ...]
    kv_first: bool


def layer_regions(name: str, tensor: Any, group: int, num_blocks: int) -> LayerRegions:
    """The regions of one layer's KV tensor; refuses layouts kvmesh cannot
    address block by block."""
    shape = tuple(tensor.shape)
    if not tensor.is_contiguous():
        raise UnsupportedLayoutError(f"KV cache of layer {name}: not contiguous (shape {shape}, stride {tuple(tensor.stride())})")
    per_elem = tensor.element_size()
    if len(shape) >= 2 and shape[0] == num_blocks:
        return LayerRegions(group, (tensor[0].numel() * per_elem,), False)
    if len(shape) >= 3 and shape[0] == 2 and shape[1] == num_blocks:
        size = tensor[0][0].numel() * per_elem
        return LayerRegions(group, (size, size), True)
    raise UnsupportedLayoutError(
        f"KV cache of layer {name}: shape {shape} has no block dimension of {num_blocks} first "
        "(want (num_blocks, ...) or (2, num_blocks, ...))"
    )


def shared_groups(layers: list[list[tuple[Any, "LayerRegions"]]]) -> dict[int, set[int]]:
    """For each group, the other groups whose tensors share its memory.

    vLLM's hybrid allocator may give layers of different groups one
    buffer (a block id names the same bytes in each; one group uses it at
    a time). A write of block b in one group then changes block b of the
    others, so their identity records must be cleared with it."""
    spans = []
    for g, group in enumerate(layers):
        for t, _ in group:
            start = t.data_ptr()
            spans.append((start, start + t.numel() * t.element_size(), g))
    spans.sort()
    out: dict[int, set[int]] = {}
    for i, (s1, e1, g1) in enumerate(spans):
        for s2, e2, g2 in spans[i + 1:]:
            if s2 >= e1:
                break
            if g1 != g2:
                out.setdefault(g1, set()).add(g2)
                out.setdefault(g2, set()).add(g1)
    return out


class WorkerSide:
    """The worker-side half of :class:`~kvmesh_vllm.connector.KVMeshConnector`."""

    def __init__(self, settings: Any, model: ModelSpec, rank_index: int, num_blocks: int,
                 layer_groups: dict[str, int], worker_client: Any,
                 feedback: Optional[Any], stats: ConnectorStats, rank: Optional[dict[str, int]] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._s = settings
        self._model = model
        self._rank = rank_index
        self._rank_of = rank or {"tp": rank_index, "pcp": 0, "dcp": 0, "pp": 0}
        self._num_blocks = num_blocks
        self._layer_groups = layer_groups
        self._client = worker_client
        self._feedback = feedback
        self._stats = stats
        self._clock = clock
        self._segment: Optional[kvmem.Segment] = None
        self._cuda = False
        self._gen = time.time_ns()
        self._open: list[tuple[BlockWrite, int]] = []
        self._begun: Optional[KVMeshConnectorMetadata] = None  # the step begin_step last took
        self._steps_done: set[int] = set()
        self._step = 0
        self._loads: dict[str, _Load] = {}
        self._sent: set[str] = set()  # finished_sending from kvmesh, not yet reported
        self._finished: set[str] = set()  # named finished by vLLM, with a delayed free pending
        self._delayed: dict[str, float] = {}  # delayed frees → when to stop waiting for kvmesh
        self._recved: set[str] = set()
        self._load_errors: set[int] = set()
        # Hybrid models: failed loads are reported by request (metadata.py).
        self._by_request = len(model.groups) > 1
        self._failed_loads: set[str] = set()
        self._bad_seen = 0
        self._aliases: dict[int, set[int]] = {}

    # ---- KV memory ------------------------------------------------------

    @property
    def segment(self) -> Optional[kvmem.Segment]:
        """The shared segment registered with the gpuworker, once registered."""
        return self._segment

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Registers the engine's KV memory with this rank's gpuworker.

        Raises a :class:`~kvmesh_vllm.errors.KVMeshError` naming the problem
        when the layout does not match the mesh's model or the gpuworker
        cannot map the memory — at engine start, never later."""
        try:
            kvmem.require_store_order()
        except kvmem.UnsupportedPlatformError as e:
            raise UnsupportedLayoutError(f"this connector's identity records need x86-64's store order: {e}") from e
        layers = self._layers(kv_caches)
        layout = kvmem.Layout([
            kvmem.GroupLayout(self._num_blocks, [r for _, lr in group for r in lr.regions])
            for group in layers
        ])
        for g, gl in enumerate(layout.groups):
            if gl.block_bytes != self._model.groups[g].bytes_per_block:
                raise ModelMismatchError(
                    f"group {g}: vLLM's KV cache holds {gl.block_bytes} bytes per block, "
                    f"the mesh's model {self._model.name!r} {self._model.groups[g].bytes_per_block}"
                )
        tensors = [t for group in layers for t, _ in group]
        self._cuda = any(getattr(t, "is_cuda", False) for t in tensors)
        if self._aliases and not self._cuda:
            raise UnsupportedLayoutError(
                f"KV-cache groups {sorted(self._aliases)} share memory: CPU KV caches are moved into a shared "
                "segment group by group, which would split that memory; share it only on GPUs (CUDA IPC)")
        path = os.path.join(kvmem.shm_dir(), f"kvmesh-{_safe(self._s.engine_id)}-r{self._rank}-{os.getpid()}.kvmem")
        self._segment = kvmem.Segment.create(path, layout)
        try:
            if self._cuda:
                body = kvmem.cuda_ipc_registration(self._segment, self._region_tensors(layers))
            else:
                self._rehome(layers)
                body = kvmem.shm_registration(self._segment)
            self._register(body)
        except BaseException:
            self._segment.remove()
            self._segment = None
            raise

    def _layers(self, kv_caches: dict[str, Any]) -> list[list[tuple[Any, LayerRegions]]]:
        """The layers' tensors per group, in vLLM's layer order; a layer
        with several state tensors (vLLM's Mamba ``[conv_state, ssm_state]``)
        contributes each, in order."""
        groups: list[list[tuple[Any, LayerRegions]]] = [[] for _ in self._model.groups]
        for name, t in kv_caches.items():
            if name not in self._layer_groups:
                raise UnsupportedLayoutError(f"KV cache of layer {name}: in no KV-cache group of vLLM's KVCacheConfig")
            g = self._layer_groups[name]
            parts = list(t) if isinstance(t, (list, tuple)) else [t]
            for i, part in enumerate(parts):
                where = f"{name}[{i}]" if len(parts) > 1 else name
                groups[g].append((part, layer_regions(where, part, g, self._num_blocks)))
        for g, ls in enumerate(groups):
            if not ls:
                raise ModelMismatchError(f"group {g}: vLLM registered no KV cache tensor for it")
        self._aliases = shared_groups(groups)
        return groups

    def _rehome(self, layers: list[list[tuple[Any, LayerRegions]]]) -> None:
        """Moves every CPU tensor into the segment, in place (``set_``), so
        that the model's attention layers keep writing the same tensor
        objects, now in memory the gpuworker maps."""
        import torch

        assert self._segment is not None
        base = torch.from_numpy(self._segment.buffer)
        offsets = self._segment.layout.offsets()
        for g, group in enumerate(layers):
            r = 0
            for t, lr in group:
                el = t.element_size()
                typed = base.view(t.dtype)
                first = offsets.data[g][r] // el
                stride = list(t.stride())  # contiguous: block-major, as each region array
                if lr.kv_first:
                    stride[0] = offsets.data[g][r + 1] // el - first  # K plane → V plane
                view = typed.as_strided(tuple(t.shape), tuple(stride), first)
                view.copy_(t)
                t.set_(view.storage(), view.storage_offset(), view.size(), view.stride())
                r += len(lr.regions)

    def _region_tensors(self, layers: list[list[tuple[Any, LayerRegions]]]) -> list[list[Any]]:
        """Per group, per region, the CUDA tensor holding it (for IPC handles)."""
        out: list[list[Any]] = []
        for group in layers:
            regions: list[Any] = []
            for t, lr in group:
                regions.extend([t[0], t[1]] if lr.kv_first else [t])
            out.append(regions)
        return out

    def _register(self, body: dict[str, Any]) -> None:
        """Checks the gpuworker's pool against the engine, then registers
        the memory."""
        from . import transport

        url = getattr(self._client, "base_url", "?")
        try:
            _, _, pool = self._client.request("GET", "/v1/pool")
            self._check_pool(url, pool)
            self._client.request("POST", "/v1/kv-memory", json_body=body)
        except transport.UnreachableError as e:
            raise MeshUnreachableError(f"gpuworker {url} of rank {self._rank} is unreachable: {e}") from e
        except transport.ProblemError as e:
            raise KVMeshError(f"gpuworker {url} refused the KV memory of rank {self._rank}: {e}") from e

    def _check_pool(self, url: str, pool: dict[str, Any]) -> None:
        """Refuses a gpuworker of another model, engine, rank or layout."""
        if pool.get("model") and pool["model"] != self._s.model:
            raise ModelMismatchError(f"gpuworker {url} serves model {pool['model']!r}, the connector's is {self._s.model!r}")
        if pool.get("engine_id") and pool["engine_id"] != self._s.engine_id:
            raise KVMeshError(f"gpuworker {url} serves engine {pool['engine_id']!r}, this engine is {self._s.engine_id!r}")
        served = {k: int((pool.get("rank") or {}).get(k, 0)) for k in ("tp", "pcp", "dcp", "pp")}
        if served != self._rank_of:
            raise UnsupportedLayoutError(
                f"gpuworker {url} serves rank {served}, this worker is rank {self._rank_of}: "
                "list kvmesh.gpuworker_urls in rank order (tp + tp_size·pp)")
        check_same_layout(self._model, pool.get("groups") or [], f"gpuworker {url}")

    # ---- the forward pass -------------------------------------------------

    def begin_step(self, meta: KVMeshConnectorMetadata) -> None:
        """Before the forward pass, at the first of vLLM's handle_preemptions
        and bind_connector_metadata (both come before it in every version;
        newer ones start connector loads only after launching the pass):
        the blocks it writes hold nothing from now on, and the step's loads
        and delayed frees are noted. Once per step: a second call with the
        same metadata does nothing."""
        if meta is self._begun:
            return
        self._begun = meta
        now = self._clock()
        for ld in meta.loads:
            self._loads[ld.request_id] = _Load(ld.blocks, now + self._s.load_timeout_s)
        for rid in meta.delayed_frees:
            self._delayed[rid] = now + self._s.finish_timeout_s
        self._step = meta.step
        if self._segment is None:
            return  # no memory registered yet
        for w in meta.writes:
            for other in self._aliases.get(w.group, ()):
                self._clear(other, w.block)  # the same bytes, under another group
            try:
                seq = self._segment.record(w.group, w.block).begin(kvmem.WRITER_ENGINE)
            except kvmem.BusyError:
                self._stats.add("blocks_busy")  # a load is writing it: never recorded
                continue
            self._open.append((w, seq))

    def _clear(self, group: int, block: int) -> None:
        """Clears a block's identity record (it holds nothing now)."""
        assert self._segment is not None
        rec = self._segment.record(group, block)
        try:
            rec.abort(rec.begin(kvmem.WRITER_ENGINE))
        except kvmem.BusyError:
            pass  # being written: that writer's commit decides

    def wait_for_save(self) -> None:
        """After the forward pass: each written block records its chunk."""
        if self._cuda:
            import torch

            torch.cuda.current_stream().synchronize()
        if self._segment is not None:
            now = time.time_ns()
            for w, seq in self._open:
                rec = self._segment.record(w.group, w.block)
                if not w.hash_hex:
                    rec.abort(seq)  # its chunk is not complete: it holds nothing
                    continue
                self._gen += 1
                try:
                    rec.commit(seq, w.hash_hex, w.request_id, self._gen, now, kvmem.WRITER_ENGINE)
                    self._stats.add("blocks_recorded")
                except kvmem.KVMemError as e:
                    log.warning("block (%d, %d) of %s not recorded: %s", w.group, w.block, w.request_id, e)
        self._open = []
        self._steps_done.add(self._step)

    def build_connector_worker_meta(self) -> Optional[KVMeshWorkerMetadata]:
        """The steps whose identities are recorded and the requests whose
        load failed, for the scheduler side."""
        if not self._steps_done and not self._failed_loads:
            return None
        out = KVMeshWorkerMetadata(self._steps_done, self._failed_loads)
        self._steps_done, self._failed_loads = set(), set()
        return out

    # ---- what kvmesh finished ---------------------------------------------

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """Newer vLLM's one snapshot per step (get_transfer_results): the
        requests :meth:`get_finished` reports sending and recving, and of
        the latter those whose load failed on a hybrid model (by request:
        vLLM fails or recomputes them per its kv_load_failure_policy). The
        failures are taken here, so the step's worker metadata no longer
        carries them."""
        sending, recving = self.get_finished(finished_req_ids)
        recving = set(recving or ())
        failed = self._failed_loads & recving
        self._failed_loads -= failed
        return set(sending or ()), recving, failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """Requests whose saves (sending) and loads (recving) kvmesh finished.

        Only requests whose free request_finished delayed (the metadata's
        delayed_frees) are ever reported sending, once vLLM has named them
        finished here: vLLM frees every other request itself."""
        now = self._clock()
        self._finished.update(rid for rid in finished_req_ids if rid in self._delayed)
        self._drain_feedback()
        sending = set()
        for rid, deadline in list(self._delayed.items()):
            if rid not in self._finished:
                continue
            if rid in self._sent:
                sending.add(rid)
            elif now >= deadline:
                self._stats.add("finish_timeouts")
                log.warning("request %s: no finished_sending from kvmesh within %.0f s; freeing its blocks", rid, self._s.finish_timeout_s)
                sending.add(rid)
        for rid in sending:
            del self._delayed[rid]
            self._sent.discard(rid)
            self._finished.discard(rid)
        for rid, ld in list(self._loads.items()):
            if now >= ld.deadline:
                self._stats.add("load_timeouts")
                log.warning("request %s: its kvmesh load did not finish within %.0f s; recomputing it", rid, self._s.load_timeout_s)
                self._fail_load(rid)
        recving, self._recved = self._recved, set()
        if sending:
            self._stats.add("finished_sending", len(sending))
        return sending or None, recving or None

    def _drain_feedback(self) -> None:
        if self._feedback is None:
            return
        for v in self._feedback.drain():
            try:
                msgs = c.Feedback.messages(v)
            except ValueError as e:
                self._stats.add("bad_feedback")
                log.warning("feedback record not understood: %s", e)
                continue
            for m in msgs:  # a bad message costs only itself
                try:
                    fb = c.Feedback.from_json(m)
                except (ValueError, TypeError) as e:
                    self._stats.add("bad_feedback")
                    log.warning("feedback message not understood: %s", e)
                    continue
                if fb.engine_id and fb.engine_id != self._s.engine_id:
                    continue
                self._apply(fb)
        bad = int(getattr(self._feedback, "bad_records", 0))
        if bad > self._bad_seen:
            self._stats.add("bad_feedback", bad - self._bad_seen)
            log.warning("%d feedback records not decodable (skipped)", bad - self._bad_seen)
            self._bad_seen = bad

    def _apply(self, fb: c.Feedback) -> None:
        if fb.kind == c.FEEDBACK_FINISHED_SENDING:
            if fb.request_id in self._delayed:  # else vLLM freed it itself
                self._sent.add(fb.request_id)
        elif fb.kind == c.FEEDBACK_FINISHED_RECVING:
            if fb.request_id not in self._loads:
                return  # an older attempt's load (preempted since), or not ours
            del self._loads[fb.request_id]
            if fb.load_errors:
                self._load_failed(fb.request_id, fb.load_errors)
            self._recved.add(fb.request_id)
        elif fb.kind == c.FEEDBACK_REQUEST_ERROR:
            self._stats.add("request_errors")
            log.warning("kvmesh stopped request %s: %s", fb.request_id, fb.error or "request_error")
            if fb.request_id in self._loads:
                self._fail_load(fb.request_id)

    def _fail_load(self, rid: str) -> None:
        """Reports a load finished with every block in error (recomputed)."""
        ld = self._loads.pop(rid)
        self._load_failed(rid, [b for _, b in ld.blocks])
        self._recved.add(rid)

    def _load_failed(self, rid: str, blocks: Any) -> None:
        """Records a load's failed blocks: by block (one group), or the
        request (hybrid models: see the module's doc)."""
        blocks = list(blocks)
        self._stats.add("load_error_blocks", len(blocks))
        if self._by_request:
            self._failed_loads.add(rid)
            return
        self._load_errors.update(blocks)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (one-group models);
        vLLM recomputes them or fails their request, per its policy."""
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        """Closes the feedback consumer and removes the segment file (the
        gpuworker keeps its mapping until an engine registers again)."""
        if self._feedback is not None:
            self._feedback.close()
        if self._segment is not None:
            self._segment.remove()
            self._segment = None


def _safe(s: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in s)[:64]
