"""The Python half of pkg/kvmem/python_interop_test.go.

Run by the Go test with PYTHONPATH=connectors/vllm; reads a JSON request on
stdin, writes a JSON answer on stdout. Modes:

``layouts DIR``
    stdin: a list of ``{"layout": (as Go marshals it), "create": bool}``.
    For each: whether the layout is valid, its JSON, offsets and header
    (base64), and (with create) the path of a fresh segment of it this side
    created in DIR.
``read PATH [--recover]``
    Open the segment Go created at PATH and dump every block (``dump``);
    with ``--recover`` then clear the records a gpuworker left mid-write
    (``recovered`` counts them).
``write PATH``
    stdin: ``{"layout": ..., "ops": [...]}``. Create a segment at PATH,
    play the ops through ``EngineWriter`` (``write``, ``write_regions``,
    ``abort``: a write whose fill fails half way, ``evict``) and answer the
    registration body, each op's result and the dump.
``stress PATH WRITES``
    Open the one-block segment Go created at PATH and rewrite its block
    WRITES times through ``EngineWriter`` (hash ``i % 5 + 1`` as 64 hex
    digits, bytes ``pattern(i % 5 + 1)``), evicting it every 13th time,
    while Go reads it by the reader's protocol.
``replay PATH``
    stdin: ``{"layout": ..., "ops": [...]}`` with fixed generations and
    times: create a segment at PATH and play the ops straight on the
    records (begin, bytes, commit or abort), for a byte-for-byte comparison
    with the same ops played by Go.
"""

import base64
import hashlib
import json
import sys

import numpy as np

from kvmesh_vllm import kvmem


def pattern(seed: int, n: int) -> np.ndarray:
    """The test bytes of a block: byte j is (seed + 7j + (j >> 8)) mod 256
    (the Go test's pattern)."""
    j = np.arange(n, dtype=np.int64)
    return ((seed + 7 * j + (j >> 8)) & 0xFF).astype(np.uint8)


def held_dict(held):
    """A Held as JSON (None stays None)."""
    if held is None:
        return None
    return {
        "hash": held.hash,
        "request_id": held.request_id,
        "generation": held.generation,
        "completed": held.completed_ns,
        "writer": int(held.writer),
    }


def dump(seg: kvmem.Segment) -> list:
    """Every block's record (sequence, ok, what it holds) and the SHA-256
    of its bytes (its regions in order), per group."""
    out = []
    for g, gl in enumerate(seg.layout.groups):
        blocks = []
        for b in range(gl.blocks):
            seq, held, ok = seg.record(g, b).load()
            h = hashlib.sha256()
            for r in seg.block_regions(g, b):
                h.update(r.tobytes())
            blocks.append({"seq": seq, "ok": ok, "held": held_dict(held), "sha256": h.hexdigest()})
        out.append(blocks)
    return out


def offsets_dict(o: kvmem.Offsets) -> dict:
    """Offsets as the Go test decodes them (Go's field names)."""
    return {"Records": list(o.records), "Data": [list(d) for d in o.data], "Size": o.size}


def mode_layouts(directory: str) -> dict:
    """Answer of ``layouts``."""
    out = []
    for i, q in enumerate(json.load(sys.stdin)):
        entry = {"valid": False, "json": None, "offsets": None, "header": None, "file": None, "error": None}
        out.append(entry)
        try:
            layout = kvmem.Layout.from_dict(q["layout"])
            layout.validate()
        except kvmem.LayoutError as e:
            entry["error"] = str(e)
            continue
        entry["valid"] = True
        entry["json"] = layout.to_json()
        entry["offsets"] = offsets_dict(layout.offsets())
        try:
            entry["header"] = base64.b64encode(kvmem.encode_header(layout)).decode()
        except kvmem.LayoutError as e:  # valid, but its JSON overflows the header
            entry["error"] = str(e)
            continue
        if not q["create"]:
            continue
        path = f"{directory}/py-{i}.kvmem"
        kvmem.Segment.create(path, layout).close()
        entry["file"] = path
    return {"layouts": out}


