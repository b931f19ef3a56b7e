"""A stub that finds /dev/shm full gets the room that other processes' idle segments hold.

Every pool keeps an idle segment for 5 s before it gives it back. Before RECLAIM, a burst that
moved from one model to another failed in the second while the first's idle segments held
/dev/shm. Now the pool that runs out asks (through the host) every process to give its idle
segments back at once, waits a moment for the room, and tries again.

Runs in a private mount namespace whose /dev/shm is a 64 MiB tmpfs (skipped with the reason
where that cannot be mounted), with real servers and stubs.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tritonpy.stress import private_shm_unavailable

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20

_IN_NAMESPACE = textwrap.dedent("""
    import json, shutil, sys, time
    from pathlib import Path
    import numpy as np
    import tritonpy
    from tritonpy._stress_models import write_repository
    MiB = 1 << 20
    repo = write_repository(Path(sys.argv[2]) / "models")
    shutil.copytree(repo / "stress_io", repo / "stress_io_b")
    cfg = repo / "stress_io_b" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace('name: "stress_io"', 'name: "stress_io_b"'))
    out = {}
    server = tritonpy.Server(str(repo), model_control_mode="explicit",
                             load_models=["stress_io", "stress_io_b"],
                             backend_config={"shm-region-prefix-name": sys.argv[1],
                                             "shm-default-byte-size": str(4 * MiB),
                                             "shm-growth-byte-size": str(4 * MiB)})
    server.start()
    try:
        small = {"DATA": np.zeros(16, np.uint8), "OUT_BYTES": np.array([MiB], np.int64)}
        for name in ("stress_io", "stress_io_b"):  # each stub makes its first segment
            assert server.model(name).infer(small).get(timeout=30).error is None
        ask = {"DATA": np.zeros(16, np.uint8), "OUT_BYTES": np.array([40 * MiB], np.int64)}
        # stress_io answers 40 MiB from a segment of their own, idle once the answer is gone.
        first = server.model("stress_io").infer(ask).get(timeout=30)
        out["first"] = first.error.message if first.error else first.outputs["OUT"].to_numpy().nbytes
        del first
        st = __import__("os").statvfs("/dev/shm")
        out["free_before"] = st.f_bavail * st.f_frsize
        t0 = time.monotonic()
        second = server.model("stress_io_b").infer(ask).get(timeout=30)
        out["seconds"] = time.monotonic() - t0
        out["second"] = second.error.message if second.error else second.outputs["OUT"].to_numpy().nbytes
        del second
        # Now stress_io_b holds 40 MiB idle, and the host wants 40 MiB for a client's input.
        data = np.full(40 * MiB, 7, np.uint8)
        third = server.model("stress_io").infer(
            {"DATA": data, "OUT_BYTES": np.array([-1], np.int64)}).get(timeout=30)
        out["third"] = third.error.message if third.error else int(third.outputs["OUT"].to_numpy().sum() // 7)
        del third
        # stress_io_b holds 40 MiB idle again; a client's 40 MiB input now comes on the frame
        # loop (as every HTTP and gRPC request does), which does not wait for room.
        again = server.model("stress_io_b").infer(ask).get(timeout=30)
        out["again"] = again.error.message if again.error else again.outputs["OUT"].to_numpy().nbytes
        del again
        import asyncio

        async def on_the_frame_loop():
            stream = server.model("stress_io").async_infer(
                {"DATA": data, "OUT_BYTES": np.array([-1], np.int64)})
            async for resp in stream:
                return resp.error.message if resp.error else int(resp.outputs["OUT"].to_numpy().sum() // 7)

        out["fourth"] = asyncio.run_coroutine_threadsafe(
            on_the_frame_loop(), server.frames.loop).result(30)
    finally:
        server.stop()
    print(json.dumps(out))
""")


def test_a_stub_out_of_room_gets_what_other_stubs_hold_idle(shm_prefix: str,
                                                           tmp_path: Path) -> None:
    reason = private_shm_unavailable(64 * MiB)
    if reason:
        pytest.skip(f"needs a private /dev/shm: {reason}")
    script = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" -c "$1" "$2" "$3"'
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script, sys.executable, _IN_NAMESPACE,
                           shm_prefix, str(tmp_path)], capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["first"] == 40 * MiB
    # The host's and both stubs' first segments (4 MiB each) and stress_io's idle 40 MiB:
    # no room for stress_io_b's 40 MiB until stress_io gives its idle segment back.
    assert out["free_before"] < 40 * MiB
    assert out["second"] == 40 * MiB, out["second"]
    assert out["seconds"] < 2.0  # not the 5 s idle time
    assert out["third"] == 40 * MiB, out["third"]  # the host's own pool gets the room too
    assert out["again"] == 40 * MiB, out["again"]
    # On the frame loop the request is queued again a moment later, by when the room is back
    # (it used to fail: that loop does not wait).
    assert out["fourth"] == 40 * MiB, out["fourth"]


_KEEP_ALIVE = textwrap.dedent("""
    import json, shutil, sys
    from pathlib import Path
    import numpy as np
    import tritonclient.http as httpclient
    import tritonpy
    from tritonpy._stress_models import write_repository
    from tritonpy.frontends import Frontends
    MiB = 1 << 20
    repo = write_repository(Path(sys.argv[2]) / "models")
    shutil.copytree(repo / "stress_io", repo / "stress_io_b")
    cfg = repo / "stress_io_b" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace('name: "stress_io"', 'name: "stress_io_b"'))
    server = tritonpy.Server(str(repo), model_control_mode="explicit",
                             load_models=["stress_io", "stress_io_b"],
                             backend_config={"shm-region-prefix-name": sys.argv[1]})
    server.start()
    fe = Frontends(server, http_port=0, allow_grpc=False, allow_metrics=False,
                   http_address="127.0.0.1")
    fe.start_in_thread()
    out = []
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{fe.http_port}",
                                                  network_timeout=60)
        def call(model, data, out_bytes):
            a = httpclient.InferInput("DATA", list(data.shape), "UINT8")
            a.set_data_from_numpy(data, binary_data=True)
            b = httpclient.InferInput("OUT_BYTES", [1], "INT64")
            b.set_data_from_numpy(np.array([out_bytes], np.int64))
            try:
                r = client.infer(model, [a, b], outputs=[
                    httpclient.InferRequestedOutput("OUT", binary_data=True)])
                return int(r.as_numpy("OUT").nbytes)
            except Exception as exc:
                return str(exc)[:300]
        size = 36 * MiB
        for _ in range(3):  # one connection, kept alive across the calls
            out.append(call("stress_io_b", np.zeros(16, np.uint8), size))
            out.append(call("stress_io", np.full(size, 7, np.uint8), -1))
        client.close()
    finally:
        fe.stop_in_thread()
        server.stop()
    print(json.dumps(out))
""")


def test_a_kept_alive_http_connection_does_not_hold_its_last_answer(shm_prefix: str,
                                                                    tmp_path: Path) -> None:
    # (QA, in Docker's default 64 MiB /dev/shm) stress_io_b answers 36 MiB from a segment of
    # its own; the connection then waited for its next request with that answer still in
    # hand, so the segment was not idle and could not be reclaimed: the next request's 36
    # MiB input failed "shared memory exhausted" every time, on that connection (a new
    # connection got the room).
    reason = private_shm_unavailable(64 * MiB)
    if reason:
        pytest.skip(f"needs a private /dev/shm: {reason}")
    script = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" -c "$1" "$2" "$3"'
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script, sys.executable, _KEEP_ALIVE,
                           shm_prefix, str(tmp_path)], capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == [36 * MiB] * 6, out
