"""Unit tests of kvmesh_vllm.kvmem: the Python twin of Go's pkg/kvmem
(the two sides are checked against each other byte for byte by
pkg/kvmem/python_interop_test.go)."""

import base64
import json
import os
import struct
import time

import numpy as np
import pytest

from kvmesh_vllm import kvmem
from kvmesh_vllm.kvmem import GroupLayout, Layout

L1 = Layout([GroupLayout(4, [64])])
L2 = Layout([GroupLayout(3, [16, 16, 32]), GroupLayout(5, [40])])


# ---------------------------------------------------------------- layouts


@pytest.mark.parametrize(
    "layout,want",
    [
        (L1, '{"groups":[{"blocks":4,"regions":[64]}]}'),
        (L2, '{"groups":[{"blocks":3,"regions":[16,16,32]},{"blocks":5,"regions":[40]}]}'),
        (Layout([GroupLayout(1 << 24, [1 << 32])]), '{"groups":[{"blocks":16777216,"regions":[4294967296]}]}'),
    ],
)
def test_to_json_is_gos(layout, want):
    assert layout.to_json() == want
    assert Layout.from_json(want) == layout
    assert json.loads(want) == layout.to_dict()


@pytest.mark.parametrize(
    "layout,ok",
    [
        (L1, True),
        (L2, True),
        (Layout([GroupLayout(1 << 24, [1 << 32])]), True),
        (Layout([]), False),
        (Layout([GroupLayout(0, [64])]), False),
        (Layout([GroupLayout((1 << 24) + 1, [64])]), False),
        (Layout([GroupLayout(4, [])]), False),
        (Layout([GroupLayout(4, [64, 0])]), False),
        (Layout([GroupLayout(4, [(1 << 32) + 1])]), False),
        (Layout([GroupLayout(4, [-1])]), False),
        (Layout([GroupLayout(True, [64])]), False),
        (Layout([GroupLayout(4, [64.0])]), False),
        (Layout([GroupLayout(4, [64]), GroupLayout(2, [0])]), False),
    ],
)
def test_validate(layout, ok):
    if ok:
        layout.validate()
    else:
        with pytest.raises(kvmem.LayoutError):
            layout.validate()


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        '{"groups":{}}',
        '{"groups":[1]}',
        '{"groups":[{"blocks":4.5,"regions":[64]}]}',
        '{"groups":[{"blocks":4,"regions":["64"]}]}',
        '{"groups":[{"blocks":4,"regions":64}]}',
        '{"groups":[{"blocks":true,"regions":[64]}]}',
    ],
)
def test_from_json_refuses(text):
    with pytest.raises(kvmem.LayoutError):
        Layout.from_json(text)


def test_from_json_nulls_and_unknown_fields():
    # Go's json.Unmarshal ignores unknown fields and decodes null as empty.
    assert Layout.from_json('{"groups":null}') == Layout([])
    assert Layout.from_json('{"groups":[{"blocks":2,"regions":null,"x":1}],"y":2}') == Layout([GroupLayout(2, [])])


def test_offsets_by_hand():
    o = L2.offsets()
    # Records: 3 blocks of group 0 from the header, then 5 of group 1.
    assert o.records == (4096, 4096 + 3 * 512)
    # Data: page aligned, each region tensor blocks × bytes long.
    assert o.data == ((8192, 12288, 16384), (20480,))
    assert o.size == 24576
    assert L1.offsets() == kvmem.Offsets(records=(4096,), data=((8192,),), size=12288)


def test_model_layout_and_check():
    spec = {"name": "tiny", "groups": [{"bytes_per_block": 64}, {"bytes_per_block": 32}]}
    layout = Layout.for_model(spec, 4)
    assert layout == Layout([GroupLayout(4, [64]), GroupLayout(4, [32])])
    layout.check_model(spec)
    Layout([GroupLayout(4, [16, 16, 32]), GroupLayout(2, [32])]).check_model(spec)
    for bad in (Layout([GroupLayout(4, [64])]), Layout([GroupLayout(4, [16, 16]), GroupLayout(4, [32])])):
        with pytest.raises(kvmem.LayoutError):
            bad.check_model(spec)


# ---------------------------------------------------------------- header