def mode_read(path: str, recover: bool) -> dict:
    """Answer of ``read``."""
    with kvmem.Segment.open(path) as seg:
        ans = {"layout": seg.layout.to_json(), "size": seg.size, "blocks": dump(seg)}
        with open(path, "rb") as f:
            ans["file_sha256"] = hashlib.sha256(f.read()).hexdigest()
        if recover:
            ans["recovered"] = kvmem.EngineWriter(seg).recover_worker_writes()
    return ans


class _FillFailed(Exception):
    """The failure an ``abort`` op's fill raises."""


def mode_write(path: str) -> dict:
    """Answer of ``write``."""
    req = json.load(sys.stdin)
    layout = kvmem.Layout.from_dict(req["layout"])
    seg = kvmem.Segment.create(path, layout)
    w = kvmem.EngineWriter(seg)
    results = []
    for op in req["ops"]:
        g, b = op["group"], op["block"]
        nbytes = layout.groups[g].block_bytes
        res = {"op": op["op"]}
        if op["op"] == "write":
            res["generation"] = w.write_bytes(g, b, op["hash"], op["request_id"], pattern(op["seed"], nbytes))
        elif op["op"] == "write_regions":
            data = pattern(op["seed"], nbytes)

            def fill(regions, data=data):
                at = 0
                for r in regions:
                    r[:] = data[at : at + r.size]
                    at += r.size

            res["generation"] = w.write(g, b, op["hash"], op["request_id"], fill)
        elif op["op"] == "abort":

            def fail(regions):
                regions[0][: regions[0].size // 2] = 0xAB
                raise _FillFailed("fill failed")

            try:
                w.write(g, b, op["hash"], op["request_id"], fail)
                res["raised"] = False
            except _FillFailed:
                res["raised"] = True
        elif op["op"] == "evict":
            res["evicted"] = w.evict(g, b)
        else:
            raise ValueError(f"unknown op {op['op']!r}")
        results.append(res)
    ans = {"registration": kvmem.shm_registration(seg), "results": results, "blocks": dump(seg)}
    seg.close()
    return ans


def mode_stress(path: str, writes: int) -> dict:
    """Answer of ``stress``."""
    with kvmem.Segment.open(path) as seg:
        n = seg.layout.groups[0].block_bytes
        contents = {k: pattern(k, n) for k in range(1, 6)}
        w = kvmem.EngineWriter(seg)
        written = evicted = 0
        for i in range(writes):
            if i % 13 == 0:
                w.evict(0, 0)
                evicted += 1
                continue
            k = i % 5 + 1
            w.write_bytes(0, 0, f"{k:064x}", "py", contents[k])
            written += 1
    return {"written": written, "evicted": evicted}


def mode_replay(path: str) -> dict:
    """Answer of ``replay``."""
    req = json.load(sys.stdin)
    layout = kvmem.Layout.from_dict(req["layout"])
    with kvmem.Segment.create(path, layout) as seg:
        for op in req["ops"]:
            g, b = op["group"], op["block"]
            rec = seg.record(g, b)
            seq = rec.begin(op["writer"])
            data = pattern(op["seed"], layout.groups[g].block_bytes)
            at = 0
            for r in seg.block_regions(g, b):
                r[:] = data[at : at + r.size]
                at += r.size
            if op["abort"]:
                rec.abort(seq)
            else:
                rec.commit(seq, op["hash"], op["request_id"], op["generation"], op["completed"], op["writer"])
        return {"blocks": dump(seg)}


def main(argv: list) -> None:
    """Dispatch on the mode; the answer goes to stdout as JSON."""
    mode = argv[1]
    if mode == "layouts":
        ans = mode_layouts(argv[2])
    elif mode == "read":
        ans = mode_read(argv[2], "--recover" in argv[3:])
    elif mode == "write":
        ans = mode_write(argv[2])
    elif mode == "stress":
        ans = mode_stress(argv[2], int(argv[3]))
    elif mode == "replay":
        ans = mode_replay(argv[2])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    json.dump(ans, sys.stdout)


if __name__ == "__main__":
    main(sys.argv)
