"""Decoupled streaming through BLS, side by side: real Triton vs tritonpy.

``decoupled_loop`` issues one ``exec(decoupled=True)`` to ``repeat_decoupled`` and drains the
stream; the rate is timed inside its execute. Two figures per server: responses/s for 1,000
tiny (16-byte) responses, and MB/s (1 MB = 1e6 bytes) for 1 MiB responses. Each is the median
of several calls.

A third figure streams the same 1,000 tiny responses to an HTTP client as Server-Sent Events
(Triton's generate extension, ``POST /v2/models/repeat_decoupled/generate_stream``): events/s
from sending the request to the last byte, the client reading the whole body.

A last table gives the two BLS measures through tritonpy's in-process API (``model.infer``
iterating the stream in this process), beside the anchor's BLS figures.

Usage: python benchmarks/decoupled_bench.py [--quick] [--only triton|tritonpy]
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import statistics
import time

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from _limits import MIB, print_table
from _servers import BENCH_MODELS, _Server, run_on_each, server_specs, bench_parser, parse_bench_args

log = logging.getLogger("decoupled_bench")

TINY = 16
TINY_COUNT = 1000
MEASURES = ("tiny responses/s", "1 MiB responses MB/s", "tiny SSE events/s (HTTP generate_stream)")


def decoupled_loop(client: httpclient.InferenceServerClient, count: int, size: int) -> tuple[float, float]:
    """One drained stream of ``count`` responses of ``size`` bytes: (responses/s, MB/s)."""
    inputs = []
    for name, value in (("COUNT", count), ("SIZE", size)):
        tensor = httpclient.InferInput(name, [1], "INT64")
        tensor.set_data_from_numpy(np.array([value], dtype=np.int64))
        inputs.append(tensor)
    result = client.infer("decoupled_loop", inputs)
    return float(result.as_numpy("RESPONSES_PER_S")[0]), float(result.as_numpy("MB_PER_S")[0])


def sse_stream(server: _Server, count: int, size: int) -> float:
    """One ``generate_stream`` of ``count`` responses read to its end: events/s."""
    host, port = server.http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    try:
        body = json.dumps({"COUNT": count, "SIZE": size})
        start = time.perf_counter()
        conn.request("POST", "/v2/models/repeat_decoupled/generate_stream", body=body)
        resp = conn.getresponse()
        data = resp.read()
        elapsed = time.perf_counter() - start
    finally:
        conn.close()
    events = data.count(b"data: ")
    if resp.status != 200 or events != count or b'"error"' in data:
        raise RuntimeError(f"generate_stream answered {resp.status} with {events} events: {data[:200]!r}")
    return events / elapsed


def run_server(server: _Server, repeats: int, seconds: float) -> dict[str, float | str]:
    """Both measures on one server; a failing measure becomes its error text."""
    results: dict[str, float | str] = {}
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=600.0)
    try:
        try:
            decoupled_loop(client, 100, TINY)  # warm-up, untimed
            samples = [decoupled_loop(client, TINY_COUNT, TINY)[0] for _ in range(repeats)]
            log.info("tiny: %s responses/s", [round(s) for s in samples])
            results[MEASURES[0]] = statistics.median(samples)
        except InferenceServerException as exc:
            results[MEASURES[0]] = str(exc)
        try:
            # Size the stream so that one call lasts about ``seconds``.
            rate = decoupled_loop(client, 16, MIB)[0]
            count = max(16, int(rate * seconds))
            samples = [decoupled_loop(client, count, MIB)[1] for _ in range(repeats)]
            log.info("1 MiB x %d: %s MB/s", count, [round(s) for s in samples])
            results[MEASURES[1]] = statistics.median(samples)
        except InferenceServerException as exc:
            results[MEASURES[1]] = str(exc)
        try:
            sse_stream(server, 100, TINY)  # warm-up, untimed
            samples = [sse_stream(server, TINY_COUNT, TINY) for _ in range(repeats)]
            log.info("SSE: %s events/s", [round(s) for s in samples])
            results[MEASURES[2]] = statistics.median(samples)
        except (OSError, RuntimeError) as exc:
            results[MEASURES[2]] = str(exc)
    finally:
        client.close()  # an open connection delays the real Triton's shutdown
    return results


def inprocess_stream(model: object, count: int, size: int) -> tuple[float, float]:
    """One drained stream through tritonpy's in-process API: (responses/s, MB/s)."""
    inputs = {"COUNT": np.array([count], np.int64), "SIZE": np.array([size], np.int64)}
    received = 0
    start = time.perf_counter()
    for response in model.infer(inputs):  # type: ignore[attr-defined]
        if response.error is not None:
            raise RuntimeError(str(response.error))
        if response.outputs:
            received += 1
    elapsed = time.perf_counter() - start
    if received != count:
        raise RuntimeError(f"repeat_decoupled sent {received} responses, expected {count}")
    return received / elapsed, received * size / elapsed / 1e6


