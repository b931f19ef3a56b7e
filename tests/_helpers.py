"""Test helpers: a real peer process on a real Channel, and data of every Triton type.

The parent side is :class:`Child`: it owns a pool, starts ``python tests/_helpers.py serve`` with
the far end of a socket pair (``pass_fds``; the parent closes its copy, so the child's death
closes the channel), reads frames on a thread as the host does, and makes calls. The child
(:func:`_serve`) runs small scripted operations on what it receives and answers each with a
REPLY frame. Both sides compute digests with :func:`digest`, which does not use the codec
under test.

Run directly, this file is the child: ``python _helpers.py serve <fd> <json config>``.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

from tritonpy.shm import (
    INLINE_LIMIT,
    Channel,
    Cmd,
    Pool,
    ProtocolError,
    TensorTransport,
    socket_pair,
)

HERE = os.path.abspath(__file__)
NUMERIC_TYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
                 "INT64", "FP16", "FP32", "FP64"]
ALL_TYPES = NUMERIC_TYPES + ["BYTES"]
MiB = 1 << 20


# -- data ------------------------------------------------------------------------------------
def digest(arr: np.ndarray) -> str:
    """A content hash of an array: raw bytes for numbers, element by element for BYTES."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{arr.dtype.kind}{arr.shape}".encode())
    if arr.dtype.kind in "OSU":
        for x in arr.ravel(order="C").tolist():
            b = x.encode("utf-8") if isinstance(x, str) else bytes(x)
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
    else:
        flat = np.ascontiguousarray(arr).reshape(-1)
        h.update(flat.view(np.uint8))
    return h.hexdigest()


def bytes_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Identical shape and bytes (so NaNs and -0.0 compare as sent)."""
    if a.shape != b.shape:
        return False
    if a.dtype.kind in "OSU" or b.dtype.kind in "OSU":
        enc = [x.encode("utf-8") if isinstance(x, str) else bytes(x)
               for x in a.ravel().tolist()]
        return enc == [bytes(x) for x in b.ravel().tolist()]
    return a.dtype == b.dtype and np.array_equal(
        np.ascontiguousarray(a).reshape(-1).view(np.uint8),
        np.ascontiguousarray(b).reshape(-1).view(np.uint8))


_SPECIAL = ["", "héllo wörld ✓", "a\x00b", "\x00", "日本語のテキスト", "🙂" * 3]


def make_array(triton_type: str, nbytes: int, seed: int = 0) -> np.ndarray:
    """An array of ``triton_type`` with about ``nbytes`` of payload (0 gives an empty array).

    Numbers are random with special values mixed in (NaN, inf, -0.0, extremes); BYTES mixes
    str, empty strings, non-ASCII text, embedded NULs and random binary.
    """
    rng = np.random.default_rng(seed)
    if triton_type == "BYTES":
        items: list[Any] = []
        size = 0
        i = 0
        while size < nbytes:
            if i < len(_SPECIAL):
                x: Any = _SPECIAL[i]
            elif i % 3 == 0:
                x = "s" * int(rng.integers(0, 40))
            else:
                x = rng.bytes(int(rng.integers(0, 200)))
            items.append(x)
            size += 4 + len(x.encode() if isinstance(x, str) else x)
            i += 1
        arr = np.empty(len(items), dtype=object)
        arr[:] = items
        return arr
    from tritonpy.shm import numpy_dtype

    dt = numpy_dtype(triton_type)
    count = nbytes // dt.itemsize
    if dt == np.bool_:
        return rng.integers(0, 2, count).astype(np.bool_)
    if dt.kind == "f":
        arr = rng.standard_normal(count).astype(dt)
        special = np.array([np.nan, np.inf, -np.inf, -0.0, np.finfo(dt).max], dtype=dt)
        arr[: min(count, special.size)] = special[: min(count, special.size)]
        return arr
    info = np.iinfo(dt)
    arr = rng.integers(info.min, info.max, count, dtype=dt, endpoint=True)
    if count >= 2:
        arr[0], arr[1] = info.min, info.max
    return arr


def mapped_segments(pid: int, prefix: str) -> set[str]:
    """Names of ``prefix`` segments that process ``pid`` has mapped right now."""
    names = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            path = parts[5].strip() if len(parts) == 6 else ""
            base = os.path.basename(path.replace(" (deleted)", ""))
            if base.startswith(prefix):
                names.add(base)
    return names


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0, interval: float = 0.005) -> bool:
    """Poll ``predicate`` until true or ``timeout``; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


