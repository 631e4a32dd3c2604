"""The cluster simulator: virtual time, continuous batching, the production manager at scale,
the report's keys, placement sweeps and calibration against bench.modes."""

import asyncio
import gc
import json
import os

import pytest

from laminar_mcore.sim import clock
from laminar_mcore.sim.clock import SimulationStalled, run_virtual
from laminar_mcore.sim.cluster import SimConfig, simulate
from laminar_mcore.sim.costs import CostModel
from laminar_mcore.sim.engine import SimEngine, SimEngineClient, TokenCount
from laminar_mcore.sim.workload import Workload

# a linear, exactly known decode cost: 10 ms + 1 ms per running request
LINEAR = CostModel("7B", decode_fixed_s=0.010, decode_per_request_s=0.001,
                   decode_per_context_token_s=0.0, prefill_per_token_s=0.0)


@pytest.mark.timeout(300)
def test_virtual_time_runs_hours_in_milliseconds_and_a_stall_is_an_error():
    async def main():
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3600)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), 60)
        return loop.time()

    assert run_virtual(main()) == pytest.approx(3660.0)  # in real time, the timeout fails it

    async def stuck():
        await asyncio.Event().wait()  # nothing will ever set it

    with pytest.raises(SimulationStalled):
        run_virtual(stuck())


def test_engine_batches_continuously_and_aborts_return_what_was_generated():
    async def main():
        loop = asyncio.get_running_loop()
        engine = SimEngine("e", LINEAR, capacity=4, kv_capacity=10_000)
        client = SimEngineClient(engine)

        async def gen(rid, n):
            chunks = [c async for c in client.stream_tokens(TokenCount(10), {"max_new_tokens": n},
                                                            rid=rid)]
            return len(chunks[-1].new_ids), chunks[-1].meta["finish_reason"]["type"], loop.time()

        # two requests: batch 2 (12 ms a step) for 100 steps, then the long one alone (11 ms)
        short, long_ = await asyncio.gather(gen("g/0", 100), gen("g/1", 300))
        assert short == (100, "stop", pytest.approx(1.2))
        assert long_ == (300, "stop", pytest.approx(1.2 + 200 * 0.011))
        start = loop.time()
        task = asyncio.create_task(gen("h/0", 1000))
        await asyncio.sleep(0.55)  # 50 steps of 11 ms
        await client.abort_request("h/0")
        n, reason, _ = await task
        assert (n, reason) == (50, "abort")
        load = await client.get_load()
        assert load.num_running == 0 and load.kv_used_tokens == 0
        return start

    run_virtual(main())


def test_engine_retracts_when_the_kv_cache_fills_and_the_request_still_finishes():
    async def main():
        engine = SimEngine("e", LINEAR, capacity=4, kv_capacity=300)
        client = SimEngineClient(engine)

        async def gen(rid):
            chunks = [c async for c in client.stream_tokens(TokenCount(50), {"max_new_tokens": 200},
                                                            rid=rid)]
            return len(chunks[-1].new_ids)

        # two requests of 50 + 200 tokens cannot both hold their KV in 300 tokens
        assert await asyncio.gather(gen("a/0"), gen("b/0")) == [200, 200]
        return engine.retracted

    assert run_virtual(main()) >= 1


def test_workload_has_laminars_long_tail():
    s = Workload().stats()
    assert s["p99"] > 10 * s["p50"]
    assert 0 < s["capped"] < 0.02  # a few reach the 16K cap


SMALL = Workload(batch_prompts=32, samples=16)


_RUNS = {}


def _run(mode, **kw):
    """One small run (deterministic, so shared between tests: they only read it)."""
    kw.setdefault("concurrency", 512)  # at this small batch, the pre-issue-33 engine size
    key = (mode, tuple(sorted(kw.items())))
    if key not in _RUNS:
        _RUNS[key] = simulate(SimConfig(model="7B", mode=mode, gpus=32, iterations=4,
                                        workload=SMALL, **kw))
    return _RUNS[key]


