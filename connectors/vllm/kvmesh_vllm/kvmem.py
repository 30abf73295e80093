"""The engine's KV memory: a byte-exact Python twin of Go's ``pkg/kvmem``.

A *segment* is one file (in ``/dev/shm`` on Linux) that the engine (this
process) and its rank's gpuworker both map shared. It holds:

* a :data:`HEADER_SIZE`-byte header: the magic ``KVMEMSEG``, the format
  version (uint32 little endian), the layout JSON's length (uint32 little
  endian) and the :class:`Layout` as JSON, exactly as Go's ``json.Marshal``
  writes it;
* the identity records, group after group, :data:`RECORD_SIZE` bytes a
  block (64 little-endian uint64 words, see :class:`Record`);
* page aligned, per group one tensor per region, each ``blocks ×
  region_bytes`` long, so that block ``b``'s region ``r`` lies at ``b ×
  regions[r]`` of that tensor, as in vLLM's paged KV cache.

Every offset follows from the layout alone (:meth:`Layout.offsets`, Go's
``Layout.Offsets``), so the layout is all the two sides share; the
registration body (:func:`shm_registration`, :func:`cuda_ipc_registration`)
tells the gpuworker where the segment is.

Record protocol and why plain stores are safe here
---------------------------------------------------
Go's side updates a record with ``sync/atomic``: a writer compare-and-swaps
the sequence from even ``s`` to ``s+1``, writes the bytes, stores the
identity, then compare-and-swaps ``s+1`` to ``s+2``; a reader loads the
sequence (even) and the record, copies the bytes out, then checks the
sequence is unchanged. Python has no compare-and-swap, so this module uses
aligned 8-byte stores and loads of numpy ``uint64`` words (numpy's element
assignment of a well-behaved array is one aligned 8-byte store, which x86-64
performs atomically: no reader ever sees a torn word). That is enough
because:

1. *No second writer.* The engine is the only writer of a block it computes
   into: by the contract's reuse rules the engine never writes a block
   while the gpuworker loads into it (a block under a load belongs to the
   load until the load finishes), and the gpuworker writes (loads) only
   blocks the engine handed it. The compare-and-swap's job of refusing a
   second concurrent writer is therefore never needed on the engine side;
   :meth:`Record.begin` still refuses an odd sequence (:class:`BusyError`).
   The gpuworker may clear a record concurrently (``POST
   /v1/dataplane/evict``, ``POST /v1/pool/reset``: Begin and Abort); the
   worst such a race does is lose that clear, never expose torn bytes,
   because the identity is stored only after all the bytes and a clear
   leaves the record holding nothing.
2. *Readers need only store order.* A gpuworker reading a block relies on
   the writer's stores becoming visible in program order: the odd sequence
   before any byte of the block, every byte before the identity, the
   identity before the even sequence. x86-64 is total-store-order (TSO):
   stores are never reordered with other stores, and CPython executes this
   module's stores in program order (each is a separate C call the
   compiler cannot move across). The reader's own full barrier (its
   compare-and-swap in ``Unchanged``) is in Go.

On any other architecture stores may become visible out of order, so every
operation that writes a record (and :meth:`Record.unchanged`, whose plain
load is only ordered after the byte loads under TSO) refuses to run there
with :class:`UnsupportedPlatformError`, checked with
:func:`platform.machine`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import enum
import json
import math
import mmap
import os
import platform
import stat
import struct
import tempfile
import threading
import time
from typing import Any, Callable, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

# --------------------------------------------------------------------------
# Constants (pkg/kvmem/layout.go, record.go; pkg/dataplane/dataplane.go).

#: MAGIC opens every segment.
MAGIC = b"KVMEMSEG"
#: VERSION is the segment format this module reads and writes.
VERSION = 1
#: HEADER_SIZE is the bytes before the records.
HEADER_SIZE = 4096
#: PAGE_SIZE aligns every data tensor.
PAGE_SIZE = 4096
#: MAX_BLOCKS bounds a group's blocks (2^24).
MAX_BLOCKS = 1 << 24
#: MAX_REGION_BYTES bounds one region of a block (2^32, inclusive).
MAX_REGION_BYTES = 1 << 32
#: MAX_HASH_LEN bounds a block identity's hash text (dataplane.MaxHashLen).
MAX_HASH_LEN = 255
#: MAX_REQUEST_ID_LEN bounds an identity's request id
#: (dataplane.MaxRequestIDLen).
MAX_REQUEST_ID_LEN = 1024

_W_SEQ = 0
_W_GEN = 1
_W_TIME = 2
_W_META = 3
_W_HASH = 4
_HASH_WORDS = (MAX_HASH_LEN + 7) // 8
_W_REQ = _W_HASH + _HASH_WORDS
_REQ_WORDS = 16
_RECORD_WORDS = 64

#: RECORD_SIZE is the bytes of one block's identity record (64 words).
RECORD_SIZE = _RECORD_WORDS * 8
#: RECORD_REQUEST_ID_LEN is how much of a request id a record keeps.
RECORD_REQUEST_ID_LEN = _REQ_WORDS * 8

#: The registration kinds (Go's KindShm, KindCUDA).
KIND_SHM = "shm"
KIND_CUDA = "cuda_ipc"
#: CUDA_IPC_HANDLE_SIZE is sizeof(cudaIpcMemHandle_t).
CUDA_IPC_HANDLE_SIZE = 64

_MASK64 = (1 << 64) - 1
_TSO_MACHINES = frozenset({"x86_64", "amd64", "x64"})

# --------------------------------------------------------------------------
# Errors.


class KVMemError(Exception):
    """Base of every error this module raises."""


class BusyError(KVMemError):
    """A block's record shows a write in progress (Go's ErrBusy)."""


class ClobberedError(KVMemError):
    """A write's record changed under it (Go's ErrClobbered): the block
    holds nothing."""


class LayoutError(KVMemError, ValueError):
    """A layout that cannot describe a KV memory, or that does not fit the
    segment or the tensors given (Go's ErrLayout)."""


class SegmentError(KVMemError):
    """A file that is not a KV memory segment of this format: bad magic,
    version, layout or size (Go's ErrSegment), or a closed segment."""


class RangeError(KVMemError, IndexError):
    """A group, block or region outside the memory, or data of the wrong
    size (Go's ErrRange)."""


class IdentityError(KVMemError, ValueError):
    """A block identity that cannot name a block's content
    (dataplane.ErrIdentity)."""


class UnsupportedPlatformError(KVMemError):
    """Writing a shared record from Python needs x86-64's store order."""


# --------------------------------------------------------------------------
# Layout.


def _is_int(v: Any) -> bool:
    """Whether v is an integer as JSON decodes one (bool is not)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _align_up(n: int, a: int) -> int:
    """n rounded up to a multiple of a."""
    return (n + a - 1) // a * a


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """One KV group's part of a :class:`Layout` (Go's ``GroupLayout``).

    ``blocks`` is the group's number of blocks (vLLM's ``num_blocks``);
    ``regions`` are the bytes of each region of one block, in order (one per
    layer tensor, or one for a contiguous block); their sum is the group's
    ``bytes_per_block``.
    """

    blocks: int
    regions: Tuple[int, ...]

    def __init__(self, blocks: int, regions: Iterable[int]) -> None:
        object.__setattr__(self, "blocks", blocks)
        object.__setattr__(self, "regions", tuple(regions))

    @property
    def block_bytes(self) -> int:
        """The sum of the group's regions (one block's bytes)."""
        return sum(self.regions)

    def to_dict(self) -> dict:
        """The group as Go marshals it: ``{"blocks": n, "regions": [...]}``."""
        return {"blocks": int(self.blocks), "regions": [int(r) for r in self.regions]}


@dataclasses.dataclass(frozen=True)
class Offsets:
    """Where a layout's parts lie in its segment (Go's ``Offsets``).

    ``records[g]`` is the offset of group g's first record, ``data[g][r]``
    that of group g's region-r tensor, ``size`` the segment's size.
    """

    records: Tuple[int, ...]
    data: Tuple[Tuple[int, ...], ...]
    size: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """A KV memory's layout (Go's ``Layout``): per KV group, in group
    order, its blocks and the bytes of each region of a block."""

    groups: Tuple[GroupLayout, ...]

    def __init__(self, groups: Iterable[GroupLayout]) -> None:
        object.__setattr__(self, "groups", tuple(groups))

    def validate(self) -> None:
        """Raise :class:`LayoutError` unless the layout describes a memory:
        at least one group, each with 1..2^24 blocks and at least one region,
        every region of 1..2^32 bytes (Go's ``Layout.Validate``)."""
        if not self.groups:
            raise LayoutError("no groups")
        for i, g in enumerate(self.groups):
            if not isinstance(g, GroupLayout):
                raise LayoutError(f"groups[{i}]: {type(g).__name__}, not a GroupLayout")
            if not _is_int(g.blocks) or not 1 <= g.blocks <= MAX_BLOCKS:
                raise LayoutError(f"groups[{i}]: {g.blocks!r} blocks (1..{MAX_BLOCKS})")
            if not g.regions:
                raise LayoutError(f"groups[{i}]: no regions")
            for j, r in enumerate(g.regions):
                if not _is_int(r) or not 1 <= r <= MAX_REGION_BYTES:
                    raise LayoutError(f"groups[{i}].regions[{j}]: {r!r} bytes")

    def check_model(self, model: Mapping[str, Any]) -> None:
        """Validate the layout and that it fits a model spec (the dict
        ``kvmesh model --json`` prints as ``"model"``): one group per model
        group, each block's regions summing to the group's
        ``bytes_per_block`` (Go's ``Layout.Check``)."""
        self.validate()
        groups = model.get("groups") or []
        if len(self.groups) != len(groups):
            raise LayoutError(f"{len(self.groups)} groups for model {model.get('name')} of {len(groups)}")
        for i, (g, mg) in enumerate(zip(self.groups, groups)):
            if g.block_bytes != mg["bytes_per_block"]:
                raise LayoutError(
                    f"groups[{i}]: regions sum to {g.block_bytes} bytes, model "
                    f"{model.get('name')}'s bytes_per_block is {mg['bytes_per_block']}"
                )

    @classmethod
    def for_model(cls, model: Mapping[str, Any], blocks: int) -> "Layout":
        """The layout of ``blocks`` blocks per group of a model spec, one
        region per block (Go's ``ModelLayout``)."""
        return cls(GroupLayout(blocks, [g["bytes_per_block"]]) for g in model["groups"])

    def to_dict(self) -> dict:
        """The layout as Go marshals it: ``{"groups": [...]}``."""
        return {"groups": [g.to_dict() for g in self.groups]}

    def to_json(self) -> str:
        """The layout's JSON exactly as Go's ``json.Marshal`` writes it
        (compact, fields in struct order)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Layout":
        """The layout a decoded JSON object describes; raises
        :class:`LayoutError` for one Go could not decode into a Layout
        (wrong types). The result is not validated."""
        if not isinstance(d, Mapping):
            raise LayoutError(f"layout: a JSON {type(d).__name__}, not an object")
        groups = d.get("groups")
        if groups is None:
            groups = []
        if not isinstance(groups, list):
            raise LayoutError("layout.groups: not an array")
        out = []
        for i, g in enumerate(groups):
            if not isinstance(g, Mapping):
                raise LayoutError(f"layout.groups[{i}]: not an object")
            blocks = g.get("blocks", 0)
            regions = g.get("regions")
            if regions is None:
                regions = []
            if not _is_int(blocks):
                raise LayoutError(f"layout.groups[{i}].blocks: {blocks!r} is not an integer")
            if not isinstance(regions, list) or not all(_is_int(r) for r in regions):
                raise LayoutError(f"layout.groups[{i}].regions: {regions!r} is not an array of integers")
            out.append(GroupLayout(int(blocks), [int(r) for r in regions]))
        return cls(out)

    @classmethod
    def from_json(cls, data: Union[str, bytes]) -> "Layout":
        """Decode a layout from JSON (as Go marshals it); raises
        :class:`LayoutError` for JSON that is not a layout. The result is not
        validated."""
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise LayoutError(f"layout: {e}") from e
        return cls.from_dict(d)

    def offsets(self) -> Offsets:
        """Where the parts of a valid layout lie (Go's ``Layout.Offsets``):
        the header, the records of every group, then every group's region
        tensors, each page aligned; the size is page aligned too."""
        at = HEADER_SIZE
        records = []
        for g in self.groups:
            records.append(at)
            at += g.blocks * RECORD_SIZE
        data = []
        for g in self.groups:
            offs = []
            for size in g.regions:
                at = _align_up(at, PAGE_SIZE)
                offs.append(at)
                at += g.blocks * size
            data.append(tuple(offs))
        return Offsets(records=tuple(records), data=tuple(data), size=_align_up(at, PAGE_SIZE))


def encode_header(layout: Layout) -> bytes:
    """The :data:`HEADER_SIZE`-byte header of a segment of ``layout``, as
    Go's ``encodeHeader`` writes it; :class:`LayoutError` when the layout's
    JSON does not fit."""
    js = layout.to_json().encode("ascii")
    if 16 + len(js) > HEADER_SIZE:
        raise LayoutError(f"layout of {len(js)} bytes of JSON over the {HEADER_SIZE - 16}-byte header")
    h = bytearray(HEADER_SIZE)
    h[0:8] = MAGIC
    struct.pack_into("<II", h, 8, VERSION, len(js))
    h[16 : 16 + len(js)] = js
    return bytes(h)


def decode_header(h: Union[bytes, bytearray, memoryview, np.ndarray]) -> Layout:
    """The valid layout a segment's header holds (Go's ``decodeHeader``);
    :class:`SegmentError` for bad magic, version, length, JSON or layout."""
    h = bytes(memoryview(h)[:HEADER_SIZE])
    if len(h) < HEADER_SIZE or h[:8] != MAGIC:
        raise SegmentError(f"no {MAGIC.decode()!r} magic")
    version, n = struct.unpack_from("<II", h, 8)
    if version != VERSION:
        raise SegmentError(f"format version {version}, this build reads {VERSION}")
    if n > HEADER_SIZE - 16:
        raise SegmentError(f"layout of {n} bytes")
    try:
        layout = Layout.from_json(h[16 : 16 + n])
        layout.validate()
    except LayoutError as e:
        raise SegmentError(f"layout: {e}") from e
    return layout


def shm_dir() -> str:
    """Where segments are made: ``/dev/shm`` when it exists, else the
    temporary directory (Go's ``ShmDir``)."""
    if os.path.isdir("/dev/shm"):
        return "/dev/shm"
    return tempfile.gettempdir()


# --------------------------------------------------------------------------
# Identities.


def _text(s: Union[str, bytes]) -> bytes:
    """The bytes of an identity part (str as UTF-8; surrogate escapes, as
    :meth:`Record.load` decodes, give the original bytes back)."""
    if isinstance(s, (bytes, bytearray, memoryview)):
        return bytes(s)
    return s.encode("utf-8", "surrogateescape")


def validate_identity(hash_hex: Union[str, bytes], request_id: Union[str, bytes] = "") -> None:
    """Raise :class:`IdentityError` for an identity that cannot name a
    block's content, as Go's ``dataplane.Identity.Validate``: the hash must
    be non-empty and at most :data:`MAX_HASH_LEN` bytes, the request id at
    most :data:`MAX_REQUEST_ID_LEN` bytes. (Like Go, the hash's characters
    are not checked: kvmesh's hashes are lower-case hex, an engine's own are
    opaque text.)"""
    h, r = _text(hash_hex), _text(request_id)
    if not h:
        raise IdentityError("no block hash")
    if len(h) > MAX_HASH_LEN:
        raise IdentityError(f"block hash of {len(h)} bytes over {MAX_HASH_LEN}")
    if len(r) > MAX_REQUEST_ID_LEN:
        raise IdentityError(f"request id of {len(r)} bytes over {MAX_REQUEST_ID_LEN}")


def check_block(layout: Layout, group: int, block: int) -> None:
    """Raise :class:`RangeError` unless (group, block) lies in ``layout``
    (Go's ``CheckBlock``)."""
    if not _is_int(group) or not 0 <= group < len(layout.groups):
        raise RangeError(f"group {group} of {len(layout.groups)}")
    n = layout.groups[group].blocks
    if not _is_int(block) or not 0 <= block < n:
        raise RangeError(f"group {group} block {block} of {n}")


# --------------------------------------------------------------------------
# Records.


class Writer(enum.IntEnum):
    """Who wrote a block, in its record (Go's ``Writer``)."""

    NONE = 0
    ENGINE = 1
    WORKER = 2


#: A record never written.
WRITER_NONE = Writer.NONE
#: The engine computing KV.
WRITER_ENGINE = Writer.ENGINE
#: The gpuworker loading a block.
WRITER_WORKER = Writer.WORKER


@dataclasses.dataclass(frozen=True)
class Held:
    """What a record says its block holds (Go's ``Held``).

    ``hash`` is the chunk hash; ``request_id`` the writing request,
    truncated to :data:`RECORD_REQUEST_ID_LEN` bytes; ``generation`` the
    write's generation; ``completed_ns`` when the write completed (unix
    nanoseconds); ``writer`` who wrote it.
    """

    hash: str
    request_id: str
    generation: int
    completed_ns: int
    writer: Union[Writer, int]


def require_store_order() -> None:
    """Raise :class:`UnsupportedPlatformError` unless this machine is
    x86-64, whose total store order the record protocol's plain stores rely
    on (module doc)."""
    machine = platform.machine()
    if machine.lower() not in _TSO_MACHINES:
        raise UnsupportedPlatformError(
            f"writing kv memory records from Python needs x86-64's total store order "
            f"(Python has no compare-and-swap); this machine is {machine!r}: "
            f"write the blocks over the data plane instead"
        )


class Record:
    """One block's identity record: 64 aligned little-endian uint64 words
    of the segment (Go's ``Record``).

    Words: 0 sequence (odd while written), 1 generation, 2 completion time
    (unix ns), 3 meta (hash length | request id length << 16 | writer <<
    32), 4..35 the hash text, 36..51 the request id text (8 bytes a word,
    little endian, zero padded). Every access is one aligned 8-byte load or
    store (module doc); the writing methods need x86-64
    (:func:`require_store_order`).
    """

    __slots__ = ("_w",)

    def __init__(self, words: np.ndarray) -> None:
        """Wrap ``words``: a writable, aligned, native ``uint64`` array of 64
        words (a view of a segment, or of any buffer)."""
        if words.dtype != np.uint64 or words.shape != (_RECORD_WORDS,):
            raise SegmentError(f"a record is {_RECORD_WORDS} uint64 words, not {words.dtype} {words.shape}")
        self._w = words

    def _load(self, i: int) -> int:
        return int(self._w[i])

    def _store(self, i: int, v: int) -> None:
        self._w[i] = v & _MASK64

    @property
    def seq(self) -> int:
        """The record's sequence now (Go's ``Seq``)."""
        return self._load(_W_SEQ)

    def begin(self, writer: int = WRITER_ENGINE) -> int:
        """Start a write by ``writer``: the sequence goes from even to odd and
        the record holds nothing. Returns the odd sequence for
        :meth:`commit` or :meth:`abort`; :class:`BusyError` when a write is
        in progress (the sequence is odd)."""
        require_store_order()
        s = self._load(_W_SEQ)
        if s & 1:
            raise BusyError("block is being written")
        self._store(_W_SEQ, s + 1)
        self._store(_W_META, (int(writer) & 0xFF) << 32)
        return (s + 1) & _MASK64

    def commit(
        self,
        seq: int,
        hash_hex: Union[str, bytes],
        request_id: Union[str, bytes],
        generation: int,
        completed_ns: Optional[int] = None,
        writer: int = WRITER_ENGINE,
    ) -> None:
        """End the write :meth:`begin` returned ``seq`` for: the record holds
        the identity (the request id truncated to
        :data:`RECORD_REQUEST_ID_LEN` bytes), ``generation`` and
        ``completed_ns`` (now when None), and the sequence goes even.

        A hash empty or over :data:`MAX_HASH_LEN` bytes aborts the write and
        raises :class:`IdentityError`; a sequence that is no longer ``seq``
        (a reset of a write taken for dead) raises :class:`ClobberedError`
        and leaves the record alone."""
        require_store_order()
        h = _text(hash_hex)
        if not h or len(h) > MAX_HASH_LEN:
            self.abort(seq)
            raise IdentityError(f"hash of {len(h)} bytes")
        req = _text(request_id)[:RECORD_REQUEST_ID_LEN]
        if completed_ns is None:
            completed_ns = time.time_ns()
        if self._load(_W_SEQ) != seq:
            raise ClobberedError("block record changed during the write")
        self._store_text(_W_HASH, h)
        self._store_text(_W_REQ, req)
        self._store(_W_GEN, generation)
        self._store(_W_TIME, completed_ns)
        self._store(_W_META, len(h) | len(req) << 16 | (int(writer) & 0xFF) << 32)
        if self._load(_W_SEQ) != seq:
            raise ClobberedError("block record changed during the write")
        self._store(_W_SEQ, seq + 1)

    def abort(self, seq: int) -> None:
        """End the write :meth:`begin` returned ``seq`` for with the block
        holding nothing (the lengths cleared, the sequence even)."""
        require_store_order()
        self._store(_W_META, self._load(_W_META) & ~0xFFFFFFFF)
        if self._load(_W_SEQ) == seq:
            self._store(_W_SEQ, seq + 1)

    def load(self) -> Tuple[int, Optional[Held], bool]:
        """The record's sequence, what it holds and whether it may be read
        (Go's ``Load``): ``ok`` is False while a write is in progress (odd
        sequence); ``held`` is None then and when the block holds
        nothing."""
        seq = self._load(_W_SEQ)
        if seq & 1:
            return seq, None, False
        meta = self._load(_W_META)
        n = meta & 0xFFFF
        if not 0 < n <= MAX_HASH_LEN:
            return seq, None, True
        wv = (meta >> 32) & 0xFF
        try:
            writer: Union[Writer, int] = Writer(wv)
        except ValueError:
            writer = wv
        held = Held(
            hash=self._load_text(_W_HASH, n),
            request_id=self._load_text(_W_REQ, min((meta >> 16) & 0xFFFF, RECORD_REQUEST_ID_LEN)),
            generation=self._load(_W_GEN),
            completed_ns=_signed64(self._load(_W_TIME)),
            writer=writer,
        )
        return seq, held, True

    def unchanged(self, seq: int) -> bool:
        """Whether the sequence is still ``seq``: no write began since the
        :meth:`load` that returned it. A plain load, ordered after every
        earlier load by x86-64's memory order (Go uses a compare-and-swap,
        a full barrier on every architecture)."""
        require_store_order()
        return self._load(_W_SEQ) == seq

    def force_clear(self) -> None:
        """Reset a record left odd by a writer that died: the sequence goes
        even and the record holds nothing. Only the memory's owner calls it,
        when no other writer can be running."""
        require_store_order()
        self._store(_W_META, 0)
        s = self._load(_W_SEQ)
        self._store(_W_SEQ, (s | 1) + 1)

    def _store_text(self, at: int, data: bytes) -> None:
        """Store data into the words from ``at``, 8 bytes a word, little
        endian, the last zero padded; later words are left as they are."""
        padded = data + b"\0" * (-len(data) % 8)
        for i, word in enumerate(struct.unpack(f"<{len(padded) // 8}Q", padded)):
            self._store(at + i, word)

    def _load_text(self, at: int, n: int) -> str:
        """Load n bytes of text from the words from ``at``."""
        k = (n + 7) // 8
        raw = struct.pack(f"<{k}Q", *(self._load(at + i) for i in range(k)))
        return raw[:n].decode("utf-8", "surrogateescape")


def _signed64(v: int) -> int:
    """v (a uint64) as an int64."""
    return v - (1 << 64) if v >= 1 << 63 else v


# --------------------------------------------------------------------------
# Segments.


class Segment:
    """A KV memory in a shared-memory file both the engine and the
    gpuworker map (Go's ``Segment``). Make one with :meth:`create` or map an
    existing one with :meth:`open`; it is also a context manager that
    closes it."""

    def __init__(self, path: str, layout: Layout, mm: mmap.mmap) -> None:
        """Lay ``layout`` out over the mapping ``mm`` of the file ``path``;
        use :meth:`create` or :meth:`open` rather than this."""
        self._path = path
        self._layout = layout
        self._mm: Optional[mmap.mmap] = mm
        self._buf: Optional[np.ndarray] = np.frombuffer(mm, dtype=np.uint8)
        o = layout.offsets()
        self._records: List[np.ndarray] = []
        self._data: List[List[np.ndarray]] = []
        for g, gl in enumerate(layout.groups):
            start = o.records[g]
            words = self._buf[start : start + gl.blocks * RECORD_SIZE].view(np.uint64)
            self._records.append(words.reshape(gl.blocks, _RECORD_WORDS))
            self._data.append(
                [
                    self._buf[o.data[g][r] : o.data[g][r] + gl.blocks * size].reshape(gl.blocks, size)
                    for r, size in enumerate(gl.regions)
                ]
            )

    @classmethod
    def create(cls, path: str, layout: Layout) -> "Segment":
        """Make a new segment file at ``path`` (it must not exist) of
        ``layout``, map it shared and write its header (Go's ``Create``).
        The file is sparse; every record holds nothing."""
        layout.validate()
        hdr = encode_header(layout)
        size = layout.offsets().size
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise SegmentError(f"create segment: {e}") from e
        try:
            try:
                os.ftruncate(fd, size)
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError) as e:
                _remove_quietly(path)
                raise SegmentError(f"size and map segment {path}: {e}") from e
        finally:
            os.close(fd)  # the mapping outlives the descriptor
        mm[0:HEADER_SIZE] = hdr
        return cls(path, layout, mm)

    @classmethod
    def open(cls, path: str, want: Optional[Layout] = None) -> "Segment":
        """Map an existing segment (one Go or this module created) and check
        it as Go's ``Open`` does: a regular file of at least
        :data:`HEADER_SIZE` bytes, the magic, the version, a valid layout
        (equal to ``want`` when given: :class:`LayoutError` otherwise) and a
        file at least as large as the layout needs. :class:`SegmentError`
        for anything else."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise SegmentError(f"open segment: {e}") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < HEADER_SIZE:
                raise SegmentError(f"{path}: {st.st_size} bytes, not a segment file")
            try:
                mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError) as e:
                raise SegmentError(f"map segment {path}: {e}") from e
        finally:
            os.close(fd)
        try:
            layout = decode_header(mm[:HEADER_SIZE])
            if want is not None and layout.to_json() != want.to_json():
                raise LayoutError(f"{path}: the segment's layout is not the registered one")
            need = layout.offsets().size
            if len(mm) < need:
                raise SegmentError(f"{path}: {len(mm)} bytes, the layout needs {need}")
        except KVMemError:
            mm.close()
            raise
        return cls(path, layout, mm)

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def path(self) -> str:
        """The segment's file."""
        return self._path

    @property
    def layout(self) -> Layout:
        """The segment's layout."""
        return self._layout

    @property
    def size(self) -> int:
        """The bytes the layout needs (``layout.offsets().size``); a file
        another process made may be larger."""
        return self._layout.offsets().size

    @property
    def buffer(self) -> np.ndarray:
        """The whole mapping as one zero-copy, writable numpy ``uint8``
        array (header, records and data at :meth:`Layout.offsets`), e.g. to
        lay engine tensors over it with ``torch.from_numpy``."""
        self._live()
        assert self._buf is not None
        return self._buf

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._buf is None

    def _live(self) -> None:
        if self._buf is None:
            raise SegmentError(f"segment {self._path} is closed")

    def _check_group(self, group: int) -> GroupLayout:
        self._live()
        if not _is_int(group) or not 0 <= group < len(self._layout.groups):
            raise RangeError(f"group {group} of {len(self._layout.groups)}")
        return self._layout.groups[group]

    def region(self, group: int, r: int) -> np.ndarray:
        """Group ``group``'s region-``r`` tensor: a zero-copy, writable
        numpy ``uint8`` view of the mapping shaped ``(blocks,
        regions[r])``; row ``b`` is block b's region r."""
        gl = self._check_group(group)
        if not _is_int(r) or not 0 <= r < len(gl.regions):
            raise RangeError(f"group {group} region {r} of {len(gl.regions)}")
        return self._data[group][r]

    def block_regions(self, group: int, block: int) -> List[np.ndarray]:
        """One block's regions, in order: zero-copy numpy ``uint8`` views
        (Go's ``Regions``)."""
        self._live()
        check_block(self._layout, group, block)
        return [t[block] for t in self._data[group]]

    def torch_region(self, group: int, r: int, dtype: Any = None, shape: Optional[Sequence[int]] = None) -> Any:
        """Group ``group``'s region-``r`` tensor as a zero-copy CPU torch
        tensor over the same bytes (``torch.frombuffer``), of ``dtype``
        (``torch.uint8`` when None) viewed as ``shape`` (``(blocks,
        regions[r] // itemsize)`` when None). The shape must multiply out to
        ``blocks × regions[r]`` bytes (:class:`LayoutError` otherwise). The
        tensor keeps the mapping alive."""
        import torch  # heavy: only when asked for

        arr = self.region(group, r)
        if dtype is None:
            dtype = torch.uint8
        itemsize = torch.empty((), dtype=dtype).element_size()
        gl = self._layout.groups[group]
        nbytes = gl.blocks * gl.regions[r]
        if shape is None:
            if gl.regions[r] % itemsize:
                raise LayoutError(f"group {group} region {r}: {gl.regions[r]} bytes are not whole {dtype} elements")
            shape = (gl.blocks, gl.regions[r] // itemsize)
        shape = tuple(int(s) for s in shape)
        if math.prod(shape) * itemsize != nbytes:
            raise LayoutError(
                f"group {group} region {r}: shape {shape} of {dtype} is {math.prod(shape) * itemsize} bytes, "
                f"the tensor is {nbytes}"
            )
        return torch.frombuffer(arr.reshape(-1), dtype=dtype).view(shape)

    def record(self, group: int, block: int) -> Record:
        """The identity record of (group, block)."""
        self._live()
        check_block(self._layout, group, block)
        return Record(self._records[group][block])

    def records(self, group: int) -> np.ndarray:
        """Group ``group``'s records as one ``(blocks, 64)`` ``uint64`` view
        (for scans; use :meth:`record` to read or write one)."""
        self._check_group(group)
        return self._records[group]

    def close(self) -> None:
        """Unmap the segment (the file stays). Views handed out earlier
        (regions, tensors, records) keep the mapping alive until they are
        gone; nothing of this object may be used afterwards."""
        if self._buf is None:
            return
        mm = self._mm
        self._buf, self._mm, self._records, self._data = None, None, [], []
        try:
            mm.close()
        except BufferError:
            pass  # views still export the mapping: it goes with the last one

    def remove(self) -> None:
        """Unmap the segment and delete its file (the creator's cleanup; a
        gpuworker that mapped it keeps its mapping until it closes it)."""
        self.close()
        try:
            os.remove(self._path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise SegmentError(f"remove segment: {e}") from e


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


# --------------------------------------------------------------------------
# The engine's writer.


class EngineWriter:
    """The engine's side of a segment it owns (Go's ``EngineWriter``): it
    writes computed KV straight into blocks and evicts them, keeping every
    block's record by the protocol. Generations start at the current time
    in nanoseconds and grow by one per committed write. Safe to share
    between threads as long as no two write one block at once."""

    def __init__(self, segment: Segment) -> None:
        """Write into ``segment``."""
        self._seg = segment
        self._gen = time.time_ns()
        self._lock = threading.Lock()

    @property
    def segment(self) -> Segment:
        """The segment written."""
        return self._seg

    def _next_generation(self) -> int:
        with self._lock:
            self._gen = (self._gen + 1) & _MASK64
            return self._gen

    def write(
        self,
        group: int,
        block: int,
        hash_hex: Union[str, bytes],
        request_id: Union[str, bytes],
        fill: Callable[[List[np.ndarray]], Any],
    ) -> int:
        """Fill one block with the content the identity names: the record
        goes odd, ``fill`` gets the block's regions (numpy ``uint8`` views)
        to write, and only when it returns does the record hold the identity
        with a new generation and the completion time. An exception from
        ``fill`` leaves the block holding nothing and is re-raised. Returns
        the write's generation. :class:`IdentityError`, :class:`RangeError`
        or :class:`BusyError` refuse the write before anything changes."""
        validate_identity(hash_hex, request_id)
        self._seg._live()
        check_block(self._seg.layout, group, block)
        regions = self._seg.block_regions(group, block)
        rec = self._seg.record(group, block)
        try:
            seq = rec.begin(WRITER_ENGINE)
        except BusyError as e:
            raise BusyError(f"group {group} block {block}: {e}") from None
        try:
            fill(regions)
        except BaseException:
            rec.abort(seq)
            raise
        gen = self._next_generation()
        rec.commit(seq, hash_hex, request_id, gen, time.time_ns(), WRITER_ENGINE)
        return gen

    def write_bytes(
        self,
        group: int,
        block: int,
        hash_hex: Union[str, bytes],
        request_id: Union[str, bytes],
        data: Any,
    ) -> int:
        """Write a contiguous block's bytes (its regions in order; any
        bytes-like object or array of exactly the group's block bytes:
        :class:`RangeError` otherwise). Returns the generation."""
        self._seg._live()
        check_block(self._seg.layout, group, block)
        src = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8) if not isinstance(data, np.ndarray) else data
        src = src.reshape(-1).view(np.uint8)
        gl = self._seg.layout.groups[group]
        if src.size != gl.block_bytes:
            raise RangeError(f"group {group}: {src.size} bytes for a {gl.block_bytes}-byte block")

        def fill(regions: List[np.ndarray]) -> None:
            at = 0
            for reg in regions:
                reg[:] = src[at : at + reg.size]
                at += reg.size

        return self.write(group, block, hash_hex, request_id, fill)

    def evict(self, group: int, block: int) -> bool:
        """Clear one block's record (the engine dropped its content);
        returns whether the block held something. :class:`BusyError` when a
        write is in progress."""
        self._seg._live()
        check_block(self._seg.layout, group, block)
        rec = self._seg.record(group, block)
        _, held, _ = rec.load()
        try:
            seq = rec.begin(WRITER_ENGINE)
        except BusyError as e:
            raise BusyError(f"group {group} block {block}: {e}") from None
        rec.abort(seq)
        return held is not None

    def recover_worker_writes(self) -> int:
        """Clear the records a gpuworker left mid-write (it died during a
        load) so the blocks can be written again; returns how many. Call it
        before registering the segment with a new gpuworker, when no
        gpuworker writes into it."""
        require_store_order()
        self._seg._live()
        n = 0
        for g in range(len(self._seg.layout.groups)):
            words = self._seg.records(g)
            stuck = np.nonzero((words[:, _W_SEQ] & np.uint64(1)) == np.uint64(1))[0]
            for b in stuck:
                if (int(words[b, _W_META]) >> 32) & 0xFF == Writer.WORKER:
                    Record(words[b]).force_clear()
                    n += 1
        return n


# --------------------------------------------------------------------------
# Registration bodies (POST /v1/kv-memory).


def shm_registration(segment: Segment) -> dict:
    """The body of ``POST /v1/kv-memory`` registering ``segment`` (kind
    ``shm``): ``{"kind", "path", "layout"}`` with the path absolute and
    clean, in Go's ``Registration`` field order."""
    return {"kind": KIND_SHM, "path": os.path.abspath(segment.path), "layout": segment.layout.to_dict()}


def ipc_mem_handle(share_handle: Union[bytes, bytearray]) -> bytes:
    """The 64-byte ``cudaIpcMemHandle_t`` in the handle torch's
    ``_share_cuda_`` returns: the handle itself (torch before the
    expandable-segment handles, e.g. 1.13), or one prefixed with a version
    byte (1) and the kind ``'c'`` (a cudaMalloc block). Expandable-segment
    handles (kind ``'e'``) are refused (:class:`LayoutError`): the gpuworker
    opens only cudaMalloc handles."""
    b = bytes(share_handle)
    if len(b) == CUDA_IPC_HANDLE_SIZE:
        return b
    if len(b) == CUDA_IPC_HANDLE_SIZE + 2 and b[0] == 1 and b[1:2] == b"c":
        return b[2:]
    if len(b) >= 2 and b[1:2] == b"e":
        raise LayoutError(
            "an expandable-segment CUDA handle: the gpuworker opens cudaIpcMemHandle_t only "
            "(run the engine with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False)"
        )
    raise LayoutError(f"a {len(b)}-byte CUDA IPC handle, want {CUDA_IPC_HANDLE_SIZE}")


def cuda_ipc_registration(segment: Segment, tensors_by_group_region: Sequence[Sequence[Any]]) -> dict:
    """The body of ``POST /v1/kv-memory`` registering the engine's device
    tensors (kind ``cuda_ipc``), the records staying in ``segment``:
    ``{"kind", "path", "layout", "handles"}``, ``handles[g][r]`` being
    ``{"device": ordinal, "handle": base64 of the 64-byte
    cudaIpcMemHandle_t, "offset": bytes from the allocation's base}`` of
    group g's region-r tensor (Go's ``CUDAHandle``; Go's ``[]byte``
    marshals as standard base64).

    ``tensors_by_group_region[g][r]`` is a CUDA torch tensor holding exactly
    ``blocks × regions[r]`` bytes, contiguous, block b's region at ``b ×
    regions[r]``. The handle comes from
    ``tensor.untyped_storage()._share_cuda_()``, which names the caching
    allocator's whole cudaMalloc block; the gpuworker maps that block once
    and addresses the tensor at ``offset``: the storage's offset inside the
    block plus the tensor's offset inside its storage (a K/V cache's V
    plane, a view such as ``kv[1]``, lies after its K plane).

    Untested against a GPU: no CUDA device or CUDA build of torch was
    available when this was written; the unit tests check the body's shape
    with stub tensors only.
    """
    layout = segment.layout
    if len(tensors_by_group_region) != len(layout.groups):
        raise LayoutError(f"{len(tensors_by_group_region)} groups of tensors for {len(layout.groups)} groups")
    handles = []
    for g, (gl, tensors) in enumerate(zip(layout.groups, tensors_by_group_region)):
        if len(tensors) != len(gl.regions):
            raise LayoutError(f"group {g}: {len(tensors)} tensors for {len(gl.regions)} regions")
        row = []
        for r, (size, t) in enumerate(zip(gl.regions, tensors)):
            where = f"group {g} region {r}"
            if not getattr(t, "is_cuda", False):
                raise LayoutError(f"{where}: not a CUDA tensor")
            if not t.is_contiguous():
                raise LayoutError(f"{where}: not contiguous")
            nbytes = t.numel() * t.element_size()
            if nbytes != gl.blocks * size:
                raise LayoutError(f"{where}: {nbytes} bytes, the layout has {gl.blocks} × {size}")
            storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
            share = storage._share_cuda_()
            device, handle, offset = int(share[0]), share[1], int(share[3])
            offset += t.storage_offset() * t.element_size()
            raw = ipc_mem_handle(handle)
            entry = {"device": device, "handle": base64.b64encode(raw).decode("ascii")}
            if offset:
                entry["offset"] = offset
            row.append(entry)
        handles.append(row)
    reg = shm_registration(segment)
    reg["kind"] = KIND_CUDA
    reg["handles"] = handles
    return reg


def decode_handle(b64: str) -> bytes:
    """The handle bytes of a registration's base64 ``handle`` (for
    checks); :class:`LayoutError` for bad base64."""
    try:
        return base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as e:
        raise LayoutError(f"handle: {e}") from e