def run_inprocess(repeats: int, seconds: float) -> dict[str, float | str]:
    """Both measures through ``tritonpy.Server(...).model("repeat_decoupled").infer()``: no
    HTTP and no BLS caller, the stream goes straight from the stub to this process."""
    import tritonpy

    prefix = f"tpbench_{os.getpid()}_ip_"
    with tritonpy.Server(BENCH_MODELS, model_control_mode="explicit",
                         load_models=["repeat_decoupled"],
                         backend_config={"shm-region-prefix-name": prefix}) as server:
        model = server.model("repeat_decoupled")
        inprocess_stream(model, 100, TINY)  # warm-up, untimed
        tiny = statistics.median(inprocess_stream(model, TINY_COUNT, TINY)[0]
                                 for _ in range(repeats))
        rate = inprocess_stream(model, 16, MIB)[0]
        count = max(16, int(rate * seconds))
        big = statistics.median(inprocess_stream(model, count, MIB)[1] for _ in range(repeats))
    return {MEASURES[0]: tiny, MEASURES[1]: big}


def report(results: dict[str, dict[str, float | str]]) -> None:
    """Print the side-by-side table and any errors under it."""
    labels = list(results)
    anchors = [label for label in labels if label != "tritonpy"]
    header = ["measure", *labels]
    if "tritonpy" in results:
        header += [f"speedup vs {a}" for a in anchors]
    rows, errors = [], []
    for m in MEASURES:
        row: list[object] = [m]
        for label in labels:
            v = results[label][m]
            if isinstance(v, float):
                row.append(f"{v:,.0f}")
            else:
                row.append("error")
                errors.append(f"{label} {m}: {v}")
        if "tritonpy" in results:
            mine = results["tritonpy"][m]
            for a in anchors:
                t = results[a][m]
                row.append(f"{mine / t:.2f}×" if isinstance(mine, float) and isinstance(t, float) else "—")
        rows.append(row)
    print_table(
        f"Decoupled stream via BLS exec(decoupled=True): {TINY_COUNT:,} responses of {TINY} B, "
        "and 1 MiB responses (1 MB = 1e6 B); the tiny stream as SSE over HTTP "
        "(speedup = tritonpy / anchor)",
        header,
        rows,
    )
    for line in errors:
        print(line)


def main() -> None:
    """Parse flags, run every available server, print the table."""
    parser = bench_parser(__doc__, "3 repeats, short 1 MiB streams")
    args = parse_bench_args(parser)
    repeats, seconds = (3, 0.1) if args.quick else (5, 0.4)
    results = run_on_each(server_specs(args.only), BENCH_MODELS, lambda s: run_server(s, repeats, seconds))
    if results:
        report(results)
    if args.only != "triton":
        mine = run_inprocess(repeats, seconds)
        rows = [[m, f"{mine[m]:,.0f}"] + [
            f"{mine[m] / results[a][m]:.2f}×" if isinstance(results[a][m], float) else "—"
            for a in results if a != "tritonpy"] for m in MEASURES if m in mine]
        print_table(
            "Decoupled stream through tritonpy's in-process API (model.infer, no BLS caller); "
            "ratio = in-process / the anchor's BLS figure above",
            ["measure", "tritonpy in-process", *[f"vs {a}" for a in results if a != "tritonpy"]],
            rows,
        )


if __name__ == "__main__":
    main()
