"""A run's long-tail story, from its trajectory trace.

    python -m laminar_mcore.tools.trace outputs/<run> [--png PATH] [--json PATH] [--top N]

Reads ``outputs/<run>/trajectories.jsonl`` (one record per consumed or discarded trajectory,
``laminar_mcore.data.trace``) and prints: how many were consumed and discarded (by reason), the
response-length percentiles (the long tail), how many were repacked or resumed and how many
straddled weight versions, the staleness histogram at consumption, where the time went
(queued, generating, rewarding, waiting in the buffer), and the slowest trajectories. It
draws ``timeline.png`` beside the trace (or ``--png``): each engine a row over the run's time,
each trajectory's requests a bar coloured by the weight version that generated it; repacked
and resumed requests are outlined. ``--json`` writes the figures as one flat object.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from typing import Dict, List, Optional

from ..data.trace import read_trace
from ..errors import within

# (name, from timing, to timing): the stages of a trajectory's life, in order
STAGES = (("queued", "submitted", "first_token"), ("generating", "first_token", "finished"),
          ("rewarding", "finished", "rewarded"), ("buffered", "rewarded", "consumed"))


def percentile(values: List[float], q: float) -> Optional[float]:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n q / 100), at least 1
    return ordered[int(rank) - 1]


def story(records: List[dict], top: int = 5) -> tuple:
    """(figures: one flat dict, lines: what to print) of a run's trace records."""
    consumed = [r for r in records if r["outcome"] == "consumed"]
    discarded = [r for r in records if r["outcome"] == "discarded"]
    left = Counter(r["outcome"] for r in records if r["outcome"] in ("buffered", "in_flight"))
    reasons = Counter(r["discard_reason"] for r in discarded)
    lengths = [r["response_tokens"] for r in consumed]
    figures: Dict[str, object] = {"trajectories": len(records), "consumed": len(consumed),
                                  "discarded": len(discarded), "buffered": left["buffered"],
                                  "in_flight": left["in_flight"]}
    for reason, n in sorted(reasons.items()):
        figures[f"discarded_{reason}"] = n
    for q in (50, 90, 99, 100):
        figures[f"length_p{q}"] = percentile(lengths, q)
    figures["repacked"] = sum(1 for r in records if r["repacks"])
    figures["repacks"] = sum(r["repacks"] for r in records)
    figures["resumed"] = sum(1 for r in records if r["resumes"])
    figures["mixed_versions"] = sum(1 for r in consumed if len(r["versions"]) > 1)
    staleness = Counter(r["staleness"] for r in consumed if r["staleness"] is not None)
    for s, n in sorted(staleness.items()):
        figures[f"staleness_{s}"] = n
    stage_s: Dict[str, List[float]] = {}
    for name, a, b in STAGES:
        spans = [r["timings"][b] - r["timings"][a] for r in consumed
                 if a in r["timings"] and b in r["timings"]]
        stage_s[name] = spans
        figures[f"{name}_s_p50"] = _round(percentile(spans, 50))
        figures[f"{name}_s_p99"] = _round(percentile(spans, 99))
        figures[f"{name}_s_total"] = _round(sum(spans))
    total = sum(sum(v) for v in stage_s.values()) or 1.0

    lines = [f"trajectories: {len(records)} ({len(consumed)} consumed, {len(discarded)} discarded"
             + (" (" + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) + ")"
                if reasons else "")
             + f"; at the end {left['buffered']} buffered, {left['in_flight']} in flight)"]
    if lengths:
        p50, p99 = figures["length_p50"], figures["length_p99"]
        lines.append(f"response length: p50 {p50}, p90 {figures['length_p90']}, p99 {p99}, max "
                     f"{figures['length_p100']} tokens (p99/p50 {p99 / max(p50, 1):.1f}x)")
    lines.append(f"repacked: {figures['repacked']} trajectories ({figures['repacks']} moves); "
                 f"resumed: {figures['resumed']}; straddled weight versions: "
                 f"{figures['mixed_versions']}")
    if staleness:
        width = max(staleness.values())
        lines.append("staleness at consumption (versions behind the trainer):")
        for s, n in sorted(staleness.items()):
            lines.append(f"  {s:>3}  {'#' * max(1, round(30 * n / width))} {n}")
    lines.append("where the time went (consumed trajectories; p50 / p99 seconds, share):")
    for name, _, _ in STAGES:
        spans = stage_s[name]
        if spans:
            lines.append(f"  {name:<11} {percentile(spans, 50):8.3f} / {percentile(spans, 99):8.3f}"
                         f"  {sum(spans) / total:5.1%}")
    slow = sorted((r for r in consumed if "finished" in r["timings"] and
                   "submitted" in r["timings"]),
                  key=lambda r: r["timings"]["finished"] - r["timings"]["submitted"],
                  reverse=True)[:top]
    if slow:
        lines.append(f"slowest {len(slow)} to generate:")
        for r in slow:
            lines.append(f"  {r['id']}: {r['response_tokens']} tokens in "
                         f"{r['timings']['finished'] - r['timings']['submitted']:.2f} s on "
                         f"{' -> '.join(r['engines']) or '?'}, version {r['version']}, "
                         f"{r['repacks']} repacks, {r['resumes']} resumes")
    return figures, lines


