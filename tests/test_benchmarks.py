"""Benchmarks keep their command-line contract: they run at tiny sizes and write the promised
JSON keys (the figures themselves are measured by running them, not by tests)."""

import json

import pytest


@pytest.mark.multiprocess
def test_engine_benchmark_writes_its_keys(tmp_path):
    from laminar_mcore.bench.engine import main

    out = tmp_path / "engine.json"
    main(["--requests", "12", "--short", "4", "--long", "40", "--hidden", "64", "--vocab", "256",
          "--controller-lengths", "64,512", "--json", str(out)])
    figures = json.loads(out.read_text())
    assert {"engine_tokens_per_s", "hf_tokens_per_s", "ratio", "controller_us_per_token_512",
            "controller_us_per_token_8192", "controller_cost_ratio"} <= set(figures)
    assert figures["controller_cost_ratio"] == pytest.approx(
        figures["controller_us_per_token_8192"] / figures["controller_us_per_token_512"])
    assert figures["ratio"] == pytest.approx(figures["engine_tokens_per_s"] / figures["hf_tokens_per_s"])
    assert figures["length_p99"] > 6 * figures["length_p50"]  # long-tailed


@pytest.mark.multiprocess
def test_weight_sync_benchmark_writes_its_keys(tmp_path):
    from laminar_mcore.bench.weight_sync import main

    out = tmp_path / "sync.json"
    main(["--hidden", "128", "--layers", "2", "--vocab", "512", "--relays", "2", "--repeats", "1",
          "--json", str(out)])
    figures = json.loads(out.read_text())
    keys = {"trainer_blocked_s", "host_copy_s", "chain_gbps", "pull_gbps", "gloo_broadcast_gbps",
            "memcpy_gbps", "bit_exact"}
    assert keys <= set(figures) and figures["bit_exact"] is True
    # a TP1 engine pulls the whole version, its buckets' 64-byte alignment aside; each rank of
    # a TP2 engine every whole bucket, or (issue 52) only its shard: about half
    assert figures["engine_pull_bytes"] >= figures["bytes"]
    assert 1.0 <= figures["engine_pull_fraction"] < 1.05
    assert 1.0 <= figures["tp2_rank_pull_fraction_whole"] < 1.05
    assert 0.5 <= figures["tp2_rank_pull_fraction_shard"] < 0.6
    assert all(figures[k] > 0 for k in keys - {"bit_exact"})
    from laminar_mcore.relay.transports import mooncake

    # issue 52: the export at TP2, stage lead against per rank; each rank copies its half
    assert figures["export_tp"] == 2
    assert figures["export_blocked_s_stage_lead"] > 0 and figures["export_blocked_s_per_rank"] > 0
    assert figures["export_bytes_stage"] / 2 <= figures["export_bytes_per_rank_max"] < \
        0.6 * figures["export_bytes_stage"]
    if mooncake.available():  # the cross-node pull is measured too, and checked bit for bit
        assert figures["mooncake_bit_exact"] is True
        assert figures["mooncake_read_gbps"] > 0 and figures["mooncake_pull_gbps"] > 0


def test_loss_benchmark_writes_its_keys(tmp_path):
    from laminar_mcore.bench.loss import main

    out = tmp_path / "loss.json"
    main(["--tokens", "1024", "--vocab", "50000", "--json", str(out)])
    figures = json.loads(out.read_text())
    assert {"peak_bytes", "naive_peak_bytes", "ratio", "seconds", "naive_seconds", "repeats",
            "dtype"} <= set(figures)
    assert figures["naive_peak_bytes"] > 2 * figures["peak_bytes"]  # a 200 MB log_softmax
    assert figures["seconds"] > 0 and figures["naive_seconds"] > 0 and figures["repeats"] >= 1
    assert figures["dtype"] == ("bfloat16" if figures["device"] == "cuda" else "float32")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_modes_benchmark_writes_its_keys(tmp_path):
    from laminar_mcore.bench.modes import main

    out = tmp_path / "modes.json"
    main(["--steps", "2", "--batch-prompts", "2", "--samples", "2", "--long", "40",
          "--json", str(out)])
    figures = json.loads(out.read_text())
    assert {"laminar_vs_sync", "laminar_vs_one_step"} <= set(figures)
    for mode in ("sync", "one_step", "laminar"):
        assert figures[f"{mode}_tokens_per_s"] > 0
        assert 0 <= figures[f"{mode}_engine_idle_fraction"] <= 1
        assert 0 <= figures[f"{mode}_trainer_idle_fraction"] <= 1
    assert figures["sync_max_staleness"] == 0
    assert figures["length_p99"] > 10 * figures["length_p50"] or figures["length_p99"] == 40