def test_the_production_manager_runs_every_mode_with_its_invariants():
    results = {m: _run(m) for m in ("sync", "one_step", "stream", "areal", "laminar",
                                    "laminar_norepack")}
    for mode, r in results.items():
        assert r.books_balance, mode
        assert r.consumed == 4 * SMALL.batch_trajectories, mode
    assert set(results["sync"].staleness) == {0}
    assert max(results["one_step"].staleness) <= 1 and max(results["stream"].staleness) <= 1
    assert results["areal"].interrupted > 0 and results["areal"].mixed_version_trajectories > 0
    for mode in ("sync", "one_step", "laminar", "laminar_norepack"):
        assert results[mode].mixed_version_trajectories == 0, mode  # one version each
    assert results["laminar"].repacked > 0 and results["laminar_norepack"].repacked == 0
    # what a user would switch for: no barrier on the long tail
    assert results["laminar"].tokens_per_s > 1.5 * results["sync"].tokens_per_s
    assert results["laminar"].tokens_per_s > 1.2 * results["one_step"].tokens_per_s
    assert results["laminar"].engine_idle_fraction < results["one_step"].engine_idle_fraction
    # event-driven: one long poll per relay and version, not one request per poll interval
    for mode, r in results.items():
        assert r.relay_requests <= 2 * r.relays * (4 + 2), (mode, r.relay_requests)


def test_a_simulation_is_deterministic(monkeypatch):
    """... and the collector's thresholds (clock.GC_THRESHOLDS: half a run's CPU time at
    Python's) change nothing but its time; the caller's are restored."""
    a = _run("laminar")
    before = gc.get_threshold()
    monkeypatch.setattr(clock, "GC_THRESHOLDS", (700, 10, 10))  # Python's defaults
    b = simulate(SimConfig(model="7B", mode="laminar", gpus=32, iterations=4, workload=SMALL,
                           concurrency=512))
    assert gc.get_threshold() == before
    assert (a.tokens_per_s, a.staleness, a.repacked, a.marks) == \
        (b.tokens_per_s, b.staleness, b.repacked, b.marks)


