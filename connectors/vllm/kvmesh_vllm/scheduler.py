"""The scheduler side of the connector: lookups and step records.

vLLM calls these methods from its scheduler process (``KVConnectorRole.
SCHEDULER``). They turn what vLLM's scheduler decides into kvmesh's engine
contract (``docs/contract.md``, "The engine contract"):

- ``get_num_new_matched_tokens`` asks kvmesh's lookup service, in the
  background, and answers ``None`` ("not yet") until it answered, as vLLM
  allows;
- ``update_state_after_alloc`` and ``build_connector_meta`` turn each
  request's admission, allocation, scheduling and preemption into request
  events with consecutive ``seq``; one step's events form one
  ``kvmesh.engine.steps`` record, keyed by the engine id;
- a step's record is published only after vLLM hands the step's output
  back (``update_connector_output``): its KV is then computed and its
  blocks' identities recorded by the workers, so a save the record causes
  never reads a block before it holds its chunk ("complete before
  publish"). Publishing does not wait for the broker: the idempotent
  producer keeps the engine's records in order, and each delivery report
  is served on a later call;
- ``request_finished`` publishes the finish and delays the free until
  kvmesh reports ``finished_sending`` (the workers return it from
  ``get_finished``).
- a request vLLM keeps a W3C trace context for (``Request.trace_headers``)
  carries it into the mesh: its lookup sends ``traceparent`` (and
  ``tracestate``) as HTTP headers, and each of its events the
  ``traceparent`` field (:mod:`kvmesh_vllm.tracing`).

Nothing here raises into vLLM's scheduler loop: a failed lookup answers 0
(the engine computes), a failed publish is counted and the mesh fails the
request closed (a sequence gap).
"""

from __future__ import annotations

import collections
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from . import contract as c
from . import tracing
from .config import Settings, valid_tenant
from .metadata import BlockWrite, KVMeshConnectorMetadata, PendingLoad
from .model import ModelSpec
from .stats import ConnectorStats

log = logging.getLogger(__name__)


def hash_hex(h: Any) -> str:
    """One of vLLM's block hashes as kvmesh's hex.

    vLLM's ``BlockHash`` is bytes; older versions used ints, and some wrap
    the value (``hash_value``)."""
    if isinstance(h, (bytes, bytearray, memoryview)):
        return bytes(h).hex()
    if isinstance(h, str):
        return h.lower()
    if isinstance(h, int):
        return (h & ((1 << 64) - 1)).to_bytes(8, "big").hex()
    inner = getattr(h, "hash_value", None)
    if inner is not None:
        return hash_hex(inner)
    raise TypeError(f"block hash of type {type(h).__name__}")


@dataclass
class _Request:
    """What the scheduler side keeps of one request."""

    request_id: str
    request: Any
    seq: int = 0
    admitted: bool = False
    tenant: str = ""
    trace: tracing.TraceContext = field(default_factory=tracing.TraceContext)
    lookup: Optional[Future] = None
    lookup_at: int = -1  # num_computed_tokens the lookup was asked with
    decision: Optional[c.Decision] = None
    matched: Optional[int] = None  # the answer for lookup_at
    local: int = 0  # vLLM's own prefix-cache hit at the lookup
    alloc_deferred: bool = False  # allocated with empty blocks: recorded at the first step
    allocated: bool = False
    loading: bool = False
    load_done: bool = False
    external: int = 0
    foreign: int = 0  # tokens another connector supplies (MultiConnector)
    scheduled: bool = False  # ever scheduled: a later first step is a resume
    running: bool = False  # scheduled since its current allocation
    prefill_end: int = 0  # tokens the current run prefills (vLLM's prefill_end_tokens)
    table: list[list[int]] = field(default_factory=list)
    finished: bool = False

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq


@dataclass
class _Record:
    """A step record waiting for its step's output, then for its turn."""

    step: c.EngineStep
    step_no: int
    needs_output: bool