# -- the parent side ---------------------------------------------------------------------------
class ChildError(AssertionError):
    """The child answered a call with an error."""


class Child:
    """A peer process on a real Channel; use as a context manager (it always cleans up). This
    side decodes handles as the host does (shared views: it never writes), the child as a
    stub (copy-on-write views)."""

    def __init__(self, prefix: str, *, child_pool: dict | None = None,
                 pool: dict | None = None, inline_limit: int = INLINE_LIMIT,
                 child_inline_limit: int = INLINE_LIMIT) -> None:
        self.prefix = prefix
        self.pool = Pool(prefix=prefix, label="parent", **(pool or {}))
        self.transport = TensorTransport(self.pool, inline_limit=inline_limit, private_views=False)
        config = {"prefix": prefix, "pool": child_pool or {}, "inline_limit": child_inline_limit}
        ours, theirs = socket_pair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, HERE, "serve", str(theirs.fileno()), json.dumps(config)],
                pass_fds=[theirs.fileno()])
        except BaseException:
            ours.close()
            self.pool.close()
            raise
        finally:
            theirs.close()  # only the child holds it now: its death closes our end
        self.pid = self.proc.pid
        self.channel = Channel(ours, self.transport, name="parent")
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.protocol_errors: list[ProtocolError] = []
        self.closed_at: float | None = None
        self.inbox_extra: list[Any] = []  # frames that arrived while waiting for a reply
        self._ids = itertools.count(1)
        self._reader = threading.Thread(target=self._read, name="test-reader", daemon=True)
        self._reader.start()

    # The host's reader thread: RELEASE frames are consumed inside recv().
    def _read(self) -> None:
        while True:
            try:
                msg = self.channel.recv()
            except ProtocolError as exc:
                self.protocol_errors.append(exc)
                continue
            except Exception as exc:  # surface anything else to the waiting test
                self.inbox.put(exc)
                return
            if msg is None:
                self.closed_at = time.monotonic()
                self.inbox.put(None)
                return
            self.inbox.put(msg)

    def next_frame(self, timeout: float = 30.0) -> Any:
        msg = self.inbox.get(timeout=timeout)
        if isinstance(msg, Exception):
            raise msg
        return msg

    def call(self, op: str, timeout: float = 60.0, **body: Any) -> dict:
        """Run ``op`` in the child and return its REPLY body."""
        cid = next(self._ids)
        self.channel.send(Cmd.EXECUTE, cid, {"op": op, **body})
        while True:
            msg = self.next_frame(timeout)
            if msg is None:
                raise ChildError(f"child {self.pid} closed the channel during {op!r}")
            if msg[0] == Cmd.REPLY and msg[1] == cid:
                reply = msg[2]
                if reply.get("error"):
                    raise ChildError(f"child failed {op!r}: {reply['error']}")
                return reply
            self.inbox_extra.append(msg)

    def send_tensors(self, op: str, arrays: dict[str, np.ndarray], **body: Any) -> dict:
        wires = [self.transport.encode(n, a, self.channel.peer) for n, a in arrays.items()]
        return self.call(op, inputs=wires, **body)

    def decode(self, wires: list) -> dict[str, np.ndarray]:
        return dict(self.transport.decode_many(wires, self.channel.peer))

    def used(self) -> int:
        return self.pool.usage()["used_bytes"]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)

    def close(self) -> None:
        """Close the channel; the child cleans up and exits (killed after 10 s)."""
        self.channel.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=5)
        self.pool.close()
        self.transport.segments.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- the child side ------------------------------------------------------------------------------
