"""The simulator's cost model and placement sweep: the chain and delta-sync formulas, a training
step's busiest rank, the sweep's candidates and its bound, and which constants a run reads
(the sensitivity's reuse of base runs)."""

import pytest

from laminar_mcore.relay.chain import chain_time
from laminar_mcore.sim.cluster import SimConfig, simulate
from laminar_mcore.sim.costs import LINKS, CostModel
from laminar_mcore.sim.workload import Workload

SMALL = Workload(batch_prompts=32, samples=16)


def test_chain_cost_is_laminars_formula_at_the_best_chunking():
    cost = CostModel("72B")
    m_tbyte, t_start = cost.weight_bytes / LINKS["chain_bytes_s"], LINKS["chain_start_s"]
    best = min(chain_time(126, int(cost.weight_bytes), k, 1 / LINKS["chain_bytes_s"], t_start)
               for k in range(1, 2000))
    assert cost.chain_s(127) == pytest.approx(best, rel=1e-3)
    assert cost.chain_s(127) < 1.6  # Laminar: under 1.6 s for 72B to 127 relays
    assert cost.chain_hop_s(127, 126) == pytest.approx(cost.chain_s(127))
    assert cost.chain_s(127) > m_tbyte  # at least one copy of the model's bytes
    assert cost.publish_s() == pytest.approx(1.40, abs=0.05)  # the paper's actor stall


def test_weight_sync_with_deltas_follows_the_documented_pipeline_formula():
    """costs.relay_sync_seconds for the 1T MoE (Kimi-K2's shape) on 64 relays, against the
    formula of docs/simulator.md computed here from its parts: the slowest of encode, publish,
    the chain's throughput and rebuild, plus one bucket's latency and the chain's fill."""
    import math

    from laminar_mcore.sim.costs import (DELTA, MOE_MODELS, relay_sync_seconds,
                                         relay_sync_stages)
    from laminar_mcore.sim.report import weight_sync_figures

    params, relays, pp, bucket = 1.04e12, 64, 16, 512 * 2**20
    full_bytes = params * 2  # bf16
    pub, t_byte, t_start = LINKS["publish_bytes_s"], 1 / LINKS["chain_bytes_s"], \
        LINKS["chain_start_s"]

    def reference(ratio, encode=math.inf, apply=math.inf):
        wire = full_bytes / ratio
        p = relays  # the master plus 63 chained relays
        k = max(1, round(math.sqrt((p - 2) * wire * t_byte / t_start)))
        chunk = wire / k * t_byte + t_start
        slowest = max(full_bytes / pp / encode, wire / pub, k * chunk, full_bytes / apply)
        return slowest + bucket / encode + bucket / ratio / pub + bucket / apply + (p - 2) * chunk

    # whole: 2.08 TB over the 103 GB/s publish link, the chain behind it (its fill), one bucket
    full = relay_sync_seconds(params, relays, False, pp=pp)
    assert full == pytest.approx(reference(1.0), rel=1e-9)
    assert full == pytest.approx(full_bytes / pub, rel=0.06)  # publish-bound: ~20.2 s + fill
    # with deltas at DELTA's figures: the same formula with encode and rebuild in it
    default = relay_sync_seconds(params, relays, True, pp=pp)
    assert default == pytest.approx(reference(DELTA["bytes_ratio"], DELTA["encode_bytes_s"],
                                              DELTA["apply_bytes_s"]), rel=1e-9)
    # where encode and rebuild keep up, the wire bytes decide: a delta beats the whole
    # version and its time falls with the ratio (publish time exactly as 1 / ratio)
    fast = {"encode_bytes_s": 1e15, "apply_bytes_s": 1e15}
    times = {r: relay_sync_seconds(params, relays, True, pp=pp, bytes_ratio=r, **fast)
             for r in (25.0, 50.0, 100.0)}
    for r, t in times.items():
        assert t == pytest.approx(reference(r, 1e15, 1e15), rel=1e-9)
    assert times[100.0] < times[50.0] < times[25.0] < full
    # 4x fewer bytes: 3x less time (the chain's per-chunk start costs do not shrink)
    assert times[25.0] / times[100.0] > 2.5
    wire = [relay_sync_stages(params, relays, True, pp=pp, bytes_ratio=r, **fast)
            for r in (25.0, 100.0)]
    assert wire[0]["publish_s"] == pytest.approx(4 * wire[1]["publish_s"], rel=1e-12)
    # rebuild throughput bounds it: the relays rebuild every full byte
    slow = relay_sync_seconds(params, relays, True, pp=pp, apply_bytes_s=1e9, encode_bytes_s=1e15)
    assert slow >= full_bytes / 1e9
    # the report's flat keys, from the same function
    figures = weight_sync_figures()
    m = MOE_MODELS["1t"]
    assert (m["params"], m["relays"], m["trainer_pp"]) == (params, relays, pp)
    assert figures["sync_s_1t_stage_lead_full"] == round(full, 3)
    assert figures["sync_s_1t_stage_lead"] == round(default, 3)
    assert figures["delta_bytes_ratio_assumed"] == DELTA["bytes_ratio"]
    assert {"sync_s_235b_stage_lead", "sync_s_235b_stage_lead_full"} <= set(figures)
    # weight_sync.delta=auto over the paper's NICs: whole versions, never the slower path
    for name in MOE_MODELS:
        assert figures[f"delta_auto_{name}_stage_lead"] is False
        assert figures[f"sync_s_{name}_stage_lead_auto"] == min(
            figures[f"sync_s_{name}_stage_lead"], figures[f"sync_s_{name}_stage_lead_full"])


