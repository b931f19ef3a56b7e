"""Tensors across a process boundary: inline bytes when small, a shm handle when large.

Lifetime protocol. Every process keeps, per peer, an export table: ``export_id -> object`` that
keeps the exported memory alive (a pool array it owns, or a view it imported from someone
else). The peer builds a zero-copy view for each handle it receives; when the last view dies a
finalizer queues ``export_id`` and the release goes back (batched) to the process that gave the
handle, which drops the entry. So a block is freed exactly when no process holds a view of it,
and a forwarded handle (host -> another stub) chains the releases back hop by hop.
"""
from __future__ import annotations

import bisect
import collections
import itertools
import os
import queue
import threading
import time
import weakref
from typing import Any

import numpy as np

from . import cuda
from ._errors import ProtocolError, ShmError
from .cuda import GPU, IPC_HANDLE_BYTES, DeviceRef
from .dtypes import ITEMSIZE, deserialize_bytes, numpy_dtype, serialize_bytes, triton_dtype_of
from .pool import Pool, SegmentMap
from .segment import PAGE, Segment

# Tensors up to this size travel inside the frame: below the channel's 60 KiB frame limit with
# room for the rest of a request, since a frame over it spills into shm (a 60 KiB tensor cost
# ~800 us per BLS call inline-and-spilled, ~620 us by handle, a 48 KiB one ~500 us inline).
INLINE_LIMIT = 48 * 1024
# Releases owed to a peer for its blocks wait for a frame going to it anyway (RELEASE_DELAY_S at
# most), until they add up to this many bytes: that release then goes at once with all those
# owed (the flusher is woken to send them), so that the owner finds the room for its next big
# tensors. An urgent release costs a wake-up of the flusher thread and a frame of its own:
# with every release of 256 KiB or more urgent, the four of a BLS call took a 1 MiB call from
# 170-220 us to 220-330 us. With a time limit alone, eight 3 MiB calls in flight took 230-310 us
# against 210-230 us with each release at once (more blocks held, and /dev/shm used grew).
URGENT_RELEASE_BYTES = 4 * 1024 * 1024
# A tensor sent again keeps its shm copy from this size up. Below it a copy is cheaper than the
# private mapping that each receiver then needs (~100 µs of mapping and page-map reads a hop,
# and page faults when the receiver reads the data, ~100 µs a MiB on this VM).
KEEP_MIN_BYTES = 4 * 1024 * 1024
MAX_DIMS = 64
MAX_ELEMENTS = 1 << 40
_NUMPY_DTYPES = {name: numpy_dtype(name) for name in ITEMSIZE}

WireTensor = list  # [name, triton_dtype, shape, data: bytes | handle]
# A handle is [segment, offset, nbytes, export_id], or [segment, offset, nbytes, export_id, 1]
# for an immutable block: one that the sender keeps and sends again (a BLS input Tensor sent
# over and over), so nobody may write into it. The host reads it through read-only views;
# a stub hands it to model code as a copy-on-write mapping (writes stay private to that view).
# A GPU tensor's handle is [ipc_handle, offset, nbytes, export_id, GPU, device] (see cuda.py).
IMMUTABLE = 1