#: At most this many steps wait for their output with one pipeline stage:
#: vLLM schedules at most one step ahead of the one running (async
#: scheduling), so a step this far back has finished its forward pass.
#: Pipeline parallelism keeps one batch in flight per stage more.
MAX_STEPS_IN_FLIGHT = 2


class SchedulerSide:
    """The scheduler-side half of :class:`~kvmesh_vllm.connector.KVMeshConnector`."""

    def __init__(self, settings: Settings, model: ModelSpec, lookup_client: Any,
                 publish: Callable[[bytes, Callable[[Optional[Exception]], None]], None], stats: ConnectorStats,
                 null_block_id: int = c.VLLM_NULL_BLOCK_ID, poll: Callable[[], Any] = lambda: None,
                 pipeline_stages: int = 1, loads: bool = True) -> None:
        self._s = settings
        # loads False: this vLLM cannot take a connector's tokens for this
        # model (_vllm.Capabilities): no lookup, every request computes.
        self._loads_ok = loads
        self._model = model
        self._lookup = lookup_client
        self._publish = publish
        self._poll = poll
        self._in_flight = MAX_STEPS_IN_FLIGHT + max(0, pipeline_stages - 1)
        self._stats = stats
        self._null = null_block_id
        self._reqs: dict[str, _Request] = {}
        self._events: list[c.RequestEvent] = []
        self._loads: list[PendingLoad] = []
        self._queue: collections.deque[_Record] = collections.deque()
        self._awaiting: collections.deque[int] = collections.deque()
        self._delayed: list[str] = []  # frees delayed since the last step's metadata
        self._step = 0
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvmesh-lookup")

    # ---- lookups -------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """Tokens kvmesh can load beyond ``num_computed_tokens``; ``None``
        while the lookup has not answered."""
        st = self._state(request)
        if st.load_done or st.running:
            return 0, False  # after a load, or a request already running
        if st.matched is not None and st.lookup_at == num_computed_tokens:
            return st.matched, st.matched > 0
        if not self._loads_ok:
            self._stats.add("lookups_skipped")
            st.lookup_at, st.local, st.matched = num_computed_tokens, num_computed_tokens, 0
            return 0, False
        if st.lookup is None or st.lookup_at != num_computed_tokens:
            st.lookup_at, st.local, st.matched, st.decision = num_computed_tokens, num_computed_tokens, None, None
            st.lookup = self._pool.submit(self._ask, st, num_computed_tokens)
            self._stats.add("lookups")
            return None, False
        if not st.lookup.done():
            return None, False
        fut, st.lookup = st.lookup, None
        try:
            dec = fut.result()
        except Exception as e:  # any failure fails open: the engine computes
            self._stats.add("lookup_failures")
            log.warning("kvmesh lookup of %s failed; computing it: %s", st.request_id, e)
            st.matched = 0
            return 0, False
        if dec.pending:
            self._stats.add("lookup_pending")
            st.lookup = self._pool.submit(self._ask, st, num_computed_tokens)
            return None, False
        st.decision = dec
        try:
            st.matched = self._accept(st, dec, num_computed_tokens)
        except (TypeError, ValueError) as e:  # a malformed answer: computed here
            self._stats.add("lookup_anomalies")
            log.warning("kvmesh lookup decision for %s not understood; computing it: %s", st.request_id, e)
            st.matched = 0
        # kvmesh's gpuworkers load in the background: always asynchronous
        # (a synchronous load would need wait_for_layer_load to block on it).
        return st.matched, st.matched > 0

    def _ask(self, st: _Request, num_computed: int) -> c.Decision:
        """One lookup call (in the lookup pool's thread)."""
        req = st.request
        hashes = [hash_hex(h) for h in getattr(req, "block_hashes", ())]
        num_tokens = int(req.num_tokens)
        if len(hashes) != num_tokens // self._model.hash_block_size:
            self._stats.add("lookup_anomalies")
            raise ValueError(
                f"{len(hashes)} block hashes for {num_tokens} tokens: vLLM hashes every "
                f"{num_tokens // max(1, len(hashes))} tokens, the mesh's model every {self._model.hash_block_size}"
            )
        body = c.lookup_request(
            self._s.engine_id, st.request_id, self._s.model, hashes, num_tokens, num_computed,
            tenant=st.tenant, kv_transfer_params=_pd_params(req), engine_version=self._s.engine_version,
        )
        _, _, data = self._lookup.request("POST", "/v1/lookup", json_body=body, headers=st.trace.headers())
        return c.Decision.from_json(data)

    def _accept(self, st: _Request, dec: c.Decision, num_computed: int) -> int:
        """The external tokens of a decision the engine can act on, else 0."""
        if dec.external_tokens <= 0 or not dec.chosen:
            return 0
        child = dec.child(dec.chosen) or {}
        spec = child.get("load_spec") or {}
        hit = int(spec.get("kvpool_cached_tokens", -1))
        problem = ""
        if int(spec.get("vllm_cached_tokens", -1)) != num_computed:
            problem = f"load spec cached {spec.get('vllm_cached_tokens')}, engine computed {num_computed}"
        elif hit - num_computed != dec.external_tokens:
            problem = f"external tokens {dec.external_tokens}, load spec hit {hit} - cached {num_computed}"
        elif hit >= int(st.request.num_tokens):
            problem = f"hit {hit} is not below the request's {st.request.num_tokens} tokens"
        if problem:
            self._stats.add("lookup_anomalies")
            log.warning("kvmesh lookup decision %s for %s not acted on: %s", dec.decision_id, st.request_id, problem)
            return 0
        return dec.external_tokens

    # ---- allocation and steps ------------------------------------------

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Records the allocation: ``admitted`` (first time), ``allocated``,
        and a ``pending_load`` when kvmesh's tokens will be loaded."""
        st = self._state(request)
        table = c.table_of(blocks.get_block_ids()) if blocks is not None else []
        if st.allocated and st.running:
            # Allocated again after running, with no preempted_req_ids naming
            # it (vLLM's reset_prefix_cache(reset_running_requests=True)
            # preempts outside schedule()): a preemption all the same.
            self._preempted(st.request_id)
        if st.allocated and not st.running:
            # vLLM's second call for an async load (this connector's or
            # another's under MultiConnector): the same allocation, grown.
            st.table = table
            return
        if not st.admitted:
            st.admitted = True
            hashes = self._hashes(st)
            self._event(st, c.RequestEvent(
                request_id=st.request_id, kind=c.EVENT_ADMITTED,
                prompt_tokens=_prompt_len(request),
                block_hashes=hashes,
                token_ids=self._token_ids(request, hashes),
                lora_name=self._lora_name(st),
                tenant=st.tenant, engine_version=self._s.engine_version, consumer=self._s.consumer,
            ))
        st.allocated, st.table, st.external = True, table, num_external_tokens
        if st.decision and st.decision.external_tokens > 0 and num_external_tokens == 0:
            self._stats.add("lookups_not_chosen")  # MultiConnector chose another child
        if num_external_tokens == 0 and not any(table):
            # vLLM's MultiConnector (2026-05-27) hands a child it did not
            # choose empty blocks: the allocation is recorded with the
            # request's real table at its first scheduled step.
            st.alloc_deferred = True
            return
        self._allocated(st, table)
        if num_external_tokens > 0:
            st.loading = True
            hit = st.local + num_external_tokens
            self._event(st, c.RequestEvent(request_id=st.request_id, kind=c.EVENT_SCHEDULED, step=c.step_of(c.STEP_PENDING_LOAD)))
            self._loads.append(PendingLoad(st.request_id, tuple(self._load_blocks(table, st.local, hit))))
            self._stats.add("loads")
            self._stats.add("load_tokens", num_external_tokens)

    def _allocated(self, st: _Request, table: list[list[int]]) -> None:
        st.alloc_deferred = False
        self._event(st, c.RequestEvent(
            request_id=st.request_id, kind=c.EVENT_ALLOCATED, external_tokens=st.external,
            block_table=table, decision_id=st.decision.decision_id if st.decision else "",
        ))

    def _load_blocks(self, table: list[list[int]], start: int, hit: int) -> list[tuple[int, int]]:
        """The (group, block) pairs a load resuming at ``hit`` writes."""
        out = []
        for g in range(len(self._model.groups)):
            for p in self._model.load_chunks(g, start, hit):
                if p < len(table[g]) and table[g][p] != self._null:
                    out.append((g, table[g][p]))
        return out

    def build_connector_meta(self, scheduler_output: Any) -> KVMeshConnectorMetadata:
        """The step's metadata for the workers; queues the step's record."""
        start = time.perf_counter()
        try:
            return self._build(scheduler_output)
        finally:
            self._stats.add("steps")
            self._stats.add("step_us", int((time.perf_counter() - start) * 1e6))

    def _build(self, scheduler_output: Any) -> KVMeshConnectorMetadata:
        self._poll()
        self._step += 1
        meta = KVMeshConnectorMetadata(step=self._step, loads=self._loads, delayed_frees=self._delayed)
        self._loads, self._delayed = [], []
        for rid in sorted(getattr(scheduler_output, "preempted_req_ids", None) or ()):
            st = self._reqs.get(rid)
            # A request preempted outside schedule() (reset_prefix_cache)
            # was recorded at its re-allocation; newer vLLM lists it here
            # too, with its new allocation already recorded.
            if st is not None and st.running:
                self._preempted(rid)
        for nr in scheduler_output.scheduled_new_reqs:
            self._scheduled_new(nr, scheduler_output.num_scheduled_tokens.get(nr.req_id, 0), meta)
        self._scheduled_cached(scheduler_output, meta)
        # A record waits for its step's output when the workers must act on
        # the step first: record identities, or register a load whose
        # finished_recving may come back at once.
        waits = bool(meta.writes or meta.loads)
        self._enqueue(self._step, waits)
        if waits:
            self._awaiting.append(self._step)
        while len(self._awaiting) > self._in_flight:
            self._output_of(self._awaiting.popleft())
        self._flush()
        return meta

    def _enqueue(self, step_no: int, needs_output: bool) -> None:
        """Queues the events so far as the records of step ``step_no``."""
        events, self._events = self._events, []
        for i in range(0, len(events), c.MAX_STEP_REQUESTS):
            rec = c.EngineStep(engine_id=self._s.engine_id, model=self._s.model, step=step_no,
                               requests=events[i:i + c.MAX_STEP_REQUESTS], null_block_id=self._null)
            self._queue.append(_Record(rec, step_no, needs_output))

    def _output_of(self, step_no: int) -> None:
        """Step ``step_no``'s forward pass is done: its records may go."""
        for rec in self._queue:
            if rec.step_no == step_no:
                rec.needs_output = False

    def _scheduled_new(self, nr: Any, n: int, meta: KVMeshConnectorMetadata) -> None:
        st = self._reqs.get(nr.req_id)
        if st is None:
            return  # never seen by the lookup: not kvmesh's (should not happen)
        table = c.table_of(nr.block_ids)
        start, end = int(nr.num_computed_tokens), int(nr.num_computed_tokens) + int(n)
        kind = c.STEP_RESUMED if st.scheduled else c.STEP_NEW
        prefill = _prompt_len(st.request) if kind == c.STEP_NEW else int(st.request.num_tokens)
        st.prefill_end = prefill
        self._begin_running(st, table, start, end, meta)
        self._event(st, c.RequestEvent(request_id=st.request_id, kind=c.EVENT_SCHEDULED, step=c.step_of(
            kind, tokens=end, table=table, hashes=self._hashes(st), prefill_tokens=prefill)))

    def _begin_running(self, st: _Request, table: list[list[int]], start: int, end: int,
                       meta: KVMeshConnectorMetadata) -> None:
        """A request's first scheduled step (new, resumed, or after its load)."""
        if st.alloc_deferred:
            self._allocated(st, table)
        st.scheduled, st.running, st.table = True, True, table
        foreign_from = st.local + st.external
        if not st.loading and not st.load_done and start > foreign_from:
            # Another connector (MultiConnector's chosen child) supplied
            # tokens [foreign_from, start): vLLM attends over them from this
            # step on, so the blocks hold that KV; record their identities.
            st.foreign = start - foreign_from
            self._stats.add("foreign_tokens", st.foreign)
            self._writes(st, table, foreign_from, start, meta, adopt=True)
        st.loading = False
        self._writes(st, table, start, end, meta)

    def _scheduled_cached(self, so: Any, meta: KVMeshConnectorMetadata) -> None:
        cr = so.scheduled_cached_reqs
        resumed = set(getattr(cr, "resumed_req_ids", None) or ())
        flags = getattr(cr, "resumed_from_preemption", None)
        for i, rid in enumerate(cr.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            n = int(so.num_scheduled_tokens.get(rid, 0))
            start = int(cr.num_computed_tokens[i])
            end = start + n
            new_ids = cr.new_block_ids[i] if cr.new_block_ids is not None else None
            if rid in resumed or (flags is not None and flags[i]):
                table = c.table_of(new_ids or [[] for _ in self._model.groups])
                st.prefill_end = int(st.request.num_tokens)  # a resume prefills every token it had
                self._begin_running(st, table, start, end, meta)
                self._event(st, c.RequestEvent(request_id=rid, kind=c.EVENT_SCHEDULED, step=c.step_of(
                    c.STEP_RESUMED, tokens=end, table=table, hashes=self._hashes(st),
                    prefill_tokens=int(st.request.num_tokens))))
                continue
            delta = c.table_of(new_ids) if new_ids is not None else None
            if delta is not None:
                for g, ids in enumerate(delta):
                    st.table[g].extend(ids)
            self._writes(st, st.table, start, end, meta)
            decode = start >= (st.prefill_end or _prompt_len(st.request))
            if decode and (delta is None or not any(delta)):
                continue  # a decode step that added no block changes nothing for the mesh
            kind = c.STEP_DECODE if decode else c.STEP_RUNNING
            self._event(st, c.RequestEvent(request_id=rid, kind=c.EVENT_SCHEDULED,
                                           step=c.step_of(kind, tokens=end, table=delta)))

    def _writes(self, st: _Request, table: list[list[int]], start: int, end: int,
                meta: KVMeshConnectorMetadata, adopt: bool = False) -> None:
        """Every block tokens [start, end) write into, each with the hash of
        the chunk it completes ("" while its chunk is incomplete). With
        ``adopt`` (another connector's blocks) only the complete ones."""
        hashes = getattr(st.request, "block_hashes", ())
        for g, grp in enumerate(self._model.groups):
            bs = grp.block_size
            for p in range(start // bs, -(-end // bs)):
                if g >= len(table) or p >= len(table[g]) or table[g][p] == self._null:
                    continue
                hi = (p + 1) * bs // self._model.hash_block_size - 1
                h = ""
                if (p + 1) * bs <= end and hi < len(hashes):
                    try:
                        h = hash_hex(hashes[hi])
                    except TypeError:
                        h = ""  # a hash this connector cannot name: the block records nothing
                if adopt and not h:
                    continue
                meta.writes.append(BlockWrite(st.request_id, g, table[g][p], h, adopt))

    def _hashes(self, st: _Request) -> Optional[list[str]]:
        try:
            return [hash_hex(h) for h in getattr(st.request, "block_hashes", ())]
        except TypeError as e:
            log.warning("request %s: block hashes not understood (%s); kvmesh gets none", st.request_id, e)
            return None

    def _token_ids(self, request: Any, hashes: Optional[list[str]]) -> Optional[list[int]]:
        """The admitted event's token ids: the prompt's tokens of the
        complete hash blocks its chain covers (the scheduler refuses any
        other list, and with it the whole step record), at most
        ``MAX_TOKEN_IDS`` of them (kvmesh keeps no more), so kvmesh's
        BlockStored events can carry their blocks' tokens. None when
        ``kvmesh.send_token_ids`` is false, or the prompt has no token ids
        (prompt embeddings) or no complete hash block."""
        if not self._s.send_token_ids or not hashes:
            return None
        prompt = getattr(request, "prompt_token_ids", None)
        if prompt is None:
            return None
        hbs = self._model.hash_block_size
        n = min(len(prompt), _prompt_len(request)) // hbs
        n = min(n, len(hashes), c.MAX_TOKEN_IDS // hbs) * hbs
        return [int(t) for t in prompt[:n]] or None

    def _lora_name(self, st: _Request) -> str:
        """The request's LoRA adapter name (vLLM's lora_request.lora_name;
        "" without one, when ``kvmesh.send_token_ids`` is false, or for a
        name kvmesh cannot store: one with a NUL byte)."""
        if not self._s.send_token_ids:
            return ""
        name = getattr(getattr(st.request, "lora_request", None), "lora_name", None) or ""
        if "\x00" in str(name):
            log.warning("request %s: LoRA name with a NUL byte not sent to kvmesh", st.request_id)
            return ""
        return str(name)

    def _preempted(self, rid: str) -> None:
        st = self._reqs.get(rid)
        if st is None or not st.admitted:
            return
        self._event(st, c.RequestEvent(request_id=rid, kind=c.EVENT_PREEMPTED))
        st.lookup, st.lookup_at, st.matched, st.decision = None, -1, None, None
        st.allocated = st.loading = st.load_done = st.running = st.alloc_deferred = False
        st.external = st.foreign = 0
        st.table = []
        self._stats.add("preemptions")

    # ---- step output, finish --------------------------------------------

    def update_connector_output(self, connector_output: Any) -> None:
        """A step's output is back: its KV is in, its record may go.

        The workers name the steps whose identities they recorded
        (``kv_connector_worker_meta``); without that (older vLLM), the
        oldest step waiting is the one whose output this is."""
        start = time.perf_counter()
        try:
            self._output(connector_output)
        finally:
            self._stats.add("step_us", int((time.perf_counter() - start) * 1e6))

    def _output(self, connector_output: Any) -> None:
        self._poll()
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        done = set(getattr(wm, "steps", ()) or ())
        if not done and self._awaiting:
            done = {self._awaiting[0]}
        for s in done:
            if s in self._awaiting:
                self._awaiting.remove(s)
            self._output_of(s)
        for rid in sorted(getattr(wm, "failed_loads", ()) or ()):
            self._load_failed(rid)
        # Newer vLLM took these as failed_recving (get_transfer_results) and
        # applied its kv_load_failure_policy before this call; each is in
        # finished_recving too, so a retried request is not looked up again.
        if failed := getattr(connector_output, "failed_recving", None):
            self._stats.add("load_failures_reported", len(failed))
        for rid in getattr(connector_output, "finished_recving", None) or ():
            st = self._reqs.get(rid)
            if st is not None and st.loading:  # MultiConnector reports every child's loads
                st.loading, st.load_done = False, True
        for rid in getattr(connector_output, "finished_sending", None) or ():
            st = self._reqs.get(rid)
            if st is not None and st.finished:
                del self._reqs[rid]
        self._flush()

    def _load_failed(self, rid: str) -> None:
        """A hybrid model's load failed on some rank (KVMeshWorkerMetadata.
        failed_loads, with the request in this output's finished_recving):
        the request goes back to the prefix it had computed locally before
        the lookup, so vLLM's next schedule() caches nothing past it and
        computes the rest. vLLM's own block-level path (invalid_block_ids)
        raises on a model of more than one group; this path never reaches
        it, and recomputes whatever kv_load_failure_policy says."""
        st = self._reqs.get(rid)
        if st is None or st.request is None:
            return
        req = st.request
        if int(req.num_computed_tokens) > st.local:
            log.warning("kvmesh load of %s failed; recomputing from token %d (was %d)", rid, st.local,
                        req.num_computed_tokens)
            req.num_computed_tokens = st.local
        self._stats.add("load_recomputes")

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Optional[dict[str, Any]]]:
        """Publishes the finish. The free waits for ``finished_sending`` only
        where kvmesh may still save the request's blocks: not for a request
        that never ran, nor for one whose load is in flight (vLLM itself
        frees it at that load's ``finished_recving``), nor on a consumer."""
        st = self._reqs.get(request.request_id)
        if st is None or not st.admitted:
            self._reqs.pop(request.request_id, None)
            return False, None
        if st.lookup is not None:
            st.lookup.cancel()
        self._event(st, c.RequestEvent(request_id=st.request_id, kind=c.EVENT_FINISHED))
        self._enqueue(self._step, False)
        self._flush()
        if st.loading or not st.scheduled or self._s.consumer:
            del self._reqs[st.request_id]
            return False, None
        st.finished = True
        self._delayed.append(st.request_id)
        return True, None

    def _flush(self) -> None:
        """Publishes every record at the head whose step output is back."""
        while self._queue and not self._queue[0].needs_output:
            rec = self._queue.popleft()
            if not rec.step.requests:
                continue
            try:
                self._publish(rec.step.encode(), self._delivered(rec))
            except Exception as e:
                self._delivered(rec)(e)

    def _delivered(self, rec: _Record) -> Callable[[Optional[Exception]], None]:
        """The delivery report of one record."""
        def done(err: Optional[Exception]) -> None:
            if err is None:
                self._stats.add("records")
                return
            # The mesh sees a seq gap for these requests and fails them
            # closed (request_error; their finish frees at once).
            self._stats.add("publish_failures")
            log.error("kvmesh step record %s (%d events) not published: %s", rec.step.step_id, len(rec.step.requests), err)
        return done

    def _event(self, st: _Request, ev: c.RequestEvent) -> None:
        ev.seq = st.next_seq()
        ev.traceparent = st.trace.traceparent
        self._events.append(ev)

    def _state(self, request: Any) -> _Request:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = _Request(request.request_id, request, tenant=self._tenant(request), trace=self._trace(request))
            self._reqs[request.request_id] = st
        st.request = request
        return st

    def _tenant(self, request: Any) -> str:
        params = getattr(request, "kv_transfer_params", None) or {}
        t = str(params.get("kvmesh_tenant") or self._s.tenant or "")
        if t and not valid_tenant(t):
            self._stats.add("tenant_invalid")
            log.warning("request %s: tenant %r is not valid; using none", request.request_id, t)
            return ""
        return t

    def _trace(self, request: Any) -> tracing.TraceContext:
        """The request's trace context, taken once, when the connector
        first sees the request; an invalid traceparent is counted and
        dropped."""
        trace = tracing.of_request(request)
        if trace.invalid:
            self._stats.add("traceparent_invalid")
            log.debug("request %s: traceparent is not valid W3C; kvmesh gets none", request.request_id)
        return trace

    def last_decision(self, request_id: str) -> Optional[c.Decision]:
        """The lookup decision the request's allocation acted on, if any."""
        st = self._reqs.get(request_id)
        return st.decision if st is not None else None

    def reset_lookups(self) -> None:
        """Forgets the lookup answers of requests not allocated yet: vLLM's
        next call asks kvmesh again."""
        for st in self._reqs.values():
            if not st.allocated:
                if st.lookup is not None:
                    st.lookup.cancel()
                st.lookup, st.lookup_at, st.matched, st.decision = None, -1, None, None

    def shutdown(self) -> None:
        """Stops the lookup threads; unpublished records are dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _prompt_len(request: Any) -> int:
    """The prompt's length (vLLM's num_prompt_tokens; prompt_token_ids is
    None for prompt embeddings)."""
    n = getattr(request, "num_prompt_tokens", None)
    return int(n) if n is not None else len(request.prompt_token_ids or ())


def _pd_params(request: Any) -> Optional[dict[str, Any]]:
    """The pd source a decode engine's request carries, if any."""
    params = getattr(request, "kv_transfer_params", None) or {}
    if "remote_engine_id" not in params:
        return None
    return {k: params[k] for k in ("remote_engine_id", "remote_block_table", "remote_tokens", "remote_null_block_id") if k in params}