def _serve(fd: int, config: dict) -> None:
    import socket

    _die_with_parent()
    pool = Pool(prefix=config["prefix"], label="child", **config["pool"])
    transport = TensorTransport(pool, inline_limit=config["inline_limit"])
    sock = socket.socket(fileno=fd)
    channel = Channel(sock, transport, name="child")
    peer = channel.peer
    held: dict[str, list[np.ndarray]] = {}
    errors: list[str] = []

    def reply(cid: int, body: dict) -> None:
        channel.send(Cmd.REPLY, cid, body)

    def op_echo(body: dict) -> dict:
        got = transport.decode_many(body.get("inputs", []), peer)
        out = []
        for name, arr in got:
            if body.get("mode") == "forward":
                out.append((name, arr))
            else:
                out.append((name, np.array(arr, copy=True)))
        return {"digests": {n: digest(a) for n, a in got},
                "outputs": transport.encode_many(out, peer),
                "payload": body.get("payload")}

    def op_hold(body: dict) -> dict:
        got = transport.decode_many(body.get("inputs", []), peer)
        views = [a[1:][::2] if body.get("slice") else a for _, a in got]
        held.setdefault(body.get("key", "default"), []).extend(views)
        return {"digests": [digest(v) for v in views]}

    def op_check(body: dict) -> dict:
        return {"digests": [digest(v) for v in held.get(body.get("key", "default"), [])]}

    def op_drop(body: dict) -> dict:
        if body.get("key") is None:
            n = sum(len(v) for v in held.values())
            held.clear()
        else:
            n = len(held.pop(body["key"], []))
        return {"dropped": n}

    def op_make(body: dict) -> dict:
        arrays = []
        for i, (dtype, nbytes) in enumerate(body["specs"]):
            src = make_array(dtype, nbytes, seed=body.get("seed", 0) + i)
            if src.dtype != object:
                arr = pool.new_array(src.dtype, src.shape)  # lives in shm: sent by handle
                arr[...] = src
            else:
                arr = src
            arrays.append((f"t{i}", arr))
        return {"outputs": transport.encode_many(arrays, peer)}

    def op_stream(body: dict) -> dict:
        # Sends frames until killed (or ``count`` frames): the peer-death test kills us mid-way.
        count = body.get("count", 1 << 62)
        nbytes = body.get("nbytes", 256 * 1024)
        for i in range(count):
            arr = pool.new_array(np.uint8, (nbytes,))
            arr[:] = i % 251
            channel.send(Cmd.RESPONSE_SEND, body.get("cid", 0),
                         {"i": i, "outputs": transport.encode_many([("s", arr)], peer)})
            del arr
        return {"sent": count}

    def op_stats(body: dict) -> dict:
        return {"segments": sorted(transport.segments.names()),
                "owned": pool.segment_names(),
                "usage": pool.usage(),
                "forwards": transport.forwards, "copies": transport.copies,
                "outstanding": peer.outstanding, "errors": errors,
                "held": sum(len(v) for v in held.values())}

    def op_reap(body: dict) -> dict:
        pool.reap()
        return {"dropped": pool.take_dropped()}

    ops = {"echo": op_echo, "hold": op_hold, "check": op_check, "drop": op_drop,
           "make": op_make, "stream": op_stream, "stats": op_stats, "reap": op_reap}
    try:
        while True:
            try:
                msg = channel.recv()
            except ProtocolError as exc:
                errors.append(str(exc))
                continue
            if msg is None:
                break
            cmd, cid, body = msg
            if cmd != Cmd.EXECUTE:
                continue  # DROPPED and the like: handled inside recv()
            try:
                result = ops[body["op"]](body)
            except ProtocolError as exc:
                errors.append(str(exc))
                result = {"error": f"ProtocolError: {exc}"}
            reply(cid, result)
            del msg, body, result
    finally:
        channel.close()
        held.clear()
        pool.close()
        transport.segments.close()


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: never outlive the test process, even if it is killed."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        _serve(int(sys.argv[2]), json.loads(sys.argv[3]))
    else:
        raise SystemExit(f"unknown role {sys.argv[1]!r}")
