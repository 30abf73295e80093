"""Unit tests of kvmesh_vllm.content: the simulator's block content and
store ranks (the Go side is checked against it by
internal/sim/content_python_test.go)."""

import hashlib
import struct

import numpy as np
import pytest

from kvmesh_vllm import content

MASK = (1 << 64) - 1

# Known answers computed by Go's sim.BlockContent (worker rank tp3) for the
# chained hash of tokens [1, 2, 3].
H123 = "a452f93a8b397e453162a0ee3b3408c00b5ddb4587f936b4ce2b66659feaedaf"
GO_VECTORS = [
    # (fingerprint, group, store rank, nbytes, first 16 bytes, sha256)
    ("fb7601abe94ba93b", 0, (3, 0, 0, 0), 2097152, "64481cfdb4bcbb1b02fa0823ec3eb32f",
     "2f5905b5ab1809d89beb18d1b44161c3a3736914d0c233106b8e05bff6b53b19"),
    ("f9fb82b50d6d4258", 0, (0, 0, 0, 0), 73728, "1a0e34e7b63c528082cc2f391061acc2",
     "aebd90ee694aa4f3dc8be8bd36478d702143ba1cf0048acc4765430a4f5eff03"),
    ("f9fb82b50d6d4258", 1, (3, 0, 0, 0), 32768, "5c20791164d3b74cfc7c6ded00023b77",
     "34fd87c813c8650721b1bd703105b31a84daea3cbc9f6e4dab0721759944495c"),
]