def test_convergence_figures_read_time_and_samples_to_target_from_the_evals():
    """The ratios of bench.convergence from four runs' summaries: the first evaluation at or
    above the target gives each mode's wall time and samples. The default target is 80% of
    the way from sync's first evaluation to its final accuracy, the mean of its last quarter's
    evaluations (here its last three: a quarter of 30 steps holds one)."""
    from laminar_mcore.bench.convergence import figures_from

    def summary(final, evals):
        return {"final_accuracy": final, "final_accuracy_greedy": 1.0, "trainer_tokens_per_s": 100.0,
                "engine_idle_fraction": 0.5, "trainer_idle_fraction": 0.25,
                "max_staleness_observed": 1,
                "evals": [{"step": s, "accuracy": a, "wall_s": t} for s, a, t in evals]}

    results = {
        "sync": summary(0.80, [(0, 0.5, 0.0), (10, 0.70, 40.0), (20, 0.79, 80.0), (30, 0.80, 120.0)]),
        "one_step": summary(0.79, [(0, 0.5, 0.0), (10, 0.6, 30.0), (20, 0.78, 60.0), (30, 0.79, 90.0)]),
        "areal": summary(0.70, [(0, 0.5, 0.0), (10, 0.6, 25.0), (20, 0.7, 50.0)]),
        "laminar": summary(0.81, [(0, 0.5, 0.0), (20, 0.781, 40.0), (10, 0.78, 20.0), (30, 0.81, 60.0)]),
    }
    sync_final, lam_final = (0.70 + 0.79 + 0.80) / 3, (0.78 + 0.781 + 0.81) / 3
    gain = sync_final - 0.5
    assert abs(figures_from(results, batch_samples=64)["target_accuracy"]
               - (0.5 + 0.8 * gain)) < 1e-12
    assert abs(figures_from(results, 64, fraction=0.5)["target_accuracy"]
               - (0.5 + 0.5 * gain)) < 1e-12
    f = figures_from(results, batch_samples=64, target=0.78)
    assert abs(f["target_accuracy"] - 0.78) < 1e-12
    # sync crossed 0.78 between its evaluations at 40 s (0.70) and 80 s (0.79): 8/9 of the way
    crossed = 40.0 + 8 / 9 * 40.0
    assert abs(f["sync_time_to_target_s"] - crossed) < 1e-9
    assert f["sync_samples_to_target"] == round((10 + 8 / 9 * 10) * 64)
    # laminar reached 0.78 exactly at its evaluation of step 10 (20 s)
    assert abs(f["laminar_time_speedup_vs_sync"] - crossed / 20.0) < 1e-9
    assert abs(f["laminar_sample_efficiency_vs_sync"] - (10 + 8 / 9 * 10) / 10) < 1e-9
    assert f["laminar_time_speedup_vs_one_step"] == 60.0 / 20.0
    assert f["areal_time_to_target_s"] is None and f["laminar_time_speedup_vs_areal"] is None
    assert f["laminar_train_wall_s"] == 60.0
    assert f["sync_generation_fraction"] == 0.5 and f["sync_trainer_wait_fraction"] == 0.25
    assert figures_from(results, 64, target=0.9)["laminar_time_speedup_vs_sync"] is None
    # the curve: targets at 30% ... 100% of sync's gain (0.5 -> its final), whatever the
    # headline's
    t30, t100 = 0.3 * gain, gain  # above 0.5
    assert abs(f["laminar_time_speedup_vs_sync_at_30"]
               - (t30 / 0.2 * 40) / (t30 / 0.28 * 20)) < 1e-9
    assert abs(f["laminar_time_speedup_vs_sync_at_100"]
               - (40 + (t100 - 0.2) / 0.09 * 40) / (t100 / 0.28 * 20)) < 1e-9
    assert all(f[f"laminar_time_speedup_vs_sync_at_{p}"] > 1 for p in (30, 50, 70, 90, 100))
    assert abs(f["sync_final_accuracy"] - sync_final) < 1e-12 and f["sync_last_accuracy"] == 0.80
    assert abs(f["final_accuracy_gap_vs_sync"] - (lam_final - sync_final)) < 1e-12
    # samples count the steps behind the weights evaluated (an eval of step 10 that ran on
    # version 14 measured 14 steps of training)
    results["laminar"]["evals"][2]["version"] = 14
    assert figures_from(results, 64, target=0.78)["laminar_samples_to_target"] == 14 * 64


