"""The simulator's table, laid beside Laminar's published results.

    python -m laminar_mcore.sim.report --json out.json [--warmup 10 --measure 5] [--jobs 2]
        [--models 7B,32B,72B] [--sweep-iterations 5] [--splits-per-point 5]
        [--plot-dir outputs/sim]
        [--calibration calib.json | --no-calibrate] [--fail MACHINE@T]
    python -m laminar_mcore.sim.report --sweep-placement --model 32B --gpus 256 [--mode laminar]
    python -m laminar_mcore.sim.report --sensitivity [--sensitivity-points 7B@256,32B@128]
        [--placements docs/sim/report.json] [--constants TABLE.key,...] [--json out.json]

Runs every system at 7B (16-256 GPUs), 32B (32-512) and 72B (64-1,024) on the DAPO-Math-like
workload (512 prompts x 16 per iteration, 16 mini-batch steps, 1,024 concurrent requests per
replica) with the paper's settings (engine TP per system and model, ``costs.ENGINE_TP_PAPER``;
AReaL at eta = infinity, and at eta = 4 as the labelled row ``areal_eta4``), each with its
own weight protocol (``relays.py``) at its own best trainer/rollout
split (``placement.py``: the same sweep for every system; ``trainer_gpus_<model>_<gpus>_<mode>``
records the choice), measured as the paper measures (prompt + response tokens of a batch over
the time between trainer updates, the mean of ``--measure`` iterations after ``--warmup``,
``tokens_per_s_spread_*`` their spread). It prints laminar's speedups over each baseline, its
scaling efficiency, staleness, repack's effect, and ``paper_<figure>`` / ``sim_<figure>`` pairs
with ``paper_max_rel_error`` (``paper.py``), plus the MoE weight-sync figures
(``costs.relay_sync_seconds``). PNG plots go to ``--plot-dir``; ``calibration_error`` comes
from ``--calibration`` (a ``sim.calibrate`` JSON; the benchmark is not run here unless
``--calibrate``).

``--sweep-placement``: one system (``--mode``) at every whole-machine split of ``--gpus``; the
best is the fastest whose staleness stays within ``--staleness-limit``. ``--sensitivity``:
each cost constant +-20% one at a time (``sensitivity.py``). ``--fail machine@T``: kill a
rollout machine at virtual second T in a laminar run of ``--model``/``--gpus`` and report the
dip and the recovery (``faults.py``; ``fail_*`` keys).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from typing import Dict, List, Optional

from .cluster import SIM_MODES
from .costs import DELTA, LINKS, MOE_MODELS, CostModel, cost_for, relay_sync_seconds
from .paper import PAPER, PAPER_OTHER, PAPER_SPLITS, WHY, paper_pairs
from .jobs import run_points as jobs_run_points
from .jobs import sweep_and_measure
from .placement import candidate_trainer_gpus, staleness_max
from .workload import Workload

GRID = {"7B": (16, 32, 64, 128, 256), "32B": (32, 64, 128, 256, 512),
        "72B": (64, 128, 256, 512, 1024)}
# the paper's four baselines (AReaL at eta = infinity, as its throughput runs); AReaL at eta = 4
# is a second, labelled row beside them (``laminar_vs_areal_eta4_*``), in no average
BASELINES = {"verl": "sync", "one_step": "one_step", "stream": "stream", "areal": "areal"}
EXTRA_BASELINES = {"areal_eta4": "areal_eta4"}
SYSTEMS = ("sync", "one_step", "stream", "areal", "areal_eta4", "laminar")
REPACK_POINT = ("32B", 128)  # the paper's repack figure


def run_points(points: List[dict], jobs: int, log=print) -> List[dict]:
    return jobs_run_points(points, jobs, log)


def sweep_and_run(pairs: List[tuple], modes: List[str], args, workload: Workload,
                  overrides: Optional[dict] = None, splits: Optional[Dict[tuple, int]] = None,
                  log=print, measured: bool = True, counts: Optional[dict] = None) -> tuple:
    """Every mode at every (model, gpus) of ``pairs``: the placement sweep (where ``splits``
    does not give the choice; pruned by ``placement.throughput_bound``), then the measured run
    at the chosen split, all on one pool (``jobs.py``). Returns (results, splits); ``counts``
    (a dict) receives the sweep's ``sweep_runs``, ``sweep_pruned``, ``sweep_bound_violations``."""
    base = {"workload": workload, "overrides": overrides}
    groups = [(m, g, mode) for m, g in pairs for mode in modes if mode != "laminar_norepack"]

    def runs(group: tuple, t: int) -> List[dict]:
        if not measured:
            return []
        m, g, mode = group
        spec = dict(base, model=m, gpus=g, split_trainer_gpus=t,
                    iterations=args.warmup + args.measure, warmup=args.warmup)
        out = [dict(spec, mode=mode)]
        if mode == "laminar" and "laminar_norepack" in modes and (
                (m, g) == REPACK_POINT or args.norepack_everywhere):
            out.append(dict(spec, mode="laminar_norepack"))
        return out

    results, chosen, sweep = sweep_and_measure(
        groups, base, dict(splits or {}), runs, args.jobs, args.sweep_iterations,
        args.splits_per_point, args.staleness_limit, workload, log)
    if counts is not None:
        counts.update(sweep)
    log(f"placement sweep: {sweep['sweep_runs']} runs of {args.sweep_iterations} iterations, "
        f"{sweep['sweep_pruned']} splits pruned by their bound; measured runs: {len(results)}")
    return results, chosen


