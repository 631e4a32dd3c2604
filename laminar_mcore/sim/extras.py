"""``sim.report``'s other questions: how far its constants can move the headline ratios
(``--sensitivity``), what a machine failure costs (``--fail machine@T``) and how much of the
scaling efficiency the trainer's step costs account for (``--explain``)."""

from __future__ import annotations

import json
from typing import Dict, List, Optional

from .faults import parse_fail
from .sensitivity import spread, unread, variants
from .workload import Workload

HEADLINE = ("laminar_vs_verl_avg", "laminar_vs_one_step_avg", "laminar_vs_stream_avg",
            "laminar_vs_areal_avg")


def _pairs(text: str) -> List[tuple]:
    out = []
    for item in text.split(","):
        m, g = item.split("@")
        out.append((m, int(g)))
    return out


def sensitivity_run(args, workload: Workload, report, log=print) -> Dict[str, object]:
    """Every system at the ``--sensitivity-points`` (their splits from ``--placements`` or a
    sweep with the base constants), then again with each constant at -20% and +20%.
    ``report``: the ``sim.report`` module, passed in so that the two do not import each other."""
    pairs = _pairs(args.sensitivity_points)
    # the systems the headline ratios read (AReaL's eta = 4 row is in none of them)
    read = {mode for b, mode in report.BASELINES.items() if f"laminar_vs_{b}_avg" in HEADLINE}
    systems = [m for m in report.SYSTEMS if m == "laminar" or m in read]
    iterations = args.iterations or args.warmup + args.measure
    warmup = min(args.warmup, iterations - 1)
    _, splits = report.sweep_and_run(pairs, systems, args, workload,
                                     splits=report.load_splits(args),
                                     log=log, measured=False)
    base_ratios: Dict[str, float] = {}
    specs, keys = [], []
    names = [c for c in (args.constants or "").split(",") if c] or None
    for i, override in enumerate([None] + variants(names=names)):
        for m, g in pairs:
            for mode in systems:
                specs.append(dict(model=m, mode=mode, gpus=g, workload=workload,
                                  iterations=iterations, warmup=warmup, overrides=override,
                                  split_trainer_gpus=splits.get((m, g, mode))))
                keys.append(i)
    # a variant of a weight protocol's constants cannot move a run of another protocol: such a
    # run is the base run (sensitivity.unread), taken from it instead of simulated again
    reuse = [unread(spec["overrides"], _protocol(spec), spec["mode"], spec["model"])
             for spec in specs]
    todo = [spec for spec, r in zip(specs, reuse) if not r]
    log(f"sensitivity: {len(todo)} runs of {iterations} iterations "
        f"({len(specs) - len(todo)} others are their base run: a constant of another "
        f"weight protocol, another system's eta, an engine TP the clamp keeps)")
    done = iter(report.run_points(todo, args.jobs, log))
    base_runs = {}
    results = []
    for spec, r in zip(specs, reuse):
        if r:
            results.append(dict(base_runs[(spec["model"], spec["gpus"], spec["mode"])],
                                overrides=spec["overrides"]))
        else:
            results.append(next(done))
            if spec["overrides"] is None:
                base_runs[(spec["model"], spec["gpus"], spec["mode"])] = results[-1]
    groups: Dict[int, List[dict]] = {}
    for k, r in zip(keys, results):
        groups.setdefault(k, []).append(r)
    runs = []
    for k, rs in sorted(groups.items()):
        override = rs[0]["overrides"]
        values = {n: v for n, v in report.ratios(rs).items() if n in HEADLINE}
        if override is None:
            base_ratios = values
        else:
            runs.append((override, values))
    figures: Dict[str, object] = {"sensitivity_points": args.sensitivity_points,
                                  "sensitivity_iterations": iterations,
                                  "sensitivity_factor": 0.2, "sensitivity_runs": len(todo),
                                  "sensitivity_reused": len(specs) - len(todo)}
    for (m, g, mode), t in sorted(splits.items()):
        figures[f"trainer_gpus_{m}_{g}_{mode}"] = t
    figures.update(spread(base_ratios, runs))
    for ratio in HEADLINE:
        if f"{ratio}_min" in figures:
            print(f"{ratio}: {figures[f'{ratio}_base']} ({figures[f'{ratio}_min']} .. "
                  f"{figures[f'{ratio}_max']} with one constant +-20%; most: "
                  f"{figures[f'{ratio}_most_sensitive_to']})")
    return figures


