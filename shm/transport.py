"""Tensors across a process boundary: inline bytes when small, a shm handle when large.

Lifetime protocol. Every process keeps, per peer, an export table: ``export_id -> object`` that
keeps the exported memory alive (a pool array it owns, or a view it imported from someone
else). The peer builds a zero-copy view for each handle it receives; when the last view dies a
finalizer queues ``export_id`` and the release goes back (batched) to the process that gave the
handle, which drops the entry. So a block is freed exactly when no process holds a view of it,
and a forwarded handle (host -> another stub) chains the releases back hop by hop.
"""
from __future__ import annotations

import itertools
import queue
import threading
import weakref
from typing import Any

import numpy as np

from ._errors import ProtocolError
from .dtypes import ITEMSIZE, deserialize_bytes, numpy_dtype, serialize_bytes, triton_dtype_of
from .pool import Pool, SegmentMap

# Tensors up to this size travel inside the frame: below the channel's 60 KiB frame limit with
# room for the rest of a request, since a frame over it spills into shm (a 60 KiB tensor cost
# ~800 us per BLS call inline-and-spilled, ~620 us by handle, a 48 KiB one ~500 us inline).
INLINE_LIMIT = 48 * 1024
URGENT_RELEASE_BYTES = 256 * 1024
MAX_DIMS = 64
MAX_ELEMENTS = 1 << 40
_NUMPY_DTYPES = {name: numpy_dtype(name) for name in ITEMSIZE}

WireTensor = list  # [name, triton_dtype, shape, data: bytes | [segment, offset, nbytes, export_id]]


class Peer:
    """Book-keeping for one peer: what we exported to it, and releases we owe it."""

    def __init__(self, name: str = "peer") -> None:
        self.name = name
        self._exports: dict[int, Any] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        # SimpleQueue.put is safe from finalizers, whichever thread drops the last view.
        self.releases_owed: queue.SimpleQueue[int | None] = queue.SimpleQueue()
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

    def owe_release(self, eid: int, urgent: bool = False) -> None:
        """Queue a release for the peer; ``urgent`` (a big block, which the peer may need back
        for its next tensor) goes at once instead of waiting for a frame to carry it. Queued
        as ``-eid`` then."""
        if self.alive:
            self.releases_owed.put(-eid if urgent else eid)

    def take_owed(self, first: int | None = None) -> list[int]:
        out = [] if first is None else [abs(first)]
        get = self.releases_owed.get_nowait
        while True:
            try:
                x = get()
            except queue.Empty:
                return out
            if x is not None:
                out.append(x if x > 0 else -x)


class TensorTransport:
    """Encodes arrays for one peer and decodes the peer's handles into zero-copy views."""

    def __init__(self, pool: Pool, segments: SegmentMap | None = None,
                 inline_limit: int = INLINE_LIMIT, writable_inline: bool = True) -> None:
        self.pool = pool
        self.segments = segments if segments is not None else pool.segments
        self.inline_limit = inline_limit
        # Inline data decodes to a private writable array (a model may write into its inputs),
        # or, for a reader that never writes (the host routing requests), to a read-only view
        # of the frame's own bytes: one numpy call instead of three per tensor.
        self.writable_inline = writable_inline
        self.copies = 0  # bytes copied into shm by encode(), for tests and benchmarks
        self.forwards = 0  # arrays sent by handle without a copy

    # -- sending ------------------------------------------------------------------------------
    def encode(self, name: str, arr: np.ndarray, peer: Peer) -> WireTensor:
        """Wire form of ``arr``: inline when small, else a handle (forwarded if already in shm)."""
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
        return [name, dt, shape, self._handle(arr, peer)]

    def _handle(self, arr: np.ndarray, peer: Peer) -> list:
        where = self.segments.locate(arr)
        if where is None:
            arr = self.pool.copy_in(np.ascontiguousarray(arr) if not arr.flags.c_contiguous else arr)
            self.copies += arr.nbytes
            where = self.segments.locate(arr)
            assert where is not None
        else:
            self.forwards += 1
        seg, off = where
        return [seg.name, off, arr.nbytes, peer.export(arr)]

    def encode_many(self, tensors: list[tuple[str, np.ndarray]], peer: Peer) -> list[WireTensor]:
        return [self.encode(n, a, peer) for n, a in tensors]

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
        if not (isinstance(data, list) and len(data) == 4):
            raise ProtocolError(f"malformed tensor {name!r}: bad data field")
        seg_name, off, nbytes, eid = data
        if not (isinstance(off, int) and isinstance(nbytes, int) and isinstance(eid, int)):
            raise ProtocolError(f"malformed handle for tensor {name!r}")
        try:
            seg = self.segments.get(seg_name)
        except ProtocolError:
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
        root = np.frombuffer(seg.mm, npdt, count, off)
        # On the base: see Pool.new_array. A big block is handed back without delay.
        weakref.finalize(root, peer.owe_release, eid, nbytes >= URGENT_RELEASE_BYTES)
        return name, root.reshape(shape)

    def decode_many(self, wires: Any, peer: Peer) -> list[tuple[str, np.ndarray]]:
        if not isinstance(wires, list):
            raise ProtocolError("malformed tensor list")
        return [self.decode(w, peer) for w in wires]