def _round(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 4)


def draw_timeline(records: List[dict], path: str) -> Optional[str]:
    """Engines (rows) over time; every request of a trajectory a bar, coloured by version."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import colormaps
    from matplotlib.colors import Normalize
    from matplotlib.cm import ScalarMappable

    segments = [(r, s) for r in records for s in r.get("segments", ())
                if s.get("start") is not None and s.get("end") is not None]
    if not segments:
        return None
    t0 = min(s["start"] for _, s in segments)
    engines = sorted({s["engine"] for _, s in segments})
    versions = [int(s["version"]) for _, s in segments]
    norm = Normalize(vmin=min(versions), vmax=max(max(versions), min(versions) + 1))
    cmap = colormaps["viridis"]
    # each engine's requests stacked in lanes so overlapping (batched) requests stay visible;
    # one barh call for every bar (a long run has hundreds of thousands)
    fig, ax = plt.subplots(figsize=(13, max(3.0, 1.2 + 1.2 * len(engines))))
    ys, widths, lefts, heights, colors, edges = [], [], [], [], [], []
    for row, engine in enumerate(engines):
        mine = sorted((s for _, s in segments if s["engine"] == engine), key=lambda s: s["start"])
        lane_end: List[float] = []
        placed = []
        for s in mine:
            lane = next((i for i, end in enumerate(lane_end) if end <= s["start"]), None)
            if lane is None:
                lane_end.append(s["end"])
                lane = len(lane_end) - 1
            lane_end[lane] = s["end"]
            placed.append((lane, s))
        height = 0.8 / max(len(lane_end), 1)
        for lane, s in placed:
            ys.append(row - 0.4 + (lane + 0.5) * height)
            widths.append(s["end"] - s["start"])
            lefts.append(s["start"] - t0)
            heights.append(height)
            colors.append(cmap(norm(int(s["version"]))))
            edges.append("red" if s.get("how") in ("repack", "resume") else "none")
    ax.barh(ys, widths, left=lefts, height=heights, color=colors, edgecolor=edges,
            linewidth=0.8)
    ax.set_yticks(range(len(engines)), engines)
    ax.set_xlabel("seconds since the first request")
    ax.set_title("trajectories on engines over time (colour: weight version; red outline: "
                 "repacked or resumed)")
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="weight version")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="the run's output directory (outputs/<run>) or its "
                                "trajectories.jsonl")
    ap.add_argument("--png", default=None, help="timeline picture (default: timeline.png "
                                                "beside the trace)")
    ap.add_argument("--json", default=None, help="write the figures as one flat JSON object")
    ap.add_argument("--top", type=int, default=5, help="how many slowest trajectories to list")
    args = ap.parse_args(argv)
    try:
        records = read_trace(args.run)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(within("trace", exc, "LMC-E708")) from None
    if not records:
        raise SystemExit(f"LMC-E708: trace: {args.run} holds no trajectories yet")
    figures, lines = story(records, args.top)
    run_dir = args.run if os.path.isdir(args.run) else os.path.dirname(os.path.abspath(args.run))
    png = draw_timeline(records, args.png or os.path.join(run_dir, "timeline.png"))
    if png:
        lines.append(f"timeline: {png}")
    print("\n".join(lines))
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return figures


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