def _protocol(spec: dict) -> str:
    """The weight protocol a sensitivity run uses (``cluster.protocol_of``)."""
    from .cluster import placement_for, protocol_of
    from .costs import cost_for
    from .sensitivity import with_settings

    spec = with_settings(spec, spec["overrides"])
    place = placement_for(spec["mode"], spec["gpus"], cost_for(spec["model"], spec["mode"],
                                                               spec.get("engine_tp")), None,
                          spec["workload"], spec["split_trainer_gpus"])
    return protocol_of(spec["mode"], place, False, True)


def failure_run(args, workload: Workload, report, log=print) -> Dict[str, object]:
    """``--mode`` (laminar) at ``--model`` / ``--gpus`` with one rollout machine killed."""
    import logging

    # every stream of the dead machine says so once: the run's own lines are what matters
    logging.getLogger("laminar_mcore.controller.manager").setLevel(logging.ERROR)
    machine, at = parse_fail(args.fail)
    splits = report.load_splits(args) or {}
    t = splits.get((args.model, args.gpus, args.mode))
    spec = dict(model=args.model, mode=args.mode, gpus=args.gpus, workload=workload,
                iterations=args.iterations or 4, warmup=1, split_trainer_gpus=t,
                fail=(machine, at))
    r = report.run_points([spec], 1, log)[0]
    figures = {"model": args.model, "gpus": args.gpus, "mode": args.mode,
               "trainer_gpus": r["trainer_gpus"], **(r["failure"] or {})}
    print(json.dumps(figures, indent=1))
    return figures


# The trainer's step costs switched off (costs.TRAINER): no exposed collectives, no fixed cost,
# an optimizer step at a million times the HBM bandwidth (microseconds)
NO_STEP_COSTS = {"TRAINER.dp_exposed": 0.0, "TRAINER.step_fixed_s": 0.0,
                 "TRAINER.optimizer_bandwidth": 1e6}


def explain(args, workload: Workload, report, results: List[dict],
            models: List[str], log=print) -> Dict[str, object]:
    """``--explain``: the runs that show which modelled term accounts for a figure, on one
    pool. ``explain_scaling``'s, then laminar at its most stale point again with a buffer of
    one batch (``explain_staleness``), then laminar with and without repack where the table
    has both, with prefill free (``explain_repack``)."""
    scaling = _scaling_specs(args, workload, results, models)
    most_stale = _most_stale(results)
    stale = _staleness_specs(args, workload, most_stale)
    repack = _repack_specs(args, workload, results)
    runs = report.run_points(scaling + stale + repack, args.jobs, log)
    out = explain_scaling(report, runs[:len(scaling)], models)
    out.update(explain_staleness(most_stale, runs[len(scaling):len(scaling) + len(stale)]))
    out.update(staleness_floor(results, workload))
    out.update(explain_repack(runs[len(scaling) + len(stale):]))
    return out


def _scaling_specs(args, workload: Workload, results: List[dict],
                   models: List[str]) -> List[dict]:
    by = {(r["model"], r["gpus"]): r for r in results if r["mode"] == "laminar"}
    specs = []
    for m in models:
        gpus = sorted(g for mm, g in by if mm == m)
        for g in sorted({gpus[0], gpus[-1]}) if len(gpus) >= 2 else ():
            specs.append(dict(model=m, mode="laminar", gpus=g, workload=workload,
                              split_trainer_gpus=by[(m, g)]["trainer_gpus"],
                              iterations=args.warmup + args.measure, warmup=args.warmup,
                              overrides=dict(NO_STEP_COSTS)))
    return specs