def ref_splitmix(z: int) -> int:
    """SplitMix64's finaliser in plain Python integers."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def ref_stream(key: int, n: int) -> bytes:
    """The first n bytes of the stream keyed key, word by word."""
    words = (ref_splitmix((key + (i + 1) * content.SPLITMIX_GAMMA) & MASK) for i in range((n + 7) // 8))
    return b"".join(struct.pack("<Q", w) for w in words)[:n]


@pytest.mark.parametrize("fp,group,sr,nbytes,first16,sha", GO_VECTORS)
def test_block_content_matches_go(fp, group, sr, nbytes, first16, sha):
    data = content.block_content(fp, group, sr, H123, nbytes)
    assert data.dtype == np.uint8 and data.shape == (nbytes,)
    assert data[:16].tobytes().hex() == first16
    assert hashlib.sha256(data.tobytes()).hexdigest() == sha


def test_stream_key42_matches_go():
    # Go: contentStream{key: 42}.fill(16 bytes).
    assert content.stream_bytes(42, 0, 16).tobytes().hex() == "956eeb2f2632d7bd03f166b233e3ef28"


@pytest.mark.parametrize("key", [0, 1, 42, MASK, 0x9E3779B97F4A7C15, 1 << 63])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 31, 32, 33, 100])
def test_stream_matches_reference(key, n):
    assert content.stream_bytes(key, 0, n).tobytes() == ref_stream(key, n)


@pytest.mark.parametrize("start,n", [(0, 5), (3, 5), (7, 1), (8, 8), (13, 100), (1 << 20, 17), ((1 << 20) - 3, 10)])
def test_stream_any_window(start, n):
    whole = ref_stream(7, start + n)
    assert content.stream_bytes(7, start, n).tobytes() == whole[start:]


def test_stream_across_chunks():
    # More than one numpy pass (1 MiB each), cut at an odd offset.
    n = 3 * (1 << 20) + 5
    whole = content.stream_bytes(99, 0, n)
    parts = [content.stream_bytes(99, 0, 1001), content.stream_bytes(99, 1001, n - 1001)]
    assert np.array_equal(whole, np.concatenate(parts))
    assert whole[-13:].tobytes() == ref_stream(99, n)[-13:]


def test_content_key_inputs():
    fp, h = "fb7601abe94ba93b", H123
    seed = hashlib.sha256(
        content.CONTENT_DOMAIN + fp.encode() + struct.pack("<5I", 1, 2, 3, 4, 5) + bytes.fromhex(h)
    ).digest()
    assert content.content_key(fp, 1, (2, 3, 4, 5), h) == int.from_bytes(seed[:8], "little")
    base = content.content_key(fp, 0, (0, 0, 0, 0), h)
    others = [
        content.content_key(fp, 1, (0, 0, 0, 0), h),
        content.content_key(fp, 0, (1, 0, 0, 0), h),
        content.content_key(fp, 0, (0, 1, 0, 0), h),
        content.content_key(fp, 0, (0, 0, 1, 0), h),
        content.content_key(fp, 0, (0, 0, 0, 1), h),
        content.content_key("0000000000000000", 0, (0, 0, 0, 0), h),
        content.content_key(fp, 0, (0, 0, 0, 0), "00"),
    ]
    assert base not in others and len(set(others)) == len(others)


@pytest.mark.parametrize(
    "rank",
    [(3, 0, 0, 0), {"tp": 3, "pcp": 0, "dcp": 0, "pp": 0}, {"tp": 3}, content.Rank(tp=3)],
)
def test_rank_forms(rank):
    assert content.as_rank(rank) == content.Rank(3, 0, 0, 0)
    assert np.array_equal(
        content.block_content("fp", 0, rank, "ab", 40), content.block_content("fp", 0, (3, 0, 0, 0), "ab", 40)
    )


def test_bad_rank():
    with pytest.raises(ValueError):
        content.as_rank((1, 2, 3))


@pytest.mark.parametrize(
    "hash_hex,want",
    [("ab", b"\xab"), ("AB01", b"\xab\x01"), (b"\x00\x01", b"\x00\x01")],
)
def test_parse_hash(hash_hex, want):
    assert content.parse_hash(hash_hex) == want


@pytest.mark.parametrize("bad", ["", "a", "abc", "zz", " ab", "ab ", "0x12"])
def test_parse_hash_refuses(bad):
    with pytest.raises(ValueError):
        content.parse_hash(bad)


@pytest.mark.parametrize(
    "cuts",
    [[73728], [1, 73727], [3, 13, 73712], [0, 8, 0, 73720], [36864, 36864], [4096] * 18],
)
def test_fill_regions_continues_the_stream(cuts):
    fp, g, sr = "f9fb82b50d6d4258", 0, (0, 0, 0, 0)
    regions = [np.zeros(n, dtype=np.uint8) for n in cuts]
    content.fill_regions(regions, fp, g, sr, H123)
    assert np.array_equal(np.concatenate(regions), content.block_content(fp, g, sr, H123, 73728))


def test_fill_regions_shapes_and_buffers():
    want = content.block_content("fp", 2, (1, 0, 0, 0), "0a", 64 + 16)
    two_d = np.zeros((4, 16), dtype=np.uint8)
    buf = bytearray(16)
    content.fill_regions([two_d, buf], "fp", 2, (1, 0, 0, 0), "0a")
    assert two_d.tobytes() + bytes(buf) == want.tobytes()
    # A strided view is filled in C order.
    big = np.zeros((4, 32), dtype=np.uint8)
    content.fill_regions([big[:, ::2]], "fp", 2, (1, 0, 0, 0), "0a")
    assert big[:, ::2].tobytes() == want[:64].tobytes() and not big[:, 1::2].any()


def test_fill_regions_refuses_other_dtypes():
    with pytest.raises(TypeError):
        content.fill_regions([np.zeros(4, dtype=np.float32)], "fp", 0, (0, 0, 0, 0), "ab")


def model(kind="full_attention", tp=8, kv_heads=0, dcp=0, pcp=0, pp=0, groups=None):
    """A model spec dict as Go marshals it (zero sizes omitted)."""
    parallel = {k: v for k, v in (("tp", tp), ("pcp", pcp), ("dcp", dcp), ("pp", pp)) if v}
    spec = {
        "name": "m",
        "hash_block_size": 16,
        "groups": groups or [{"kind": kind, "block_size": 16, "bytes_per_block": 64}],
        "parallel": parallel,
    }
    if kv_heads:
        spec["kv_heads"] = kv_heads
    return spec


@pytest.mark.parametrize(
    "spec,worker,want_tp",
    [
        (model("mla", tp=8), 7, 0),  # MLA: every TP rank shares one namespace
        (model("mamba", tp=8, kv_heads=1), 7, 7),  # Mamba state: sharded by rank
        (model("full_attention", tp=8), 5, 5),  # no kv_heads: a head per rank
        (model("full_attention", tp=8, kv_heads=2), 5, 1),  # GQA: 4 ranks share
        (model("full_attention", tp=8, kv_heads=8), 5, 5),
        (model("full_attention", tp=4, kv_heads=16), 3, 3),  # max(1, 4 // 16)
        (model("sliding_window", tp=8, kv_heads=4), 7, 3),
        (model("mla", tp=4, dcp=2), 3, 3),  # DCP: replication 1
        (model("full_attention", tp=2, kv_heads=1, pcp=2), 1, 0),
    ],
)
def test_store_rank(spec, worker, want_tp):
    r = content.Rank(tp=worker, pcp=1, dcp=0, pp=1)
    assert content.store_rank(spec, 0, r) == content.Rank(want_tp, 1, 0, 1)


def test_store_rank_tp8_preset_and_wrapper():
    # hybrid-mla-linear-tp8 as `kvmesh model --json` prints it.
    out = {
        "model": {
            "name": "hybrid-mla-linear",
            "hash_block_size": 16,
            "groups": [
                {"kind": "mla", "block_size": 16, "bytes_per_block": 73728},
                {"kind": "mamba", "block_size": 16, "bytes_per_block": 32768},
            ],
            "parallel": {"tp": 8},
        },
        "fingerprint": "f9fb82b50d6d4258",
        "world_size": 8,
    }
    for tp in range(8):
        assert content.store_rank(out, 0, {"tp": tp, "pcp": 0, "dcp": 0, "pp": 0}) == (0, 0, 0, 0)
        assert content.store_rank(out["model"], 1, (tp, 0, 0, 0)) == (tp, 0, 0, 0)
    assert content.replication(out, 0) == 8 and content.replication(out, 1) == 1


@pytest.mark.parametrize(
    "spec,want",
    [
        (model(tp=2), [(0, 0, 0, 0), (1, 0, 0, 0)]),
        (model(tp=4, dcp=2), [(0, 0, 0, 0), (1, 0, 1, 0), (2, 0, 0, 0), (3, 0, 1, 0)]),
        (model(tp=2, pcp=2, pp=2), [(t, c, 0, p) for c in range(2) for t in range(2) for p in range(2)]),
        ({"name": "x", "groups": [], "parallel": {}}, [(0, 0, 0, 0)]),
    ],
)
def test_worker_ranks(spec, want):
    assert content.worker_ranks(spec) == [content.Rank(*w) for w in want]
