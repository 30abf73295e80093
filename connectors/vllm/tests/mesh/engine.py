"""A vLLM-shaped engine that drives the connector as vLLM does.

:class:`Engine` plays vLLM's v1 scheduler loop (``vllm/v1/core/sched/
scheduler.py``) for one engine with one worker per rank, calling the
connector at the points vLLM calls it, step by step:

- waiting requests: ``get_num_new_matched_tokens`` (``None``: skipped this
  step), allocation, ``update_state_after_alloc``; an async load parks the
  request in ``WAITING_FOR_REMOTE_KVS`` until a worker reports it in
  ``get_finished``, then its failed blocks (``get_block_ids_with_load_
  errors``) are recomputed and it is allocated again and scheduled;
- running requests: a prefill chunk or one decode token each, with new
  blocks; when blocks run out the newest running request is preempted (its
  blocks freed and reusable at once, as vLLM does);
- ``build_connector_meta`` → every worker: ``bind_connector_metadata``,
  ``start_load_kv``, the forward pass (the KV of every block the step
  completes written into the layer tensors, as the simulator's content
  function defines it), ``wait_for_save``, ``build_connector_worker_meta``,
  ``get_finished``, ``get_block_ids_with_load_errors``;
- ``update_connector_output`` and ``request_finished`` (free delayed until
  ``finished_sending``).

With ``pd_child`` the engine plays vLLM's ``MultiConnector`` with a P/D
connector first and kvmesh second (``multi_connector.py``): every child is
asked, "not yet" from any is "not yet", the first with tokens is chosen and
receives them in ``update_state_after_alloc``, the others 0.

Every block a load (kvmesh's or the P/D child's) filled is checked byte for
byte against what its hash implies before the request goes on.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from kvmesh_vllm import content
from kvmesh_vllm.metadata import KVMeshConnectorMetadata

from fakevllm import (KVCacheBlocks, KVConnectorOutput, NewRequestData, Request,
                      SchedulerOutput)

NULL = 0


@dataclass
class EngineStats:
    """What one engine run measured."""

    requests_total: int = 0
    requests_ok: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    local_tokens: int = 0
    tokens_loaded: dict[str, int] = field(default_factory=dict)
    blocks_checked: int = 0
    blocks_mismatched: int = 0
    load_error_blocks: int = 0
    recomputed_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    lookups_not_yet: int = 0
    finish_waits: int = 0
    failures: list[str] = field(default_factory=list)


class BlockPool:
    """vLLM's BlockPool shape: one id space shared by every group, block 0
    the null block, reference counts, and a prefix cache of freed blocks
    whose chunk is known (evicted least recently freed first when a fresh
    block is needed, as vLLM's free queue does). Freed blocks are reusable
    at once."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, 0, -1))  # ref 0, content unknown
        self.lru: "collections.OrderedDict[int, None]" = collections.OrderedDict()  # ref 0, cached
        self.ref = [0] * num_blocks
        self.key: list[Optional[tuple[int, str]]] = [None] * num_blocks
        self.index: dict[tuple[int, str], int] = {}

    def available(self) -> int:
        return len(self.free) + len(self.lru)

    def take(self, n: int) -> Optional[list[int]]:
        """``n`` fresh blocks (evicting cached ones if needed), or None."""
        if n > self.available():
            return None
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.pop()
            else:
                b, _ = self.lru.popitem(last=False)
                self._forget(b)
            self.ref[b] = 1
            out.append(b)
        return out

    def cached(self, group: int, hash_hex: str) -> Optional[int]:
        return self.index.get((group, hash_hex))

    def acquire(self, b: int) -> None:
        """One more reference to a cached block (a prefix-cache hit)."""
        if self.ref[b] == 0:
            self.lru.pop(b, None)
        self.ref[b] += 1

    def release(self, b: int) -> None:
        if b == NULL:
            return
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if self.key[b] is not None:
                self.lru[b] = None
            else:
                self.free.append(b)

    def register(self, group: int, b: int, hash_hex: str) -> None:
        """The block now holds the group's chunk of this hash."""
        k = (group, hash_hex)
        if k in self.index or self.key[b] == k:
            return
        self._forget(b)
        self.key[b] = k
        self.index[k] = b

    def _forget(self, b: int) -> None:
        k = self.key[b]
        if k is not None and self.index.get(k) == b:
            del self.index[k]
        self.key[b] = None


@dataclass
class _Req:
    req: Request
    outputs: list[int]
    status: str = "waiting"  # waiting, remote, running, finishing, done
    table: list[list[int]] = field(default_factory=list)
    scheduled_once: bool = False
    resumed: bool = False
    load: Optional[tuple[str, int, int]] = None  # (connector, start, hit)
    chosen: str = ""
    failed: str = ""


class Engine:
    """One vLLM engine: a scheduler connector and one worker connector per rank."""

    def __init__(self, model: Any, fingerprint: str, spec: dict, scheduler: Any, workers: list[Any],
                 kv_tensors: list[dict[str, Any]], layer_groups: list[list[str]], num_blocks: int,
                 ranks: list[dict[str, int]], max_batch_tokens: int = 256, max_running: int = 8,
                 pd_child: Optional["FakePD"] = None) -> None:
        self.model, self.fp, self.spec = model, fingerprint, spec
        self.sched, self.workers = scheduler, workers
        self.kv, self.layer_groups, self.ranks = kv_tensors, layer_groups, ranks
        self.pool = BlockPool(num_blocks)
        self.budget, self.max_running = max_batch_tokens, max_running
        self.pd = pd_child
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.reqs: dict[str, _Req] = {}
        self.finished_ids: set[str] = set()
        self.stats = EngineStats()
        self.done_ids: list[str] = []
        self._sending: dict[str, int] = {}  # finished_sending reports per request, until every rank's
        self._recving: dict[str, int] = {}
        #: Called with each request whose load the engine just issued (tests
        #: break the store with it).
        self.on_load_issued: Optional[Any] = None
        #: Called after every step (tests break the mesh with it).
        self.on_step_done: Optional[Any] = None

    # ---- content -------------------------------------------------------

    def _regions(self, rank: int, group: int, block: int) -> list[np.ndarray]:
        """The block's bytes in every layer tensor of the group, in region
        order, as numpy views of the tensors' memory."""
        out = []
        for name in self.layer_groups[group]:
            layer = self.kv[rank][name]
            for t in layer if isinstance(layer, list) else [layer]:
                nb = len(self.pool.ref)  # as the worker reads it: block dimension first, or K/V planes then blocks
                planes = [t[block]] if t.shape[0] == nb else [t[0][block], t[1][block]]
                for p in planes:
                    out.append(p.reshape(-1).view(torch.uint8).numpy())
        return out

    def _expected(self, rank: int, group: int, hash_hex: str) -> np.ndarray:
        sr = content.store_rank(self.spec, group, self.ranks[rank])
        return content.block_content(self.fp, group, sr, hash_hex, self.model.groups[group].bytes_per_block)

    def write_block(self, rank: int, group: int, block: int, hash_hex: str) -> None:
        """The forward pass's KV of one block, on one rank."""
        sr = content.store_rank(self.spec, group, self.ranks[rank])
        content.fill_regions(self._regions(rank, group, block), self.fp, group, sr, hash_hex)

    def check_block(self, rank: int, group: int, block: int, hash_hex: str) -> bool:
        got = np.concatenate(self._regions(rank, group, block))
        return bool(np.array_equal(got, self._expected(rank, group, hash_hex)))

    # ---- requests ------------------------------------------------------

    def submit(self, req: Request, outputs: list[int]) -> None:
        r = _Req(req, outputs, table=[[] for _ in self.model.groups])
        self.reqs[req.request_id] = r
        self.waiting.append(r)
        self.stats.requests_total += 1

    def idle(self) -> bool:
        return not self.waiting and not self.running and all(r.status == "done" for r in self.reqs.values())

    # ---- one step --------------------------------------------------------

    def step(self) -> bool:
        """One scheduler step; whether it scheduled anything."""
        so = SchedulerOutput()
        budget = self.budget
        budget = self._schedule_running(so, budget)
        if not so.preempted_req_ids:
            self._schedule_waiting(so, budget)
        so.finished_req_ids, self.finished_ids = self.finished_ids, set()
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        metas = self._build_meta(so)
        out = self._execute(so, metas)
        for w in metas[0].writes:  # the step's complete blocks enter the prefix cache
            if w.hash_hex:
                self.pool.register(w.group, w.block, w.hash_hex)
        self._update_from_output(so, out)
        self.stats.steps += 1
        if self.on_step_done is not None:
            self.on_step_done(self)
        return so.total_num_scheduled_tokens > 0

    def _blocks_for(self, r: _Req, tokens: int, hit: int = 0) -> Optional[list[list[int]]]:
        """New blocks so that the table covers ``tokens`` in every group;
        chunks ending at or below ``hit`` that no group needs are null."""
        need, plan = 0, []
        for g, grp in enumerate(self.model.groups):
            have = len(r.table[g])
            ids = []
            for p in range(have, -(-tokens // grp.block_size)):
                end = (p + 1) * grp.block_size
                real = not (end <= hit and not grp.reaches(end, hit))
                ids.append(real)
                need += real
            plan.append(ids)
        fresh = self.pool.take(need)
        if fresh is None:
            return None
        added: list[list[int]] = []
        for g, ids in enumerate(plan):
            add = [fresh.pop() if real else NULL for real in ids]
            r.table[g].extend(add)
            added.append(add)
        return added

    def _free(self, r: _Req) -> None:
        for ids in r.table:
            for b in ids:
                self.pool.release(b)
        r.table = [[] for _ in self.model.groups]

    def _chunk_hash(self, r: _Req, group: int, p: int) -> str:
        bs = self.model.groups[group].block_size
        return r.req.block_hashes[(p + 1) * bs // self.model.hash_block_size - 1].hex()

    def _local_hit(self, r: _Req) -> int:
        """vLLM's get_computed_blocks: the longest prefix, a multiple of the
        scheduler block and short of the last token, whose chunks every
        group needs to resume at are in the prefix cache."""
        sbs = self.model.scheduler_block_size
        for h in range((r.req.num_tokens - 1) // sbs * sbs, 0, -sbs):
            if all(self.pool.cached(g, self._chunk_hash(r, g, p)) is not None
                   for g in range(len(self.model.groups)) for p in self.model.load_chunks(g, 0, h)):
                return h
        return 0

    def _alloc(self, r: _Req, local: int, tokens: int, hit: int) -> bool:
        """The request's table: cached blocks for the local hit's chunks
        (null for those no group needs), fresh ones up to ``tokens``."""
        r.table = [[] for _ in self.model.groups]
        for g, grp in enumerate(self.model.groups):
            for p in range(local // grp.block_size):
                if grp.reaches((p + 1) * grp.block_size, local):
                    b = self.pool.cached(g, self._chunk_hash(r, g, p))
                    self.pool.acquire(b)
                    r.table[g].append(b)
                else:
                    r.table[g].append(NULL)
        if self._blocks_for(r, tokens, hit=hit) is None:
            self._free(r)
            return False
        return True

    def _schedule_running(self, so: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            n = min(r.req.num_tokens - r.req.num_computed_tokens, budget)
            added = self._blocks_for(r, r.req.num_computed_tokens + n)
            while added is None:
                victim = self.running[-1]
                self._preempt(victim, so)
                if victim is r:
                    break
                added = self._blocks_for(r, r.req.num_computed_tokens + n)
            if added is None:
                continue
            cr = so.scheduled_cached_reqs
            cr.req_ids.append(r.req.request_id)
            cr.num_computed_tokens.append(r.req.num_computed_tokens)
            cr.new_block_ids.append(tuple(added) if any(added) else None)
            so.num_scheduled_tokens[r.req.request_id] = n
            budget -= n
            i += 1
        return budget

    def _preempt(self, r: _Req, so: SchedulerOutput) -> None:
        self.running.remove(r)
        self._free(r)
        r.req.num_computed_tokens = 0
        r.status, r.resumed, r.load = "waiting", True, None
        self.waiting.insert(0, r)
        so.preempted_req_ids.add(r.req.request_id)
        self.stats.preemptions += 1

    def _ask(self, r: _Req, local: int) -> tuple[Optional[int], bool, str]:
        """The connector's answer (MultiConnector's when a P/D child plays)."""
        if self.pd is None:
            n, async_ = self.sched.get_num_new_matched_tokens(r.req, local)
            return n, async_, "kvmesh"
        answers = [("pd", *self.pd.get_num_new_matched_tokens(r.req, local)),
                   ("kvmesh", *self.sched.get_num_new_matched_tokens(r.req, local))]
        if any(n is None for _, n, _ in answers):
            return None, False, ""
        for name, n, async_ in answers:
            if n and n > 0:
                return n, async_, name
        return 0, False, ""

    def _schedule_waiting(self, so: SchedulerOutput, budget: int) -> None:
        keep: list[_Req] = []
        blocked = False  # a request found no blocks: only loaded ones (whose blocks they hold) go on
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            r = self.waiting.pop(0)
            if r.status == "remote" or (blocked and r.status != "loaded"):
                keep.append(r)
                continue
            if r.status == "loaded":
                n = min(r.req.num_tokens - r.req.num_computed_tokens, budget)
                added = self._blocks_for(r, r.req.num_computed_tokens + n)
                if added is None:
                    keep.append(r)
                    blocked = True
                    continue
                self._alloc_notify(r, KVCacheBlocks(tuple(list(g) for g in r.table)), 0)
                self._run(r, so, n)
                budget -= n
                continue
            local = self._local_hit(r)
            n_ext, _, who = self._ask(r, local)
            if n_ext is None:
                self.stats.lookups_not_yet += 1
                keep.append(r)
                continue
            hit = local + n_ext
            n = min(r.req.num_tokens - hit, budget)
            # A load's request gets the blocks of its whole prompt, so that
            # once loaded it can always run (no loaded request waits for
            # blocks that other loaded, unpreemptible requests hold).
            if not self._alloc(r, local, r.req.num_tokens if n_ext > 0 else hit + n, hit):
                keep.append(r)
                blocked = True
                continue
            self.stats.prompt_tokens += r.req.num_tokens
            self.stats.local_tokens += local
            r.req.num_computed_tokens = hit
            self._alloc_notify(r, KVCacheBlocks(tuple(list(g) for g in r.table)), n_ext, chosen=who)
            if n_ext > 0:
                r.status, r.load = "remote", (who, local, hit)
                if self.on_load_issued is not None:
                    self.on_load_issued(r)
                r.chosen = self._chosen_name(r, who)
                self.stats.tokens_loaded[r.chosen] = self.stats.tokens_loaded.get(r.chosen, 0) + n_ext
                keep.append(r)
                continue
            self._run(r, so, n)
            budget -= n
        self.waiting = keep + self.waiting

    def _chosen_name(self, r: _Req, who: str) -> str:
        if who == "pd":
            return "pd_child"
        dec = self.sched.last_decision(r.req.request_id)
        return dec.chosen if dec is not None else "kvmesh"

    def _alloc_notify(self, r: _Req, blocks: KVCacheBlocks, n_ext: int, chosen: str = "") -> None:
        self.sched.update_state_after_alloc(r.req, blocks, n_ext if chosen in ("", "kvmesh") else 0)
        if self.pd is not None:
            self.pd.update_state_after_alloc(r.req, blocks, n_ext if chosen == "pd" else 0)

    def _run(self, r: _Req, so: SchedulerOutput, n: int) -> None:
        assert r not in self.running and r.req.request_id not in so.num_scheduled_tokens, (r.req.request_id, r.status)
        r.status = "running"
        self.running.append(r)
        if r.resumed and r.scheduled_once:
            cr = so.scheduled_cached_reqs
            cr.req_ids.append(r.req.request_id)
            cr.resumed_req_ids.add(r.req.request_id)
            cr.num_computed_tokens.append(r.req.num_computed_tokens)
            cr.new_block_ids.append(tuple(list(g) for g in r.table))
        else:
            so.scheduled_new_reqs.append(NewRequestData(r.req.request_id, r.req.prompt_token_ids,
                                                        tuple(list(g) for g in r.table), r.req.num_computed_tokens))
        r.scheduled_once, r.resumed = True, False
        so.num_scheduled_tokens[r.req.request_id] = n

    # ---- the workers -----------------------------------------------------

    def _build_meta(self, so: SchedulerOutput) -> tuple[Any, Any]:
        meta = self.sched.build_connector_meta(so)
        pd_meta = self.pd.build_connector_meta(so) if self.pd is not None else None
        return meta, pd_meta

    def _execute(self, so: SchedulerOutput, metas: tuple[Any, Any]) -> KVConnectorOutput:
        meta, pd_meta = metas
        out = KVConnectorOutput(finished_sending=set(), finished_recving=set())
        wmeta = None
        for k, w in enumerate(self.workers):
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            self._forward(k, so, meta)
            w.wait_for_save()
            # vLLM's order (KVConnectorModelRunnerMixin._get_kv_connector_output):
            # get_finished, the load errors, then the worker metadata.
            sending, recving = w.get_finished(so.finished_req_ids)
            out.finished_sending |= self._all_ranks(self._sending, sending)
            out.finished_recving |= self._all_ranks(self._recving, recving)
            out.invalid_block_ids |= w.get_block_ids_with_load_errors()
            m = w.build_connector_worker_meta()
            wmeta = m if wmeta is None else (wmeta.aggregate(m) if m is not None else wmeta)
            w.clear_connector_metadata()
        if self.pd is not None:
            out.finished_recving |= self.pd.finish_loads(self)
        out.kv_connector_worker_meta = wmeta
        return out

    def _all_ranks(self, counts: dict[str, int], ids: Optional[set[str]]) -> set[str]:
        """vLLM's KVOutputAggregator: a request is finished once every
        rank reported it, in this step or earlier ones."""
        done = set()
        for rid in ids or ():
            counts[rid] = counts.get(rid, 0) + 1
            if counts[rid] == len(self.workers):
                del counts[rid]
                done.add(rid)
        return done

    def _forward(self, rank: int, so: SchedulerOutput, meta: KVMeshConnectorMetadata) -> None:
        """The forward pass of one rank: every block the step completes
        gets its KV (those the metadata lists with ``adopt`` were filled by
        another connector and are not rewritten)."""
        for w in meta.writes:
            if not w.adopt and w.hash_hex:
                self.write_block(rank, w.group, w.block, w.hash_hex)

    # ---- the output --------------------------------------------------------

    def _update_from_output(self, so: SchedulerOutput, out: KVConnectorOutput) -> None:
        for rid, n in so.num_scheduled_tokens.items():
            r = self.reqs[rid]
            r.req.num_computed_tokens += n
            if r.req.num_computed_tokens == r.req.num_tokens:
                self._sample(r)
        self.sched.update_connector_output(out)
        failed = set(getattr(out.kv_connector_worker_meta, "failed_loads", ()) or ())
        for rid in sorted(out.finished_recving or ()):
            self._loaded(self.reqs[rid], out.invalid_block_ids, failed)
        for rid in sorted(out.finished_sending or ()):
            r = self.reqs[rid]
            if r.status == "finishing":
                self._free(r)
                r.status = "done"
                self.done_ids.append(rid)

    def _sample(self, r: _Req) -> None:
        r.req.append_output(r.outputs[len(r.req.output_token_ids)])
        if len(r.req.output_token_ids) >= len(r.outputs):
            self.running.remove(r)
            self.finished_ids.add(r.req.request_id)
            delay, _ = self.sched.request_finished_all_groups(r.req, tuple(list(g) for g in r.table))
            if self.pd is not None:
                self.pd.request_finished(r.req, r.table)
            self.stats.requests_ok += 1
            if delay:
                r.status = "finishing"
                self.stats.finish_waits += 1
            else:
                self._free(r)
                r.status = "done"
                self.done_ids.append(r.req.request_id)

    def _loaded(self, r: _Req, invalid: set[int], failed: set[str]) -> None:
        """A load finished: check its blocks, recompute the failed ones. A
        hybrid model's failed load names the request (``failed``): the
        connector's scheduler side has put it back to its local prefix,
        which is recomputed from."""
        who, start, hit = r.load or ("", 0, 0)
        if r.req.request_id in failed:
            back = r.req.num_computed_tokens
            self.stats.load_error_blocks += sum(len(self.model.load_chunks(g, start, hit))
                                                for g in range(len(self.model.groups)))
            self.stats.recomputed_tokens += hit - back
            self.stats.tokens_loaded[r.chosen] -= hit - back
            r.status, r.load = "loaded", None
            return
        first_bad = hit
        for g, grp in enumerate(self.model.groups):
            for p in self.model.load_chunks(g, start, hit):
                b = r.table[g][p]
                h = r.req.block_hashes[(p + 1) * grp.block_size // self.model.hash_block_size - 1].hex()
                if b in invalid:
                    self.stats.load_error_blocks += 1
                    first_bad = min(first_bad, p * grp.block_size)
                    continue
                right = True
                for rank in range(len(self.workers)):
                    self.stats.blocks_checked += 1
                    if not self.check_block(rank, g, b, h):
                        right = False
                        self.stats.blocks_mismatched += 1
                        self.stats.failures.append(f"{r.req.request_id}: group {g} block {b} (chunk {p}) on rank {rank} holds wrong bytes")
                if right:
                    self.pool.register(g, b, h)
        if first_bad < hit:
            # vLLM recomputes from the first failed block (its prefix must be whole).
            sbs = self.model.scheduler_block_size
            first_bad = first_bad // sbs * sbs
            self.stats.recomputed_tokens += hit - first_bad
            self.stats.tokens_loaded[r.chosen] -= hit - first_bad
            r.req.num_computed_tokens = first_bad
        r.status, r.load = "loaded", None  # still in the waiting queue, where it waited


class FakePD:
    """A P/D connector (NixlConnector's role) placed before kvmesh in a
    MultiConnector: it claims ``pd_tokens`` tokens of the requests whose
    ``kv_transfer_params`` ask for them, "loads" them by writing the KV a
    prefill engine computed, and finishes each load the next step."""

    def __init__(self) -> None:
        self.pending: dict[str, tuple[int, list[list[int]]]] = {}
        self.chosen: set[str] = set()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        n = int((request.kv_transfer_params or {}).get("fake_pd_tokens", 0))
        return (n - num_computed_tokens, True) if n > num_computed_tokens else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self.pending[request.request_id] = (num_external_tokens, [list(g) for g in blocks.get_block_ids()])
            self.chosen.add(request.request_id)

    def build_connector_meta(self, so: SchedulerOutput) -> None:
        return None

    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, None]:
        return False, None

    def finish_loads(self, engine: Engine) -> set[str]:
        """Writes every pending load's KV (as NIXL would) and reports it."""
        done = set()
        for rid, (hit, table) in list(self.pending.items()):
            r = engine.reqs[rid]
            for g, grp in enumerate(engine.model.groups):
                for p in engine.model.load_chunks(g, 0, hit):
                    h = r.req.block_hashes[(p + 1) * grp.block_size // engine.model.hash_block_size - 1].hex()
                    for rank in range(len(engine.workers)):
                        engine.write_block(rank, g, table[g][p], h)
            done.add(rid)
            del self.pending[rid]
        return done


def run(engine: Engine, plan: list[dict], make_request, deadline_s: float = 90.0) -> None:
    """Plays the plan: each request once the one it follows finished."""
    as_engine: dict[str, str] = {}  # plan request id → the engine's (make_request may prefix it)
    end = time.monotonic() + deadline_s
    while True:
        done = set(engine.done_ids)
        for p in plan:
            rid, after = p["request_id"], p.get("after")
            if rid not in as_engine and (not after or as_engine.get(after) in done):
                req = make_request(p)
                as_engine[rid] = req.request_id
                engine.submit(req, list(p["output_token_ids"]))
        if len(as_engine) == len(plan) and engine.idle():
            return
        if not engine.step():
            time.sleep(0.005)  # poll interval: waiting on kvmesh (lookups, loads, finishes)
        if time.monotonic() > end:
            stuck = {rid: r.status for rid, r in engine.reqs.items() if r.status != "done"}
            raise TimeoutError(f"run not done within {deadline_s:.0f} s; unfinished: {stuck}; "
                               f"{len(as_engine)}/{len(plan)} started")
