"""A process whose file size limit (``ulimit -f``, RLIMIT_FSIZE: batch schedulers set it) is
below a segment's size cannot reserve that segment. It is told so, naming that limit: it used
to read "shared memory exhausted (no space left) ... 25 GB free", which sends one looking at
/dev/shm. (Python ignores the SIGXFSZ that comes with it, so nothing dies.)

The server runs in a child process whose limit is lowered (never this one's).
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from _models import assert_clean, run_driver, write_model

pytestmark = pytest.mark.timeout(60)


DRIVER = textwrap.dedent("""
    import resource, sys
    import numpy as np
    import tritonpy

    repo, prefix, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    server = tritonpy.Server(repo, backend_config={"shm-region-prefix-name": prefix})
    try:
        server.start()
        r = server.model("m").infer({"IN": np.ones(8 << 20, np.float32)}).get(timeout=20)
        print("RESULT", "ok" if r.error is None else f"error: {r.error}")
    except Exception as exc:
        print("RESULT", f"raised {type(exc).__name__}: {exc}")
    finally:
        server.stop()
""")


def _run(tmp_path: Path, prefix: str, limit: int) -> str:
    result, _ = run_driver(DRIVER, str(tmp_path), prefix, str(limit))
    assert_clean(prefix)
    return result


SMALL_FIRST = DRIVER.replace(
    '    r = server.model("m").infer(',
    '    small = server.model("m").infer({"IN": np.ones(1000, np.float32)}).get(timeout=20)\n'
    '    r = server.model("m").infer(').replace(
    'print("RESULT", ',
    'print("RESULT", small.error or small.outputs["OUT"].to_numpy().sum(), "then", ', 1)


def test_a_server_whose_segment_size_is_over_the_file_size_limit_serves_what_fits(
        tmp_path: Path, shm_prefix: str) -> None:
    # The pools' segments are 16 MiB, over the 8 MiB limit: they are made smaller (see
    # shm.pool), so the server starts and serves a small tensor; a 32 MiB one fails alone,
    # naming the limit. (It used to fail the start, as the first segment could not be made.)
    write_model(tmp_path, "m")
    out, _ = run_driver(SMALL_FIRST, str(tmp_path), shm_prefix, str(8 << 20))
    assert_clean(shm_prefix)
    assert out.startswith("2000.0 then error: "), out
    assert "RLIMIT_FSIZE 8388608 bytes" in out and "ulimit -f" in out, out
    assert "ulimit -f): asked for" in out, out
    assert "no space left" not in out, out


def test_a_tensor_over_the_file_size_limit_fails_alone(tmp_path: Path, shm_prefix: str) -> None:
    write_model(tmp_path, "m")
    got = _run(tmp_path, shm_prefix, 24 << 20)  # a 32 MiB input needs a segment of its own
    assert got.startswith("error: "), got
    assert "RLIMIT_FSIZE 25165824 bytes" in got, got


BIG_OUTPUT_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", np.ones(8 << 20, np.float32))]) for _ in requests]
"""

OUT_DRIVER = DRIVER.replace(
    '{"IN": np.ones(8 << 20, np.float32)}', '{"IN": np.ones(1, np.float32)}').replace(
    'f"error: {r.error}"', 'f"error: {r.error.code.value} {r.error}"')


def test_an_output_that_finds_no_room_is_unavailable_as_an_input_is(
        tmp_path: Path, shm_prefix: str) -> None:
    # A 32 MiB output needs a segment of the stub's own, over the limit: the request gets
    # UNAVAILABLE naming the limit, as an input that finds no room does, and the stub writes
    # no traceback (it got INTERNAL, "ShmExhaustedError: ...", and a traceback in the log).
    write_model(tmp_path, "m", BIG_OUTPUT_PY)
    got, log = run_driver(OUT_DRIVER, str(tmp_path), shm_prefix, str(24 << 20))
    assert_clean(shm_prefix)
    assert got.startswith(
        "error: UNAVAILABLE Failed to process the request(s) for model 'm_0'"), got
    assert "RLIMIT_FSIZE 25165824 bytes" in got and "ShmExhaustedError" not in got, got
    assert "Traceback" not in log, log
