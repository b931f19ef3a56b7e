"""A growable pool of segments owned by this process, and the map of every segment it can see.

Allocation is first-fit over per-segment free lists (64-byte aligned). The pool starts with one
segment of ``default_size``, grows by whole new segments of ``growth_size`` (live segments are
never remapped), gives a tensor larger than the growth size a segment of its own, and unlinks a
segment that has stayed empty for ``idle_seconds`` (the first one is kept warm). ``cap`` bounds
the bytes of all its segments together.

When ``/dev/shm`` itself has no room for a new segment, the pool calls ``on_exhausted(size)``
(outside its lock) once: the process's hook gives idle segments back across processes (see
``Cmd.RECLAIM``) and says whether this thread may wait for them. If so, the pool waits up to
``RECLAIM_WAIT_S`` for the room and tries once more; a wait that found none spares the next
ones for ``NO_ROOM_S``.
"""
from __future__ import annotations

import bisect
import threading
import time
import weakref
from typing import Any, Callable

import numpy as np

from ._errors import NO_SPACE, ShmExhaustedError
from .segment import (PAGE, Segment, _unlink, could_fit, free_bytes, process_token, round_up,
                      wait_for_room)
from .sweep import owner_pid

ALIGN = 64
MiB = 1 << 20
#: How long a thread whose allocation found /dev/shm full waits for other processes to give
#: their idle segments back (``Cmd.RECLAIM``), and how often one process asks them at most.
RECLAIM_WAIT_S = 0.25
RECLAIM_EVERY_S = 0.05
#: After such a wait found no room, the pool's allocations of as much or more fail at once for
#: this long instead of waiting again (nothing gave room back just now: /dev/shm is full of
#: what others hold). A smaller one still waits: the room it needs may come back.
NO_ROOM_S = 1.0


class _Arena:
    """Free-list allocator over one owned segment."""

    __slots__ = ("seg", "free", "used", "idle_since", "dedicated")

    def __init__(self, seg: Segment, dedicated: bool) -> None:
        self.seg = seg
        self.free: list[list[int]] = [[0, seg.size]]  # sorted [offset, size]
        self.used = 0
        self.idle_since = time.monotonic()
        self.dedicated = dedicated

    def alloc(self, n: int) -> int:
        for i, (off, size) in enumerate(self.free):
            if size >= n:
                if size == n:
                    del self.free[i]
                else:
                    self.free[i][0] = off + n
                    self.free[i][1] = size - n
                self.used += n
                return off
        return -1

    def release(self, off: int, n: int) -> None:
        # Both lists are made before the index is computed: making one may run the cyclic GC,
        # whose finalizers may free (re-entrantly) into this very list.
        key, item = [off, 0], [off, n]
        self.used -= n
        free = self.free
        i = bisect.bisect_left(free, key)
        if i > 0 and free[i - 1][0] + free[i - 1][1] == off:
            free[i - 1][1] += n
            if i < len(free) and free[i - 1][0] + free[i - 1][1] == free[i][0]:
                free[i - 1][1] += free[i][1]
                del free[i]
        elif i < len(free) and off + n == free[i][0]:
            free[i][0] = off
            free[i][1] += n
        else:
            free.insert(i, item)
        if self.used == 0:
            self.idle_since = time.monotonic()


