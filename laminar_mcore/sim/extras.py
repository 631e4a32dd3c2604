"""``sim.report``'s two other questions: how far its constants can move the headline ratios
(``--sensitivity``) and what a machine failure costs (``--fail machine@T``)."""

from __future__ import annotations

import json
from typing import Dict, List

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
    iterations = args.iterations or args.warmup + args.measure
    warmup = min(args.warmup, iterations - 1)
    _, splits = report.sweep_and_run(pairs, list(report.SYSTEMS), args, workload,
                                     splits=report.load_splits(args),
                                     log=log, measured=False)
    base_ratios: Dict[str, float] = {}
    specs, keys = [], []
    names = [c for c in (args.constants or "").split(",") if c] or None
    for i, override in enumerate([None] + variants(names=names)):
        for m, g in pairs:
            for mode in report.SYSTEMS:
                specs.append(dict(model=m, mode=mode, gpus=g, workload=workload,
                                  iterations=iterations, warmup=warmup, overrides=override,
                                  split_trainer_gpus=splits.get((m, g, mode))))
                keys.append(i)
    # a variant of a weight protocol's constants cannot move a run of another protocol: such a
    # run is the base run (sensitivity.unread), taken from it instead of simulated again
    reuse = [unread(spec["overrides"], _protocol(spec)) for spec in specs]
    todo = [spec for spec, r in zip(specs, reuse) if not r]
    log(f"sensitivity: {len(todo)} runs of {iterations} iterations "
        f"({len(specs) - len(todo)} others are their base run: a constant of another "
        f"weight protocol)")
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
                                  "sensitivity_factor": 0.2}
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
    from .costs import CostModel

    place = placement_for(spec["mode"], spec["gpus"], CostModel(spec["model"]), None,
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