def test_the_convergence_criterion_tells_a_plateau_from_a_rising_curve():
    """A run's final accuracy is its last quarter's mean; it has plateaued when those
    evaluations rise by less than PLATEAU_RISE along their least-squares line, judged on the
    curve averaged over seeds (one evaluation's noise would decide a single seed's)."""
    from laminar_mcore.bench.convergence import (PLATEAU_RISE, final_accuracy, mean_curve,
                                                 plateau_figures, plateau_rise)

    def run(points):
        return {"final_accuracy": points[-1][1],
                "evals": [{"step": s, "accuracy": a} for s, a in points]}

    steps = range(0, 101, 10)
    rising = run([(s, 0.4 + 0.004 * s) for s in steps])  # +0.1 over the last quarter
    flat = run([(s, min(0.4 + 0.008 * s, 0.8)) for s in steps])  # flat from step 50
    # the last quarter of 100 steps: the evaluations at 80, 90 and 100
    assert abs(final_accuracy(rising) - (0.72 + 0.76 + 0.80) / 3) < 1e-12
    assert abs(plateau_rise(rising["evals"]) - 0.1) < 1e-9
    assert abs(plateau_rise(flat["evals"])) < 1e-12 and abs(final_accuracy(flat) - 0.8) < 1e-12
    # noise of +-0.03 on one seed, opposite on the other: the mean curve is flat
    noisy = [run([(s, 0.8 + (0.03 if s == 100 else 0) * sign) for s in steps]) for sign in (1, -1)]
    assert plateau_rise(noisy[0]["evals"]) >= PLATEAU_RISE
    assert abs(plateau_rise(mean_curve(noisy))) < 1e-12
    f = plateau_figures({"sync": [flat, flat], "laminar": noisy})
    assert f["sync_plateaued"] and f["laminar_plateaued"] and f["all_modes_plateaued"]
    f = plateau_figures({"sync": [flat], "areal": [rising]})
    assert not f["areal_plateaued"] and not f["all_modes_plateaued"]
    assert abs(f["areal_plateau_rise_mean_curve"] - 0.1) < 1e-9
    # a step only some seeds evaluated is left out of the mean curve
    assert [e["step"] for e in mean_curve([flat, run([(0, 0.4), (10, 0.5)])])] == [0, 10]


def test_convergence_over_seeds_reports_medians_and_spreads():
    """Three seeds' figures: each key is the median, the ratios and times to target also get
    _median, _min, _max and how many seeds reached the target (a seed that did not is left
    out of the spread)."""
    from laminar_mcore.bench.convergence import over_seeds

    seeds = [{"laminar_time_speedup_vs_sync": 1.2, "sync_time_to_target_s": 30.0,
              "laminar_final_accuracy": 0.70, "target_accuracy": 0.68},
             {"laminar_time_speedup_vs_sync": 1.9, "sync_time_to_target_s": 40.0,
              "laminar_final_accuracy": 0.72, "target_accuracy": 0.69},
             {"laminar_time_speedup_vs_sync": None, "sync_time_to_target_s": 35.0,
              "laminar_final_accuracy": 0.71, "target_accuracy": 0.70}]
    f = over_seeds(seeds)
    assert f["seeds"] == 3
    assert f["laminar_time_speedup_vs_sync"] == f["laminar_time_speedup_vs_sync_median"]
    assert abs(f["laminar_time_speedup_vs_sync"] - 1.55) < 1e-12
    assert f["laminar_time_speedup_vs_sync_min"] == 1.2
    assert f["laminar_time_speedup_vs_sync_max"] == 1.9
    assert f["laminar_time_speedup_vs_sync_seeds"] == 2
    assert f["sync_time_to_target_s_median"] == 35.0 and f["sync_time_to_target_s_seeds"] == 3
    assert f["laminar_final_accuracy"] == 0.71  # with its range: parity is judged against it
    assert (f["laminar_final_accuracy_min"], f["laminar_final_accuracy_max"]) == (0.70, 0.72)
    assert "target_accuracy_min" not in f
    assert over_seeds([{"x": None}, {"x": None}])["x"] is None


