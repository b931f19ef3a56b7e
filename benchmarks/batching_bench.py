"""Dynamic batching throughput, side by side: an identity model with and without Triton's
dynamic batcher, at concurrency 1, 8 and 32.

Models (``batch_models/``, the same ``model.py`` in both): ``identity_nobatch`` (max_batch_size
32, no ``dynamic_batching``: one request per ``execute``) and ``identity_dynamic`` (the same
with ``dynamic_batching { }``, no queue delay). One instance each; every request carries one
row of 1,024 FP32 (4 KiB). Closed loop: one thread per concurrency slot, each sending its next
request as soon as the last one is answered.

Columns:

* **tritonpy in-process** — ``tritonpy.Server`` in this process, ``model(...).infer()`` (the
  embedding API; no network);
* **tritonpy gRPC** and **Triton gRPC** — ``python -m tritonpy serve`` and the real Triton 2.51
  (the anchor), each driven by tritonclient's sync gRPC client, one client per thread.

Reported per point: infer/s over the timed window, p50 latency, and the mean batch size that
reached ``execute`` (inference_count / execution_count from the model's statistics over the
window). Ratios: *batching gain* = dynamic / nobatch infer/s on the same server; *vs Triton* =
tritonpy infer/s / Triton gRPC infer/s for the same model and concurrency (the in-process
ratio compares an embedded call with a network call, and says so in its label).

Usage: python benchmarks/batching_bench.py [--quick] [--only triton|tritonpy] [-v]
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

import _load
from _limits import print_table
from _servers import ServerSpec, TritonpyServer, _Server, run_on_each, server_specs, bench_parser, parse_bench_args

log = logging.getLogger("batching_bench")

REPO = Path(__file__).resolve().parent / "batch_models"
MODELS = ("identity_nobatch", "identity_dynamic")
CONCURRENCY = (1, 8, 32)
ROW = np.random.default_rng(0).random((1, 1024), dtype=np.float32)


@dataclass
class Result:
    """One point: throughput, median latency, mean batch size seen by execute."""

    infer_per_s: float
    p50_ms: float
    mean_batch: float


def closed_loop(make_call: Callable[[], tuple[Callable[[], None], Callable[[], None]]],
                concurrency: int, warmup: float, duration: float) -> tuple[float, float]:
    """(infer/s, p50 ms) of a closed loop (see ``_load.closed_loop``)."""
    lat = _load.closed_loop(make_call, concurrency, warmup, duration)
    return len(lat) / duration, float(np.percentile(lat, 50)) * 1e3


def _counts(stats: dict) -> tuple[int, int]:
    s = stats["model_stats"][0]
    return int(s.get("inference_count", 0)), int(s.get("execution_count", 0))


def _point(stats: Callable[[], dict], run: Callable[[], tuple[float, float]]) -> Result:
    inf0, ex0 = _counts(stats())
    rate, p50 = run()
    inf1, ex1 = _counts(stats())
    return Result(rate, p50, (inf1 - inf0) / max(1, ex1 - ex0))


# -- tritonpy in this process ------------------------------------------------------------------
def run_inprocess(warmup: float, duration: float) -> dict[tuple[str, int], Result]:
    """Every model × concurrency point through ``tritonpy.Server`` in this process."""
    import tritonpy

    server = tritonpy.Server(
        os.fspath(REPO), backend_config={"shm-region-prefix-name": f"tpbench_{os.getpid()}_ip_"})
    server.start()
    try:
        results = {}
        for name in MODELS:
            model = server.model(name)
            out = model.infer({"INPUT0": ROW}).get(timeout=60)
            if out.error is not None or out.outputs["OUTPUT0"].to_numpy().shape != (1, 1024):
                raise RuntimeError(f"{name}: bad answer {out!r}")

            def make_call(model: Any = model) -> tuple[Callable[[], None], Callable[[], None]]:
                def call() -> None:
                    resp = model.infer({"INPUT0": ROW}).get(timeout=60)
                    if resp.error is not None:
                        raise RuntimeError(resp.error)
                return call, lambda: None

            for c in CONCURRENCY:
                results[(name, c)] = r = _point(
                    lambda name=name: server.statistics(name),
                    lambda c=c, mc=make_call: closed_loop(mc, c, warmup, duration))
                log.info("in-process %s c=%d: %.0f infer/s, batch %.1f", name, c,
                         r.infer_per_s, r.mean_batch)
        return results
    finally:
        server.stop()


# -- a server over gRPC ------------------------------------------------------------------------
def run_grpc(server: _Server, warmup: float, duration: float) -> dict[tuple[str, int], Result]:
    """Every model × concurrency point through tritonclient's sync gRPC client."""
    admin = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        results = {}
        for name in MODELS:
            def make_call(name: str = name) -> tuple[Callable[[], None], Callable[[], None]]:
                client = grpcclient.InferenceServerClient(server.grpc_url)
                inp = grpcclient.InferInput("INPUT0", [1, 1024], "FP32")
                inp.set_data_from_numpy(ROW)
                outputs = [grpcclient.InferRequestedOutput("OUTPUT0")]
                return (lambda: client.infer(name, [inp], outputs=outputs)), client.close

            call, close = make_call()
            try:
                if call().as_numpy("OUTPUT0").shape != (1, 1024):
                    raise RuntimeError(f"{name} returned a wrong-shaped output")
            finally:
                close()
            for c in CONCURRENCY:
                results[(name, c)] = r = _point(
                    lambda name=name: admin.get_inference_statistics(name, as_json=True),
                    lambda c=c, mc=make_call: closed_loop(mc, c, warmup, duration))
                log.info("%s %s c=%d: %.0f infer/s, batch %.1f", server.kind, name, c,
                         r.infer_per_s, r.mean_batch)
        return results
    finally:
        admin.close()