def test_encode_header():
    h = kvmem.encode_header(L2)
    js = L2.to_json().encode()
    assert len(h) == kvmem.HEADER_SIZE
    assert h[:8] == b"KVMEMSEG"
    assert struct.unpack_from("<II", h, 8) == (1, len(js))
    assert h[16 : 16 + len(js)] == js and not any(h[16 + len(js) :])
    assert kvmem.decode_header(h) == L2


def test_encode_header_too_big():
    big = Layout([GroupLayout(4, [1_000_000] * 800)])
    big.validate()
    with pytest.raises(kvmem.LayoutError):
        kvmem.encode_header(big)


def _patched(h: bytes, at: int, b: bytes) -> bytes:
    return h[:at] + b + h[at + len(b) :]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda h: _patched(h, 0, b"KVMEMSEX"),
        lambda h: _patched(h, 8, struct.pack("<I", 2)),
        lambda h: _patched(h, 12, struct.pack("<I", 4081)),
        lambda h: _patched(h, 16, b"["),
        lambda h: _patched(h, 12, struct.pack("<I", 5)),  # truncated JSON
        lambda h: h[:100],
        # A layout of zero blocks, same JSON length (padded with spaces).
        lambda h: _patched(h, 16, b'{"groups":[{"blocks":0,"regions":[64]}]}' + b" " * 2),
    ],
)
def test_decode_header_refuses(mutate):
    h = kvmem.encode_header(L1)
    with pytest.raises(kvmem.SegmentError):
        kvmem.decode_header(mutate(h))


# ---------------------------------------------------------------- segments


@pytest.fixture
def seg(tmp_path):
    s = kvmem.Segment.create(str(tmp_path / "s.kvmem"), L2)
    yield s
    s.remove()


def test_create(tmp_path, seg):
    assert os.path.getsize(seg.path) == seg.size == L2.offsets().size
    assert (os.stat(seg.path).st_mode & 0o777) == 0o600
    with open(seg.path, "rb") as f:
        assert f.read(kvmem.HEADER_SIZE) == kvmem.encode_header(L2)
    for g, gl in enumerate(L2.groups):
        for b in range(gl.blocks):
            assert seg.record(g, b).load() == (0, None, True)
    with pytest.raises(kvmem.SegmentError):
        kvmem.Segment.create(seg.path, L2)  # exclusive
    with pytest.raises(kvmem.LayoutError):
        kvmem.Segment.create(str(tmp_path / "bad"), Layout([]))
    assert not (tmp_path / "bad").exists()


def test_open_shares_the_bytes(seg):
    other = kvmem.Segment.open(seg.path, L2)
    try:
        assert other.layout == L2
        seg.region(1, 0)[2, :] = 7
        assert (other.block_regions(1, 2)[0] == 7).all()
        w = kvmem.EngineWriter(seg)
        gen = w.write_bytes(0, 1, "ab", "r", np.arange(64, dtype=np.uint8))
        _, held, ok = other.record(0, 1).load()
        assert ok and held.hash == "ab" and held.generation == gen
        assert np.concatenate(other.block_regions(0, 1)).tolist() == list(range(64))
    finally:
        other.close()


def test_open_refuses(tmp_path, seg):
    with pytest.raises(kvmem.LayoutError):
        kvmem.Segment.open(seg.path, L1)
    with pytest.raises(kvmem.SegmentError):
        kvmem.Segment.open(str(tmp_path / "missing"))
    with pytest.raises(kvmem.SegmentError):
        kvmem.Segment.open(str(tmp_path))  # a directory
    short = tmp_path / "short"
    short.write_bytes(b"KVMEMSEG")
    with pytest.raises(kvmem.SegmentError):
        kvmem.Segment.open(str(short))
    truncated = tmp_path / "truncated"
    with open(seg.path, "rb") as f:
        truncated.write_bytes(f.read(seg.size - 4096))
    with pytest.raises(kvmem.SegmentError):
        kvmem.Segment.open(str(truncated))
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"\0" * 8192)
    with pytest.raises(kvmem.SegmentError):
        kvmem.Segment.open(str(garbage))


def test_views(seg):
    r = seg.region(0, 2)
    assert r.shape == (3, 32) and r.dtype == np.uint8 and r.flags.writeable
    regions = seg.block_regions(0, 1)
    assert [x.shape for x in regions] == [(16,), (16,), (32,)]
    regions[2][:] = 9
    assert (r[1] == 9).all() and not r[0].any() and not r[2].any()
    # Views lie at the offsets the layout gives.
    with open(seg.path, "rb") as f:
        raw = f.read()
    off = L2.offsets().data[0][2] + 32
    assert raw[off : off + 32] == b"\x09" * 32