def ratios(results: List[dict]) -> Dict[str, float]:
    """laminar's speedups over each baseline (average and maximum over the points); at <= 64
    GPUs over verl (``laminar_vs_verl_le64_avg``) and over every one of the paper's baselines
    (``laminar_vs_all_le64_avg``, the paper's definition); at each model's largest point over
    the best baseline there, averaged over the models
    (``laminar_vs_best_baseline_largest_avg``)."""
    by = {(r["model"], r["gpus"], r["mode"]): r for r in results}
    out: Dict[str, float] = {}
    le64: List[float] = []
    for name, mode in {**BASELINES, **EXTRA_BASELINES}.items():
        pts = [(g, by[(m, g, "laminar")]["tokens_per_s"] / by[(m, g, mode)]["tokens_per_s"])
               for (m, g, md) in by if md == mode and (m, g, "laminar") in by]
        if pts:
            out[f"laminar_vs_{name}_avg"] = round(statistics.mean(v for _, v in pts), 3)
            out[f"laminar_vs_{name}_max"] = round(max(v for _, v in pts), 3)
            small = [v for g, v in pts if g <= 64]
            if name == "verl" and small:
                out["laminar_vs_verl_le64_avg"] = round(statistics.mean(small), 3)
            if name in BASELINES:
                le64 += small
    if le64:
        out["laminar_vs_all_le64_avg"] = round(statistics.mean(le64), 3)
    largest = []
    for m in sorted({m for m, _, _ in by}):
        g = max(gg for mm, gg, _ in by if mm == m)
        base = [by[(m, g, md)]["tokens_per_s"] for md in BASELINES.values() if (m, g, md) in by]
        if base and (m, g, "laminar") in by:
            largest.append(by[(m, g, "laminar")]["tokens_per_s"] / max(base))
    if largest:
        out["laminar_vs_best_baseline_largest_avg"] = round(statistics.mean(largest), 3)
    return out


def scaling_efficiency(by: Dict[tuple, dict], mode: str, models: List[str]) -> Dict[str, float]:
    """Per model, ``mode``'s per-GPU tokens/s at its largest point over its smallest
    (``<model>``), and their mean (``mean``)."""
    out: Dict[str, float] = {}
    for m in models:
        pts = sorted((g, by[(m, g, mode)]["tokens_per_s"]) for (mm, g, md) in by
                     if mm == m and md == mode)
        if len(pts) >= 2:
            (g0, t0), (g1, t1) = pts[0], pts[-1]
            out[m] = (t1 / g1) / (t0 / g0)
    if out:
        out["mean"] = statistics.mean(out.values())
    return out