def explain_scaling(report, runs: List[dict], models: List[str]) -> Dict[str, object]:
    """Laminar again at each model's smallest and largest point of the table, at the same
    splits and iterations, without the trainer's step costs (``NO_STEP_COSTS``):
    ``explain_scaling_efficiency_without_step_costs`` (and per model) beside
    ``scaling_efficiency``, the run that shows how much of the efficiency those costs take."""
    effs = report.scaling_efficiency({(r["model"], r["gpus"], "laminar"): r for r in runs},
                                     "laminar", models)
    out: Dict[str, object] = {f"explain_scaling_efficiency_without_step_costs_{m}": round(v, 3)
                              for m, v in effs.items() if m != "mean"}
    if "mean" in effs:
        out["explain_scaling_efficiency_without_step_costs"] = round(effs["mean"], 3)
    for r in runs:
        out[f"explain_tokens_per_s_without_step_costs_{r['model']}_{r['gpus']}"] = round(
            r["tokens_per_s"], 1)
    return out


# explain_staleness's buffer: one batch (rollout.max_buffered_batches; the table's is 8)
EXPLAIN_BUFFER_BATCHES = 1


def _most_stale(results: List[dict]) -> Optional[dict]:
    """Laminar's measured run with the most stale trajectory (the largest point of a tie)."""
    runs = [r for r in results if r["mode"] == "laminar" and r["staleness"]]
    return max(runs, key=lambda r: (max(map(int, r["staleness"])), r["gpus"]), default=None)


def _staleness_specs(args, workload: Workload, r: Optional[dict]) -> List[dict]:
    if r is None:
        return []
    return [dict(model=r["model"], mode="laminar", gpus=r["gpus"], workload=workload,
                 split_trainer_gpus=r["trainer_gpus"], iterations=args.warmup + args.measure,
                 warmup=args.warmup, max_buffered_batches=EXPLAIN_BUFFER_BATCHES,
                 overrides=None)]


def explain_staleness(r: Optional[dict], runs: List[dict]) -> Dict[str, object]:
    """Laminar's staleness is unbounded: a trajectory is as stale as the iterations its own
    generation spans plus those it waits in the buffer. Its most stale point again with a
    buffer of ``EXPLAIN_BUFFER_BATCHES`` batch splits the two:
    ``explain_staleness_max_laminar_buffer_1`` (the generation's span, and a batch's wait)
    beside ``staleness_max_laminar`` (the table's buffer), and what that buffer costs in
    tokens/s at that point. ``r``: that point's run in the table (``_most_stale``)."""
    from .cluster import SimConfig

    if r is None or not runs:
        return {}
    run, point = runs[0], f"{r['model']}_{r['gpus']}"
    b, table = EXPLAIN_BUFFER_BATCHES, SimConfig.max_buffered_batches
    return {"explain_staleness_point": point,
            f"explain_staleness_max_laminar_buffer_{b}": max(map(int, run["staleness"])),
            f"explain_tokens_per_s_laminar_buffer_{b}_{point}": round(run["tokens_per_s"], 1),
            f"explain_tokens_per_s_laminar_buffer_{table}_{point}": round(r["tokens_per_s"], 1)}


def decode_alone_s(cost, prompt: int, tokens: int) -> float:
    """Seconds to decode ``tokens`` tokens after a ``prompt``-token prompt with nothing else
    on the engine (batch 1 every step): the fastest any scheduler can generate a response."""
    return sum(cost.decode_step_s(1, prompt + i) for i in range(tokens))


