"""The simulator's table, laid beside Laminar's published results.

    python -m laminar_mcore.sim.report --json out.json [--iterations 10] [--jobs 2]
        [--models 7B,32B,72B] [--plot-dir outputs/sim] [--calibration calib.json | --no-calibrate]
    python -m laminar_mcore.sim.report --sweep-placement --model 32B --gpus 256 [--json out.json]

Runs every mode at 7B (16-256 GPUs), 32B (32-512) and 72B (64-1,024) on the DAPO-Math-like
workload (512 prompts x 16 per step) and prints tokens/s per mode, laminar's speedups over
each baseline (average and maximum over the points), laminar's scaling efficiency, the
staleness histogram, repack's effect on generation throughput and KV utilisation, and the
publish and chain seconds -- each beside the paper's figure, with why they differ -- and the
weight sync of two MoE shapes through the relay tier with and without deltas
(``costs.relay_sync_seconds``: ``sync_s_235b``, ``sync_s_1t``, ``*_full``). PNG plots
of tokens/s against GPUs per model go to ``--plot-dir``. ``calibration_error`` comes from
``sim.calibrate`` (run here unless ``--calibration`` names its JSON or ``--no-calibrate``).

``--sweep-placement`` answers "how should I split N GPUs between trainer and rollouts": it
runs laminar at every whole-machine split and names the one with the most tokens/s whose
staleness stays within ``--staleness-limit``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from typing import Dict, List, Optional

from .cluster import GPUS_PER_MACHINE, SIM_MODES, SimConfig, placement_for, simulate, summary_line
from .costs import DELTA, MOE_MODELS, CostModel, relay_sync_seconds
from .workload import Workload

GRID = {"7B": (16, 32, 64, 128, 256), "32B": (32, 64, 128, 256, 512),
        "72B": (64, 128, 256, 512, 1024)}
BASELINES = {"verl": "sync", "one_step": "one_step", "stream": "stream", "areal": "areal"}
# Laminar (arXiv 2510.12633), section 7: speedups in training tokens/s over each baseline,
# averaged over (and the maximum of) its strong-scaling points; see ../shared/REFERENCES.md.
PUBLISHED = {"laminar_vs_verl": (2.56, 5.49), "laminar_vs_one_step": (1.98, 4.09),
             "laminar_vs_stream": (1.93, 4.06), "laminar_vs_areal": (1.39, 1.81),
             "scaling_efficiency": 0.537, "repack_generation_gain": 0.26,
             "kv_utilisation_norepack": 0.716, "kv_utilisation_repack": 0.822,
             "chain_72b_127_relays_s": 1.6, "publish_32b_s": 0.64, "publish_72b_s": 1.40,
             "staleness_max": 4}
WHY = {
    "laminar_vs_verl": "our verl is colocated (every GPU generates, then every GPU trains, then "
                       "reshards in place) on the same engine and trainer costs; at the smallest "
                       "placements it beats the disaggregated modes (whole machines leave too "
                       "few rollout GPUs), at the largest it waits on one 16K-token tail per "
                       "batch; the paper's verl also pays framework overheads we do not charge",
    "laminar_vs_one_step": "one-step keeps a global barrier per batch, so its engines idle on "
                           "the longest trajectory of each batch; ours gives it the same "
                           "balanced placement as laminar, which starves it of rollout GPUs",
    "laminar_vs_stream": "stream generation trains on quarter batches as they complete but "
                         "keeps the barrier: within 1% of one-step here, 3% in the paper",
    "laminar_vs_areal": "AReaL's interruptible generation (eta 4) also never waits on a tail; "
                        "it loses the KV recompute of every interrupted request and its bound, "
                        "which costs most where weights change often (small models, many GPUs)",
    "scaling_efficiency": "per-GPU tokens/s at the largest vs the smallest placement; ours is "
                          "higher because the smallest placements (whole machines) are the "
                          "least balanced, and we charge no network contention or stragglers",
    "repack_generation_gain": "generated tokens per busy engine-second with vs without repack; "
                              "the gain follows how many engines wait on a few long requests",
    "chain_72b_127_relays_s": "T(p, k) at the best k with 200 GB/s relay links and 1 ms per "
                              "chunk (costs.LINKS)",
    "staleness_max": "laminar runs unbounded; where an iteration (26-85 s at 7B and 72B on the "
                     "most GPUs) is much shorter than one 16K-token generation (130-450 s), "
                     "that trajectory is 5-9 versions old when consumed; the paper's iterations "
                     "were longer. 10 iterations are also too few for a steady state there, "
                     "so consumed tokens/s at 7B >= 128 GPUs is a transient (repack can lower "
                     "it while raising generation throughput)",
}


def _one(args) -> dict:
    model, mode, gpus, iterations, fraction, workload = args
    r = simulate(SimConfig(model=model, mode=mode, gpus=gpus, iterations=iterations,
                           trainer_fraction=fraction, workload=workload))
    return asdict(r)


def run_points(points: List[tuple], jobs: int, log=print) -> List[dict]:
    results = []
    if jobs <= 1:
        for p in points:
            results.append(_one(p))
            log(_line(results[-1]))
        return results
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for r in pool.map(_one, points):
            results.append(r)
            log(_line(r))
    return results


def _line(r: dict) -> str:
    from .cluster import SimResult
    return summary_line(SimResult(**r))


def table(results: List[dict], models: List[str]) -> Dict[str, object]:
    """The figures of the report (a flat dict) from the runs."""
    by = {(r["model"], r["gpus"], r["mode"]): r for r in results}
    figures: Dict[str, object] = {}
    for r in results:
        figures[f"tokens_per_s_{r['model']}_{r['gpus']}_{r['mode']}"] = round(r["tokens_per_s"], 1)
    for name, mode in BASELINES.items():
        ratios = [by[(m, g, "laminar")]["tokens_per_s"] / by[(m, g, mode)]["tokens_per_s"]
                  for (m, g, md) in by if md == mode and (m, g, "laminar") in by]
        if ratios:
            figures[f"laminar_vs_{name}_avg"] = round(statistics.mean(ratios), 3)
            figures[f"laminar_vs_{name}_max"] = round(max(ratios), 3)
    effs = []
    for m in models:
        pts = sorted((g, by[(m, g, "laminar")]["tokens_per_s"]) for (mm, g, md) in by
                     if mm == m and md == "laminar")
        if len(pts) >= 2:
            (g0, t0), (g1, t1) = pts[0], pts[-1]
            eff = (t1 / g1) / (t0 / g0)
            figures[f"scaling_efficiency_{m}"] = round(eff, 3)
            effs.append(eff)
    if effs:
        figures["scaling_efficiency"] = round(statistics.mean(effs), 3)
    gains, kv_on, kv_off = [], [], []
    for (m, g, md), r in by.items():
        if md == "laminar" and (m, g, "laminar_norepack") in by:
            off = by[(m, g, "laminar_norepack")]
            gains.append(r["generation_tokens_per_s"] / off["generation_tokens_per_s"] - 1)
            kv_on.append(r["kv_utilisation"])
            kv_off.append(off["kv_utilisation"])
    if gains:
        figures["repack_generation_gain"] = round(statistics.mean(gains), 3)
        figures["repack_generation_gain_max"] = round(max(gains), 3)
        figures["kv_utilisation_repack"] = round(statistics.mean(kv_on), 3)
        figures["kv_utilisation_norepack"] = round(statistics.mean(kv_off), 3)
    hist: Dict[int, int] = {}
    for r in results:
        if r["mode"] == "laminar":
            for k, v in r["staleness"].items():
                hist[int(k)] = hist.get(int(k), 0) + v
    if hist:
        total = sum(hist.values())
        figures["staleness_max"] = max(hist)
        figures["staleness_below_3_fraction"] = round(
            sum(v for k, v in hist.items() if k < 3) / total, 4)
        for k in sorted(hist):
            figures[f"staleness_{k}"] = hist[k]
    figures["chain_72b_127_relays_s"] = round(CostModel("72B").chain_s(127), 3)
    figures["publish_32b_s"] = round(CostModel("32B").publish_s(), 3)
    figures["publish_72b_s"] = round(CostModel("72B").publish_s(), 3)
    figures.update(weight_sync_figures())
    return figures


def weight_sync_figures() -> Dict[str, float]:
    """Weight sync through the relay tier with and without delta publication, for the MoE
    shapes of ``costs.MOE_MODELS`` (``costs.relay_sync_seconds``): ``sync_s_235b``,
    ``sync_s_235b_full``, ``sync_s_1t``, ``sync_s_1t_full``, ``sync_s_*_at_memory_bandwidth``,
    ``delta_bytes_ratio_assumed``."""
    figures: Dict[str, float] = {}
    for name, m in MOE_MODELS.items():
        for delta, suffix in ((True, ""), (False, "_full")):
            figures[f"sync_s_{name}{suffix}"] = round(relay_sync_seconds(
                m["params"], m["relays"], delta, pp=m["trainer_pp"]), 3)
        # encode and rebuild spread over a host's cores, up to its memory bandwidth
        figures[f"sync_s_{name}_at_memory_bandwidth"] = round(relay_sync_seconds(
            m["params"], m["relays"], True, pp=m["trainer_pp"],
            encode_bytes_s=DELTA["host_bytes_s"], apply_bytes_s=DELTA["host_bytes_s"]), 3)
    figures["delta_bytes_ratio_assumed"] = DELTA["bytes_ratio"]
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
                    staleness_limit: int, splits: int = 8, log=print) -> Dict[str, object]:
    """Laminar at up to ``splits`` whole-machine splits of ``gpus`` (evenly spaced)."""
    cost = CostModel(model)
    machines = gpus // GPUS_PER_MACHINE
    if machines < 2:
        raise SystemExit(f"--sweep-placement splits whole machines of {GPUS_PER_MACHINE} GPUs: "
                         f"give --gpus of at least {2 * GPUS_PER_MACHINE}")
    fractions, seen = [], set()
    n = min(splits, machines - 1)
    for t in sorted({round(1 + i * (machines - 2) / max(n - 1, 1)) for i in range(n)}):
        place = placement_for("laminar", gpus, cost, t / machines, workload)
        if place.rollout_gpus >= cost.engine_tp and place.trainer_gpus not in seen:
            seen.add(place.trainer_gpus)
            fractions.append(t / machines)
    results = run_points([(model, "laminar", gpus, iterations, f, workload) for f in fractions],
                         jobs, log)
    ok = [r for r in results if max(map(int, r["staleness"]), default=0) <= staleness_limit]
    best = max(ok or results, key=lambda r: r["tokens_per_s"])
    figures = {"model": model, "gpus": gpus, "best_trainer_gpus": best["trainer_gpus"],
               "best_rollout_gpus": gpus - best["trainer_gpus"],
               "best_tokens_per_s": round(best["tokens_per_s"], 1),
               "best_staleness_max": max(map(int, best["staleness"]), default=0),
               "balanced_trainer_gpus": placement_for("laminar", gpus, cost, None,
                                                      workload).trainer_gpus}
    fastest = max(results, key=lambda r: r["tokens_per_s"])
    figures["fastest_trainer_gpus"] = fastest["trainer_gpus"]
    figures["fastest_tokens_per_s"] = round(fastest["tokens_per_s"], 1)
    for r in results:
        figures[f"tokens_per_s_trainer_{r['trainer_gpus']}"] = round(r["tokens_per_s"], 1)
        figures[f"staleness_max_trainer_{r['trainer_gpus']}"] = max(map(int, r["staleness"]),
                                                                    default=0)
    return figures


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--models", default="7B,32B,72B")
    ap.add_argument("--gpus-max", type=int, default=1024, help="skip larger placements")
    ap.add_argument("--modes", default=",".join(SIM_MODES))
    ap.add_argument("--batch-prompts", type=int, default=512)
    ap.add_argument("--plot-dir", default=os.path.join("outputs", "sim"))
    ap.add_argument("--calibration", default=None, help="sim.calibrate's JSON to reuse")
    ap.add_argument("--no-calibrate", action="store_true")
    ap.add_argument("--sweep-placement", action="store_true")
    ap.add_argument("--model", default="32B")
    ap.add_argument("--gpus", type=int, default=256)
    ap.add_argument("--staleness-limit", type=int, default=4)
    ap.add_argument("--splits", type=int, default=8, help="placements the sweep tries")
    args = ap.parse_args(argv)
    workload = Workload(batch_prompts=args.batch_prompts)
    t0 = time.perf_counter()
    if args.sweep_placement:
        if args.model not in GRID:
            ap.error(f"--model must be one of {', '.join(GRID)}")
        figures = sweep_placement(args.model, args.gpus, args.iterations, args.jobs, workload,
                                  args.staleness_limit, args.splits)
        figures["wall_s"] = round(time.perf_counter() - t0, 1)
        print(f"best split for {args.model} on {args.gpus} GPUs: trainer "
              f"{figures['best_trainer_gpus']}, rollouts {figures['best_rollout_gpus']} -> "
              f"{figures['best_tokens_per_s']:,.0f} tokens/s, staleness max "
              f"{figures['best_staleness_max']} (<= --staleness-limit "
              f"{args.staleness_limit}); fastest at any staleness: trainer "
              f"{figures['fastest_trainer_gpus']} -> {figures['fastest_tokens_per_s']:,.0f} "
              f"tokens/s; balanced estimate: trainer {figures['balanced_trainer_gpus']}")
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
    points = [(m, mode, g, args.iterations, None, workload) for m in models for g in GRID[m]
              if g <= args.gpus_max for mode in modes]
    results = run_points(points, args.jobs)
    figures = table(results, models)
    figures["iterations"] = args.iterations
    figures["calibration_error"] = calibration_error(args)
    figures["wall_s"] = round(time.perf_counter() - t0, 1)
    print_report(figures, models, results)
    for path in plot(results, models, args.plot_dir):
        print(f"plot: {path}")
    _write(args.json, figures)
    return figures


def calibration_error(args) -> Optional[float]:
    if args.calibration:
        with open(args.calibration) as f:
            return json.load(f)["calibration_error"]
    if args.no_calibrate:
        return None
    from .calibrate import main as calibrate
    return calibrate([])["calibration_error"]


def print_report(figures: dict, models: List[str], results: List[dict]) -> None:
    print("\ntokens/s (trainer-consumed response tokens, steady state):")
    for m in models:
        gpus = sorted({r["gpus"] for r in results if r["model"] == m})
        print(f"  {m:4s} " + "".join(f"{g:>10d}" for g in gpus))
        for mode in SIM_MODES:
            row = [figures.get(f"tokens_per_s_{m}_{g}_{mode}") for g in gpus]
            if any(v is not None for v in row):
                print(f"    {mode:16s}" + "".join(
                    f"{v:>10,.0f}" if v is not None else f"{'-':>10s}" for v in row))
    print("\nbeside Laminar's published figures:")
    for key, why in WHY.items():
        pub = PUBLISHED.get(key)
        if key.startswith("laminar_vs_"):
            if f"{key}_avg" not in figures:
                continue
            print(f"  {key}: {figures[f'{key}_avg']:.2f}x avg / {figures[f'{key}_max']:.2f}x max "
                  f"(paper {pub[0]:.2f}x / {pub[1]:.2f}x) -- {why}")
        elif key in figures:
            print(f"  {key}: {figures[key]} (paper {pub}) -- {why}")
    if "kv_utilisation_repack" in figures:
        print(f"  kv_utilisation: {figures['kv_utilisation_norepack']:.1%} -> "
              f"{figures['kv_utilisation_repack']:.1%} with repack (paper 71.6% -> 82.2%)")
    print(f"  publish stall: 32B {figures['publish_32b_s']} s, 72B {figures['publish_72b_s']} s "
          f"(paper 0.64 / 1.40 s: the publish link is fitted to them, costs.LINKS)")
    if "sync_s_1t" in figures:
        print(f"  weight sync to every relay (costs.relay_sync_seconds, delta ratio "
              f"{figures['delta_bytes_ratio_assumed']:g}): 235B {figures['sync_s_235b']} s "
              f"(whole {figures['sync_s_235b_full']} s), 1T {figures['sync_s_1t']} s (whole "
              f"{figures['sync_s_1t_full']} s; goal <= 3 s with deltas)")
    hist = {k: v for k, v in figures.items() if k.startswith("staleness_") and k[10:].isdigit()}
    print(f"  staleness histogram (laminar): {hist} (paper: mostly < 3, max 4)")
    print(f"  calibration_error: {figures['calibration_error']}")


def _write(path: Optional[str], figures: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