@pytest.mark.slow
def test_report_and_placement_sweep_write_their_keys(tmp_path):
    from laminar_mcore.sim.report import main as report
    from laminar_mcore.sim.paper import AVERAGES

    out = tmp_path / "report.json"
    figures = report(["--models", "7B", "--gpus-max", "32", "--warmup", "1", "--measure", "1",
                      "--splits-per-point", "1", "--explain",
                      "--batch-prompts", "32", "--jobs", "1", "--norepack-everywhere",
                      "--plot-dir", str(tmp_path), "--json", str(out)])
    on_disk = json.loads(out.read_text())
    assert on_disk == figures
    for key in ("laminar_vs_verl_avg", "laminar_vs_verl_max", "laminar_vs_areal_avg",
                "laminar_vs_areal_max", "laminar_vs_one_step_avg", "laminar_vs_stream_avg",
                "calibration_error", "scaling_efficiency", "repack_generation_gain_7B_32",
                "staleness_max", "chain_72b_127_relays_s", "laminar_vs_verl_le64_avg",
                "paper_max_rel_error", "tokens_per_s_spread_7B_32_laminar"):
        assert key in figures, key
    assert figures["laminar_vs_verl_max"] >= figures["laminar_vs_verl_avg"] > 1.0
    assert all(isinstance(v, (int, float, str, type(None))) for v in figures.values())  # flat
    assert figures["calibration_error"] is None  # the benchmark runs only with --calibrate
    # every system at the split its sweep chose, recorded per point
    for mode in ("sync", "one_step", "stream", "areal", "laminar"):
        t = figures[f"trainer_gpus_7B_32_{mode}"]
        assert t == 32 if mode == "sync" and figures[f"rollout_gpus_7B_32_{mode}"] == 32 \
            else t in (8, 16, 24), (mode, t)
    # paper pairs: each figure beside the paper's, the largest relative error over them
    errs = [abs(figures[f"sim_{k[6:]}"] - v) / v for k, v in figures.items()
            if k[6:] in AVERAGES and isinstance(figures.get(f"sim_{k[6:]}"), (int, float))]
    assert figures["paper_max_rel_error"] == pytest.approx(max(errs), abs=1e-3)
    assert figures["paper_laminar_vs_areal_avg"] == 1.39
    assert figures["paper_max_rel_error_maxima_pairs"] == \
        "laminar_vs_verl_max,laminar_vs_one_step_max,laminar_vs_stream_max,laminar_vs_areal_max"
    assert figures["staleness_max_laminar"] == figures["staleness_max"]
    assert figures["engine_tp_7B_32_one_step"] == 2 and figures["engine_tp_7B_32_laminar"] == 1
    assert "laminar_vs_areal_eta4_avg" in figures and "laminar_vs_all_le64_avg" in figures
    # --explain: laminar again at 16 and 32 GPUs without the trainer's step costs
    assert figures["explain_scaling_efficiency_without_step_costs"] > 0
    assert figures["explain_tokens_per_s_without_step_costs_7B_32"] != \
        figures["tokens_per_s_7B_32_laminar"]
    # ... and at laminar's most stale point with a buffer of one batch: no staler than the 8's
    point = figures["explain_staleness_point"]
    assert figures[f"staleness_max_{point}_laminar"] == figures["staleness_max_laminar"]
    assert figures["explain_staleness_max_laminar_buffer_1"] <= figures["staleness_max_laminar"]
    assert figures[f"explain_tokens_per_s_laminar_buffer_8_{point}"] == \
        figures[f"tokens_per_s_{point}_laminar"]
    # ... the floor of the longest responses' staleness, and the cap 2 iterations put on it
    assert figures["explain_staleness_run_cap"] == 1
    assert figures["explain_staleness_floor_laminar_7B_32"] >= 0
    # ... and with and without repack where the table has both, with prefill free
    for g in (16, 32):
        assert f"explain_repack_generation_gain_without_prefill_7B_{g}" in figures
        for k in ("repack", "norepack"):
            assert 0 < figures[f"explain_kv_utilisation_{k}_without_prefill_7B_{g}"] <= 1
    assert os.path.exists(tmp_path / "sim_tokens_per_s_7B.png")

    sweep = report(["--sweep-placement", "--model", "7B", "--gpus", "32", "--iterations", "2",
                    "--batch-prompts", "32", "--jobs", "1", "--json", str(tmp_path / "s.json")])
    splits = [k for k in sweep if k.startswith("tokens_per_s_trainer_")]
    assert len(splits) == 3  # 8, 16 and 24 of 32 GPUs to the trainer
    assert sweep["mode"] == "laminar"
    assert sweep["fastest_tokens_per_s"] == max(sweep[k] for k in splits)
    within = [sweep[k] for k in splits if sweep[k.replace("tokens_per_s", "staleness_max")] <= 4]
    assert sweep["best_tokens_per_s"] == max(within or [sweep["fastest_tokens_per_s"]])
    assert sweep["best_trainer_gpus"] + sweep["best_rollout_gpus"] == 32


def test_bad_arguments_are_clear_errors():
    from laminar_mcore.sim.report import main as report

    with pytest.raises(ValueError, match="not one of"):
        simulate(SimConfig(mode="fast"))
    with pytest.raises(SystemExit):
        report(["--models", "13B", "--no-calibrate"])
    with pytest.raises(SystemExit, match="whole machines"):
        report(["--sweep-placement", "--model", "7B", "--gpus", "8"])


REFERENCE = os.path.join(os.path.dirname(__file__), os.pardir, "laminar_mcore", "sim",
                         "calibration_reference.json")