def table(results: List[dict], models: List[str]) -> Dict[str, object]:
    """The figures of the report (a flat dict) from the runs."""
    by = {(r["model"], r["gpus"], r["mode"]): r for r in results}
    figures: Dict[str, object] = {}
    for r in results:
        key = f"{r['model']}_{r['gpus']}_{r['mode']}"
        figures[f"tokens_per_s_{key}"] = round(r["tokens_per_s"], 1)
        figures[f"tokens_per_s_spread_{key}"] = round(r["tokens_per_s_spread"], 4)
        figures[f"trainer_gpus_{key}"] = r["trainer_gpus"]
        figures[f"rollout_gpus_{key}"] = r["gpus"] if r["trainer_gpus"] >= r["gpus"] \
            else r["gpus"] - r["trainer_gpus"]
        figures[f"staleness_max_{key}"] = staleness_max(r)
        figures[f"engine_tp_{key}"] = r.get("engine_tp", 0)
        paper = PAPER_SPLITS.get((r["model"], r["gpus"], r["mode"]))
        if paper is not None:
            figures[f"paper_trainer_gpus_{key}"] = paper
    figures.update(ratios(results))
    effs = scaling_efficiency(by, "laminar", models)
    for m in models:
        if m in effs:
            figures[f"scaling_efficiency_{m}"] = round(effs[m], 3)
    if effs:
        figures["scaling_efficiency"] = round(effs["mean"], 3)
    best = [(scaling_efficiency(by, mode, models).get("mean"), name)
            for name, mode in BASELINES.items()]
    best = [b for b in best if b[0] is not None]
    if best:
        figures["scaling_efficiency_best_baseline"] = round(max(best)[0], 3)
        figures["scaling_efficiency_best_baseline_is"] = max(best)[1]
    for (m, g, md), r in sorted(by.items()):
        if md == "laminar" and (m, g, "laminar_norepack") in by:
            off = by[(m, g, "laminar_norepack")]
            key = f"{m}_{g}"
            figures[f"repack_generation_gain_{key}"] = round(
                r["generation_tokens_per_s"] / off["generation_tokens_per_s"] - 1, 3)
            figures[f"repack_tokens_per_s_gain_{key}"] = round(
                r["tokens_per_s"] / off["tokens_per_s"] - 1, 3)
            figures[f"kv_utilisation_repack_{key}"] = round(r["kv_utilisation"], 3)
            figures[f"kv_utilisation_norepack_{key}"] = round(off["kv_utilisation"], 3)
    hist: Dict[int, int] = {}
    for r in results:
        if r["mode"] == "laminar":
            for k, v in r["staleness"].items():
                hist[int(k)] = hist.get(int(k), 0) + v
    if hist:
        total = sum(hist.values())
        figures["staleness_max"] = figures["staleness_max_laminar"] = max(hist)
        figures["staleness_below_3_fraction"] = round(
            sum(v for k, v in hist.items() if k < 3) / total, 4)
        for k in sorted(hist):
            figures[f"staleness_{k}"] = hist[k]
    spreads = [r["tokens_per_s_spread"] for r in results]
    figures["tokens_per_s_spread_max"] = round(max(spreads), 4) if spreads else None
    figures["chain_72b_127_relays_s"] = round(CostModel("72B").chain_s(127), 3)
    figures["publish_32b_s"] = round(CostModel("32B").publish_s(), 3)
    figures["publish_72b_s"] = round(CostModel("72B").publish_s(), 3)
    figures["broadcast_32b_s"] = round(CostModel("32B").broadcast_s(), 3)
    figures["broadcast_72b_s"] = round(CostModel("72B").broadcast_s(), 3)
    figures["network_shared_s"] = round(sum(r["network_shared_s"] for r in results), 3)
    figures.update(weight_sync_figures())
    figures.update(paper_pairs(figures))
    return figures


