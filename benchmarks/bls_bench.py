"""BLS round trip, side by side: real Triton (default and best shm settings) vs tritonpy.

The figure is the time of one BLS call (``identity`` with a SIZE-byte UINT8 tensor), timed
inside ``bls_loop``'s execute over ITERS calls; the client only starts the loop. Each point is
the median of several such loops. GB/s counts the tensor both ways (2 × size / time), since a
BLS round trip carries it to ``identity`` and back. "sync" and "async ×8" send one Tensor built
before the loop (both servers keep its shm copy: the steady state of a constant input);
"sync, new Tensor" wraps the data in a new Tensor for each call, which costs one copy per call.

With ``--gpu`` the tensor is a CuPy array on GPU 0 and ``identity`` takes it on the GPU
(``benchmarks/gpu_models``): the call passes a CUDA IPC handle each way. It needs CuPy and a
GPU, and says so and stops where either is missing.

Usage: python benchmarks/bls_bench.py [--quick] [--only triton|tritonpy] [--gpu]
"""

from __future__ import annotations

import importlib.util
import logging
import os
import statistics
from dataclasses import dataclass

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from _limits import KIB, MIB, Limits, fmt_size, measure_limits, print_limits, print_table
from _servers import BENCH_MODELS, _Server, run_on_each, server_specs, bench_parser, parse_bench_args

log = logging.getLogger("bls_bench")

SYNC, ASYNC, SYNC_NEW = 0, 1, 2
MODE_LABELS = {SYNC: "sync", ASYNC: "async ×8", SYNC_NEW: "sync, new Tensor"}


@dataclass(frozen=True)
class Point:
    """One row: a tensor size and a BLS mode."""

    size: int
    mode: int

    @property
    def label(self) -> tuple[str, str]:
        """(size, mode) cells."""
        return fmt_size(self.size), MODE_LABELS[self.mode]


def points(quick: bool) -> list[Point]:
    """Sizes of the run; --quick drops 256 MiB (a second per call on the real Triton)."""
    sizes = [16, 4 * KIB, 1 * MIB, 16 * MIB, 64 * MIB] + ([] if quick else [256 * MIB])
    return (
        [Point(s, SYNC) for s in sizes]
        + [Point(4 * KIB, ASYNC), Point(1 * MIB, ASYNC)]
        + [Point(s, SYNC_NEW) for s in sizes if s >= MIB]
    )


GPU_MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_models")


def gpu_points(quick: bool) -> list[Point]:
    """GPU tensors: sync at each size, async ×8 at 4 KiB and 1 MiB (no "new Tensor" mode)."""
    sizes = [16, 4 * KIB, 1 * MIB, 16 * MIB, 64 * MIB] + ([] if quick else [256 * MIB])
    return [Point(s, SYNC) for s in sizes] + [Point(4 * KIB, ASYNC), Point(1 * MIB, ASYNC)]


def gpu_missing() -> str | None:
    """Why the GPU points cannot run here, or None."""
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (pip install 'tritonpy[gpu]')"
    from tritonpy._gpus import visible_gpu_count

    if visible_gpu_count() == 0:
        return "no GPU: nvidia-smi -L lists none"
    return None


def bls_loop(client: httpclient.InferenceServerClient, size: int, iters: int, mode: int) -> float:
    """One call of ``bls_loop``: mean µs per BLS call over ``iters`` calls."""
    inputs = []
    for name, value in (("SIZE", size), ("ITERS", iters), ("MODE", mode)):
        tensor = httpclient.InferInput(name, [1], "INT64")
        tensor.set_data_from_numpy(np.array([value], dtype=np.int64))
        inputs.append(tensor)
    result = client.infer("bls_loop", inputs, outputs=[httpclient.InferRequestedOutput("OUTPUT")])
    return float(result.as_numpy("OUTPUT")[0])