def report(results: dict[str, dict[tuple[str, int], Result]]) -> None:
    """One table: per server and model, infer/s, p50 and mean batch; then the ratios."""
    labels = list(results)
    header = ["model", "concurrency"]
    for label in labels:
        header += [f"{label} infer/s", f"{label} p50 ms", f"{label} batch"]
    rows = []
    for name in MODELS:
        for c in CONCURRENCY:
            row: list[object] = [name, c]
            for label in labels:
                r = results[label][(name, c)]
                row += [f"{r.infer_per_s:,.0f}", f"{r.p50_ms:.2f}", f"{r.mean_batch:.1f}"]
            rows.append(row)
    print_table("Identity, 1×1,024 FP32 per request, closed loop (batch = mean requests per "
                "execute in the window)", header, rows)

    header = ["concurrency"] + [f"{label} batching gain" for label in labels]
    anchor = "Triton gRPC"
    mine = [label for label in labels if label != anchor]
    if anchor in results:
        header += [f"{label} vs {anchor} ({m})" for label in mine for m in ("nobatch", "dynamic")]
    rows = []
    for c in CONCURRENCY:
        row = [c]
        for label in labels:
            r = results[label]
            row.append(f"{r[('identity_dynamic', c)].infer_per_s / r[('identity_nobatch', c)].infer_per_s:.2f}×")
        if anchor in results:
            for label in mine:
                for name in MODELS:
                    ratio = results[label][(name, c)].infer_per_s / results[anchor][(name, c)].infer_per_s
                    row.append(f"{ratio:.2f}×")
        rows.append(row)
    print_table("Ratios (batching gain = dynamic / nobatch infer/s; vs Triton = tritonpy / Triton "
                "infer/s; the in-process column is an embedded call, Triton's is gRPC)",
                header, rows)


def main() -> None:
    """Parse flags, run every available server, print the tables."""
    parser = bench_parser(__doc__, "short windows")
    parser.add_argument("--duration", type=float, help="seconds timed per point")
    args = parse_bench_args(parser)
    duration = args.duration or (1.0 if args.quick else 3.0)
    warmup = 0.3 if args.quick else 0.5
    results: dict[str, dict[tuple[str, int], Result]] = {}
    if args.only in (None, "tritonpy"):
        try:
            results["tritonpy in-process"] = run_inprocess(warmup, duration)
        except Exception as exc:  # the network columns still run
            log.debug("in-process failed", exc_info=True)
            print(f"tritonpy in-process: failed ({type(exc).__name__}: {str(exc)[:300]})")
    specs = [ServerSpec("Triton gRPC" if s.cls is not TritonpyServer else "tritonpy gRPC", s.cls,
                        s.backend_config)
             for s in server_specs(args.only, triton_best=False)]
    results.update(run_on_each(specs, REPO, lambda s: run_grpc(s, warmup, duration)))
    if results:
        report(results)


if __name__ == "__main__":
    main()