def test_simulator_predicts_the_stored_bench_modes_measurement(tmp_path):
    """Fed with the costs measured on this kind of machine (``sim.calibrate``'s stored JSON:
    engine decode steps, an engine's pull, the trainer's busy seconds), the simulator predicts
    the ratios ``bench.modes`` measured in the same run within 20%, and predicts them the same
    way every time: the replay is deterministic, so it does not depend on this machine's speed
    (the live calibration is the benchmark ``python -m laminar_mcore.sim.calibrate``; no test
    runs it)."""
    from laminar_mcore.sim.calibrate import main as calibrate

    with open(REFERENCE) as f:
        stored = json.load(f)
    figures = calibrate(["--costs-json", REFERENCE, "--json", str(tmp_path / "replay.json")])
    for other in ("sync", "one_step"):
        assert figures[f"measured_laminar_vs_{other}"] == stored[f"measured_laminar_vs_{other}"]
        assert figures[f"predicted_laminar_vs_{other}"] == pytest.approx(
            stored[f"predicted_laminar_vs_{other}"], abs=0.002)
    assert figures["calibration_error"] < 0.20, figures
    assert figures["engine_step_fixed_ms"] == stored["engine_step_fixed_ms"]
    again = calibrate(["--costs-json", REFERENCE])
    assert {k: v for k, v in again.items() if k != "wall_s"} == \
        {k: v for k, v in figures.items() if k != "wall_s"}


def test_a_calibration_replay_refuses_a_json_that_is_not_a_calibration(tmp_path):
    from laminar_mcore.sim.calibrate import main as calibrate

    bad = tmp_path / "modes.json"
    bad.write_text(json.dumps({"laminar_vs_sync": 2.0, "steps": 16}))
    with pytest.raises(SystemExit) as err:
        calibrate(["--costs-json", str(bad)])
    assert "missing prompt_tokens" in str(err.value) and "sim.calibrate --json" in str(err.value)


def test_a_bug_that_fails_every_trajectory_stops_the_run_instead_of_spinning(caplog):
    """The production manager asks simulated engines for routed experts, which they cannot
    return: every trajectory fails. The run stops (after MAX_INTERNAL_ERRORS_IN_A_ROW), says
    why once, and logs only the first few tracebacks."""
    import logging

    from laminar_mcore.controller.manager import RolloutManager

    with caplog.at_level(logging.ERROR, logger="laminar_mcore.controller.manager"):
        with pytest.raises((SimulationStalled, RuntimeError)):
            _run("laminar", routed_experts=True)
    stops = [r for r in caplog.records if "trajectories in a row" in r.getMessage()]
    assert len(stops) == 1 and "GenerateReqInput extras" in stops[0].getMessage()
    assert sum("the trajectory is discarded" in r.getMessage() for r in caplog.records) == 3
    assert RolloutManager.MAX_INTERNAL_ERRORS_IN_A_ROW == 64


def test_verl_pays_a_global_broadcast_behind_a_barrier_where_laminar_pays_a_publish():
    """verl disaggregated, one-step, stream and AReaL update by one NCCL broadcast that stops
    the trainer and every engine (costs.PROTOCOL, verl's checkpoint engine); laminar stalls
    its trainer for the publish only; colocated verl reshards in place."""
    cost = CostModel("7B")
    split = _run("sync", split_trainer_gpus=16)  # verl on its own rollout GPUs
    relayed = _run("sync", split_trainer_gpus=16, protocols=False)  # same, laminar's relays
    colocated = _run("sync")
    lam = _run("laminar")
    assert (split.protocol, colocated.protocol, lam.protocol) == \
        ("broadcast", "colocated", "laminar")
    assert split.trainer_update_stall_s == pytest.approx(cost.broadcast_s())
    assert split.update_s == pytest.approx(cost.broadcast_s()) and cost.broadcast_s() > 2.0
    assert lam.trainer_update_stall_s == pytest.approx(cost.publish_s(), rel=1e-3)
    # a synchronous loop adds the whole barrier to each iteration
    assert split.iteration_s - relayed.iteration_s == pytest.approx(
        cost.broadcast_s() - cost.pull_s(), rel=0.1)
    assert colocated.trainer_gpus == 32 and colocated.publish_s == 0.0
    for mode in ("one_step", "stream", "areal"):
        assert _run(mode).protocol == "broadcast", mode


def test_areal_re_prefills_what_its_updates_interrupt():
    """An update flushes the radix cache (SGLang's default) and AReaL resubmits every
    interrupted request with its prefix: its engines prefill far more than laminar's, whose
    trajectories each run on one version."""
    areal, lam = _run("areal"), _run("laminar")
    assert areal.interrupted > 0 and lam.interrupted == 0
    assert areal.prefill_tokens > 1.5 * lam.prefill_tokens