def weight_sync_figures() -> Dict[str, float]:
    """Weight sync at the MoE sizes. Issue 52's path (``sharded.sharded_figures``: per-rank
    export into striped relays, each rollout node taking its engines' share): ``sync_s_1t``,
    ``sync_s_1t_full``, ``trainer_stall_s_1t``, ``engine_pause_s_1t``,
    ``engine_pause_bound_s_1t``, ``sync_s_235b``, ... The path of today, stage leads into one
    master relay and whole versions at every relay (``costs.relay_sync_seconds``, shapes of
    ``costs.MOE_MODELS``), with and without deltas: ``sync_s_<m>_stage_lead``,
    ``sync_s_<m>_stage_lead_full``, ``sync_s_<m>_stage_lead_at_memory_bandwidth``,
    ``delta_bytes_ratio_assumed``; ``sync_s_<m>_stage_lead_auto`` and
    ``delta_auto_<m>_stage_lead``: what ``weight_sync.delta=auto`` (``weights/delta.py``,
    ``choose_delta``) picks over the publish link, and its sync."""
    import torch

    from ..weights.delta import choose_delta
    from .sharded import sharded_figures

    figures: Dict[str, float] = {}
    for name, m in MOE_MODELS.items():
        key = f"sync_s_{name}_stage_lead"
        for delta, suffix in ((True, ""), (False, "_full")):
            figures[key + suffix] = round(relay_sync_seconds(
                m["params"], m["relays"], delta, pp=m["trainer_pp"]), 3)
        on, _ = choose_delta("auto", torch.bfloat16, model_bytes=int(m["params"] * 2),
                             stages=m["trainer_pp"], link_gbit=LINKS["publish_bytes_s"] * 8 / 1e9,
                             lr=1e-6, encode_bytes_s=DELTA["encode_bytes_s"],
                             apply_bytes_s=DELTA["apply_bytes_s"])
        figures[f"delta_auto_{name}_stage_lead"] = on
        figures[key + "_auto"] = figures[key if on else key + "_full"]
        # encode and rebuild spread over a host's cores, up to its memory bandwidth
        figures[key + "_at_memory_bandwidth"] = round(relay_sync_seconds(
            m["params"], m["relays"], True, pp=m["trainer_pp"],
            encode_bytes_s=DELTA["host_bytes_s"], apply_bytes_s=DELTA["host_bytes_s"]), 3)
    figures["delta_bytes_ratio_assumed"] = DELTA["bytes_ratio"]
    figures.update(sharded_figures())
    return figures


def plot(results: List[dict], models: List[str], out_dir: str) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for m in models:
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode in SIM_MODES:
            pts = sorted((r["gpus"], r["tokens_per_s"]) for r in results
                         if r["model"] == m and r["mode"] == mode)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("trainer tokens/s (simulated)")
        ax.set_title(f"Qwen2.5-{m}, DAPO-Math-like lengths")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        path = os.path.join(out_dir, f"sim_tokens_per_s_{m}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def sweep_placement(model: str, gpus: int, iterations: int, jobs: int, workload: Workload,
                    staleness_limit: int, splits: int = 8, log=print,
                    mode: str = "laminar") -> Dict[str, object]:
    """``mode`` at up to ``splits`` whole-machine splits of ``gpus`` (placement.py)."""
    cost = cost_for(model, mode)
    cands = candidate_trainer_gpus(mode, gpus, cost, splits)
    if gpus // 8 < 2:
        raise SystemExit("--sweep-placement splits whole machines of 8 GPUs: "
                         "give --gpus of at least 16")
    results = run_points([dict(model=model, mode=mode, gpus=gpus, iterations=iterations,
                               workload=workload, split_trainer_gpus=t) for t in cands],
                         jobs, log)
    from .placement import best as best_of
    from .cluster import placement_for
    best = best_of(results, staleness_limit)
    figures = {"model": model, "gpus": gpus, "mode": mode,
               "best_trainer_gpus": best["trainer_gpus"],
               "best_rollout_gpus": gpus - best["trainer_gpus"] if best["trainer_gpus"] < gpus
               else gpus,
               "best_tokens_per_s": round(best["tokens_per_s"], 1),
               "best_staleness_max": staleness_max(best),
               "balanced_trainer_gpus": placement_for("laminar", gpus, cost, None,
                                                      workload).trainer_gpus}
    fastest = max(results, key=lambda r: r["tokens_per_s"])
    figures["fastest_trainer_gpus"] = fastest["trainer_gpus"]
    figures["fastest_tokens_per_s"] = round(fastest["tokens_per_s"], 1)
    for r in results:
        figures[f"tokens_per_s_trainer_{r['trainer_gpus']}"] = round(r["tokens_per_s"], 1)
        figures[f"staleness_max_trainer_{r['trainer_gpus']}"] = staleness_max(r)
    return figures


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--warmup", type=int, default=10, help="iterations before the measured")
    ap.add_argument("--measure", type=int, default=5, help="iterations measured")
    ap.add_argument("--iterations", type=int, default=None,
                    help="--sweep-placement / --fail: iterations of each run")
    ap.add_argument("--sweep-iterations", type=int, default=5,
                    help="iterations of each placement-sweep run (the first is warm-up)")
    ap.add_argument("--splits-per-point", type=int, default=5,
                    help="whole-machine splits the per-point sweep tries")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--models", default="7B,32B,72B")
    ap.add_argument("--gpus-max", type=int, default=1024, help="skip larger placements")
    ap.add_argument("--points", default=None,
                    help="model@gpus,... instead of the whole grid of --models")
    ap.add_argument("--modes", default=",".join(SIM_MODES))
    ap.add_argument("--norepack-everywhere", action="store_true",
                    help="laminar_norepack at every point (default: 32B on 128 GPUs only)")
    ap.add_argument("--batch-prompts", type=int, default=512)
    ap.add_argument("--plot-dir", default=os.path.join("outputs", "sim"))
    ap.add_argument("--calibration", default=None, help="sim.calibrate's JSON to reuse")
    ap.add_argument("--no-calibrate", action="store_true", help="(the default; kept)")
    ap.add_argument("--calibrate", action="store_true", help="run the sim.calibrate benchmark")
    ap.add_argument("--sweep-placement", action="store_true")
    ap.add_argument("--mode", default="laminar", help="--sweep-placement: the system")
    ap.add_argument("--model", default="32B")
    ap.add_argument("--gpus", type=int, default=256)
    ap.add_argument("--staleness-limit", type=int, default=4)
    ap.add_argument("--splits", type=int, default=8, help="placements --sweep-placement tries")
    ap.add_argument("--sensitivity", action="store_true")
    ap.add_argument("--sensitivity-points", default="7B@256,32B@128",
                    help="model@gpus,... the --sensitivity runs use")
    ap.add_argument("--constants", default=None,
                    help="--sensitivity: TABLE.key,... to vary (default: every constant)")
    ap.add_argument("--placements", default=None,
                    help="a report JSON whose trainer_gpus_* choices to reuse (no sweep)")
    ap.add_argument("--fail", default=None, help="machine@T: kill that rollout machine at T")
    ap.add_argument("--explain", action="store_true",
                    help="also run laminar at each model's smallest and largest point without "
                         "the trainer's step costs, at its most stale point with a buffer of "
                         "one batch, and with and without repack with prefill free "
                         "(explain_* keys)")
    return ap