def test_buffer_is_the_mapping(seg):
    buf = seg.buffer
    assert buf.dtype == np.uint8 and buf.shape == (seg.size,) and buf.flags.writeable
    assert buf[:8].tobytes() == b"KVMEMSEG"
    off = L2.offsets().data[1][0]
    buf[off + 40 : off + 80] = 3  # block 1 of group 1
    assert (seg.block_regions(1, 1)[0] == 3).all() and not seg.block_regions(1, 0)[0].any()


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.region(2, 0),
        lambda s: s.region(0, 3),
        lambda s: s.region(-1, 0),
        lambda s: s.block_regions(0, 3),
        lambda s: s.block_regions(1, -1),
        lambda s: s.record(1, 5),
        lambda s: s.record(2, 0),
    ],
)
def test_out_of_range(seg, call):
    with pytest.raises(kvmem.RangeError):
        call(seg)


def test_torch_region(seg):
    torch = pytest.importorskip("torch")
    t = seg.torch_region(0, 2, torch.float16, (3, 2, 8))
    assert t.shape == (3, 2, 8) and t.dtype == torch.float16
    t[1].fill_(1.0)
    assert np.frombuffer(seg.block_regions(0, 1)[2].tobytes(), dtype=np.float16).tolist() == [1.0] * 16
    seg.region(0, 2)[2, :2] = np.frombuffer(np.float16(2.5).tobytes(), dtype=np.uint8)
    assert t[2, 0, 0].item() == 2.5
    u = seg.torch_region(1, 0)
    assert u.shape == (5, 40) and u.dtype == torch.uint8
    for shape, dtype in [((3, 17), torch.float16), ((3, 5), torch.float64), ((96,), torch.float16)]:
        with pytest.raises(kvmem.LayoutError):
            seg.torch_region(0, 2, dtype, shape)
    with pytest.raises(kvmem.LayoutError):
        seg.torch_region(1, 0, torch.complex128)  # 40-byte regions: no whole 16-byte element
    # The tensor outlives the segment object's close: the mapping stays.
    seg.close()
    assert t[1, 0, 0].item() == 1.0


def test_close_and_remove(tmp_path):
    path = str(tmp_path / "c.kvmem")
    with kvmem.Segment.create(path, L1) as s:
        view = s.region(0, 0)
        rec = s.record(0, 0)
    assert s.closed
    s.close()  # twice is fine
    for call in (lambda: s.region(0, 0), lambda: s.record(0, 0), lambda: s.block_regions(0, 0), lambda: s.buffer):
        with pytest.raises(kvmem.SegmentError):
            call()
    view[0, 0] = 1  # views taken before keep the mapping alive
    assert rec.load() == (0, None, True)
    assert os.path.exists(path)
    s.remove()
    assert not os.path.exists(path)
    s.remove()  # gone already: fine


# ---------------------------------------------------------------- records


def words(seg, g, b):
    return seg.records(g)[b]


def test_record_protocol(seg):
    rec = seg.record(0, 0)
    seq = rec.begin()
    assert seq == 1 and rec.seq == 1
    assert rec.load() == (1, None, False)
    with pytest.raises(kvmem.BusyError):
        rec.begin()
    rec.commit(seq, "abcdefghij", "req-1", 77, 123, kvmem.WRITER_ENGINE)
    s2, held, ok = rec.load()
    assert (s2, ok) == (2, True)
    assert held == kvmem.Held("abcdefghij", "req-1", 77, 123, kvmem.Writer.ENGINE)
    assert rec.unchanged(2)
    seq = rec.begin(kvmem.WRITER_WORKER)
    assert not rec.unchanged(2)
    rec.abort(seq)
    assert rec.load() == (4, None, True)


