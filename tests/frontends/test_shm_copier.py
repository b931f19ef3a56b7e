"""Large copies between a client's system shared-memory region and the server's segments are
made by the copier, a child process that maps both (``tritonpy/frontends/_shmcopy.py``): the
data arrives whole both ways; a client that shrinks its object gets the error it always got,
also when the shrink lands during the copy (the SIGBUS ends the copier alone, and the next copy
starts a new one); nothing of a region stays mapped once it is unregistered, no segment the
server gave back stays mapped in the copier, and the copier ends with the server."""
from __future__ import annotations

import os
import signal
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException
from tritonclient.utils import shared_memory as shm_utils

from _models import holds, truncate_shm
from _serve import Serve, serve_repo
from tritonpy._errors import InvalidArgumentError
from tritonpy.frontends import _shmcopy, sharedmem
from tritonpy.frontends.sharedmem import SharedMemoryRegistry
from tritonpy.shm import Pool, SegmentMap

SIZE = 4 << 20  # past the copier's 1 MiB

CONFIG = """\
name: "ident"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_UINT8 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_UINT8 dims: [ -1 ] } ]
"""
MODEL = """\
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT",
                    pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()[::-1].copy())])
                for r in requests]
"""


def _copiers(parent: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(parent).children()
            if any("_shmcopy_child" in part for part in p.cmdline())]