class SegmentMap:
    """Every segment this process has mapped, its own and its peers', found by name or address.

    Peers' segments are attached on first sight and cached; ``locate`` tells whether an array's
    memory lies inside one of them so that it can be forwarded by handle instead of copied.
    """

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory
        self._by_name: dict[str, Segment] = {}
        self._bases: list[int] = []
        self._segs: list[Segment] = []
        self._lock = threading.Lock()
        # Segments of ended peers still viewed here (see forget_created_by): not unlinked yet.
        self.kept: set[str] = set()

    def add(self, seg: Segment) -> None:
        with self._lock:
            self._add_locked(seg)

    def _add_locked(self, seg: Segment) -> None:
        self._by_name[seg.name] = seg
        i = bisect.bisect_left(self._bases, seg.base)
        self._bases.insert(i, seg.base)
        self._segs.insert(i, seg)

    def get(self, name: str) -> Segment:
        """The mapping of ``name``, attaching it on first use."""
        seg = self._by_name.get(name)
        if seg is None:
            with self._lock:
                seg = self._by_name.get(name)
                if seg is None:
                    # Attached under the lock so two threads never map (and index) it twice.
                    seg = Segment.attach(name, self.directory)
                    self._add_locked(seg)
        return seg

    def forget(self, name: str, owned: bool = True) -> None:
        """Drop a peer's segment (it was unlinked); unmap it now or when its last view dies.

        With ``owned=False`` a segment this process created is left alone: a peer's DROPPED
        message must never unmap memory our own pool still carves blocks from.
        """
        with self._lock:
            seg = self._by_name.get(name)
            if seg is None or (seg.owner and not owned):
                return
            self._drop_locked(seg)
        seg.close()

    def _drop_locked(self, seg: Segment) -> None:
        """Take ``seg`` out of the index (caller holds the lock; the mapping is the caller's)."""
        if self._by_name.get(seg.name) is seg:
            del self._by_name[seg.name]
            i = self._segs.index(seg)
            del self._segs[i]
            del self._bases[i]

    def forget_created_by(self, prefix: str, pid: int) -> list[str]:
        """Drop the peer segments that process ``pid`` created under ``prefix`` (it ended):
        those nothing here views any more are unmapped now, and their names returned (to
        unlink, and to tell the other peers). One still viewed (a response of it that a BLS
        caller has yet to read, through a handle that names the segment) stays mapped, and
        named: it is in :attr:`kept` until :meth:`reap_kept` finds it viewed no more.
        Without this, each stub that ended left its segments mapped here, and their memory
        used, until the server stopped."""
        with self._lock:
            segs = [seg for n, seg in self._by_name.items()
                    if not seg.owner and owner_pid(n, prefix) == pid]
        gone = []
        for seg in segs:
            if self._close_unviewed(seg):
                gone.append(seg.name)
            else:
                self.kept.add(seg.name)
        return gone

    def reap_kept(self) -> list[str]:
        """Unmap and unlink the :attr:`kept` segments viewed no more; their names."""
        gone = []
        for name in list(self.kept):
            with self._lock:
                seg = self._by_name.get(name)
            if seg is None or self._close_unviewed(seg):
                self.kept.discard(name)
                _unlink(name, self.directory)
                gone.append(name)
        return gone

    def _close_unviewed(self, seg: Segment) -> bool:
        """Unmap ``seg`` and drop it, unless something here still views it."""
        with self._lock:
            if not seg.close():
                return False
            self._drop_locked(seg)
        return True

    def locate(self, arr: np.ndarray) -> tuple[Segment, int] | None:
        """(segment, offset) if ``arr`` is C-contiguous and lies wholly inside a mapped segment."""
        if not self._bases or not arr.flags.c_contiguous:
            return None
        addr = arr.__array_interface__["data"][0]
        i = bisect.bisect_right(self._bases, addr) - 1
        if i < 0:
            return None
        seg = self._segs[i]
        off = addr - seg.base
        if off + arr.nbytes > seg.size:
            return None
        return seg, off

    def names(self) -> list[str]:
        return list(self._by_name)

    def close(self) -> None:
        with self._lock:
            segs = list(self._by_name.values())
            self._by_name.clear()
            self._bases.clear()
            self._segs.clear()
        for seg in segs:
            seg.close()


