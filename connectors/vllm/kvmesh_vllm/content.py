"""The Go simulator's block content in numpy (``internal/sim/content.go``).

The simulated engine "computes" a block's KV bytes as a pure function of
the model's fingerprint, the KV group, the rank namespace the block is
stored under (``kvcore.Model.StoreRank``, :func:`store_rank`) and the block
hash of the chunk's last hash-block:

* ``seed = SHA-256(b"kvmesh-sim/block-content/v2" || fingerprint ||
  uint32le(group, tp, pcp, dcp, pp) || hash bytes)``;
* ``key`` is the seed's first 8 bytes, little endian;
* word ``i`` of the block (bytes ``[8i, 8i+8)``, little endian) is
  SplitMix64's finaliser of ``key + (i+1) × 0x9e3779b97f4a7c15`` (mod
  2^64), and the block is the first ``bytes_per_block`` bytes of that
  stream.

A block split into regions (:func:`fill_regions`) gets the stream continued
across its regions in order, as Go's ``nsFill``. Everything is vectorised
in numpy ``uint64`` arithmetic, which wraps modulo 2^64 like Go's.
"""

from __future__ import annotations

import hashlib
import re
import struct
from typing import Any, Iterable, List, Mapping, NamedTuple, Sequence, Union

import numpy as np

#: CONTENT_DOMAIN separates the simulator's block contents from any other
#: use of the same hashes.
CONTENT_DOMAIN = b"kvmesh-sim/block-content/v2"
#: SPLITMIX_GAMMA is SplitMix64's counter increment.
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15

_GAMMA = np.uint64(SPLITMIX_GAMMA)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_CHUNK_WORDS = 1 << 17  # 1 MiB of stream per numpy pass
_HEX = re.compile(r"(?:[0-9a-fA-F]{2})+")

# The group kinds whose replication differs (pkg/kvcore/model.go).
KIND_MLA = "mla"
KIND_MAMBA = "mamba"


class Rank(NamedTuple):
    """A rank namespace (or worker rank): the tp/pcp/dcp/pp indices of a
    store key (``kvcore.Rank``)."""

    tp: int = 0
    pcp: int = 0
    dcp: int = 0
    pp: int = 0


RankLike = Union[Rank, Sequence[int], Mapping[str, int]]


def as_rank(r: RankLike) -> Rank:
    """``r`` as a :class:`Rank`: a Rank, a (tp, pcp, dcp, pp) sequence, or a
    dict with keys tp, pcp, dcp, pp (missing ones 0), as Go marshals
    ``kvcore.Rank``."""
    if isinstance(r, Rank):
        return r
    if isinstance(r, Mapping):
        return Rank(*(int(r.get(k, 0)) for k in Rank._fields))
    vals = tuple(int(v) for v in r)
    if len(vals) != 4:
        raise ValueError(f"a rank is (tp, pcp, dcp, pp), not {vals!r}")
    return Rank(*vals)


def parse_hash(hash_hex: Union[str, bytes]) -> bytes:
    """The bytes of a block hash: ``hash_hex`` in hex (either case, as
    ``kvcore.ParseBlockHash`` accepts; empty or malformed raises
    ``ValueError``), or ``bytes`` taken as the raw hash."""
    if isinstance(hash_hex, (bytes, bytearray, memoryview)):
        return bytes(hash_hex)
    if not _HEX.fullmatch(hash_hex):
        raise ValueError(f"block hash {hash_hex!r}: not a non-empty even-length hex string")
    return bytes.fromhex(hash_hex)


def content_key(fingerprint: str, group: int, rank: RankLike, hash_hex: Union[str, bytes]) -> int:
    """The key of one block's content stream: the first 8 bytes (little
    endian) of SHA-256 of the content inputs (Go's ``contents.seed``)."""
    sr = as_rank(rank)
    h = hashlib.sha256()
    h.update(CONTENT_DOMAIN)
    h.update(fingerprint.encode("utf-8"))
    h.update(struct.pack("<5I", *(v & 0xFFFFFFFF for v in (group, sr.tp, sr.pcp, sr.dcp, sr.pp))))
    h.update(parse_hash(hash_hex))
    return int.from_bytes(h.digest()[:8], "little")


def _words(key: int, first: int, count: int) -> np.ndarray:
    """Stream words first..first+count-1 of the stream keyed ``key``."""
    z = np.arange(first + 1, first + 1 + count, dtype=np.uint64)
    z *= _GAMMA
    z += np.uint64(key)
    z ^= z >> np.uint64(30)
    z *= _MIX1
    z ^= z >> np.uint64(27)
    z *= _MIX2
    z ^= z >> np.uint64(31)
    return z