def test_throughput_is_measured_as_the_paper_measures():
    """Prompt + response tokens of each batch over the time since the previous update,
    averaged over the iterations after the warm-up, with their spread."""
    r = _run("laminar", warmup=2)
    assert r.measured_iterations == 2
    assert r.tokens_per_s_min <= r.tokens_per_s <= r.tokens_per_s_max
    assert r.tokens_per_s_spread == pytest.approx(
        (r.tokens_per_s_max - r.tokens_per_s_min) / r.tokens_per_s)
    # prompt tokens count too: more than the response tokens alone
    assert r.tokens_per_s > r.response_tokens_per_s * 0.9


def test_transfers_that_share_a_nic_share_its_bandwidth():
    from laminar_mcore.sim.network import Network

    async def main():
        loop = asyncio.get_running_loop()
        net = Network(nic_bytes_s=100.0)
        alone = await net.transfer("a", "b", 1000, cap=100.0)
        t0 = loop.time()
        # two out of machine a at once: 50 bytes/s each, so each takes twice as long
        both = await asyncio.gather(net.transfer("a", "b", 1000, cap=100.0),
                                    net.transfer("a", "c", 1000, cap=100.0))
        # one from a to b and one from c to d: no NIC shared
        apart = await asyncio.gather(net.transfer("a", "b", 1000, cap=100.0),
                                     net.transfer("c", "d", 1000, cap=100.0))
        # a transfer's own cap binds below the NIC's share
        capped = await net.transfer("a", "b", 1000, cap=10.0)
        # a second transfer joining half-way slows only the rest of the first
        first = asyncio.ensure_future(net.transfer("x", "y", 1000, cap=100.0))
        await asyncio.sleep(5.0)
        second = await net.transfer("x", "z", 250, cap=100.0)
        return alone, both, apart, capped, await first, second, net.shared_s, loop.time() - t0

    alone, both, apart, capped, first, second, shared, _ = run_virtual(main())
    assert alone == pytest.approx(10.0)
    assert both == [pytest.approx(20.0), pytest.approx(20.0)]
    assert apart == [pytest.approx(10.0), pytest.approx(10.0)]
    assert capped == pytest.approx(100.0)
    assert second == pytest.approx(5.0)  # 250 bytes at 50/s
    assert first == pytest.approx(12.5)  # 500 alone (5 s), 250 shared (5 s), 250 alone
    assert shared > 0


def test_the_relay_chain_on_the_network_keeps_laminars_timing():
    """Without contention every hop ends when Laminar's T(p, k) says (chain_hop_s)."""
    from laminar_mcore.sim.relays import RelayTier

    cost = CostModel("72B")

    async def main():
        loop = asyncio.get_running_loop()
        tier = RelayTier(cost, 16, "laminar")
        t0 = loop.time()
        stall = await tier.publish(lambda: 1)
        held = {}
        while len(held) < 16:
            for i, r in enumerate(tier.relays):
                if r.version == 1 and i not in held:
                    held[i] = loop.time() - t0 - stall
            await asyncio.sleep(0.001)
        await tier.close()
        return stall, held

    stall, held = run_virtual(main())
    assert stall == pytest.approx(cost.publish_s(), rel=1e-6)
    for i in (1, 8, 15):
        assert held[i] == pytest.approx(cost.chain_hop_s(16, i), abs=0.002)