def test_the_striped_path_follows_its_documented_formula():
    """sim/sharded.py at the 1T anchor (256 trainer GPUs, 128 rollout GPUs, 32-GPU engines),
    computed here from its parts: each rank copies 1/256 of 2.08 TB; a rollout node takes a
    quarter (its 8 of an engine's 32 GPUs), 1/16 of the version straight from the trainer and
    the rest from its peers on the same NICs; the report's keys come from it, auto never picks
    the slower way, and per-rank export stalls the trainer less than a PP16 stage lead."""
    from laminar_mcore.sim.costs import BUCKET_BYTES
    from laminar_mcore.sim.report import weight_sync_figures
    from laminar_mcore.sim.sharded import (ANCHORS, EXPORT_BYTES_S, H2D_BYTES_S,
                                           sharded_sync_stages)

    a = ANCHORS["1t"]
    assert (a["trainer_gpus"], a["rollout_gpus"], a["engine_gpus"]) == (256, 128, 32)
    full_bytes = 1.04e12 * 2
    st = sharded_sync_stages(1.04e12, 256, 128, 32, False)
    assert st["share"] == 0.25 and st["stripes"] == 32  # one stripe per trainer node
    assert st["trainer_stall_s"] == pytest.approx(full_bytes / 256 / EXPORT_BYTES_S)
    direct, share = full_bytes / 16, full_bytes / 4
    ingress = direct / LINKS["publish_bytes_s"] + (share - direct) / LINKS["chain_bytes_s"]
    assert st["node_ingress_s"] == pytest.approx(ingress)
    fill = 3 * (BUCKET_BYTES / LINKS["chain_bytes_s"] + LINKS["chain_start_s"])
    latency = BUCKET_BYTES / EXPORT_BYTES_S + BUCKET_BYTES / LINKS["publish_bytes_s"]
    assert st["total_s"] == pytest.approx(ingress + fill + latency)  # ingress-bound
    assert st["engine_pause_bound_s"] == pytest.approx(full_bytes / 32 / H2D_BYTES_S)
    assert st["engine_pause_s"] == pytest.approx(
        full_bytes / 32 / LINKS["pull_bytes_s"] + LINKS["pull_fixed_s"])
    # a node that served the whole model (engines within a node) would take all of it
    assert sharded_sync_stages(1.04e12, 256, 128, 8, False)["share"] == 1.0
    figures = weight_sync_figures()
    assert figures["sync_s_1t_full"] == round(st["total_s"], 3)
    for name in ANCHORS:
        assert figures[f"sync_s_{name}"] == min(figures[f"sync_s_{name}_full"],
                                                figures[f"sync_s_{name}_delta"])
        assert figures[f"trainer_stall_s_{name}"] < figures[f"trainer_stall_s_{name}_stage_lead"]
        assert figures[f"engine_pause_s_{name}"] > figures[f"engine_pause_bound_s_{name}"]


# ---------------------------------------------------------------- issue 33: protocols, measurement


def test_placement_candidates_are_the_same_sweep_for_every_system():
    from laminar_mcore.sim.placement import best, candidate_trainer_gpus

    cost = CostModel("7B")
    assert candidate_trainer_gpus("laminar", 256, cost, 3) == [64, 128, 192]
    assert candidate_trainer_gpus("sync", 256, cost, 3) == [256, 64, 128, 192]  # + colocated
    # the report's 5 splits (whole machines at 1/6 .. 5/6 of 32), and the paper's Table 2
    # split where it gives one (laminar 192, one-step 40, AReaL 128: already a candidate)
    assert candidate_trainer_gpus("laminar", 256, cost) == [40, 88, 128, 168, 216, 192]
    assert candidate_trainer_gpus("areal", 256, cost) == [40, 88, 128, 168, 216]
    assert candidate_trainer_gpus("sync", 256, cost) == [256, 40, 88, 128, 168, 216]
    assert candidate_trainer_gpus("laminar", 128, cost) == [24, 40, 64, 88, 104]
    runs = [{"tokens_per_s": 10, "staleness": {"5": 1}, "trainer_gpus": 8},
            {"tokens_per_s": 7, "staleness": {"2": 1}, "trainer_gpus": 16}]
    assert best(runs, 4)["trainer_gpus"] == 16  # the fastest within the staleness limit
    assert best(runs, 9)["trainer_gpus"] == 8