class Peer:
    """Book-keeping for one peer: what we exported to it, and releases we owe it."""

    def __init__(self, name: str = "peer") -> None:
        self.name = name
        self._exports: dict[int, Any] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        # Releases owed to the peer, appended by finalizers in whichever thread drops the last
        # view (deque.append is atomic). A frame going to the peer anyway takes them all along.
        # The channel's flusher sends what no frame took within RELEASE_DELAY_S, and the
        # urgent ones at once. Only ``wake`` wakes the flusher: every urgent release does, and
        # a plain one only when the flusher is parked (nothing was owed for a while). So
        # steady traffic, whose frames carry the releases, costs no wake-up per release.
        self.lazy: collections.deque[int] = collections.deque()
        self.urgent: collections.deque[int] = collections.deque()
        self.lazy_since = 0.0  # time.monotonic() when ``lazy`` last stopped being empty
        # The bytes of the blocks in ``lazy`` (about: threads add to it without a lock).
        self.lazy_bytes = 0
        self.parked = True
        self.wake: queue.SimpleQueue[int | None] = queue.SimpleQueue()  # 0: look; None: stop
        self.alive = True

    def export(self, keep: Any) -> int:
        eid = next(self._ids)
        with self._lock:
            self._exports[eid] = keep
        return eid

    def release(self, ids: list[int]) -> None:
        """The peer says it holds no view of these exports any more."""
        with self._lock:
            pop = self._exports.pop
            for eid in ids:
                pop(eid, None)

    def drop_all(self) -> int:
        """The peer died: forget what it held (frees those blocks); returns how many."""
        with self._lock:
            n = len(self._exports)
            self._exports.clear()
        self.alive = False
        return n

    @property
    def outstanding(self) -> int:
        return len(self._exports)

    def owe_release(self, eid: int, nbytes: int = 0) -> None:
        """Queue a release for the peer. ``nbytes``: the size of a block the peer may need back
        for its next tensors (0 for one it keeps anyway); once what is owed adds up to
        :data:`URGENT_RELEASE_BYTES`, it goes at once instead of waiting for a frame to carry
        it."""
        if not self.alive:
            return
        if nbytes and self.lazy_bytes + nbytes >= URGENT_RELEASE_BYTES:
            self.lazy_bytes = 0
            self.urgent.append(eid)
            self.wake.put(0)
            return
        lazy = self.lazy
        if not lazy:
            self.lazy_since = time.monotonic()
        self.lazy_bytes += nbytes
        lazy.append(eid)
        if self.parked:  # (the flusher re-checks ``lazy`` after it parks: see Channel)
            self.parked = False
            self.wake.put(0)

    def take_owed(self) -> list[int]:
        """Every release owed now (another thread may take some at the same time)."""
        out: list[int] = []
        self.lazy_bytes = 0
        for owed in (self.urgent, self.lazy):
            pop = owed.popleft
            try:
                while owed:
                    out.append(pop())
            except IndexError:
                pass
        return out


_PAGEMAP = "/proc/self/pagemap"
# /proc/self/pagemap entry bits 63..61: present, swapped, file page (or shared anonymous).
# Clean: 0b000 (not mapped yet) or 0b101 / 0b001 (the segment's own page); anything else
# (0b100: a private copy made by a write, 0b01x: swapped out) counts as written.


