"""The response cache (Triton's ``--cache-config local,size=N`` with a model's
``response_cache { enable: true }``): a request whose model, version and inputs (names, types,
shapes and bytes) match an earlier successful one is answered with that one's outputs, without
running the model.

As in Triton 2.51 (measured side by side): request ids and parameters are not part of the key;
a hit counts as a success and in ``cache_hit`` (its lookup time), a miss in ``cache_miss`` (its
lookup and insertion time) once its request has run (not one rejected or timed out in the
queue), unless an identical request's answer was kept first, and only executions count in
``inference_count`` and the compute times. Unlike Triton, a hit answers only the outputs its request asks for, and an entry that
lacks one of them is a miss (Triton answers whatever the entry holds).

Entries are kept least recently used first and evicted to stay within the size, each counted
as Triton's cache entry packs its response (:func:`packed_size`; Triton's local cache adds its
allocator's few bytes per entry on top); an answer bigger than the whole cache is not kept, and
the log says so in Triton's words. Cached arrays are read-only: a caller that writes to an
output gets its own copy.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import threading
import time
from typing import Any, Iterable

import numpy as np

from .shm.dtypes import serialize_bytes, triton_dtype_of

log = logging.getLogger(__name__)

def packed_size(outputs: Iterable[tuple[str, np.ndarray]]) -> int:
    """An answer's size as Triton's cache entry packs it (its documented layout, and what
    Triton 2.51 reports in "Requested byte_size"): the number of outputs (4 bytes), then for
    each its packed size (8), its name, data type and shape (int64s), each after a 4-byte
    length, and its data after an 8-byte length (BYTES data as it travels: serialize_bytes)."""
    size = 4
    for name, arr in outputs:
        dtype = triton_dtype_of(arr)
        data = len(serialize_bytes(arr)) if dtype == "BYTES" else int(arr.nbytes)
        size += 8 + 4 + len(name.encode()) + 4 + len(dtype) + 4 + 8 * arr.ndim + 8 + data
    return size


class ResponseCache:
    """An LRU of successful answers, at most ``size`` bytes of them as Triton packs them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.used = 0
        self._entries: collections.OrderedDict[bytes, tuple[dict[str, np.ndarray], Any, int]] = \
            collections.OrderedDict()
        self._lock = threading.Lock()
        # Server-wide counts and times (Triton's nv_cache_* metrics).
        self.hits = self.misses = self.evictions = 0
        self.lookup_ns = self.insert_ns = 0

    @staticmethod
    def key(model: str, version: int, inputs: Iterable[tuple[str, np.ndarray]]) -> bytes:
        """The digest of a request's model, version and inputs (in name order)."""
        h = hashlib.blake2b(digest_size=20)
        h.update(f"{model}\0{version}\0".encode())
        for name, arr in sorted(inputs, key=lambda item: item[0]):
            h.update(f"{name}\0{arr.dtype.str}\0{arr.shape}\0".encode())
            if arr.dtype == np.object_:
                for x in arr.flat:
                    b = x if isinstance(x, bytes) else str(x).encode()
                    h.update(len(b).to_bytes(8, "little"))
                    h.update(b)
            else:
                h.update(np.ascontiguousarray(arr).data)
        return h.digest()

    def lookup(self, key: bytes, wanted: Iterable[str]) -> tuple[list[tuple[str, np.ndarray]],
                                                                 Any] | None:
        """The outputs named in ``wanted`` and the parameters of the entry for ``key``, or None
        (no entry, or one without all of them)."""
        t0 = time.monotonic_ns()
        with self._lock:
            try:
                entry = self._entries.get(key)
                if entry is None:
                    self.misses += 1
                    return None
                outputs, params, _ = entry
                try:
                    found = [(name, outputs[name]) for name in wanted]
                except KeyError:
                    self.misses += 1
                    return None
                self.hits += 1
                self._entries.move_to_end(key)
                return found, dict(params) if params else None
            finally:
                self.lookup_ns += time.monotonic_ns() - t0

    def insert(self, key: bytes, outputs: list[tuple[str, np.ndarray]], params: Any,
               model: str = "") -> bool | None:
        """Keep a copy of a successful answer; False (and an error in the log, as Triton
        writes one) when it is larger than the cache; None when the cache holds that key
        with these outputs already (an identical request's answer, kept first: it stays, as
        in Triton). An entry without some of them is replaced."""
        t0 = time.monotonic_ns()
        with self._lock:
            held = self._entries.get(key)
            if held is not None and all(name in held[0] for name, _ in outputs):
                return None
        kept: dict[str, np.ndarray] = {}
        for name, arr in outputs:
            copy = np.array(arr, copy=True)
            copy.flags.writeable = False
            kept[name] = copy
        size = packed_size(kept.items())
        if size > self.size:
            # Triton's words, its key a number (ours, the key's first 8 bytes), and the model.
            log.error("Failed to insert key [%d] into response cache: Requested byte_size: %d "
                      "is greater than total cache size: %d (model '%s')",
                      int.from_bytes(key[:8], "little"), size, self.size, model)
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.used -= old[2]
            while self._entries and self.used + size > self.size:
                _, (_, _, gone) = self._entries.popitem(last=False)
                self.used -= gone
                self.evictions += 1
            self._entries[key] = (kept, dict(params) if params else None, size)
            self.used += size
            self.insert_ns += time.monotonic_ns() - t0
        return True

    def metrics(self) -> dict[str, float]:
        """Triton's server-wide cache metrics (nv_cache_*): counts, utilization and the
        cumulative lookup and insertion times in µs."""
        with self._lock:
            return {
                "util": self.used / self.size if self.size else 0.0,
                "entries": float(len(self._entries)),
                "lookups": float(self.hits + self.misses),
                "hits": float(self.hits),
                "misses": float(self.misses),
                "evictions": float(self.evictions),
                "lookup_us": float(self.lookup_ns // 1000),  # whole µs, as Triton prints
                "insertion_us": float(self.insert_ns // 1000),
            }

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
