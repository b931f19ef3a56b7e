"""Start-up, side by side: real Triton vs tritonpy.

Two figures per server, on a repository of 8 copies of ``identity`` generated into a
temporary directory:

* start to ready — from spawning the server to the first 200 on ``/v2/health/ready``, with all
  8 models loaded at start (``--model-control-mode`` none); median of several starts;
* explicit load — with ``--model-control-mode=explicit``, the time of one HTTP repository
  load call (``POST /v2/repository/models/<name>/load``, which returns once the model is
  loaded) for a model not loaded before; median over several models.

Usage: python benchmarks/startup_bench.py [--quick] [--only triton|tritonpy]
"""

from __future__ import annotations

import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import tritonclient.http as httpclient

from _limits import print_table
from _servers import BENCH_MODELS, ServerSpec, _Server, run_on_each, server_specs, bench_parser, parse_bench_args

log = logging.getLogger("startup_bench")

N_MODELS = 8


def make_repository(root: Path, n: int = N_MODELS) -> Path:
    """``root/identity_0 .. identity_{n-1}``: copies of bench_models/identity, renamed."""
    src = BENCH_MODELS / "identity"
    for i in range(n):
        dst = root / f"identity_{i}"
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        config = dst / "config.pbtxt"
        config.write_text(config.read_text().replace('name: "identity"', f'name: "identity_{i}"'))
    return root


def start_to_ready(spec: ServerSpec, repo: Path, starts: int) -> float | str:
    """Median seconds from spawn to ready over ``starts`` fresh servers."""
    samples: list[float] = []

    def body(server: _Server) -> float:
        return server.start_to_ready_seconds

    for _ in range(starts):
        out = run_on_each([spec], repo, body)
        if spec.label not in out:
            return "not ready"
        samples.append(out[spec.label])
    log.info("%s start to ready: %s", spec.label, [round(s, 2) for s in samples])
    return statistics.median(samples)


def explicit_loads(server: _Server, loads: int) -> float:
    """Median seconds of one repository load call, each for a model not loaded before."""
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=300.0)
    try:
        samples = []
        for i in range(loads):
            name = f"identity_{i}"
            t0 = time.perf_counter()
            client.load_model(name)
            samples.append(time.perf_counter() - t0)
            if not client.is_model_ready(name):
                raise RuntimeError(f"{name} not ready after its load call returned")
        log.info("%s explicit loads: %s", server.kind, [round(s, 2) for s in samples])
        return statistics.median(samples)
    finally:
        client.close()  # an open connection delays the real Triton's shutdown


def main() -> None:
    """Parse flags, build the 8-model repository, measure each server, print the table."""
    parser = bench_parser(__doc__, "one start and two loads per server")
    args = parse_bench_args(parser)
    starts, loads = (1, 2) if args.quick else (3, 3)
    results: dict[str, tuple[float | str, float | str]] = {}
    with tempfile.TemporaryDirectory(prefix="tpbench-startup-") as tmp:
        repo = make_repository(Path(tmp))
        for spec in server_specs(args.only, triton_best=False):
            ready = start_to_ready(spec, repo, starts)
            if not isinstance(ready, float):
                continue  # its "not ready (...)" line is printed already
            out = run_on_each([spec], repo, lambda s: explicit_loads(s, loads), args=["--model-control-mode=explicit"])
            results[spec.label] = (ready, out.get(spec.label, "failed"))
    if not results:
        return
    labels = list(results)
    anchors = [label for label in labels if label != "tritonpy"]
    header = ["measure", *[f"{label} s" for label in labels]]
    if "tritonpy" in results:
        header += [f"speedup vs {a}" for a in anchors]
    rows = []
    for i, measure in enumerate((f"start to ready, {N_MODELS} models", "explicit load of one model")):
        row: list[object] = [measure]
        for label in labels:
            v = results[label][i]
            row.append(f"{v:.2f}" if isinstance(v, float) else v)
        if "tritonpy" in results:
            mine = results["tritonpy"][i]
            for a in anchors:
                t = results[a][i]
                row.append(f"{t / mine:.2f}×" if isinstance(t, float) and isinstance(mine, float) else "—")
        rows.append(row)
    print_table("Start-up (seconds, median; speedup = anchor s / tritonpy s)", header, rows)


if __name__ == "__main__":
    main()