def test_record_words(seg):
    rec = seg.record(1, 3)
    seq = rec.begin()
    w = words(seg, 1, 3)
    assert int(w[3]) == 1 << 32  # begin: writer engine, no lengths
    rec.commit(seq, "abcdefghij", "r" * 130, 1 << 63, -5, kvmem.WRITER_WORKER)
    assert int(w[0]) == 2
    assert int(w[1]) == 1 << 63
    assert int(w[2]) == (1 << 64) - 5
    assert int(w[3]) == 10 | 128 << 16 | 2 << 32
    assert int(w[4]) == int.from_bytes(b"abcdefgh", "little")
    assert int(w[5]) == int.from_bytes(b"ij", "little")
    assert all(int(w[36 + i]) == int.from_bytes(b"r" * 8, "little") for i in range(16))
    assert not w[52:].any()
    _, held, _ = rec.load()
    assert held.request_id == "r" * 128 and held.completed_ns == -5 and held.writer == kvmem.Writer.WORKER
    # A shorter rewrite stores only its own words: the rest are stale, unread.
    seq = rec.begin()
    rec.commit(seq, "x", "", 2, 3)
    assert int(w[4]) == ord("x") and int(w[5]) == int.from_bytes(b"ij", "little")
    assert rec.load()[1] == kvmem.Held("x", "", 2, 3, kvmem.Writer.ENGINE)
    # Writer values Go does not name are kept as numbers.
    w[3] = 1 | 9 << 32
    assert rec.load()[1].writer == 9


def test_record_text_bytes(seg):
    rec = seg.record(0, 2)
    seq = rec.begin()
    rec.commit(seq, b"\xff\xfe", "é" * 70, 1, 1)  # 140 UTF-8 bytes, cut mid-character
    _, held, _ = rec.load()
    assert held.hash.encode("utf-8", "surrogateescape") == b"\xff\xfe"
    assert held.request_id.encode("utf-8", "surrogateescape") == ("é" * 70).encode()[:128]


@pytest.mark.parametrize("bad_hash", ["", "a" * 256])
def test_commit_bad_hash_aborts(seg, bad_hash):
    rec = seg.record(0, 1)
    seq = rec.begin()
    with pytest.raises(kvmem.IdentityError):
        rec.commit(seq, bad_hash, "", 1, 1)
    assert rec.load() == (2, None, True)


def test_commit_clobbered(seg):
    rec = seg.record(0, 1)
    seq = rec.begin()
    rec.force_clear()  # the owner reset a write taken for dead
    assert rec.load() == (2, None, True)
    with pytest.raises(kvmem.ClobberedError):
        rec.commit(seq, "ab", "", 1, 1)
    assert rec.load() == (2, None, True)


def test_record_needs_uint64_words():
    with pytest.raises(kvmem.SegmentError):
        kvmem.Record(np.zeros(64, dtype=np.int64))
    with pytest.raises(kvmem.SegmentError):
        kvmem.Record(np.zeros(63, dtype=np.uint64))


@pytest.mark.parametrize("machine", ["aarch64", "arm64", "ppc64le", "riscv64", ""])
def test_refuses_without_store_order(seg, monkeypatch, machine):
    rec = seg.record(0, 0)
    seq = rec.begin()
    rec.commit(seq, "ab", "", 1, 1)
    monkeypatch.setattr(kvmem.platform, "machine", lambda: machine)
    w = kvmem.EngineWriter(seg)
    for call in (
        rec.begin,
        lambda: rec.abort(2),
        lambda: rec.commit(2, "ab", "", 1, 1),
        lambda: rec.unchanged(2),
        rec.force_clear,
        lambda: w.write_bytes(0, 1, "ab", "", bytes(64)),
        lambda: w.evict(0, 0),
        w.recover_worker_writes,
    ):
        with pytest.raises(kvmem.UnsupportedPlatformError):
            call()
    assert rec.load()[1].hash == "ab"  # reading is fine, nothing changed


@pytest.mark.parametrize("machine", ["x86_64", "AMD64"])
def test_store_order_machines(seg, monkeypatch, machine):
    monkeypatch.setattr(kvmem.platform, "machine", lambda: machine)
    seg.record(0, 0).begin()


# ---------------------------------------------------------------- writer


def test_writer_generations(seg):
    before = time.time_ns()
    w = kvmem.EngineWriter(seg)
    gens = [w.write_bytes(0, b % 3, "ab", "", bytes(64)) for b in range(5)]
    assert gens == sorted(set(gens)) and gens[0] > before and gens[-1] - gens[0] == 4
    assert seg.record(0, 1).load()[1].generation == gens[4]
    assert seg.record(0, 1).load()[1].completed_ns >= before


def test_write_fill(seg):
    w = kvmem.EngineWriter(seg)
    seen = []

    def fill(regions):
        seen.append(seg.record(1, 4).load())  # odd while filling
        regions[0][:] = np.arange(40, dtype=np.uint8)

    gen = w.write(1, 4, "c0ffee", "req", fill)
    assert seen == [(1, None, False)]
    _, held, ok = seg.record(1, 4).load()
    assert ok and held == kvmem.Held("c0ffee", "req", gen, held.completed_ns, kvmem.Writer.ENGINE)
    assert seg.region(1, 0)[4].tolist() == list(range(40))


