# SPDX-License-Identifier: Apache-2.0
"""Shared helpers for the DCP benchmarks: timing, CSV/PNG output, tables.

Imported as ``benchmarks._common``: run the scripts from the repository root
as modules (``python -m benchmarks.decode_step``).
"""

from __future__ import annotations

import csv
import os
import platform

import torch


def time_ms(fn, *, graph: bool = True, rep: int = 40) -> float:
    """Median time of ``fn()`` in ms (CUDA-graph replay when ``graph``).

    Falls back to eager event timing if ``fn`` cannot be captured.
    """
    import triton.testing as tt

    fn()
    torch.cuda.synchronize()
    if graph:
        try:
            return float(tt.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
        except Exception as e:  # noqa: BLE001 - report and fall back
            print(f"  (graph capture failed: {type(e).__name__}: {e}; eager)")
            torch.cuda.synchronize()
    return float(tt.do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def cuda_event_median_ms(fn, reps: int = 50, *, warmup: int = 3) -> float:
    """Median time of one eager ``fn()`` in ms from CUDA events.

    Back-to-back calls with no cache flush between them (what one decode step
    sees in a serving loop), unlike ``time_ms``'s flushed Triton timing.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth_tbs(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy rate, counting bytes read plus written (TB/s)."""
    src = torch.empty(num_bytes // 2, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), graph=False, rep=100)
    return 2 * num_bytes / (ms * 1e-3) / 1e12


def environment() -> dict:
    env = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__,
               cuda=torch.version.cuda, python=platform.python_version())
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import flashinfer
        env["flashinfer"] = flashinfer.__version__
    except Exception:  # noqa: BLE001
        pass
    return env


def write_csv(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    keys = list(rows[0])
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def run_parts(parts: dict, names: list[str], csv_path: str) -> list[dict]:
    """Run the benchmark parts ``names`` (``parts[name]()`` returns CSV
    rows) in order; a part that fails is reported and the others still run.
    The rows so far are written to ``csv_path`` after each part."""
    rows = []
    for name in names:
        try:
            rows += parts[name]()
        except Exception as error:  # noqa: BLE001 - the other parts still run
            import traceback

            traceback.print_exc()
            print(f"part {name} failed: {type(error).__name__}: {error}")
        if rows:
            write_csv(csv_path, rows)
    return rows


def print_table(rows: list[dict], cols: list[str], fmt: dict | None = None) -> str:
    fmt = fmt or {}
    def cell(r, c):
        v = r.get(c, "")
        if isinstance(v, float):
            return format(v, fmt.get(c, ".3g"))
        return str(v)
    widths = [max(len(c), *(len(cell(r, c)) for r in rows)) for c in cols]
    lines = ["| " + " | ".join(c.rjust(w) for c, w in zip(cols, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(cell(r, c).rjust(w)
                                        for c, w in zip(cols, widths)) + " |")
    text = "\n".join(lines)
    print(text)
    return text


def random_paged_tables(num_reqs: int, kv_lens: torch.Tensor, page: int,
                        pool_pages: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [R, B] distinct random page ids in [1, pool_pages) per table.

    Timing only: tables into a preallocated pool of pages whose contents do
    not matter, every column a real page. Correctness checks build a cache
    with its contents and tables with ``random_paged_kv``
    (``tools/dcp_simulated_ranks.py``).
    """
    cols = max(int(((kv_lens + page - 1) // page).max()), 1)
    need = num_reqs * cols
    assert need < pool_pages, (need, pool_pages)
    ids = torch.randperm(pool_pages - 1, generator=gen)[:need] + 1
    return ids.view(num_reqs, cols).to(torch.int32)
