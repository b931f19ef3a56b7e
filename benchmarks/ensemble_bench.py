"""Ensemble vs the same chain done with BLS, side by side: real Triton vs tritonpy.

``chain_ensemble`` (a Triton ensemble) and ``chain_bls`` (one Python model making three BLS
calls) both compute ``step_c(step_b(step_a(x)))`` over the same three Python models in
``ensemble_models/`` (a repository of its own, so that the other benchmarks' start-up figures
do not change). The figure is the median latency of one request, requests sent one after the
other by one client, for a 4 KiB and a 1 MiB FP32 tensor.

Columns: the real Triton over HTTP (``tritonclient.http``, binary tensors); tritonpy over HTTP
with the same client (``python -m tritonpy serve``); tritonpy in-process (``tritonpy.Server``
and ``Model.infer`` in this process, no HTTP: what a server that embeds tritonpy pays). The
real Triton has no in-process Python API in the anchor, so HTTP is the like-for-like column.

Usage: python benchmarks/ensemble_bench.py [--quick] [--only triton|tritonpy] [-v]
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from _limits import KIB, MIB, fmt_size, print_table
from _servers import _Server, run_on_each, server_specs, bench_parser, parse_bench_args

log = logging.getLogger("ensemble_bench")

REPO = Path(__file__).resolve().parent / "ensemble_models"
MODELS = ("chain_ensemble", "chain_bls")
SIZES = (4 * KIB, 1 * MIB)
INPROC = "tritonpy in-process"


def _measure(call: Callable[[np.ndarray], np.ndarray], size: int, seconds: float) -> float:
    """Median µs of ``call`` over about ``seconds`` (after a checked warm-up)."""
    x = np.arange(size // 4, dtype=np.float32)
    out = call(x)
    if not np.array_equal(out, x + 3):
        raise RuntimeError("the chain returned a wrong result")
    for _ in range(5):
        call(x)
    samples = []
    deadline = time.perf_counter() + seconds
    while len(samples) < 20 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        call(x)
        samples.append(time.perf_counter() - t0)
    log.info("size %s: %d requests, median %.1f µs", fmt_size(size), len(samples),
             statistics.median(samples) * 1e6)
    return statistics.median(samples) * 1e6


def run_http(server: _Server, seconds: float) -> dict[tuple[str, int], float | str]:
    """Every (model, size) point over HTTP on one server; a failing point becomes its error."""
    results: dict[tuple[str, int], float | str] = {}
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=600.0,
                                              connection_timeout=600.0)
    try:
        for model in MODELS:
            def call(x: np.ndarray, model: str = model) -> np.ndarray:
                inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
                inp.set_data_from_numpy(x, binary_data=True)
                out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
                return client.infer(model, [inp], outputs=[out]).as_numpy("OUTPUT0")

            for size in SIZES:
                try:
                    results[(model, size)] = _measure(call, size, seconds)
                except Exception as exc:  # one broken point must not cost the others
                    results[(model, size)] = f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        client.close()  # an open connection makes the real Triton wait out its exit timeout
    return results


def run_inprocess(seconds: float) -> dict[tuple[str, int], float | str]:
    """Every point through tritonpy's in-process API, on a server started in this process."""
    import tritonpy

    results: dict[tuple[str, int], float | str] = {}
    prefix = f"tpbench_{os.getpid()}_inproc_"
    with tritonpy.Server(str(REPO), backend_config={"shm-region-prefix-name": prefix}) as srv:
        for model in MODELS:
            handle = srv.model(model)

            def call(x: np.ndarray, handle: tritonpy.Model = handle) -> np.ndarray:
                resp = handle.infer({"INPUT0": x}).get(timeout=60)
                if resp.error is not None:
                    raise RuntimeError(resp.error.message)
                return resp.outputs["OUTPUT0"].to_numpy()

            for size in SIZES:
                try:
                    results[(model, size)] = _measure(call, size, seconds)
                except Exception as exc:
                    results[(model, size)] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return results


def _us(v: float | str | None) -> str:
    if not isinstance(v, float):
        return "error" if isinstance(v, str) else "—"
    return f"{v:,.0f}" if v >= 1000 else f"{v:.1f}"


def _ratio(a: float | str | None, b: float | str | None) -> str:
    return f"{a / b:.2f}×" if isinstance(a, float) and isinstance(b, float) else "—"


def report(results: dict[str, dict[tuple[str, int], float | str]]) -> None:
    """Print the side-by-side table, the ensemble/BLS ratios, and any errors."""
    labels = list(results)
    anchors = [label for label in labels if label.startswith("Triton")]
    header = ["chain", "size"] + [f"{label} µs" for label in labels]
    header += [f"tritonpy speedup vs {a} (HTTP)" for a in anchors if "tritonpy" in results]
    header += [f"{a} vs {INPROC}" for a in anchors if INPROC in results]
    rows, errors = [], []
    for model in MODELS:
        for size in SIZES:
            point = (model, size)
            row = ["ensemble" if model == "chain_ensemble" else "BLS ×3", fmt_size(size)]
            for label in labels:
                v = results[label].get(point)
                row.append(_us(v))
                if isinstance(v, str):
                    errors.append(f"{label} {model} {fmt_size(size)}: {v}")
            if "tritonpy" in results:
                row += [_ratio(results[a].get(point), results["tritonpy"].get(point))
                        for a in anchors]
            if INPROC in results:
                row += [_ratio(results[a].get(point), results[INPROC].get(point))
                        for a in anchors]
            rows.append(row)
    print_table("Three Python models chained: ensemble vs BLS (median µs per request, one client, "
                "sequential; speedup = anchor µs / tritonpy µs)", header, rows)
    ratio_rows = []
    for size in SIZES:
        ratio_rows.append([fmt_size(size)] + [
            _ratio(results[label].get(("chain_ensemble", size)),
                   results[label].get(("chain_bls", size))) for label in labels])
    print_table("Ensemble µs / BLS-chain µs on the same server (below 1: the ensemble is faster)",
                ["size"] + labels, ratio_rows)
    for line in errors:
        print(line)


def main() -> None:
    """Parse flags, run each server in turn, then tritonpy in-process, print the tables."""
    parser = bench_parser(__doc__, "about 1 s per point")
    parser.add_argument("--seconds", type=float, help="timed seconds per point")
    args = parse_bench_args(parser)
    seconds = args.seconds or (1.0 if args.quick else 4.0)
    results = run_on_each(server_specs(args.only, triton_best=False), REPO,
                          lambda server: run_http(server, seconds))
    if args.only in (None, "tritonpy"):
        try:
            results[INPROC] = run_inprocess(seconds)
        except Exception as exc:
            print(f"{INPROC}: failed ({type(exc).__name__}: {str(exc)[:300]})")
    if results:
        report(results)


if __name__ == "__main__":
    main()