def test_write_fill_failure_aborts(seg):
    w = kvmem.EngineWriter(seg)
    w.write_bytes(1, 0, "aa", "", bytes(40))

    class Boom(Exception):
        pass

    def fill(regions):
        regions[0][:5] = 1
        raise Boom()

    with pytest.raises(Boom):
        w.write(1, 0, "bb", "", fill)
    assert seg.record(1, 0).load() == (4, None, True)


def test_write_bytes_regions_in_order(seg):
    w = kvmem.EngineWriter(seg)
    data = np.arange(64, dtype=np.uint8)
    w.write_bytes(0, 2, "ab", "", data)
    want = [list(range(16)), list(range(16, 32)), list(range(32, 64))]
    assert [r.tolist() for r in seg.block_regions(0, 2)] == want
    w.write_bytes(0, 1, "ab", "", bytes(range(64)))
    assert np.concatenate(seg.block_regions(0, 1)).tolist() == list(range(64))
    with pytest.raises(kvmem.RangeError):
        w.write_bytes(0, 0, "ab", "", bytes(63))


@pytest.mark.parametrize(
    "hash_hex,request_id,ok",
    [
        ("ab", "", True),
        ("a" * 255, "r" * 1024, True),
        ("not-hex-but-go-accepts-it", "", True),
        ("", "", False),
        ("a" * 256, "", False),
        ("ab", "r" * 1025, False),
        ("é" * 128, "", False),  # 256 bytes of UTF-8
    ],
)
def test_identity_validation(seg, hash_hex, request_id, ok):
    w = kvmem.EngineWriter(seg)
    if ok:
        w.write_bytes(1, 1, hash_hex, request_id, bytes(40))
        assert seg.record(1, 1).load()[1].hash == hash_hex
    else:
        with pytest.raises(kvmem.IdentityError):
            w.write_bytes(1, 1, hash_hex, request_id, bytes(40))
        assert seg.record(1, 1).load() == (0, None, True)  # untouched


def test_writer_refuses(seg):
    w = kvmem.EngineWriter(seg)
    with pytest.raises(kvmem.RangeError):
        w.write(2, 0, "ab", "", lambda r: None)
    with pytest.raises(kvmem.RangeError):
        w.evict(0, 3)
    seg.record(0, 0).begin(kvmem.WRITER_WORKER)
    with pytest.raises(kvmem.BusyError):
        w.write_bytes(0, 0, "ab", "", bytes(64))
    with pytest.raises(kvmem.BusyError):
        w.evict(0, 0)


def test_evict(seg):
    w = kvmem.EngineWriter(seg)
    w.write_bytes(1, 2, "ab", "", bytes(40))
    assert w.evict(1, 2) is True
    assert seg.record(1, 2).load() == (4, None, True)
    assert w.evict(1, 2) is False
    assert w.evict(1, 3) is False
    assert seg.record(1, 3).seq == 2


def test_recover_worker_writes(seg):
    w = kvmem.EngineWriter(seg)
    w.write_bytes(1, 0, "ab", "", bytes(40))
    seg.record(1, 0).begin(kvmem.WRITER_WORKER)  # a load that died: seq 3
    seg.record(0, 2).begin(kvmem.WRITER_WORKER)  # seq 1
    engine_seq = seg.record(1, 4).begin(kvmem.WRITER_ENGINE)  # the engine's own: left alone
    assert w.recover_worker_writes() == 2
    assert seg.record(1, 0).load() == (4, None, True)
    assert seg.record(0, 2).load() == (2, None, True)
    assert seg.record(1, 4).seq == engine_seq
    assert w.recover_worker_writes() == 0


# ---------------------------------------------------------------- registration