def test_a_training_step_lasts_as_long_as_its_busiest_data_parallel_rank():
    """A fixed global batch over more trainer GPUs: the step shrinks with the ranks until
    one rank holds only the batch's longest sequence, then stops shrinking."""
    cost = CostModel("7B")  # trainer TP 2: 96 data-parallel ranks on 192 GPUs

    def group_s(flops):  # one model-parallel group (TP 2) computing ``flops``
        return flops / (2 * cost.hw["peak_flops"] * cost.trainer_efficiency())

    tail, rest = 16384 + 180, [1400] * 511
    seqs = [tail] + rest
    longest = group_s(cost.sequence_flops(tail))
    step = cost.train_step_compute_s  # the compute; train_step_s adds the step's own costs
    assert step(seqs, 192) == pytest.approx(longest)  # 5 sequences per rank
    assert step(seqs, 384) == pytest.approx(longest)  # more GPUs: no faster
    small = step(seqs, 8)  # 4 ranks of ~128 sequences: balanced
    total = sum(cost.sequence_flops(n) for n in seqs)
    assert group_s(total / 4) <= small <= group_s(total / 4) * 1.01
    # never faster than the linear model the sweep's bound uses; equal when balanced and short
    assert small >= cost.train_s(sum(seqs), 8)
    for g in (8, 192, 384):
        assert cost.train_step_s(seqs, g) == pytest.approx(step(seqs, g) +
                                                           cost.step_overhead_s(g))
    even = step([1000] * 64, 8)
    assert even == pytest.approx(group_s(16 * cost.sequence_flops(1000)))
    assert even == pytest.approx(cost.train_s(64_000, 8) * (1 + 3584 * 28 * 1000 / 7.62e9),
                                 rel=1e-3)  # + causal attention


def test_the_sweeps_bound_is_never_beaten():
    """Every split the sweep may skip is skipped on a bound no run of it beats: each system
    at every candidate split, measured as the sweep measures (one iteration after one)."""
    from laminar_mcore.sim.costs import cost_for
    from laminar_mcore.sim.placement import candidate_trainer_gpus, throughput_bound

    w = Workload(batch_prompts=16)
    for mode in ("sync", "one_step", "stream", "areal", "areal_eta4", "laminar"):
        cost = cost_for("7B", mode)  # the paper's engine TP for the system
        for t in candidate_trainer_gpus(mode, 32, cost, 3):
            r = simulate(SimConfig(model="7B", mode=mode, gpus=32, iterations=2, warmup=1,
                                   split_trainer_gpus=t, workload=w))
            bound = throughput_bound(mode, cost, 32, t, w)
            assert r.tokens_per_s <= bound, (mode, t, r.tokens_per_s, bound)


def test_a_constant_of_another_weight_protocol_does_not_move_a_run():
    """What lets --sensitivity reuse the base run: a laminar run does not read the NCCL
    broadcast's constants and a broadcast run not the relays' links (checked on real runs,
    so a protocol that starts reading another's constant fails here)."""
    from laminar_mcore.sim.jobs import run_one
    from laminar_mcore.sim.sensitivity import unread

    def run(mode, override):
        spec = dict(model="7B", mode=mode, gpus=32, iterations=3, warmup=1, workload=SMALL,
                    split_trainer_gpus=16, overrides=override)
        return {k: v for k, v in run_one(spec).items() if k not in ("wall_s", "overrides")}

    nccl = {"PROTOCOL.nccl_broadcast_bytes_s": 4e9}
    links = {"LINKS.publish_bytes_s": 50e9, "LINKS.pull_bytes_s": 20e9}
    assert unread(nccl, "laminar") and unread(links, "broadcast")
    assert not unread(nccl, "broadcast") and not unread(links, "laminar")
    assert not unread({"EFFICIENCY.trainer_mfu": 0.3}, "laminar")
    assert not unread({"Workload.sigma_sample": 0.7}, "broadcast")
    # half of 7B laminar's TP 1 is TP 1 again (the clamp): the base run; half of verl's TP 2 is not
    half = {"SETTING.engine_tp_scale": 0.5}
    assert unread(half, "laminar", "laminar", "7B") and not unread(half, "laminar", "laminar")
    assert not unread(half, "colocated", "sync", "7B") and not unread(half, "laminar", "laminar",
                                                                         "32B")
    assert run("laminar", half) == run("laminar", None)
    assert run("laminar", nccl) == run("laminar", None)
    assert run("one_step", links) == run("one_step", None)
    # and the constants a protocol does read move it
    assert run("laminar", links)["tokens_per_s"] != run("laminar", None)["tokens_per_s"]
    assert run("one_step", nccl)["tokens_per_s"] != run("one_step", None)["tokens_per_s"]
