"""The simulator against what this machine can measure: ``bench.modes``.

    python -m laminar_mcore.sim.calibrate [--steps 20] [--json PATH] [--modes-json PATH]
    python -m laminar_mcore.sim.calibrate --costs-json laminar_mcore/sim/calibration_reference.json

1. Measures the costs of this machine's components alone: a CPU engine's decode step time at
   batch 1-16 on the bench's model (a live engine over HTTP; a linear fit), and the trainer's
   busy seconds per step in ``bench.modes``' sync run (where it runs alone: the engines wait
   for its weights), and an engine's pull of the model from a relay (``bench.weight_sync``).
2. Runs ``bench.modes`` (or reads its JSON, ``--modes-json``): the real system in sync,
   one_step and laminar on the same lengths.
3. Simulates the same three runs (2 engines, the bench's replayed lengths, batch, capacity)
   with the measured costs, the production manager unchanged, and reports the predicted
   ``laminar_vs_sync`` and ``laminar_vs_one_step`` beside the measured ones;
   ``calibration_error`` is the larger relative error.

Both benchmarks run as their own processes and calibration reads their ``--json``: the
simulator models the trainer, it never imports it (``tests/test_layering.py`` holds this
through every chain of imports); the runs' shape comes from the neutral ``run_shape``.

The engines and the trainer share this machine's two cores, yet their costs barely interact:
the trainer's busy seconds per step in one_step (overlapping generation) are no higher than in
sync (alone): 88 against 99 ms in one run. So by default the simulated components do not slow
each other; ``--cores N`` models N shared cores (busy / N slower while more are busy), which
made the predictions worse here (errors 14% at N=2 against 6% without).

``--costs-json`` replays a calibration's JSON (this module's ``--json``): its measured costs
and ``bench_*`` figures stand in for steps 1 and 2, so only the simulation runs. It is
deterministic, which is how the test suite checks the simulator against stored measurements
(``calibration_reference.json``) without timing anything on the machine that runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from ..run_shape import add_run_args, run_args, run_overrides
from .cluster import SimConfig, simulate, summary_line
from .costs import CostModel
from .workload import Workload


@dataclass(frozen=True)
class ReplayWorkload(Workload):
    """``bench.modes``' lengths: the controller's ``rollout.forced_*`` length function
    (``length_fn_from_config``), of group ``g<key>``."""

    length_fn: Optional[Callable[[str, int], int]] = None
    prompt: int = 8

    def prompt_length(self, prompt: int) -> int:
        return self.prompt

    def response_length(self, prompt: int, sample: int) -> int:
        return self.length_fn(f"g{prompt}", sample)

    def mean_context(self) -> float:
        return self.prompt + self.stats(500)["mean"]


def measure_engine(cfg, model_path: str, prompt_ids: List[int], batches=(1, 2, 4, 8, 16),
                   tokens: int = 48) -> Dict[int, float]:
    """Decode seconds per step at each batch size on one engine started as the run starts
    them (``rollout`` config: threads, streaming every ``stream_interval`` tokens), alone,
    read through the client call the rollout manager makes (``stream_tokens``)."""
    from ..rollout.client import SGLangClient
    from ..rollout.launcher import EngineProcess, engine_command_from_config

    cmd = engine_command_from_config(cfg.rollout, model_path, port=0, seed=cfg.seed)
    steps = {}

    async def one(client, i):
        n = 0
        async for chunk in client.stream_tokens(prompt_ids, {"max_new_tokens": tokens,
                                                             "ignore_eos": True},
                                                rid=f"calibrate-{i}-{time.monotonic_ns()}"):
            n += len(chunk.new_ids)
        return n

    async def run(url):
        async with SGLangClient(url, incremental_stream=True) as client:  # as the run's engines
            await one(client, -1)  # warm-up
            for b in batches:
                best = float("inf")
                for _ in range(3):  # the fastest of three: the machine is noisy
                    t0 = time.perf_counter()
                    assert await asyncio.gather(*[one(client, i) for i in range(b)]) == [tokens] * b
                    best = min(best, time.perf_counter() - t0)
                steps[b] = best / tokens

    threads = str(cfg.cluster.threads_per_process or os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="laminar-calibrate-") as tmp:
        with EngineProcess(cmd, log_path=os.path.join(tmp, "engine.log"),
                           env={"OMP_NUM_THREADS": threads}) as proc:
            asyncio.run(run(proc.url))
    return steps


def run_benchmark(module: str, flags: List[str]) -> dict:
    """``python -m laminar_mcore.bench.<module> FLAGS --json PATH`` in its own process (its
    lines printed as it prints them), and its JSON: the benchmarks start the trainer, which
    the simulator must not import."""
    with tempfile.TemporaryDirectory(prefix="laminar-calibrate-bench-") as tmp:
        path = os.path.join(tmp, f"{module}.json")
        done = subprocess.run([sys.executable, "-m", f"laminar_mcore.bench.{module}", *flags,
                               "--json", path])
        if done.returncode != 0 or not os.path.exists(path):
            raise SystemExit(f"bench.{module} {' '.join(flags)} failed (exit {done.returncode}, "
                             "its output is above); calibration needs its figures")
        with open(path) as f:
            return json.load(f)


def measure_pull(cfg) -> float:
    """Seconds for an engine to pull a version of the run's model shape from its relay
    (``bench.weight_sync``: a real relay, the CPU engine's shared-memory pull)."""
    arch = cfg.model.arch
    figures = run_benchmark("weight_sync", [
        "--hidden", str(arch.hidden_size), "--layers", str(arch.num_hidden_layers),
        "--vocab", str(arch.vocab_size), "--relays", "1", "--repeats", "3", "--mooncake", "off"])
    return float(figures["pull_s"])


def fit_line(points: Dict[int, float]):
    """Least squares y = a + b x."""
    xs, ys = list(points), list(points.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return max(my - b * mx, 0.0), max(b, 0.0)


# the runs' shape (bench.modes' add_run_args but --steps), kept in the JSON for --costs-json
RUN_SHAPE = ("batch_prompts", "samples", "short", "long", "long_fraction", "engines")


def _load_costs(path: str) -> dict:
    """A calibration's JSON, checked for the keys ``--costs-json`` replays."""
    with open(path) as f:
        stored = json.load(f)
    need = ["prompt_tokens", "engine_step_ms_b1", "pull_ms", "bench_steps", "bench_sync_span_s",
            "bench_sync_trainer_idle_fraction", "bench_laminar_vs_sync",
            "bench_laminar_vs_one_step", *RUN_SHAPE]
    missing = [k for k in need if k not in stored]
    if missing:
        raise SystemExit(f"--costs-json {path}: missing {', '.join(missing)}; it must be the "
                         "JSON of a `python -m laminar_mcore.sim.calibrate --json PATH` run")
    return stored


def predict(cost: CostModel, workload: Workload, args, steps: int,
            log: Callable[[str], None] = print) -> Dict[str, float]:
    out = {}
    for mode in ("sync", "one_step", "laminar"):
        r = simulate(SimConfig(mode=mode, iterations=steps, workload=workload, cost=cost,
                               engines=args.engines, trainer_gpus=1,
                               cpu_cores=args.cores or None,
                               max_staleness=None, repack_interval_s=5.0))
        log("  simulated " + summary_line(r))
        out[mode] = r.response_tokens_per_s  # as bench.modes counts (response tokens)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(ap)
    ap.add_argument("--pull-s", type=float, default=None,
                    help="an engine's pull from its relay (default: measured, bench.weight_sync)")
    ap.add_argument("--cores", type=float, default=0.0,
                    help="model engines and trainer sharing this many cores (0: they do not "
                         "slow each other, as measured here: see the module's docstring)")
    ap.add_argument("--modes-json", default=None, help="a bench.modes JSON of the same settings "
                    "(with its *_span_s keys) instead of running it")
    ap.add_argument("--costs-json", default=None,
                    help="a calibration's JSON (this module's --json): its measured costs and "
                         "bench_* figures instead of measuring; only the simulation runs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    stored = _load_costs(args.costs_json) if args.costs_json else None
    if stored is not None:  # the stored run's shape, not the command line's defaults
        for key in RUN_SHAPE:
            setattr(args, key, type(getattr(args, key))(stored[key]))

    from hydra import compose, initialize_config_dir

    from ..bench.common import report
    from ..config import register_configs, validate_config
    from ..config.paths import conf_dir
    from ..controller.role import load_task
    from ..controller.server import length_fn_from_config

    t0 = time.perf_counter()
    if stored is not None:
        measured = {k[6:]: v for k, v in stored.items() if k.startswith("bench_")}
    elif args.modes_json:
        with open(args.modes_json) as f:  # bench.modes' JSON, or a calibration's (bench_*)
            measured = json.load(f)
        if "bench_steps" in measured:
            measured = {k[6:]: v for k, v in measured.items() if k.startswith("bench_")}
    else:
        measured = run_benchmark("modes", run_args(args))
    steps = int(measured.get("steps", args.steps))

    register_configs()
    with tempfile.TemporaryDirectory(prefix="laminar-calibrate-task-") as tmp:
        with initialize_config_dir(config_dir=conf_dir(), version_base=None):
            cfg = compose(config_name="config", overrides=run_overrides(args) + [
                f"output_dir={tmp}", "run_name=calibrate"])
        validate_config(cfg)
        if stored is not None:
            prompt_tokens = int(stored["prompt_tokens"])
            engine_steps = {int(k[len("engine_step_ms_b"):]): ms / 1e3
                            for k, ms in stored.items() if k.startswith("engine_step_ms_b")}
        else:
            task = load_task(cfg, tmp, lambda *a: None)
            prompt_ids = task.codec.encode_prompt(task.rows[0])
            prompt_tokens = len(prompt_ids)
            engine_steps = measure_engine(cfg, task.model_path, prompt_ids)
    if stored is not None:
        pull_s = stored["pull_ms"] / 1e3
    else:
        pull_s = measure_pull(cfg) if args.pull_s is None else args.pull_s
    fixed, per_request = fit_line(engine_steps)

    workload = ReplayWorkload(batch_prompts=args.batch_prompts, samples=args.samples,
                              length_fn=length_fn_from_config(cfg.rollout),
                              prompt=prompt_tokens, max_response=args.long)
    # the trainer's busy seconds per step in the sync run, where it runs alone (the engines
    # wait for its weights); per token over the batch's prompt + response tokens
    span = measured["sync_span_s"]
    busy_per_step = (1.0 - measured["sync_trainer_idle_fraction"]) * span / max(steps - 1, 1)
    stats = workload.stats(2000)
    tokens_per_step = workload.batch_trajectories * (stats["mean"] + prompt_tokens)
    cost = CostModel("7B", decode_fixed_s=fixed, decode_per_request_s=per_request,
                     decode_per_context_token_s=0.0, prefill_per_token_s=0.0,
                     trainer_per_token_s=busy_per_step / tokens_per_step,
                     publish_seconds=0.0, pull_seconds=pull_s,
                     engine_capacity=cfg.rollout.max_running_requests, kv_capacity=65536)
    lines = {"engine_step": "decode step " + ", ".join(
        f"b{b} {s * 1e3:.2f} ms" for b, s in engine_steps.items()) +
        f" (fit {fixed * 1e3:.2f} ms + {per_request * 1e3:.3f} ms/request)",
        "trainer_step": f"trainer {busy_per_step * 1e3:.1f} ms per step (alone, sync run)",
        "pull": f"pull {pull_s * 1e3:.1f} ms"}
    predicted = predict(cost, workload, args, steps)
    figures = {**{f"bench_{k}": v for k, v in measured.items() if not k.startswith("bench_")},
               "pull_ms": round(pull_s * 1e3, 4), "prompt_tokens": prompt_tokens,
               **{f"engine_step_ms_b{b}": round(s * 1e3, 6) for b, s in engine_steps.items()},
               **{key: getattr(args, key) for key in RUN_SHAPE},
               "engine_step_fixed_ms": round(fixed * 1e3, 3),
               "engine_step_per_request_ms": round(per_request * 1e3, 4),
               "trainer_busy_s_per_step": round(busy_per_step, 3), "steps": steps}
    errors = []
    for other in ("sync", "one_step"):
        pred = predicted["laminar"] / predicted[other]
        meas = measured[f"laminar_vs_{other}"]
        err = abs(pred - meas) / meas
        errors.append(err)
        figures[f"predicted_laminar_vs_{other}"] = round(pred, 3)
        figures[f"measured_laminar_vs_{other}"] = round(meas, 3)
        figures[f"error_laminar_vs_{other}"] = round(err, 3)
        lines[f"laminar_vs_{other}"] = (f"predicted {pred:.2f}x, measured {meas:.2f}x "
                                        f"(error {err:.0%})")
    figures["calibration_error"] = round(max(errors), 3)
    figures["wall_s"] = round(time.perf_counter() - t0, 1)
    lines["calibration_error"] = f"{max(errors):.0%} (the larger relative error; goal < 20%)"
    report(figures, args.json, lines)
    return figures


if __name__ == "__main__":
    main()