def stream_bytes(key: int, start: int, n: int) -> np.ndarray:
    """Bytes ``[start, start+n)`` of the content stream keyed ``key``, as a
    new numpy ``uint8`` array."""
    out = np.empty(n, dtype=np.uint8)
    at = 0
    while at < n:
        pos = start + at
        w0 = pos // 8
        count = min(_CHUNK_WORDS, (start + n + 7) // 8 - w0)
        b = _words(key, w0, count).astype("<u8", copy=False).view(np.uint8)
        skip = pos - 8 * w0
        take = min(n - at, b.size - skip)
        out[at : at + take] = b[skip : skip + take]
        at += take
    return out


def block_content(
    fingerprint: str, group: int, store_rank: RankLike, hash_hex: Union[str, bytes], nbytes: int
) -> np.ndarray:
    """The KV bytes the simulated engine computes for one block (Go's
    ``BlockContent`` / ``nsBlock``): ``nbytes`` (the group's
    ``bytes_per_block``) bytes of the stream of (fingerprint, group,
    store_rank, hash). ``store_rank`` is the namespace the block is stored
    under (:func:`store_rank`), not the worker rank."""
    if nbytes < 0:
        raise ValueError(f"{nbytes} bytes")
    return stream_bytes(content_key(fingerprint, group, store_rank, hash_hex), 0, nbytes)


def _writable_bytes(region: Any) -> np.ndarray:
    """region (a numpy array, or a writable buffer) as a numpy array to
    write bytes into."""
    if isinstance(region, np.ndarray):
        if region.dtype != np.uint8:
            raise TypeError(f"a region is uint8, not {region.dtype}")
        return region
    return np.frombuffer(memoryview(region).cast("B"), dtype=np.uint8)


def fill_regions(
    regions: Iterable[Any], fingerprint: str, group: int, store_rank: RankLike, hash_hex: Union[str, bytes]
) -> None:
    """Write one block's content into its regions, in order, the stream
    continuing across them (Go's ``nsFill``): the regions together get what
    :func:`block_content` returns for their total size. Each region is a
    writable numpy ``uint8`` array (any shape, filled in C order) or a
    writable buffer."""
    key = content_key(fingerprint, group, store_rank, hash_hex)
    pos = 0
    for region in regions:
        dst = _writable_bytes(region)
        np.copyto(dst, stream_bytes(key, pos, dst.size).reshape(dst.shape))
        pos += dst.size


# --------------------------------------------------------------------------
# Store ranks (pkg/kvcore/parallel.go).


def _model(spec: Mapping[str, Any]) -> Mapping[str, Any]:
    """The model of a spec: the dict itself, or its ``"model"`` when it is
    the whole ``kvmesh model --json`` output."""
    if "groups" not in spec and isinstance(spec.get("model"), Mapping):
        return spec["model"]
    return spec


def _size(n: Any) -> int:
    """A parallel size: zero or absent means 1."""
    n = int(n or 0)
    return 1 if n <= 0 else n


def replication(model_spec: Mapping[str, Any], group: int) -> int:
    """The number of TP ranks holding byte-identical values of ``group``,
    sharing one store namespace (``kvcore.Model.Replication``): 1 with DCP,
    1 for Mamba state, tp for MLA, otherwise max(1, tp // kv_heads) (1
    without kv_heads)."""
    m = _model(model_spec)
    p = m.get("parallel") or {}
    tp = _size(p.get("tp"))
    kind = m["groups"][group]["kind"]
    kv_heads = int(m.get("kv_heads") or 0)
    if _size(p.get("dcp")) > 1 or kind == KIND_MAMBA:
        return 1
    if kind == KIND_MLA:
        return tp
    if kv_heads <= 0:
        return 1
    return max(1, tp // kv_heads)


def store_rank(model_spec: Mapping[str, Any], group: int, worker_rank: RankLike) -> Rank:
    """The namespace worker rank ``worker_rank`` reads and writes for
    ``group`` (``kvcore.Model.StoreRank``): its TP index divided by the
    group's :func:`replication`. ``model_spec`` is the model spec as JSON
    decodes it (``kvmesh model --json``'s ``"model"``, or that whole
    output)."""
    r = as_rank(worker_rank)
    return r._replace(tp=r.tp // replication(model_spec, group))


def worker_ranks(model_spec: Mapping[str, Any]) -> List[Rank]:
    """Every worker rank of one engine, pcp outermost, then tp, then pp;
    a worker's dcp index is tp % dcp (``kvcore.Model.WorkerRanks``)."""
    p = _model(model_spec).get("parallel") or {}
    tp, pcp, dcp, pp = (_size(p.get(k)) for k in ("tp", "pcp", "dcp", "pp"))
    return [Rank(t, c, t % dcp, q) for c in range(pcp) for t in range(tp) for q in range(pp)]