def _eventually(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_large_tensors_cross_shared_memory_through_the_copier(
        serve: Callable[..., Serve], tmp_path: Path,
        regions: Callable[[int], tuple[str, Any]]) -> None:
    (tmp_path / "repo" / "ident" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "ident" / "config.pbtxt").write_text(CONFIG)
    (tmp_path / "repo" / "ident" / "1" / "model.py").write_text(textwrap.dedent(MODEL))
    server, http_port, grpc_port = serve_repo(serve, tmp_path / "repo")
    in_key, in_handle = regions(SIZE)
    out_key, out_handle = regions(2 * SIZE)
    data = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
    shm_utils.set_shared_memory_region(in_handle, [data])
    http = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
    grpcc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        http.register_system_shared_memory("in", "/" + in_key, SIZE)
        http.register_system_shared_memory("out", "/" + out_key, 2 * SIZE)
        for client, mod, offset in ((http, httpclient, 0), (grpcc, grpcclient, SIZE)):
            inp = mod.InferInput("IN", [SIZE], "UINT8")
            inp.set_shared_memory("in", SIZE)
            out = mod.InferRequestedOutput("OUT")
            out.set_shared_memory("out", SIZE, offset=offset)
            client.infer("ident", [inp], outputs=[out])
        got = shm_utils.get_contents_as_numpy(out_handle, np.uint8, [2 * SIZE])
        assert np.array_equal(got[:SIZE], data[::-1]) and np.array_equal(got[SIZE:], data[::-1])

        copiers = _copiers(server.proc.pid)
        assert len(copiers) == 1
        copier = copiers[0].pid
        assert holds(copier, in_key) and holds(copier, out_key)
        http.unregister_system_shared_memory()
        for pid in (server.proc.pid, copier):
            assert _eventually(lambda: not holds(pid, in_key) and not holds(pid, out_key))
        # small tensors do not start anything new
        small = httpclient.InferInput("IN", [3], "UINT8")
        small.set_data_from_numpy(np.arange(3, dtype=np.uint8))
        assert http.infer("ident", [small]).as_numpy("OUT").tolist() == [2, 1, 0]
    finally:
        http.close()
        grpcc.close()
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait(30) == 0
    assert not psutil.pid_exists(copier) or psutil.Process(copier).status() == psutil.STATUS_ZOMBIE


@pytest.fixture
def registry(shm_prefix: str) -> Iterator[tuple[SharedMemoryRegistry, Pool]]:
    segments = SegmentMap()
    pool = Pool(prefix=shm_prefix, default_size=SIZE, growth_size=SIZE, segments=segments)
    reg = SharedMemoryRegistry(segments=segments)
    try:
        yield reg, pool
    finally:
        reg.close()
        pool.close()
        segments.close()


def test_a_shrink_during_a_copy_ends_the_copier_only(
        registry: tuple[SharedMemoryRegistry, Pool], regions: Callable[[int], tuple[str, Any]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    reg, pool = registry
    key, handle = regions(SIZE)
    data = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    shm_utils.set_shared_memory_region(handle, [data])
    reg.register("r", "/" + key, 0, SIZE)
    got = reg.read("r", 0, SIZE, lambda n: pool.new_array(np.uint8, (n,)))
    assert np.array_equal(got, data)
    (first,) = _copiers(os.getpid())

    # The shrink lands between the size check and the copy: the check is skipped once, so the
    # copier's load past the object's end is a SIGBUS, and the request gets the error a check
    # would have given.
    real = sharedmem._check_size
    skipped: list[bool] = []

    def check_once(*args: Any) -> None:
        if not skipped:
            skipped.append(True)
            return
        real(*args)

    monkeypatch.setattr(sharedmem, "_check_size", check_once)
    truncate_shm(key, 4096)
    with pytest.raises(InvalidArgumentError, match=f"shared memory region 'r' cannot be read: "
                       f"its shm object '/{key}' no longer holds byte 4096"):
        reg.read("r", 0, SIZE, lambda n: pool.new_array(np.uint8, (n,)))
    assert skipped and not psutil.pid_exists(first.pid)
    monkeypatch.setattr(sharedmem, "_check_size", real)

    # The object back at its size: the next copy starts a new copier, both ways.
    truncate_shm(key, SIZE)
    out = pool.new_array(np.uint8, (SIZE,))
    out[:] = data[::-1]
    reg.write("r", 0, out)
    assert np.array_equal(shm_utils.get_contents_as_numpy(handle, np.uint8, [SIZE]), data[::-1])
    assert np.array_equal(reg.read("r", 0, SIZE, lambda n: pool.new_array(np.uint8, (n,))),
                          data[::-1])
    (second,) = _copiers(os.getpid())
    assert second.pid != first.pid


def test_the_copier_lets_go_of_segments_the_server_gave_back(
        registry: tuple[SharedMemoryRegistry, Pool], regions: Callable[[int], tuple[str, Any]],
        shm_prefix: str) -> None:
    reg, pool = registry
    key, handle = regions(SIZE)
    reg.register("r", "/" + key, 0, SIZE)
    arr = reg.read("r", 0, SIZE, lambda n: pool.new_array(np.uint8, (n,)))
    (copier,) = _copiers(os.getpid())
    names = pool.segment_names()
    assert names and all(holds(copier.pid, n) for n in names)
    del arr
    assert set(pool.reap(force=True)) == set(names)
    # unmapped within its sweep (a second), with no copy to prompt it
    assert _eventually(lambda: not any(holds(copier.pid, n) for n in names))
    reg.close()
    assert _eventually(lambda: not psutil.pid_exists(copier.pid))


def test_a_stuck_copier_is_replaced_and_the_copy_made_in_the_server(
        registry: tuple[SharedMemoryRegistry, Pool], regions: Callable[[int], tuple[str, Any]]
) -> None:
    # Given a quarter second and 5 ms a MiB: the copy runs on the thread that decodes the
    # request, the event loop's for HTTP and gRPC, where every client waited as long (10 s).
    reg, pool = registry
    key, handle = regions(SIZE)
    data = np.random.default_rng(2).integers(0, 256, SIZE, dtype=np.uint8)
    shm_utils.set_shared_memory_region(handle, [data])
    reg.register("r", "/" + key, 0, SIZE)
    assert np.array_equal(reg.read("r", 0, SIZE, lambda n: pool.new_array(np.uint8, (n,))), data)
    (stuck,) = _copiers(os.getpid())
    stuck.suspend()  # SIGSTOP: it takes the copy and never answers
    t0 = time.monotonic()
    got = reg.read("r", 0, SIZE, lambda n: pool.new_array(np.uint8, (n,)))
    assert np.array_equal(got, data) and time.monotonic() - t0 < 1.5
    assert _eventually(lambda: not psutil.pid_exists(stuck.pid)
                       or psutil.Process(stuck.pid).status() == psutil.STATUS_ZOMBIE)
    # the next copy starts a new one
    reg.read("r", 0, SIZE, lambda n: pool.new_array(np.uint8, (n,)))
    (fresh,) = _copiers(os.getpid())
    assert fresh.pid != stuck.pid


def test_a_copy_past_the_objects_end_is_refused_by_the_copier_which_lives_on(
        registry: tuple[SharedMemoryRegistry, Pool], regions: Callable[[int], tuple[str, Any]]) -> None:
    """Without the server's size check (a shrink between it and the copier's first mapping):
    the copier answers that it cannot, and goes on; the server then copies itself."""
    _, pool = registry
    key, _ = regions(4096)
    dst = pool.new_array(np.uint8, (SIZE,))
    seg, off = pool.segments.locate(dst)  # type: ignore[misc]
    copier = _shmcopy.Copier()
    fd = os.open(f"/dev/shm/{key}", os.O_RDWR)
    try:
        path = _shmcopy.segment_path(seg.name, seg.directory)
        assert copier.copy(1, fd, 0, path, off, SIZE, write=False) is False
        (child,) = _copiers(os.getpid())
        assert copier.copy(1, fd, 0, path, off, 4096, write=False) is True  # what is there
        assert _copiers(os.getpid()) == [child]
    finally:
        os.close(fd)
        copier.close()
    assert not psutil.pid_exists(child.pid) or child.status() == psutil.STATUS_ZOMBIE


def test_clients_racing_truncates_against_large_copies_lose_nothing_else(
        serve: Callable[..., Serve], tmp_path: Path,
        regions: Callable[[int], tuple[str, Any]]) -> None:
    """Clients send large tensors in and out of one region while it is shrunk and grown back
    again and again (each shrink may land during a copy: a SIGBUS in the copier). Each request
    is answered, right or with the shrink's error; no connection drops; the log holds nothing
    but the copier's deaths; the server serves on. (This race found three bugs.)"""
    (tmp_path / "repo" / "ident" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "ident" / "config.pbtxt").write_text(CONFIG)
    (tmp_path / "repo" / "ident" / "1" / "model.py").write_text(textwrap.dedent(MODEL))
    server, http_port, grpc_port = serve_repo(serve, tmp_path / "repo")
    key, handle = regions(2 * SIZE)
    shm_utils.set_shared_memory_region(handle, [np.full(SIZE, 7, np.uint8)])
    http = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
    http.register_system_shared_memory("r", "/" + key, 2 * SIZE)
    stop = time.monotonic() + 3.0
    outcomes: list[str] = []

    def client(mod: Any, url: str) -> None:
        c = mod.InferenceServerClient(url)
        inp = mod.InferInput("IN", [SIZE], "UINT8")
        inp.set_shared_memory("r", SIZE)
        out = mod.InferRequestedOutput("OUT")
        out.set_shared_memory("r", SIZE, offset=SIZE)
        try:
            while time.monotonic() < stop:
                try:
                    c.infer("ident", [inp], outputs=[out])
                    outcomes.append("ok")
                except InferenceServerException as exc:
                    shrunk = "no longer holds byte" in (exc.message() or "")
                    outcomes.append("shrunk" if shrunk else f"{exc.status()}: {exc.message()}")
        finally:
            c.close()

    threads = [threading.Thread(target=client, args=(mod, url)) for mod, url in (
        (grpcclient, f"127.0.0.1:{grpc_port}"), (grpcclient, f"127.0.0.1:{grpc_port}"),
        (httpclient, f"127.0.0.1:{http_port}"))]
    for t in threads:
        t.start()
    try:
        sizes = [4096, SIZE // 2, SIZE + SIZE // 2]
        k = 0
        while time.monotonic() < stop:
            truncate_shm(key, sizes[k % 3])
            k += 1
            time.sleep(0.002)
            truncate_shm(key, 2 * SIZE)
            time.sleep(0.01)
    finally:
        for t in threads:
            t.join(60)
        truncate_shm(key, 2 * SIZE)
    others = [o for o in outcomes if o not in ("ok", "shrunk")]
    assert outcomes and not others, others[:5]
    assert "ok" in outcomes and "shrunk" in outcomes, set(outcomes)
    shm_utils.set_shared_memory_region(handle, [np.arange(SIZE, dtype=np.uint8)])
    inp = httpclient.InferInput("IN", [SIZE], "UINT8")
    inp.set_shared_memory("r", SIZE)
    out = httpclient.InferRequestedOutput("OUT")
    out.set_shared_memory("r", SIZE, offset=SIZE)
    http.infer("ident", [inp], outputs=[out])
    got = shm_utils.get_contents_as_numpy(handle, np.uint8, [2 * SIZE])[SIZE:]
    assert np.array_equal(got, np.arange(SIZE, dtype=np.uint8)[::-1])
    http.unregister_system_shared_memory()
    http.close()
    log = server.log()
    assert "Traceback" not in log and "Fatal error" not in log, log[-3000:]
