"""The Python half of internal/sim/content_python_test.go.

Run by the Go test with PYTHONPATH=connectors/vllm. stdin:
``{"blocks": [...], "ranks": [...]}``; each block is ``{"fingerprint",
"group", "rank": {tp, pcp, dcp, pp}, "hash": hex, "nbytes", "regions":
[sizes] or null}``, each rank query ``{"model": spec, "group",
"worker_rank": {tp, pcp, dcp, pp}}``. stdout: ``{"blocks": [SHA-256 hex of
block_content, or of fill_regions over the given region sizes],
"store_ranks": [{tp, pcp, dcp, pp}], "worker_ranks": [[...] per distinct
model in order of first appearance]}``.
"""

import hashlib
import json
import sys

import numpy as np

from kvmesh_vllm import content


def block_digest(q: dict) -> str:
    """SHA-256 hex of one queried block's content."""
    args = (q["fingerprint"], q["group"], q["rank"], q["hash"])
    if q.get("regions") is None:
        data = content.block_content(*args, q["nbytes"])
    else:
        regions = [np.zeros(n, dtype=np.uint8) for n in q["regions"]]
        content.fill_regions(regions, *args)
        data = np.concatenate(regions)
    return hashlib.sha256(data.tobytes()).hexdigest()


def main() -> None:
    """Answer the request on stdin."""
    req = json.load(sys.stdin)
    ans = {
        "blocks": [block_digest(q) for q in req["blocks"]],
        "store_ranks": [
            content.store_rank(q["model"], q["group"], q["worker_rank"])._asdict() for q in req["ranks"]
        ],
        "worker_ranks": [[r._asdict() for r in content.worker_ranks(m)] for m in req.get("models", [])],
    }
    json.dump(ans, sys.stdout)


if __name__ == "__main__":
    main()
