"""NVIDIA's perf_analyzer against both servers: the tool Triton users measure with.

perf_analyzer 2.51 (installed by ``scripts/install_anchor.sh`` beside the real Triton) runs the
same command line against the real Triton and against tritonpy, each serving ``bench_models/``:

* ``identity_fp32`` with a 4 KiB input, over HTTP and gRPC, the tensors in the request and
  response (``--shared-memory none``) or in system shared memory regions perf_analyzer
  registers (``--shared-memory system``), at concurrency 1 and 4;
* ``identity`` (UINT8) with 1, 16 and 64 MiB inputs over gRPC, in the messages and in system
  shared memory, at concurrency 1.

Reported: perf_analyzer's infer/s and p50 latency for each server, tritonpy's ratio to each
Triton column, and for the large shared-memory rows the ratio to one memcpy of the tensor (the
least a request whose input and output are both in the client's regions can cost: the output
is written once). perf_analyzer writes its inputs into its regions once, before it measures, so
the shared-memory rows time the server alone. Triton at its best shm settings is run for the
large rows only (they do not matter at 4 KiB).

Usage: python benchmarks/perf_analyzer_bench.py [--quick] [--only triton|tritonpy] [-v]
"""

from __future__ import annotations

import csv
import logging
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from _limits import MIB, fmt_size, measure_memcpy, print_table
from _servers import (
    BENCH_MODELS,
    DEFAULT_ANCHOR_DIR,
    _Server,
    bench_parser,
    parse_bench_args,
    run_on_each,
    server_specs,
)

log = logging.getLogger("perf_analyzer_bench")

PERF_ANALYZER = DEFAULT_ANCHOR_DIR / "bin" / "perf_analyzer"
MISSING = "perf_analyzer not installed: run scripts/install_anchor.sh"


@dataclass(frozen=True)
class Case:
    """One row: a model, its input size in bytes, a protocol, where the tensors go, clients."""

    model: str
    size: int
    protocol: str
    shm: str
    concurrency: int

    @property
    def large(self) -> bool:
        return self.size >= MIB

    def flags(self) -> list[str]:
        """perf_analyzer's flags for this row (the server's URL and the timing come apart)."""
        elements = self.size // 4 if self.model == "identity_fp32" else self.size
        out = ["-m", self.model, "-i", self.protocol.lower(), "--shape", f"INPUT0:{elements}",
               "--shared-memory", self.shm, "--concurrency-range", str(self.concurrency)]
        if self.shm == "system":
            out += ["--output-shared-memory-size", str(self.size)]
        return out


def cases(quick: bool) -> list[Case]:
    """Every row, small ones first."""
    small = [Case("identity_fp32", 4096, p, s, c)
             for p in ("HTTP", "gRPC") for s in ("none", "system") for c in (1, 4)]
    sizes = (MIB, 16 * MIB) if quick else (MIB, 16 * MIB, 64 * MIB)
    large = [Case("identity", n, "gRPC", s, 1) for n in sizes for s in ("none", "system")]
    return small + large


@dataclass
class Point:
    """perf_analyzer's figures for one row on one server."""

    infer_per_s: float
    p50_us: float


def run_case(server: _Server, case: Case, window_ms: int, workdir: Path) -> Point | str:
    """One perf_analyzer run; its figures, or the last line it printed when it failed."""
    url = server.http_url if case.protocol == "HTTP" else server.grpc_url
    out = workdir / "pa.csv"
    out.unlink(missing_ok=True)
    # Stability within 50 % over 3 windows, at most 6 windows: this VM's figures move more
    # than perf_analyzer's default 10 % allows, and an unstable run reports nothing.
    cmd = [str(PERF_ANALYZER), *case.flags(), "-u", url,
           "--measurement-interval", str(window_ms), "-s", "50", "-r", "6", "-f", str(out)]
    log.info("%s: %s", server.kind, " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or not out.exists():
        lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
        return lines[-1] if lines else f"exit status {proc.returncode}"
    with out.open() as f:
        row = next(csv.DictReader(f))
    return Point(float(row["Inferences/Second"]), float(row["p50 latency"]))


def run_server(server: _Server, rows: list[Case], window_ms: int) -> dict[Case, Point | str]:
    """Every row on one server; Triton at its best shm settings runs the large rows only."""
    results: dict[Case, Point | str] = {}
    best = "shm-default-byte-size" in server.backend_config
    with tempfile.TemporaryDirectory(prefix="pa_bench_") as tmp:
        for case in rows:
            if best and not case.large:
                continue
            results[case] = r = run_case(server, case, window_ms, Path(tmp))
            log.info("%s %s: %s", server.kind, case, r)
    return results


def _cell(point: Point | str | None, case: Case) -> str:
    if point is None:
        return ""
    if isinstance(point, str):
        return "failed"
    if case.large:
        return f"{point.infer_per_s:,.1f} ({point.infer_per_s * case.size / 1e9:.2f} GB/s)"
    return f"{point.infer_per_s:,.0f}"


def report(results: dict[str, dict[Case, Point | str]], rows: list[Case]) -> None:
    """The side-by-side table, then each failure in full."""
    labels = list(results)
    anchors = [label for label in labels if label != "tritonpy"]
    mine = results.get("tritonpy", {})
    memcpy_us = {n: measure_memcpy(n) * 1e6 for n in {c.size for c in rows if c.large}}
    header = ["model", "size", "protocol", "shm", "concurrency"]
    header += [f"{label} infer/s" for label in labels] + [f"{label} p50 µs" for label in labels]
    header += [f"tritonpy / {a}" for a in anchors if mine] + (["tritonpy / memcpy"] if mine else [])
    table = []
    for case in rows:
        row: list[object] = [case.model, fmt_size(case.size), case.protocol, case.shm, case.concurrency]
        points = [results[label].get(case) for label in labels]
        row += [_cell(p, case) for p in points]
        row += [f"{p.p50_us:,.0f}" if isinstance(p, Point) else "" for p in points]
        ours = mine.get(case)
        for a in anchors if mine else ():
            theirs = results[a].get(case)
            ok = isinstance(ours, Point) and isinstance(theirs, Point)
            row.append(f"{ours.infer_per_s / theirs.infer_per_s:.2f}×" if ok else "")  # type: ignore[union-attr]
        if mine:
            # Time per request over one memcpy of the tensor: shared-memory large rows only.
            fits = isinstance(ours, Point) and case.large and case.shm == "system"
            row.append(f"{1e6 / ours.infer_per_s / memcpy_us[case.size]:.2f}×" if fits else "")  # type: ignore[union-attr]
        table.append(row)
    print_table("perf_analyzer 2.51, the same command line on each server (ratios: tritonpy's "
                "infer/s over the column's; tritonpy's time per request over one memcpy)",
                header, table)
    for label in labels:
        for case, point in results[label].items():
            if isinstance(point, str):
                print(f"{label} {case.model} {fmt_size(case.size)} {case.protocol} shm={case.shm} "
                      f"c={case.concurrency}: {point}")


def main() -> None:
    """Parse flags, run every available server, print the table."""
    parser = bench_parser(__doc__, "short windows, no 64 MiB row")
    args = parse_bench_args(parser)
    if not PERF_ANALYZER.exists():
        print(MISSING)
        return
    rows = cases(args.quick)
    window_ms = 800 if args.quick else 2000
    results = run_on_each(server_specs(args.only), BENCH_MODELS,
                          lambda s: run_server(s, rows, window_ms))
    if results:
        report(results, rows)


if __name__ == "__main__":
    main()