def test_shm_registration(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = kvmem.Segment.create("rel.kvmem", L2)
    try:
        reg = kvmem.shm_registration(s)
        assert reg == {"kind": "shm", "path": str(tmp_path / "rel.kvmem"), "layout": L2.to_dict()}
        assert json.dumps(reg, separators=(",", ":")) == (
            '{"kind":"shm","path":"%s","layout":%s}' % (tmp_path / "rel.kvmem", L2.to_json())
        )
    finally:
        s.remove()


class StubStorage:
    """What torch's untyped_storage() offers that the registration uses."""

    def __init__(self, device, handle, offset):
        self.share = (device, handle, 1 << 30, offset, b"ref", 0, b"event", False)

    def _share_cuda_(self):
        return self.share


class StubTensor:
    """A CUDA tensor as cuda_ipc_registration sees it."""

    def __init__(self, nbytes, device=0, handle=None, offset=0, storage_offset=0, is_cuda=True, contiguous=True):
        self.nbytes, self.is_cuda, self._contiguous = nbytes, is_cuda, contiguous
        self._storage_offset = storage_offset
        self._storage = StubStorage(device, bytes(range(64)) if handle is None else handle, offset)

    def numel(self):
        return self.nbytes // 2

    def element_size(self):
        return 2

    def is_contiguous(self):
        return self._contiguous

    def storage_offset(self):
        return self._storage_offset

    def untyped_storage(self):
        return self._storage


def stub_tensors():
    """Stub tensors for L2, one per group per region, on device g."""
    sizes = [[3 * 16, 3 * 16, 3 * 32], [5 * 40]]
    return [[StubTensor(n, device=g) for n in row] for g, row in enumerate(sizes)]


def test_cuda_ipc_registration_body(seg):
    prefixed = b"\x01c" + bytes(range(100, 164))
    tensors = stub_tensors()
    tensors[1][0] = StubTensor(200, device=1, handle=prefixed)
    reg = kvmem.cuda_ipc_registration(seg, tensors)
    assert list(reg) == ["kind", "path", "layout", "handles"]
    assert reg["kind"] == "cuda_ipc" and reg["path"] == os.path.abspath(seg.path)
    assert reg["layout"] == L2.to_dict()
    assert [len(row) for row in reg["handles"]] == [3, 1]
    for g, row in enumerate(reg["handles"]):
        for h in row:
            assert list(h) == ["device", "handle"] and h["device"] == g
            assert len(base64.b64decode(h["handle"], validate=True)) == kvmem.CUDA_IPC_HANDLE_SIZE
    assert kvmem.decode_handle(reg["handles"][0][0]["handle"]) == bytes(range(64))
    assert kvmem.decode_handle(reg["handles"][1][0]["handle"]) == bytes(range(100, 164))
    json.dumps(reg)  # serialisable as the POST body


@pytest.mark.parametrize(
    "tensors",
    [
        stub_tensors()[:1],  # a group short
        [stub_tensors()[0][:2], stub_tensors()[1]],  # a region short
        [[StubTensor(48, is_cuda=False), StubTensor(48), StubTensor(96)], stub_tensors()[1]],
        [[StubTensor(48, contiguous=False), StubTensor(48), StubTensor(96)], stub_tensors()[1]],
        [[StubTensor(50), StubTensor(48), StubTensor(96)], stub_tensors()[1]],  # wrong size
        [[StubTensor(48, handle=b"\x01e" + bytes(64)), StubTensor(48), StubTensor(96)], stub_tensors()[1]],
        [[StubTensor(48, handle=bytes(63)), StubTensor(48), StubTensor(96)], stub_tensors()[1]],
    ],
)
def test_cuda_ipc_registration_refuses(seg, tensors):
    with pytest.raises(kvmem.LayoutError):
        kvmem.cuda_ipc_registration(seg, tensors)


def test_cuda_ipc_registration_offsets(seg):
    """A tensor inside its allocation (the caching allocator's block, or a
    view such as a K/V cache's V plane) is sent with its byte offset from
    the allocation's base; one at the base sends none."""
    t = stub_tensors()
    t[0][0] = StubTensor(48, offset=512, storage_offset=8)
    t[0][1] = StubTensor(48, storage_offset=24)
    reg = kvmem.cuda_ipc_registration(seg, t)
    assert reg["handles"][0][0]["offset"] == 512 + 8 * 2
    assert reg["handles"][0][1]["offset"] == 24 * 2
    assert "offset" not in reg["handles"][0][2]


def test_exceptions_share_a_base():
    for e in (
        kvmem.BusyError,
        kvmem.ClobberedError,
        kvmem.LayoutError,
        kvmem.SegmentError,
        kvmem.RangeError,
        kvmem.IdentityError,
        kvmem.UnsupportedPlatformError,
    ):
        assert issubclass(e, kvmem.KVMemError)