def main(argv=None) -> dict:
    ap = _parser()
    args = ap.parse_args(argv)
    workload = Workload(batch_prompts=args.batch_prompts)
    t0 = time.perf_counter()
    if args.sweep_placement:
        if args.model not in GRID:
            ap.error(f"--model must be one of {', '.join(GRID)}")
        figures = sweep_placement(args.model, args.gpus, args.iterations or 10, args.jobs,
                                  workload, args.staleness_limit, args.splits, mode=args.mode)
        figures["wall_s"] = round(time.perf_counter() - t0, 1)
        print(f"best split for {args.mode} at {args.model} on {args.gpus} GPUs: trainer "
              f"{figures['best_trainer_gpus']}, rollouts {figures['best_rollout_gpus']} -> "
              f"{figures['best_tokens_per_s']:,.0f} tokens/s, staleness max "
              f"{figures['best_staleness_max']} (<= --staleness-limit "
              f"{args.staleness_limit}); fastest at any staleness: trainer "
              f"{figures['fastest_trainer_gpus']} -> {figures['fastest_tokens_per_s']:,.0f} "
              f"tokens/s; balanced estimate: trainer {figures['balanced_trainer_gpus']}")
        _write(args.json, figures)
        return figures
    if args.fail:
        from .extras import failure_run
        figures = failure_run(args, workload, sys.modules[__name__])  # (no import circle)
        figures["wall_s"] = round(time.perf_counter() - t0, 1)
        _write(args.json, figures)
        return figures
    if args.sensitivity:
        from .extras import sensitivity_run
        figures = sensitivity_run(args, workload, sys.modules[__name__])
        figures["wall_s"] = round(time.perf_counter() - t0, 1)
        _write(args.json, figures)
        return figures
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in GRID]
    if unknown:
        ap.error(f"unknown models {unknown}: choose from {', '.join(GRID)}")
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in SIM_MODES]
    if bad:
        ap.error(f"unknown modes {bad}: choose from {', '.join(SIM_MODES)}")
    pairs = [(m, g) for m in models for g in GRID[m] if g <= args.gpus_max]
    if args.points:
        pairs = [(p.split("@")[0], int(p.split("@")[1])) for p in args.points.split(",")]
        models = [m for m in models if any(pm == m for pm, _ in pairs)]
    counts: Dict[str, int] = {}
    results, _ = sweep_and_run(pairs, modes, args, workload, splits=load_splits(args),
                               counts=counts)
    figures = table(results, models)
    figures.update(counts)
    if args.explain:
        from .extras import explain
        figures.update(explain(args, workload, sys.modules[__name__], results, models))
    figures["jobs"] = args.jobs
    figures["warmup_iterations"] = args.warmup
    figures["measured_iterations"] = args.measure
    figures["calibration_error"] = calibration_error(args)
    figures["wall_s"] = round(time.perf_counter() - t0, 1)
    figures["cpu_s"] = cpu_seconds()
    print_report(figures, models, results)
    for path in plot(results, models, args.plot_dir):
        print(f"plot: {path}")
    _write(args.json, figures)
    return figures


