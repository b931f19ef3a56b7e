"""End-to-end inference, side by side: real Triton vs tritonpy, over HTTP and gRPC.

``identity_fp32`` with a 4 KiB tensor (1,024 FP32), sent by tritonclient's sync clients: one
thread and one client per concurrency slot, each sending its next request as soon as the
last one is answered. Reported: infer/s over the timed window (after a warm-up), and the p50
and p99 latency of the requests in it. The client runs on the same two CPUs as the server,
for both servers alike.

Usage: python benchmarks/e2e_bench.py [--quick] [--only triton|tritonpy]
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from _load import closed_loop
from _limits import print_table
from _servers import BENCH_MODELS, _Server, run_on_each, server_specs, bench_parser, parse_bench_args

log = logging.getLogger("e2e_bench")

MODEL = "identity_fp32"
CONCURRENCY = (1, 4, 16)
PROTOCOLS = ("HTTP", "gRPC")


@dataclass
class Result:
    """One point: throughput and latency percentiles."""

    infer_per_s: float
    p50_ms: float
    p99_ms: float


def _client(protocol: str, server: _Server) -> tuple[Any, list[Any], list[Any]]:
    """A client with its inputs and requested outputs built once (not part of the timing)."""
    mod: Any = httpclient if protocol == "HTTP" else grpcclient
    data = np.random.default_rng(0).random(1024, dtype=np.float32)
    if protocol == "HTTP":
        client = httpclient.InferenceServerClient(server.http_url, concurrency=1, network_timeout=60.0)
    else:
        client = grpcclient.InferenceServerClient(server.grpc_url)
    inp = mod.InferInput("INPUT0", [1024], "FP32")
    inp.set_data_from_numpy(data)  # binary tensor data over HTTP (tritonclient's default)
    out = mod.InferRequestedOutput("OUTPUT0")
    return client, [inp], [out]


def measure(server: _Server, protocol: str, concurrency: int, warmup: float, duration: float) -> Result:
    """Run ``concurrency`` closed-loop client threads; time the window after the warm-up."""
    # The first client answers once, outside the timing, to check the output.
    client, inputs, outputs = _client(protocol, server)
    try:
        if client.infer(MODEL, inputs, outputs=outputs).as_numpy("OUTPUT0").nbytes != 4096:
            raise RuntimeError(f"{MODEL} returned a wrong-sized output")
    finally:
        client.close()

    def make_call() -> tuple[Any, Any]:
        client, inputs, outputs = _client(protocol, server)
        return (lambda: client.infer(MODEL, inputs, outputs=outputs)), client.close

    lat = closed_loop(make_call, concurrency, warmup, duration)
    return Result(len(lat) / duration, float(np.percentile(lat, 50)) * 1e3, float(np.percentile(lat, 99)) * 1e3)


def run_server(server: _Server, warmup: float, duration: float) -> dict[tuple[str, int], Result]:
    """Every protocol × concurrency point on one server."""
    results = {}
    for protocol in PROTOCOLS:
        for c in CONCURRENCY:
            results[(protocol, c)] = r = measure(server, protocol, c, warmup, duration)
            log.info("%s c=%d: %.0f infer/s p50 %.2f ms p99 %.2f ms", protocol, c, r.infer_per_s, r.p50_ms, r.p99_ms)
    return results


def report(results: dict[str, dict[tuple[str, int], Result]]) -> None:
    """Print the side-by-side table with tritonpy's speedup over each anchor column."""
    labels = list(results)
    header = ["protocol", "concurrency"]
    for label in labels:
        header += [f"{label} infer/s", f"{label} p50 ms", f"{label} p99 ms"]
    anchors = [label for label in labels if label != "tritonpy"]
    if "tritonpy" in results:
        header += [f"speedup vs {a}" for a in anchors]
    rows = []
    for protocol in PROTOCOLS:
        for c in CONCURRENCY:
            row: list[object] = [protocol, c]
            for label in labels:
                r = results[label][(protocol, c)]
                row += [f"{r.infer_per_s:,.0f}", f"{r.p50_ms:.2f}", f"{r.p99_ms:.2f}"]
            if "tritonpy" in results:
                mine = results["tritonpy"][(protocol, c)].infer_per_s
                row += [f"{mine / results[a][(protocol, c)].infer_per_s:.2f}×" for a in anchors]
            rows.append(row)
    print_table(
        f"End-to-end {MODEL}, 4 KiB tensor, tritonclient sync clients "
        "(speedup = tritonpy infer/s / anchor infer/s)",
        header,
        rows,
    )


def main() -> None:
    """Parse flags, run every available server, print the table."""
    parser = bench_parser(__doc__, "short windows")
    parser.add_argument("--duration", type=float, help="seconds timed per point")
    args = parse_bench_args(parser)
    duration = args.duration or (0.8 if args.quick else 3.0)
    warmup = 0.2 if args.quick else 0.5
    # shm settings do not matter for 4 KiB tensors: Triton at its defaults only.
    results = run_on_each(
        server_specs(args.only, triton_best=False), BENCH_MODELS, lambda s: run_server(s, warmup, duration)
    )
    if results:
        report(results)


if __name__ == "__main__":
    main()