def staleness_floor(results: List[dict], workload: Workload) -> Dict[str, object]:
    """The least staleness laminar's longest responses can have at each point of the table
    at its pace: a ``max_response``-token response decoded alone on its engine
    (``decode_alone_s``, the fastest the engine goes) spans that many of the run's iterations
    (at their mean length), so one that is trained on is about that many versions behind.
    ``explain_staleness_floor_laminar_<point>`` beside the measured
    ``staleness_max_<point>_laminar``; ``explain_decode_alone_s_<model>``. And the other
    side: a run of n iterations cannot show a staleness above n - 1 (version 0's trajectories
    trained on at the last step), ``explain_staleness_run_cap``; the points whose measured
    maximum sits on that cap (``explain_staleness_capped_points``) would show more in a
    longer run."""
    from .costs import cost_for

    out: Dict[str, object] = {}
    floors, capped, cap = [], [], 0
    alone_s: Dict[tuple, float] = {}  # per (model, engine TP): the same at every point
    for r in results:
        if r["mode"] != "laminar" or len(r.get("marks") or ()) < 2:  # (no iteration to span)
            continue
        key = (r["model"], r.get("engine_tp") or None)
        if key not in alone_s:
            alone_s[key] = decode_alone_s(cost_for(key[0], "laminar", key[1]),
                                          int(workload.prompt_median), workload.max_response)
        alone = alone_s[key]
        out[f"explain_decode_alone_s_{r['model']}"] = round(alone, 1)
        floor = int(alone // r["iteration_s"])
        out[f"explain_staleness_floor_laminar_{r['model']}_{r['gpus']}"] = floor
        floors.append(floor)
        cap = max(cap, len(r["marks"]) - 1)
        if r["staleness"] and max(map(int, r["staleness"])) == len(r["marks"]) - 1:
            capped.append(f"{r['model']}_{r['gpus']}")
    if floors:
        out["explain_staleness_floor_max_laminar"] = max(floors)
        out["explain_staleness_run_cap"] = cap
        out["explain_staleness_capped_points"] = ",".join(capped)
    return out


# explain_repack's prefill: at a million times the table's compute efficiency (microseconds)
PREFILL_FREE = {"EFFICIENCY.prefill_compute": 1e6}


def _repack_specs(args, workload: Workload, results: List[dict]) -> List[dict]:
    """Laminar with and without repack at each point where the table has both, again with
    prefill free (``PREFILL_FREE``)."""
    by = {(r["model"], r["gpus"], r["mode"]): r for r in results}
    specs = []
    for m, g, mode in sorted(by):
        if mode == "laminar_norepack" and (m, g, "laminar") in by:
            for md in ("laminar", "laminar_norepack"):
                specs.append(dict(model=m, mode=md, gpus=g, workload=workload,
                                  split_trainer_gpus=by[(m, g, md)]["trainer_gpus"],
                                  iterations=args.warmup + args.measure, warmup=args.warmup,
                                  overrides=dict(PREFILL_FREE)))
    return specs


def explain_repack(runs: List[dict]) -> Dict[str, object]:
    """Repack's generation gain (generated tokens per busy engine-second, with vs without
    repack) again with prefill free: ``explain_repack_generation_gain_without_prefill_<point>``
    and the KV utilisation of both runs beside the table's ``repack_generation_gain_<point>``.
    A moved trajectory prefills its whole context again on its destination, and an engine
    decodes nothing while it prefills: the run shows how much of the gain that takes."""
    out: Dict[str, object] = {}
    for on, off in zip(runs[0::2], runs[1::2]):
        key = f"{on['model']}_{on['gpus']}"
        out[f"explain_repack_generation_gain_without_prefill_{key}"] = round(
            on["generation_tokens_per_s"] / off["generation_tokens_per_s"] - 1, 3)
        out[f"explain_kv_utilisation_repack_without_prefill_{key}"] = round(on["kv_utilisation"], 3)
        out[f"explain_kv_utilisation_norepack_without_prefill_{key}"] = round(
            off["kv_utilisation"], 3)
    return out