def test_a_killed_rollout_machine_dips_and_recovers(monkeypatch):
    """Laminar section 8.4: a rollout machine killed; its trajectories resume elsewhere, the
    machine comes back (detect + restart, its relay re-fetches, its engines pull) at the
    time the failure constants say, and the training throughput dips at most slightly."""
    from laminar_mcore.sim import costs

    monkeypatch.setitem(costs.FAILURE, "detect_s", 5.0)
    monkeypatch.setitem(costs.FAILURE, "restart_s", 20.0)
    base = _run("laminar", trainer_fraction=0.25)  # 24 rollout GPUs: 3 machines
    r = _run("laminar", trainer_fraction=0.25, fail=(1, 60.0), fail_horizon_s=50.0)
    f = r.failure
    assert r.books_balance and r.relays == 3
    assert f["fail_detect_s"] == pytest.approx(5.0)
    cost = CostModel("7B")
    assert 25.0 + cost.pull_s() <= f["fail_recovery_s"] <= 25.0 + cost.pull_s() + 20.0
    # as the paper saw: training throughput unaffected or dipping slightly (the trainer eats
    # the experience buffer while a third of the engines are gone for 25 s)
    assert f["fail_tokens_per_s_before"] > 0 and -0.1 < f["fail_dip"] < 0.25
    assert f["fail_tokens_per_s_after_recovery"] > 0.8 * base.tokens_per_s


def test_paper_pairs_and_the_sensitivity_spread():
    from laminar_mcore.sim import costs
    from laminar_mcore.sim.paper import PAPER, paper_pairs
    from laminar_mcore.sim.sensitivity import applied, constants, spread, variants

    from laminar_mcore.sim.paper import AVERAGES, MAXIMA

    pairs = paper_pairs({"laminar_vs_verl_avg": 2.56 * 1.5, "staleness_max_laminar": 9,
                         "laminar_vs_verl_max": 5.49 * 0.9})
    assert pairs["paper_laminar_vs_verl_avg"] == 2.56 and pairs["sim_staleness_max_laminar"] == 9
    # the averages' maximum covers the averages only; the maxima have their own; staleness
    # is paired in neither
    assert pairs["paper_max_rel_error"] == pytest.approx(0.5)
    assert pairs["paper_max_rel_error_maxima"] == pytest.approx(0.1)
    assert pairs["rel_error_staleness_max_laminar"] == pytest.approx(1.25)
    assert pairs["paper_max_rel_error_pairs"].split(",") == list(AVERAGES)
    assert pairs["paper_max_rel_error_maxima_pairs"].split(",") == list(MAXIMA)
    assert {"laminar_vs_all_le64_avg", "scaling_efficiency", "repack_generation_gain_32B_128",
            "laminar_vs_verl_avg", "laminar_vs_one_step_avg", "laminar_vs_stream_avg",
            "laminar_vs_areal_avg"} == set(AVERAGES)
    assert set(PAPER) >= {"staleness_max_laminar", "laminar_vs_best_baseline_largest_avg",
                          "scaling_efficiency_best_baseline", "kv_utilisation_repack_32B_128"}
    names = constants()
    assert {"PROTOCOL.nccl_broadcast_bytes_s", "EFFICIENCY.trainer_mfu",
            "Workload.max_response"} <= set(names)
    assert len(variants()) == 2 * len(names)
    before = costs.EFFICIENCY["trainer_mfu"]
    with applied({"EFFICIENCY.trainer_mfu": before * 1.2}):
        assert costs.EFFICIENCY["trainer_mfu"] == pytest.approx(before * 1.2)
    assert costs.EFFICIENCY["trainer_mfu"] == before  # restored
    out = spread({"r": 2.0}, [({"A.x": 1}, {"r": 1.9}), ({"A.x": 2}, {"r": 2.1}),
                              ({"B.y": 1}, {"r": 1.5}), ({"B.y": 2}, {"r": 2.2})])
    assert (out["r_min"], out["r_max"], out["r_most_sensitive_to"]) == (1.5, 2.2, "B.y")