def test_convergence_reads_one_runs_loss_tokens_per_step(tmp_path):
    """``<mode>_loss_tokens_cv``: sd over mean of the loss tokens of this run's steps; the
    earlier runs appended to the same metrics.jsonl (another seed) and the evaluations are
    left out."""
    import statistics

    from laminar_mcore.bench.convergence import loss_tokens_cv

    path = tmp_path / "metrics.jsonl"
    rows = [{"kind": "train", "time": 10.0, "global_tokens": 9000},  # the previous seed's run
            {"kind": "eval", "time": 101.0, "accuracy": 0.5},
            *({"kind": "train", "time": 100.0 + i, "global_tokens": n}
              for i, n in enumerate((300, 500, 1300, 400)))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    mine = [300, 500, 1300, 400]
    assert loss_tokens_cv(str(path), 100.0) == pytest.approx(
        statistics.pstdev(mine) / statistics.fmean(mine))
    assert loss_tokens_cv(str(path), 1000.0) is None  # no step of this run: no figure


def test_crossing_interpolates_between_evaluations():
    """The time to target is where the accuracy crossed it, between the last evaluation below
    and the first at or above (in wall time), not the next evaluation's time."""
    from laminar_mcore.bench.common import crossing

    evals = [{"step": 0, "accuracy": 0.4, "wall_s": 0.0},
             {"step": 10, "accuracy": 0.6, "wall_s": 20.0},
             {"step": 20, "accuracy": 0.8, "wall_s": 50.0},
             {"step": 30, "accuracy": 0.7, "wall_s": 70.0}]
    hit = crossing(evals, 0.75)
    assert abs(hit["wall_s"] - (20.0 + 0.75 * 30.0)) < 1e-9
    assert abs(hit["steps"] - 17.5) < 1e-9 and hit["eval"]["step"] == 20
    assert crossing(evals, 0.3)["wall_s"] == 0.0  # reached at the first evaluation
    assert crossing(evals, 0.9) is None


def test_demo_prints_the_stored_speedup_with_its_spread_not_one_runs_ratio(tmp_path):
    """make demo's comparison: the stored benchmark's median and range over seeds and the
    machine it was measured on; this run's time beside the stored sync run's only for
    orientation (a ratio of one run to a stored one is not returned as a speedup)."""
    from hydra import compose, initialize_config_dir

    from laminar_mcore.bench import reference
    from laminar_mcore.config import register_configs
    from laminar_mcore.config.paths import conf_dir

    register_configs()
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        cfg = compose(config_name="config", overrides=["experiment=cpu_demo"])
    evals = [{"step": 0, "accuracy": 0.4, "wall_s": 0.0}, {"step": 10, "accuracy": 0.8,
                                                          "wall_s": 40.0}]
    mine = [{"step": 0, "accuracy": 0.4, "wall_s": 0.0}, {"step": 10, "accuracy": 0.8,
                                                         "wall_s": 20.0}]
    stored = {"measured": "2026-11-25", "machine": "2 CPU cores, x86_64, Python 3.11",
              "config": reference.fingerprint(cfg),
              "figures": {"target_accuracy": 0.6, "seeds": 3,
                          "laminar_time_speedup_vs_sync": 1.6,
                          "laminar_time_speedup_vs_sync_min": 1.3,
                          "laminar_time_speedup_vs_sync_max": 2.1,
                          "laminar_time_speedup_vs_sync_at_30": 1.2,
                          "laminar_time_speedup_vs_sync_at_90": 1.9,
                          "laminar_time_speedup_vs_sync_at_100": None,
                          "sync_generation_fraction": 0.72},
              "modes": {"sync": {"final_accuracy": 0.8, "trainer_tokens_per_s": 500.0,
                                 "evals": evals}}}
    path = tmp_path / "ref.json"
    path.write_text(json.dumps(stored))
    lines = []
    summary = {"initial_accuracy": 0.4, "final_accuracy": 0.8, "trainer_tokens_per_s": 900.0,
               "evals": mine}
    out = reference.compare(cfg, summary, str(tmp_path), log=lines.append, path=str(path))
    text = "\n".join(lines)
    assert "1.60x sooner than sync (median; range 1.30-2.10)" in text
    assert "2 CPU cores, x86_64, Python 3.11" in text and "3 seeds" in text
    assert out["stored_speedup_median"] == 1.6 and out["stored_speedup_min"] == 1.3
    assert "30%: 1.20x, 90%: 1.90x" in text  # the curve's stored medians (100% not reached)
    assert out["stored_speedup_curve"] == {30: 1.2, 90: 1.9}
    assert "time_speedup_vs_sync" not in out  # one run against a stored one is no measurement
    assert abs(out["time_speedup_vs_stored_sync"] - 2.0) < 1e-9  # 0.6 crossed at 20 s vs 10 s
    # another configuration: nothing to compare with, and the user is told how to measure
    cfg.trainer.lr = cfg.trainer.lr * 2
    lines.clear()
    assert reference.compare(cfg, summary, str(tmp_path), log=lines.append,
                             path=str(path)) is None
    assert "bench.convergence" in lines[0]


def test_stripes_benchmark_writes_its_keys(tmp_path):
    """bench.stripes on loopback with a small model: both tiers publish every version to every
    master relay of theirs (the separate-host figures are in docs/benchmarks.md)."""
    from laminar_mcore.bench.stripes import main

    out = tmp_path / "stripes.json"
    main(["--loopback", "--layers", "2", "--hidden", "112", "--vocab", "512", "--repeats", "1",
          "--logs", str(tmp_path / "logs"), "--json", str(out)])
    figures = json.loads(out.read_text())
    assert figures["stripes_link_gbit"] == 0 and figures["stripes_repeats"] == 1
    assert figures["stripes_sync_s_one_master"] > 0 and figures["stripes_sync_s_two_masters"] > 0
    assert figures["stripes_speedup"] == pytest.approx(
        figures["stripes_sync_s_one_master"] / figures["stripes_sync_s_two_masters"], rel=0.05)