class Pool:
    """Segments owned by this process, carved into blocks that are freed when their array dies."""

    def __init__(
        self,
        prefix: str = "tritonpy_",
        default_size: int = 16 * MiB,
        growth_size: int = 16 * MiB,
        cap: int = 0,
        directory: str | None = None,
        idle_seconds: float = 5.0,
        segments: SegmentMap | None = None,
        label: str = "pool",
        on_exhausted: Callable[[int], bool] | None = None,
    ) -> None:
        self.prefix = prefix + process_token()
        self.default_size = round_up(max(default_size, PAGE))
        self.growth_size = round_up(max(growth_size, PAGE))
        self.cap = cap
        self.directory = directory
        self.idle_seconds = idle_seconds
        self.segments = segments if segments is not None else SegmentMap(directory)
        self.label = label
        self._arenas: list[_Arena] = []
        self._lost: list[_Arena] = []  # see drop_lost
        self._by_name: dict[str, _Arena] = {}
        self._counter = 0
        # Re-entrant: a block's finalizer (-> free) can run inside any allocation made while
        # the lock is held, when the cyclic GC happens to collect an array there.
        self._lock = threading.RLock()
        self._closed = False
        self.peak_bytes = 0
        self.dropped: list[str] = []  # unlinked names not yet told to peers (take_dropped)
        self.on_exhausted = on_exhausted
        self._no_room_until = 0.0  # see NO_ROOM_S
        self._no_room_asked = 0  # the bytes that found no room then

    # -- allocation -------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> tuple[Segment, int]:
        """Reserve ``nbytes`` (at least 1); the caller must call :meth:`free` exactly once."""
        try:
            return self._allocate(nbytes)
        except ShmExhaustedError as exc:
            hook = self.on_exhausted
            if (hook is None or exc.reason != NO_SPACE or not hook(exc.asked)
                    or (time.monotonic() < self._no_room_until
                        and exc.asked >= self._no_room_asked)):
                raise
            if not wait_for_room(self.directory, exc.asked, RECLAIM_WAIT_S):
                if could_fit(self.directory, exc.asked):  # (else it failed without a wait)
                    self._no_room_until = time.monotonic() + NO_ROOM_S
                    self._no_room_asked = exc.asked
                raise
        return self._allocate(nbytes)

    def _allocate(self, nbytes: int) -> tuple[Segment, int]:
        n = (max(nbytes, 1) + ALIGN - 1) // ALIGN * ALIGN
        with self._lock:
            for arena in self._arenas:
                if arena.dedicated and (arena.seg.size < n or arena.used):
                    continue
                off = arena.alloc(n)
                if off >= 0:
                    return arena.seg, off
            self._reap_locked()
            if not self._arenas:
                size = max(self.default_size, round_up(n)) if n <= self.growth_size else round_up(n)
            else:
                size = self.growth_size if n <= self.growth_size else round_up(n)
            arena = self._grow_locked(size, dedicated=n > self.growth_size, need=round_up(n))
            off = arena.alloc(n)
            return arena.seg, off

    def free(self, seg: Segment, offset: int, nbytes: int) -> None:
        """Give back a block from :meth:`allocate`."""
        n = (max(nbytes, 1) + ALIGN - 1) // ALIGN * ALIGN
        with self._lock:
            arena = self._by_name.get(seg.name)
            if arena is not None:
                arena.release(offset, n)

    def new_array(self, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        """A C-contiguous array inside the pool; its block is freed when its last view dies."""
        dt = np.dtype(dtype)
        count = 1
        for d in shape:
            count *= d
        nbytes = count * dt.itemsize
        seg, off = self.allocate(nbytes)
        # The finalizer goes on the frombuffer() array itself: every later view (reshape,
        # slice) collapses its base onto it, so it dies exactly with the last view.
        root = np.frombuffer(seg.mm, dt, count, off)
        weakref.finalize(root, self.free, seg, off, nbytes)
        return root.reshape(shape)

    def copy_in(self, src: np.ndarray) -> np.ndarray:
        """A pool copy of ``src`` (one memcpy)."""
        dst = self.new_array(src.dtype, src.shape)
        np.copyto(dst, src, casting="no")
        return dst

    # -- growth, idling, cap ----------------------------------------------------------------
    def _grow_locked(self, size: int, dedicated: bool, need: int = 0) -> _Arena:
        """A new segment of ``size`` bytes, or, under the cap, of what the cap leaves if that
        still holds ``need`` (a cap below the default or growth size must not refuse all)."""
        if self._closed:
            raise RuntimeError(f"{self.label} is closed")
        total = sum(a.seg.size for a in self._arenas)
        if self.cap and total + size > self.cap:
            self._reap_locked(force=True)
            total = sum(a.seg.size for a in self._arenas)
            room = (self.cap - total) // PAGE * PAGE
            if not dedicated and 0 < need <= room < size:
                size = room
            if total + size > self.cap:
                raise ShmExhaustedError(size, max(self.cap - total, 0),
                                        "the pool" if self.label == "pool"
                                        else f"the {self.label} pool",
                                        "pool cap")
        name = f"{self.prefix}_{self._counter}"
        self._counter += 1
        while True:
            try:
                seg = Segment.create(name, size, self.directory)
                break
            except ShmExhaustedError:
                # No room for a whole growth step: a smaller segment may still hold this block
                # (halves, down to the block itself). A 1 MB tensor was refused with 12 MiB
                # free because a new segment is 16 MiB.
                if dedicated or not 0 < need < size:
                    raise
                size = max(need, size // 2 // PAGE * PAGE)
        arena = _Arena(seg, dedicated)
        self._arenas.append(arena)
        self._by_name[name] = arena
        self.segments.add(seg)
        self.peak_bytes = max(self.peak_bytes, total + size)
        return arena

    def _reap_locked(self, force: bool = False) -> list[str]:
        now = time.monotonic()
        gone = []
        # The first segment is kept warm, unless it is a big tensor's own segment.
        keep_first = not force and bool(self._arenas) and not self._arenas[0].dedicated
        for arena in list(self._arenas[1:] if keep_first else self._arenas):
            if arena.used == 0 and (force or now - arena.idle_since >= self.idle_seconds):
                self._arenas.remove(arena)
                del self._by_name[arena.seg.name]
                arena.seg.unlink()
                self.segments.forget(arena.seg.name)
                gone.append(arena.seg.name)
        self.dropped.extend(gone)
        return gone

    def reap(self, force: bool = False) -> list[str]:
        """Unlink segments idle for ``idle_seconds`` (``force``: every idle one, the first
        too), and let go of lost ones now unused; returns their names (peers may unmap)."""
        with self._lock:
            return self._reap_locked(force) + (self._reap_lost_locked() if self._lost else [])

    def drop_lost(self) -> list[str]:
        """Stop carving blocks from segments that lost their name (``Segment.lost``: removed
        from their directory while in use, by ``rm`` or systemd's ``RemoveIPC``): peers open
        segments by name, so a tensor placed there could not reach one that has not mapped it
        yet. Their blocks stay valid (and are sent by copy, not by handle: ``Segment.gone``);
        each segment is let go, and its peers told, once its last block is freed (see
        ``_reap_lost_locked``). Returns their names."""
        with self._lock:
            lost = [a for a in self._arenas if a.seg.lost()]
            for arena in lost:
                self._arenas.remove(arena)
                arena.seg.gone = True  # (the name is not ours now: never unlink it)
                self._lost.append(arena)
            names = [a.seg.name for a in lost]
            self._reap_lost_locked()
        return names

    def _reap_lost_locked(self) -> list[str]:
        """Let go of the lost segments none of whose blocks is in use any more."""
        gone = []
        for arena in [a for a in self._lost if a.used == 0]:
            self._lost.remove(arena)
            del self._by_name[arena.seg.name]
            self.segments.forget(arena.seg.name)
            gone.append(arena.seg.name)
        self.dropped.extend(gone)
        return gone

    def take_dropped(self) -> list[str]:
        """Names unlinked since the last call, for peers to unmap."""
        with self._lock:
            out, self.dropped = self.dropped, []
        return out

    def usage(self) -> dict[str, int]:
        """Segments, mapped bytes and bytes in use right now."""
        with self._lock:
            return {
                "segments": len(self._arenas),
                "mapped_bytes": sum(a.seg.size for a in self._arenas),
                "used_bytes": sum(a.used for a in self._arenas),
                "peak_bytes": self.peak_bytes,
                "free_system_bytes": free_bytes(self.directory),
            }

    def segment_names(self) -> list[str]:
        with self._lock:
            return [a.seg.name for a in self._arenas]

    def close(self) -> None:
        """Unlink every segment; live views stay valid until they die (the mapping outlives
        the name)."""
        with self._lock:
            self._closed = True
            arenas, self._arenas = self._arenas + self._lost, []
            self._lost = []
            self._by_name.clear()
        for arena in arenas:
            arena.seg.unlink()  # (not a lost one's: see drop_lost)
            self.segments.forget(arena.seg.name)