def load_splits(args) -> Optional[Dict[tuple, int]]:
    """``--placements``: the trainer_gpus_<model>_<gpus>_<mode> choices of a report JSON."""
    if not args.placements:
        return None
    with open(args.placements) as f:
        stored = json.load(f)
    out = {}
    for k, v in stored.items():
        if k.startswith("trainer_gpus_"):
            m, g, mode = k[len("trainer_gpus_"):].split("_", 2)
            out[(m, int(g), mode)] = int(v)
    return out


def calibration_error(args) -> Optional[float]:
    """From ``--calibration``'s JSON; the live benchmark only with ``--calibrate``."""
    if args.calibration:
        with open(args.calibration) as f:
            return json.load(f)["calibration_error"]
    if not args.calibrate:
        return None
    from .calibrate import main as calibrate
    return calibrate([])["calibration_error"]


def print_report(figures: dict, models: List[str], results: List[dict]) -> None:
    print("\ntokens/s (prompt + response tokens per second between trainer updates; "
          "trainer GPUs in brackets):")
    for m in models:
        gpus = sorted({r["gpus"] for r in results if r["model"] == m})
        print(f"  {m:4s} " + "".join(f"{g:>16d}" for g in gpus))
        for mode in SIM_MODES:
            row = [(figures.get(f"tokens_per_s_{m}_{g}_{mode}"),
                    figures.get(f"trainer_gpus_{m}_{g}_{mode}")) for g in gpus]
            if any(v is not None for v, _ in row):
                print(f"    {mode:16s}" + "".join(
                    f"{v:>10,.0f} [{t:>4d}]" if v is not None else f"{'-':>16s}"
                    for v, t in row))
    print("\nbeside Laminar's published figures:")
    for name in PAPER:
        why = next((w for k, w in WHY.items() if name.startswith(k)), "")
        print(f"  {name}: sim {figures.get(f'sim_{name}')} paper {PAPER[name]} "
              f"(error {figures.get(f'rel_error_{name}')}) -- {why}")
    for key in ("paper_max_rel_error", "paper_max_rel_error_maxima"):
        print(f"  {key}: {figures.get(key)} over {figures.get(f'{key}_pairs')}")
    print(f"  staleness_max_laminar: {figures.get('staleness_max_laminar')} (paper: < 4)")
    print(f"  publish stall: 32B {figures['publish_32b_s']} s, 72B {figures['publish_72b_s']} s "
          f"(paper {PAPER_OTHER['publish_32b_s']} / {PAPER_OTHER['publish_72b_s']} s: the "
          f"publish link is fitted to them); NCCL broadcast 32B {figures['broadcast_32b_s']} s, "
          f"72B {figures['broadcast_72b_s']} s")
    if "sync_s_1t" in figures:
        print(f"  weight sync, striped per-rank path (issue 52): 235B {figures['sync_s_235b']} s, "
              f"1T {figures['sync_s_1t']} s (trainer stall {figures['trainer_stall_s_1t']} s, "
              f"engine pause {figures['engine_pause_s_1t']} s, bound "
              f"{figures['engine_pause_bound_s_1t']} s); stage leads into one master: 235B "
              f"{figures['sync_s_235b_stage_lead_full']} s, 1T "
              f"{figures['sync_s_1t_stage_lead_full']} s whole (deltas at ratio "
              f"{figures['delta_bytes_ratio_assumed']:g}: {figures['sync_s_1t_stage_lead']} s)")
    hist = {k: v for k, v in figures.items() if k.startswith("staleness_") and k[10:].isdigit()}
    print(f"  staleness histogram (laminar, measured iterations): {hist}")
    print(f"  calibration_error: {figures['calibration_error']}")


def cpu_seconds() -> float:
    """CPU seconds of this process and its finished workers (the pool's, once shut down)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return round(own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime, 1)


def _write(path: Optional[str], figures: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
