"""TRITONPY_FRAME_TRACE (what ``benchmarks/bls_trace.py`` reads): every process of a server, the
stubs too, writes the whole record of the frames it sent and received, even though a stub may
end by ``os._exit`` on one thread while its main thread writes the record at exit."""
from __future__ import annotations

import collections
from pathlib import Path

from _models import new_prefix, run_driver, segments

from tritonpy.shm import Cmd

DRIVER = """
import os, sys
os.environ["TRITONPY_FRAME_TRACE"] = sys.argv[1]
from _models import fp32, infer, serving, write_model
write_model(sys.argv[2], "double")
with serving(sys.argv[2], sys.argv[3]) as srv:
    for _ in range(int(sys.argv[4])):
        infer(srv.model("double"), {"IN": fp32(1)})
    stub = srv.runtime("double").instances[0].stub.pid
print("RESULT", os.getpid(), stub)
"""
REQUESTS = 40


def test_host_and_stub_write_every_frame_of_their_trace(tmp_path: Path) -> None:
    prefix = new_prefix()
    for attempt in range(3):  # the stub's two ways to end race: a few servers, one after another
        trace = tmp_path / f"trace{attempt}"
        trace.mkdir()
        result, _ = run_driver(DRIVER, str(trace), str(tmp_path / "repo"), prefix, str(REQUESTS))
        host, stub = result.split()
        counts = {}
        for pid in (host, stub):
            lines = (trace / f"{pid}.tsv").read_text().splitlines()
            rows = [line.split("\t") for line in lines]
            assert all(len(row) == 5 for row in rows), f"a cut line in {pid}.tsv"
            counts[pid] = collections.Counter((row[2], int(row[3])) for row in rows)
        assert counts[host][("send", Cmd.EXECUTE)] == REQUESTS
        assert counts[host][("recv", Cmd.EXECUTE_DONE)] == REQUESTS
        assert counts[stub][("recv", Cmd.EXECUTE)] == REQUESTS
        assert counts[stub][("send", Cmd.EXECUTE_DONE)] == REQUESTS
    assert segments(prefix) == []