def measure_point(
    client: httpclient.InferenceServerClient, point: Point, call_seconds: float, repeats: int
) -> float:
    """Median µs per BLS call, with ITERS scaled so that one loop lasts ``call_seconds``."""
    step = 8 if point.mode == ASYNC else 1
    # A short loop first, to size the real ones (and to warm this size's pools up).
    per_call_us = bls_loop(client, point.size, step * (1 if point.size >= MIB else 20), point.mode)
    iters = max(step, int(call_seconds * 1e6 / max(per_call_us, 1.0)) // step * step)
    samples = [bls_loop(client, point.size, iters, point.mode) for _ in range(repeats)]
    log.info("%s %s: %d iters, samples %s", *point.label, iters, [round(s, 1) for s in samples])
    return statistics.median(samples)


def run_server(server: _Server, pts: list[Point], call_seconds: float, repeats: int) -> dict[Point, float | str]:
    """All points on one server; a failing point becomes its error text."""
    results: dict[Point, float | str] = {}
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=600.0, connection_timeout=600.0)
    try:
        for point in pts:
            try:
                results[point] = measure_point(client, point, call_seconds, repeats)
            except InferenceServerException as exc:
                results[point] = str(exc)
    finally:
        # An open connection makes the real Triton wait out its exit timeout and then skip
        # unloading its models, leaving its shm regions behind.
        client.close()
    return results


def _us(value: float) -> str:
    return f"{value:,.0f}" if value >= 1000 else f"{value:.1f}"


def report(pts: list[Point], results: dict[str, dict[Point, float | str]], limits: Limits,
           gpu: bool = False) -> None:
    """Print the side-by-side table and any errors under it."""
    labels = list(results)
    header = ["size", "mode", "limit µs"]
    for label in labels:
        header += [f"{label} µs", f"{label} GB/s"]
    tritonpy = results.get("tritonpy")
    anchors = [label for label in labels if label != "tritonpy"]
    if tritonpy is not None:
        header += [f"speedup vs {a}" for a in anchors]
    header += [f"{label} / limit" for label in labels]
    rows = []
    errors = []
    for p in pts:
        limit = limits.limit_us(p.size)
        row = [*p.label, _us(limit)]
        for label in labels:
            v = results[label].get(p)
            if isinstance(v, float):
                # Bandwidth means nothing for a few bytes: shown from 1 MiB up.
                row += [_us(v), f"{2 * p.size / v / 1e3:.2f}" if p.size >= MIB else "—"]
            else:
                row += ["error", "—"]
                errors.append(f"{label} {p.label[0]} {p.label[1]}: {v}")
        if tritonpy is not None:
            for a in anchors:
                t, mine = results[a].get(p), tritonpy.get(p)
                row.append(f"{t / mine:.2f}×" if isinstance(t, float) and isinstance(mine, float) else "—")
        for label in labels:
            v = results[label].get(p)
            row.append(f"{v / limit:.1f}" if isinstance(v, float) else "—")
        rows.append(row)
    print_table(
        ("GPU tensors (CuPy, GPU 0), " if gpu else "") +
        "BLS round trip (µs per call, timed inside execute; GB/s = 2 × size / time; "
        "limit = round-trip floor + one host memcpy; speedup = anchor µs / tritonpy µs)",
        header,
        rows,
    )
    for line in errors:
        print(line)


def main() -> None:
    """Parse flags, measure the limits, run every available server, print the table."""
    parser = bench_parser(__doc__, "short loops, 3 repeats, no 256 MiB")
    parser.add_argument("--call-seconds", type=float, help="target length of one bls_loop call")
    parser.add_argument("--repeats", type=int, help="bls_loop calls per point (median taken)")
    parser.add_argument("--gpu", action="store_true", help="GPU tensors (CuPy), by CUDA IPC")
    args = parse_bench_args(parser)
    call_seconds = args.call_seconds or (0.05 if args.quick else 0.3)
    repeats = args.repeats or (3 if args.quick else 5)
    pts = points(args.quick)
    repo = BENCH_MODELS
    if args.gpu:
        missing = gpu_missing()
        if missing is not None:
            print(f"GPU BLS round trip: not run ({missing})")
            return
        pts, repo = gpu_points(args.quick), GPU_MODELS

    limits = measure_limits(quick=args.quick, sizes=sorted({p.size for p in pts if p.size >= MIB}))
    print_limits(limits)
    results = run_on_each(
        server_specs(args.only), repo, lambda server: run_server(server, pts, call_seconds, repeats)
    )
    if results:
        report(pts, results, limits, gpu=args.gpu)


if __name__ == "__main__":
    main()