class PrivateViews:
    """Copy-on-write views of the blocks a stub receives, and the test that forwards them
    unwritten.

    Model code may write into its input arrays (it can with the real Triton, which hands it
    copies). A block may have other readers than this process (the sender, which may hold a
    view of it still, as a BLS caller holds its own request input; the other steps an
    ensemble gives it to; the other calls an immutable block is sent to), so each view of one
    is a private mapping: a write copies the page it touches into this process only. When
    model code sends such a view on (an identity output, a pass-through to another BLS call),
    the kernel's page map tells whether any of its pages were written: if none were, the
    original handle goes (zero copy); if some were, the array is copied like any other.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []
        # (start, end, segment, its offset, whether the block is immutable)
        self._spans: list[tuple[int, int, str, int, bool]] = []
        self._lock = threading.RLock()
        self._pagemap = -1
        self._pagemap_pid = 0
        self.enabled = True  # False: never forward a private view (always copy it)

    def map(self, seg: Segment, off: int, nbytes: int, npdt: Any, count: int,
            immutable: bool = True) -> np.ndarray:
        """A private view of ``count`` items of ``npdt`` at ``off`` in ``seg``."""
        mm, delta, address = seg.map_private(off, nbytes)
        root = np.frombuffer(mm, npdt, count, delta)
        start = address + delta
        span = (start, start + nbytes, seg.name, off, immutable)
        # Nothing is allocated under the lock, and it is re-entrant anyway: an allocation may
        # run the cyclic GC, whose finalizers may call _forget from right here.
        with self._lock:
            i = bisect.bisect_left(self._starts, start)
            self._starts.insert(i, start)
            self._spans.insert(i, span)
        weakref.finalize(root, self._forget, start)
        return root

    def _forget(self, start: int) -> None:
        with self._lock:
            i = bisect.bisect_left(self._starts, start)
            if i < len(self._starts) and self._starts[i] == start:
                del self._starts[i]
                del self._spans[i]

    def source(self, arr: np.ndarray) -> tuple[str, int, bool] | None:
        """(segment, offset, whether the block is immutable) of the block ``arr`` views, if it
        is a private view whose pages were never written; None otherwise."""
        if not self._starts or not arr.flags.c_contiguous:
            return None
        addr = arr.__array_interface__["data"][0]
        with self._lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            if i < 0:
                return None
            start, end, seg_name, seg_off, immutable = self._spans[i]
        if addr + arr.nbytes > end or not self.enabled or not self._unwritten(addr, arr.nbytes):
            return None
        return seg_name, seg_off + (addr - start), immutable

    def _unwritten(self, addr: int, nbytes: int) -> bool:
        """True when no page of [addr, addr + nbytes) holds a private (written) copy."""
        if self._pagemap_pid != os.getpid():  # (a forked child must read its own map)
            self._pagemap_pid = os.getpid()
            try:
                self._pagemap = os.open(_PAGEMAP, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._pagemap = -1
        if self._pagemap < 0:
            return False
        first = addr // PAGE
        pages = (addr + max(nbytes, 1) - 1) // PAGE - first + 1
        try:
            raw = os.pread(self._pagemap, pages * 8, first * 8)
        except OSError:
            return False
        if len(raw) != pages * 8:
            return False
        top = np.frombuffer(raw, np.uint64) >> np.uint64(61)
        return not bool(((top != 0) & (top != 1) & (top != 5)).any())

    def __len__(self) -> int:
        return len(self._starts)


class TensorTransport:
    """Encodes arrays for one peer and decodes the peer's handles into zero-copy views."""

    def __init__(self, pool: Pool, segments: SegmentMap | None = None,
                 inline_limit: int = INLINE_LIMIT, writable_inline: bool = True,
                 private_views: bool = True, device_refs: bool = False) -> None:
        self.pool = pool
        self.segments = segments if segments is not None else pool.segments
        self.inline_limit = inline_limit
        # Inline data decodes to a private writable array (a model may write into its inputs),
        # or, for a reader that never writes (the host routing requests), to a read-only view
        # of the frame's own bytes: one numpy call instead of three per tensor.
        self.writable_inline = writable_inline
        # Immutable blocks reach model code as copy-on-write views (a stub), or as read-only
        # views for a reader that never writes (the host, whose users get copies).
        self.private = PrivateViews() if private_views else None
        # GPU tensors decode to DeviceRef stand-ins (the host, which only passes them on), or
        # to CuPy arrays over the sender's device memory (a stub).
        self.device_refs = device_refs
        self.copies = 0  # bytes copied into shm by encode(), for tests and benchmarks
        self.forwards = 0  # arrays sent by handle without a copy
        self.reuses = 0  # sends of a tensor's kept shm copy (see encode's ``owner``)

    # -- sending ------------------------------------------------------------------------------
    def encode(self, name: str, arr: np.ndarray, peer: Peer, owner: Any = None) -> WireTensor:
        """Wire form of ``arr``: inline when small, else a handle (forwarded if already in shm).

        ``owner`` (a stub's ``pb_utils.Tensor``) may keep the shm copy of ``arr`` in its
        ``_shm`` slot: None before its first send by handle, True after it, then the copy made
        at its second send, which every later send reuses without copying (immutable). The
        real Triton keeps the copy made at the first send; a second copy spares the common
        once-sent tensor a private mapping at the receiver."""
        if type(arr) is not np.ndarray and cuda.is_device_array(arr):
            # An empty one has no device memory to name: it arrives as an empty CPU tensor.
            data = self._device_handle(arr, peer) if arr.nbytes else b""
            return [name, triton_dtype_of(arr), list(arr.shape), data]
        dt = triton_dtype_of(arr)
        shape = list(arr.shape)
        if dt == "BYTES":
            data = serialize_bytes(arr)
            if len(data) <= self.inline_limit:
                return [name, dt, shape, data]
            block = self.pool.new_array(np.uint8, (len(data),))
            block[:] = np.frombuffer(data, np.uint8)
            self.copies += len(data)
            seg, off = self.segments.locate(block)  # type: ignore[misc]
            return [name, dt, shape, [seg.name, off, block.nbytes, peer.export(block)]]
        if arr.nbytes <= self.inline_limit:
            return [name, dt, shape, arr.tobytes()]
        return [name, dt, shape, self._handle(arr, peer, owner)]

    def _handle(self, arr: np.ndarray, peer: Peer, owner: Any) -> list:
        where = self.segments.locate(arr)
        if where is not None and not where[0].gone:  # (gone: its name was removed: copied)
            self.forwards += 1
            seg, off = where
            # A read-only view in shm is the host's view of an immutable block.
            if arr.flags.writeable:
                return [seg.name, off, arr.nbytes, peer.export(arr)]
            return [seg.name, off, arr.nbytes, peer.export(arr), IMMUTABLE]
        if self.private is not None:
            source = self.private.source(arr)
            if source is not None:
                self.forwards += 1
                wire = [source[0], source[1], arr.nbytes, peer.export(arr)]
                return wire + [IMMUTABLE] if source[2] else wire
        if owner is not None and arr.nbytes < KEEP_MIN_BYTES:
            owner = None
        kept = None if owner is None else owner._shm
        if kept is not None and kept is not True:
            where = self.segments.locate(kept)
            if where is not None and not where[0].gone:
                self.reuses += 1
                seg, off = where
                return [seg.name, off, kept.nbytes, peer.export(kept), IMMUTABLE]
            kept = owner._shm = True  # (a kept copy whose name was removed: copied again)
        arr = self.pool.copy_in(np.ascontiguousarray(arr) if not arr.flags.c_contiguous else arr)
        self.copies += arr.nbytes
        where = self.segments.locate(arr)
        assert where is not None
        seg, off = where
        if owner is None:
            return [seg.name, off, arr.nbytes, peer.export(arr)]
        if kept is None:
            owner._shm = True
            return [seg.name, off, arr.nbytes, peer.export(arr)]
        owner._shm = arr
        return [seg.name, off, arr.nbytes, peer.export(arr), IMMUTABLE]

    @staticmethod
    def _device_handle(arr: Any, peer: Peer) -> list:
        # A DeviceRef is passed on as it came (the host); a CuPy array gets one, which keeps
        # it alive in the export table.
        ref = arr if type(arr) is DeviceRef else cuda.ref_of(arr)
        wire = [ref.handle, ref.offset, ref.nbytes, peer.export(ref), GPU, ref.device]
        return wire if ref.reuse else wire + [0]

    def encode_many(self, tensors: Any, peer: Peer) -> list[WireTensor]:
        """Wire forms of (name, array) or (name, array, owner) tuples (``owner``: see
        :meth:`encode`); when one cannot be encoded (shared memory exhausted), the handles
        made for the others are given back before the error goes on: their message will never
        be sent."""
        out: list[WireTensor] = []
        try:
            for item in tensors:
                out.append(self.encode(item[0], item[1], peer,
                                       item[2] if len(item) > 2 else None))
        except BaseException:
            peer.release([w[3][3] for w in out if type(w[3]) is list])  # (see discard)
            raise
        return out

    # -- receiving ----------------------------------------------------------------------------
    def decode(self, wire: Any, peer: Peer) -> tuple[str, np.ndarray]:
        """(name, array) from a wire tensor; validates every field before touching memory."""
        # Exact type checks (msgpack yields exact types) keep this hot path cheap.
        if type(wire) is not list or len(wire) != 4:
            raise ProtocolError(f"malformed tensor: {type(wire).__name__} of wrong length")
        name, dt, shape, data = wire
        if type(name) is not str or type(dt) is not str:
            raise ProtocolError("malformed tensor: name and dtype must be strings")
        if type(shape) is not list or len(shape) > MAX_DIMS:
            raise ProtocolError(f"malformed tensor {name!r}: bad shape {shape!r}")
        count = 1
        for d in shape:
            if type(d) is not int or not 0 <= d < MAX_ELEMENTS:
                raise ProtocolError(f"malformed tensor {name!r}: bad shape {shape!r}")
            count *= d
        if count > MAX_ELEMENTS:
            raise ProtocolError(f"tensor {name!r} is too large: {count} elements")
        npdt = _NUMPY_DTYPES.get(dt)  # wire names are canonical: no TYPE_ prefix, no STRING
        if npdt is None:
            raise ProtocolError(f"tensor {name!r}: unknown or unsupported data type {dt!r}")
        if isinstance(data, bytes):
            if dt == "BYTES":
                arr = deserialize_bytes(data, count).reshape(shape)
            else:
                if len(data) != count * ITEMSIZE[dt]:
                    raise ProtocolError(
                        f"tensor {name!r}: {len(data)} bytes for shape {shape} of {dt}"
                    )
                arr = np.frombuffer(bytearray(data) if self.writable_inline else data, npdt, count)
                if len(shape) != 1:
                    arr = arr.reshape(shape)
            return name, arr
        if isinstance(data, list) and 6 <= len(data) <= 7 and data[4] == GPU:
            return name, self._decode_device(name, dt, shape, count, data, peer)
        if not (isinstance(data, list) and (len(data) == 4 or len(data) == 5 and data[4] == IMMUTABLE)):
            raise ProtocolError(f"malformed tensor {name!r}: bad data field")
        seg_name, off, nbytes, eid = data[:4]
        if not (isinstance(off, int) and isinstance(nbytes, int) and isinstance(eid, int)):
            raise ProtocolError(f"malformed handle for tensor {name!r}")
        try:
            seg = self.segments.get(seg_name)
        except ShmError:  # a bad name, or no descriptor left (FdLimitError)
            peer.owe_release(eid)
            raise
        if off < 0 or nbytes < 0 or off + nbytes > seg.size:
            peer.owe_release(eid)
            raise ProtocolError(
                f"handle for tensor {name!r} is out of range: offset {off} + {nbytes} bytes "
                f"exceeds segment {seg_name} of {seg.size} bytes"
            )
        if dt == "BYTES":
            try:
                arr = deserialize_bytes(memoryview(seg.mm)[off:off + nbytes], count).reshape(shape)
            finally:
                peer.owe_release(eid)
            return name, arr
        if nbytes != count * ITEMSIZE[dt]:
            peer.owe_release(eid)
            raise ProtocolError(f"tensor {name!r}: {nbytes} bytes for shape {shape} of {dt}")
        if self.private is not None:
            # (QA) A shared view let model code write into a block that others read: a BLS
            # caller's own input, an ensemble's other steps, responses already sent.
            try:
                root = self.private.map(seg, off, nbytes, npdt, count, len(data) == 5)
            except ShmError:
                peer.owe_release(eid)
                raise
        else:  # (the host, which never writes)
            root = np.frombuffer(seg.mm, npdt, count, off)
            if len(data) == 5:
                root.flags.writeable = False
        # On the base: see Pool.new_array. Its size counts towards what is owed (see
        # URGENT_RELEASE_BYTES), unless it is immutable: its owner keeps it for the next send.
        weakref.finalize(root, peer.owe_release, eid, nbytes if len(data) == 4 else 0)
        return name, root.reshape(shape)

    def _decode_device(self, name: str, dt: str, shape: list, count: int, data: list,
                       peer: Peer) -> Any:
        handle, off, nbytes, eid, _, device = data[:6]
        reuse = len(data) == 6 or data[6] != 0
        if not (type(eid) is int and type(off) is int and type(nbytes) is int
                and type(device) is int and type(handle) is bytes):
            raise ProtocolError(f"malformed GPU handle for tensor {name!r}")
        if len(handle) != IPC_HANDLE_BYTES or off < 0 or dt == "BYTES" \
                or nbytes != count * ITEMSIZE[dt]:
            peer.owe_release(eid)
            raise ProtocolError(f"GPU handle for tensor {name!r} does not fit its {dt} {shape}: "
                                f"{nbytes} bytes, handle of {len(handle)}")
        npdt = _NUMPY_DTYPES[dt]
        if self.device_refs:
            ref = DeviceRef(handle, off, nbytes, device, npdt, tuple(shape), reuse=reuse)
            weakref.finalize(ref, peer.owe_release, eid)
            return ref
        try:
            return cuda.open_array(handle, off, nbytes, npdt, tuple(shape),
                                   lambda: peer.owe_release(eid), reuse)
        except Exception as exc:
            peer.owe_release(eid)
            raise ProtocolError(f"tensor {name!r}: cannot map its GPU memory: {exc}") from None

    def discard(self, wires: Any, peer: Peer) -> None:
        """Give back the handles of wire tensors that will never be decoded (their reader is
        gone), without mapping them: the sender's blocks are freed as if views had died."""
        if not isinstance(wires, list):
            return
        for w in wires:
            data = w[3] if type(w) is list and len(w) == 4 else None
            if type(data) is list and 4 <= len(data) <= 7 and type(data[3]) is int:
                peer.owe_release(data[3], data[2] if type(data[2]) is int and len(data) == 4
                                 else 0)

    def decode_many(self, wires: Any, peer: Peer) -> list[tuple[str, np.ndarray]]:
        if not isinstance(wires, list):
            raise ProtocolError("malformed tensor list")
        if len(wires) == 1:  # the usual answer: no loop to set up
            return [self.decode(wires[0], peer)]
        out: list[tuple[str, np.ndarray]] = []
        try:
            for w in wires:
                out.append(self.decode(w, peer))
        except BaseException:  # (the one that failed gave its own handle back)
            self.discard(wires[len(out) + 1:], peer)
            raise
        return out