def test_a_relay_rejoining_shares_the_masters_nic_with_the_chain():
    """Where the NIC binds (72B at a 100 GB/s NIC, below the chain's 200 GB/s link), a relay
    re-joining after a failure and the chain's first hop both leave the master's NIC: each runs
    at half of it, so both take twice as long as either alone (network.py's equal shares)."""
    from laminar_mcore.sim.network import Network
    from laminar_mcore.sim.relays import RelayTier

    cost = CostModel("72B")
    nic = 100e9
    alone_s = cost.weight_bytes / nic

    async def run(rejoin: bool):
        loop = asyncio.get_running_loop()
        tier = RelayTier(cost, 3, "laminar", Network(nic_bytes_s=nic))
        tier.kill(2)  # the chain is then master -> relay 1
        stall = await tier.publish(lambda: 1)
        t0 = loop.time()
        rejoin_s = await tier.rejoin(2) if rejoin else None
        while tier.relays[1].version < 1:
            await asyncio.sleep(0.01)
        hop_s = loop.time() - t0
        await tier.close()
        return stall, rejoin_s, hop_s, tier.network.shared_s

    stall, _, hop_alone, shared_alone = run_virtual(run(False))
    _, rejoin_s, hop_shared, shared = run_virtual(run(True))
    assert stall == pytest.approx(alone_s, rel=1e-6)  # the publish: NIC-bound, alone
    assert hop_alone == pytest.approx(alone_s, rel=0.02)
    # network_shared_s: transfer-seconds below their own link rate (publish and hop: the NIC's)
    assert shared_alone == pytest.approx(2 * alone_s, rel=0.02)
    # sharing the master's outgoing NIC: 50 GB/s each, twice the time alone
    assert rejoin_s == pytest.approx(2 * alone_s, rel=1e-6)
    assert hop_shared == pytest.approx(2 * alone_s, rel=0.02)
    assert shared == pytest.approx((1 + 2 + 2) * alone_s, rel=0.02)  # publish, hop, rejoin


# ---------------------------------------------------------------- the CLI, end to end
def _cli(tmp_path, *args) -> dict:
    """``python -m laminar_mcore.sim.report ARGS --json PATH`` in a subprocess; its JSON."""
    import subprocess
    import sys

    out = tmp_path / "out.json"
    root = os.path.join(os.path.dirname(__file__), os.pardir)
    proc = subprocess.run([sys.executable, "-m", "laminar_mcore.sim.report", *args,
                           "--json", str(out)], cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert all(isinstance(v, (int, float, str, type(None))) for v in figures.values())  # flat
    return figures


def test_cli_sensitivity_reports_each_ratios_spread(tmp_path):
    from laminar_mcore.sim.extras import HEADLINE
    from laminar_mcore.sim.sensitivity import constants

    varied = ["EFFICIENCY.trainer_mfu", "Workload.sigma_sample"]
    f = _cli(tmp_path, "--sensitivity", "--sensitivity-points", "7B@16", "--batch-prompts", "8",
             "--iterations", "3", "--warmup", "1", "--jobs", "1", "--constants", ",".join(varied))
    assert f["sensitivity_points"] == "7B@16" and f["sensitivity_factor"] == 0.2
    for ratio in HEADLINE:
        base, low, high = f[f"{ratio}_base"], f[f"{ratio}_min"], f[f"{ratio}_max"]
        assert 0 < low <= base <= high, (ratio, low, base, high)
        assert f[f"{ratio}_most_sensitive_to"] in varied and set(varied) <= set(constants())
        moved = [k for k in f if k.startswith(f"{ratio}@")]
        assert len(moved) == 2 * len(varied)  # each constant at -20% and +20%
        assert min(f[k] for k in moved) == low and max(f[k] for k in moved) == high


def test_cli_fail_reports_the_dip_and_the_recovery(tmp_path):
    placements = tmp_path / "placements.json"
    placements.write_text(json.dumps({"trainer_gpus_7B_32_laminar": 8}))  # 3 rollout machines
    f = _cli(tmp_path, "--fail", "1@60", "--model", "7B", "--gpus", "32", "--batch-prompts",
             "8", "--iterations", "3", "--placements", str(placements))
    assert (f["fail_machine"], f["fail_at_s"], f["trainer_gpus"]) == (1, 60.0, 8)
    # this tiny run is trainer-bound: its buffer may carry it through (a negative dip); the
    # dip's size is test_a_killed_rollout_machine_dips_and_recovers'
    assert -1 < f["fail_dip"] <= 1
    assert f["fail_detect_s"] == 20.0  # SGLang's health-check timeout (costs.FAILURE)
    assert f["fail_recovery_s"] > 20.0 + 180.0  # detect + restart, then the relay and pulls
    assert f["fail_tokens_per_s_before"] > 0 and f["fail_tokens_per_s_after_recovery"] > 0
