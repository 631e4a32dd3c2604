"""Per-call cost of the tool sandbox (``agents.sandbox``): latency of ``calculator`` and of
``run_python`` under bubblewrap one call at a time, beside the same calculator call in the
``unsafe-local`` child (no isolation) and a bare ``python -I -S -c pass`` started the same way
(the floor any fresh-process sandbox pays); ``bubblewrap_overhead_median_ms`` is what bubblewrap
adds per call. Calls/s with 1 and 8 calls in flight, under bubblewrap.

    python -m laminar_mcore.bench.sandbox [--calls 200] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from typing import Awaitable, Callable, Dict, List

from ..agents.sandbox import SandboxLimits, calculator, run_python
from .common import report

PROGRAM = "total = sum(inputs['xs'])\nprint(total)"


async def _latencies(calls: Dict[str, Callable[[], Awaitable[object]]],
                     n: int) -> Dict[str, List[float]]:
    """Milliseconds of ``n`` calls of each kind, one at a time, the kinds interleaved so that
    a change in the machine's load falls on all of them alike."""
    times: Dict[str, List[float]] = {name: [] for name in calls}
    for _ in range(n):
        for name, call in calls.items():
            start = time.perf_counter()
            result = await call()
            times[name].append((time.perf_counter() - start) * 1e3)
            if getattr(result, "ok", True) is False:
                raise RuntimeError(f"a benchmark call failed: {result.error}")
    return times


async def _calls_per_s(n: int, in_flight: int, limits: SandboxLimits) -> float:
    """Calculator calls/s with ``in_flight`` calls at a time."""
    queue = list(range(n))

    async def worker():
        while queue:
            i = queue.pop()
            result = await calculator(f"{i}+87654321", limits=limits)
            if not result.ok:
                raise RuntimeError(f"a benchmark call failed: {result.error}")

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return n / (time.perf_counter() - start)


async def _bare_start() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", "-c", "pass", stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={})
    await proc.communicate()


def _p90(values: List[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


async def measure(calls: int) -> Dict[str, object]:
    limits = SandboxLimits(max_concurrency=8, sandbox="bubblewrap")
    local = SandboxLimits(max_concurrency=8, sandbox="unsafe-local")
    first = await calculator("1+1", limits=limits)  # the one-time bwrap probe, page cache
    if not first.ok:
        raise RuntimeError(f"the sandbox does not run here: {first.error}")
    xs = list(range(100))
    t = await _latencies({
        "bare": _bare_start,
        "calc": lambda: calculator("12345678+87654321", limits=limits),
        "calc_local": lambda: calculator("12345678+87654321", limits=local),
        "code": lambda: run_python(PROGRAM, inputs={"xs": xs}, limits=limits)}, calls)
    bare, calc, calc_local, code = t["bare"], t["calc"], t["calc_local"], t["code"]
    return {
        "isolation": first.isolation,
        "calls": calls,
        "bare_start_median_ms": round(statistics.median(bare), 2),
        "calculator_median_ms": round(statistics.median(calc), 2),
        "calculator_p90_ms": round(_p90(calc), 2),
        "calculator_unsafe_local_median_ms": round(statistics.median(calc_local), 2),
        "bubblewrap_overhead_median_ms": round(statistics.median(
            [a - b for a, b in zip(calc, calc_local)]), 2),
        "run_python_median_ms": round(statistics.median(code), 2),
        "run_python_p90_ms": round(_p90(code), 2),
        "calls_per_s_concurrency_1": round(await _calls_per_s(calls, 1, limits), 1),
        "calls_per_s_concurrency_8": round(await _calls_per_s(calls, 8, limits), 1),
    }


def main(argv=None) -> Dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per figure")
    parser.add_argument("--json", default=None, help="write the figures as one flat JSON object")
    args = parser.parse_args(argv)
    if args.calls < 10:
        parser.error("--calls must be at least 10 (a p90 needs them)")
    f = asyncio.run(measure(args.calls))
    bare = f["bare_start_median_ms"]
    c1 = f["calls_per_s_concurrency_1"]
    report(f, args.json, {
        "isolation": f"{f['isolation']}",
        "bare_start_median_ms": f"{bare} ms (baseline: python -I -S -c pass)",
        "calculator_median_ms": f"{f['calculator_median_ms']} ms "
                                f"({f['calculator_median_ms'] / bare:.2f}x bare start)",
        "calculator_p90_ms": f"{f['calculator_p90_ms']} ms ({f['calculator_p90_ms'] / bare:.2f}x)",
        "calculator_unsafe_local_median_ms": f"{f['calculator_unsafe_local_median_ms']} ms "
                                             f"({f['calculator_unsafe_local_median_ms'] / bare:.2f}x"
                                             " bare start; no isolation)",
        "bubblewrap_overhead_median_ms": f"{f['bubblewrap_overhead_median_ms']} ms per call "
                                         "(bubblewrap minus unsafe-local, paired calls)",
        "run_python_median_ms": f"{f['run_python_median_ms']} ms "
                                f"({f['run_python_median_ms'] / bare:.2f}x)",
        "run_python_p90_ms": f"{f['run_python_p90_ms']} ms ({f['run_python_p90_ms'] / bare:.2f}x)",
        "calls_per_s_concurrency_1": f"{c1} calls/s",
        "calls_per_s_concurrency_8": f"{f['calls_per_s_concurrency_8']} calls/s "
                                     f"({f['calls_per_s_concurrency_8'] / c1:.2f}x concurrency 1)",
    })
    return f


if __name__ == "__main__":
    main()
