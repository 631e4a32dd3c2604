"""The trainer's per-step costs (issue 54): the distributed optimizer's data-parallel
collectives over the trainer's NICs, the Adam step over HBM and a fixed cost per step, on top
of each step's busiest rank; and the paper's settings per system (engine TP, AReaL's eta)."""

import asyncio

import pytest

from laminar_mcore.sim.clock import run_virtual
from laminar_mcore.sim.cluster import Placement, SimConfig, SimTrainer, simulate
from laminar_mcore.sim.costs import (ENGINE_TP_PAPER, HARDWARE, NETWORK, TRAINER, CostModel,
                                     cost_for)
from laminar_mcore.sim.workload import Workload


def _step_formula(gpus: int, seqs) -> float:
    """One 7B optimizer step at trainer TP 2, written out from the constants: the busiest
    rank's compute (equal sequences: 512 / d each), the fp32 reduce-scatter and bf16
    all-gather of its shard over its NIC at the link fraction, the Adam step (30 bytes a
    parameter of its shard) over HBM, the fixed cost."""
    cost, hw = CostModel("7B"), HARDWARE["H800"]
    n, tp = 7.62e9, 2
    d = gpus // tp
    per_rank = len(seqs) // d * cost.sequence_flops(seqs[0])
    compute = per_rank / (tp * hw["peak_flops"] * 0.42)
    link = (NETWORK["nic_bytes_s"] / 8 if gpus > 8 else hw["nvlink_bytes_s"]) * 0.5
    comm = (d - 1) / d * n / tp * (4 + 2) / link
    adam = n / (tp * d) * 30 / (hw["hbm_bytes_s"] * 0.75)
    return compute + comm + adam + 0.1


def test_scaling_efficiency_falls_as_the_trainer_grows_by_what_the_formula_gives():
    assert (TRAINER["dp_link_fraction"], TRAINER["dp_exposed"], TRAINER["step_fixed_s"],
            TRAINER["optimizer_bandwidth"]) == (0.5, 1.0, 0.1, 0.75)
    cost = CostModel("7B")
    seqs = [1400] * 512  # one mini-batch of the paper's 512 x 16 batch, balanced lengths
    for g in (8, 16, 64, 256):
        assert cost.train_step_s(seqs, g) == pytest.approx(_step_formula(g, seqs), rel=1e-9)
    # per-GPU throughput at a fixed batch, 256 trainer GPUs against 16
    eff = (cost.train_step_s(seqs, 16) * 16) / (cost.train_step_s(seqs, 256) * 256)
    assert eff == pytest.approx(_step_formula(16, seqs) * 16 / (_step_formula(256, seqs) * 256))
    assert 0.2 < eff < 0.5  # without the step's own costs it would be 1 (compute only)
    compute_only = (cost.train_step_compute_s(seqs, 16) * 16) / (
        cost.train_step_compute_s(seqs, 256) * 256)
    assert compute_only == pytest.approx(1.0)
    # the efficiency keeps falling as the trainer grows
    effs = [(cost.train_step_s(seqs, 16) * 16) / (cost.train_step_s(seqs, g) * g)
            for g in (32, 64, 128, 256)]
    assert effs == sorted(effs, reverse=True)
    # a measured trainer (calibration) already holds its step costs
    assert CostModel("7B", trainer_per_token_s=1e-6).step_overhead_s(256) == 0.0


def test_the_trainers_collectives_share_its_nics_with_the_publish():
    """A trainer spanning machines sends its collectives over the network model: alone they
    take the formula's seconds; where a publish leaves the same NICs at once and the NIC
    binds, the two share it (``network_shared_s``)."""
    from laminar_mcore.sim.network import Network
    from laminar_mcore.sim.relays import RelayTier

    cost = CostModel("7B")
    place = Placement(64, 32)

    async def run(nic, publish: bool):
        tier = RelayTier(cost, 4, "laminar", Network(nic_bytes_s=nic))
        trainer = SimTrainer(SimConfig(), cost, place, None, tier, False)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        pub = asyncio.ensure_future(tier.publish(lambda: 1)) if publish else None
        dp = await trainer._dp_sync(16)
        stall = await pub if pub else None
        await tier.close()
        return dp, stall, loop.time() - t0, tier.network.shared_s

    dp, _, _, shared = run_virtual(run(None, False))
    assert dp == pytest.approx(16 * cost.dp_sync_s(32), rel=1e-6) and shared == 0.0
    # at 100 GB/s NICs the collectives (50 GB/s a machine) and the publish (103 GB/s alone)
    # leave the trainer's NIC together: the publish runs at half the NIC until they end
    nic = 100e9
    dp_alone = 16 * 8 * cost.dp_sync_bytes(32) / (nic * TRAINER["dp_link_fraction"])
    dp, stall, _, shared = run_virtual(run(nic, True))
    assert dp == pytest.approx(dp_alone, rel=1e-6)  # its share is its own cap
    assert stall == pytest.approx(cost.weight_bytes / (nic / 2), rel=1e-6)
    assert shared > 0


def test_each_system_runs_with_the_papers_engine_tp_and_areal_with_eta_infinite():
    assert [cost_for("7B", m).engine_tp for m in ("sync", "one_step", "stream", "areal",
                                                  "laminar", "laminar_norepack")] == \
        [2, 2, 2, 1, 1, 1]
    assert {cost_for("32B", m).engine_tp for m in ENGINE_TP_PAPER["32B"]} == {4}
    assert {cost_for("72B", m).engine_tp for m in ENGINE_TP_PAPER["72B"]} == {8}
    assert cost_for("7B", "laminar", engine_tp=2).engine_tp == 2
    w = Workload(batch_prompts=16)
    kw = dict(model="7B", gpus=32, split_trainer_gpus=16, iterations=3, workload=w)
    one = simulate(SimConfig(mode="one_step", **kw))
    assert (one.engine_tp, one.engines) == (2, 8)  # 16 rollout GPUs at TP 2
    lam = simulate(SimConfig(mode="laminar", **kw))
    assert (lam.engine_tp, lam.engines) == (1, 16)
    # AReaL: eta = infinity in the throughput rows (its staleness is not capped at 4 ...)
    inf = simulate(SimConfig(mode="areal", iterations=8, **{k: v for k, v in kw.items()
                                                            if k != "iterations"}))
    eta4 = simulate(SimConfig(mode="areal_eta4", iterations=8, **{
        k: v for k, v in kw.items() if k != "iterations"}))
    assert inf.engine_tp == eta4.engine_tp == 1

    def mean(h):
        return sum(k * v for k, v in h.items()) / sum(h.values())
    # eta = 4 parks engines once their admissions are 4 versions ahead; unbounded, they keep
    # generating (up to the buffer, rollout.max_buffered_batches) and are interrupted more
    assert inf.engine_idle_fraction < eta4.engine_idle_fraction
    assert inf.interrupted > eta4.interrupted
    assert mean(inf.staleness) > mean(eta4.staleness)


def test_the_sensitivity_varies_the_trainers_constants_engine_tp_and_areals_eta():
    from laminar_mcore.sim.sensitivity import constants, unread, variants, with_settings

    names = constants()
    assert {"TRAINER.dp_link_fraction", "TRAINER.step_fixed_s", "SETTING.engine_tp_scale",
            "SETTING.areal_eta"} <= set(names)
    assert variants(names=["SETTING.engine_tp_scale", "SETTING.areal_eta"]) == [
        {"SETTING.engine_tp_scale": 0.5}, {"SETTING.engine_tp_scale": 2.0},
        {"SETTING.areal_eta": 4}, {"SETTING.areal_eta": 8}]
    spec = dict(model="7B", mode="one_step")
    assert with_settings(spec, {"SETTING.engine_tp_scale": 2.0})["engine_tp"] == 4
    assert with_settings(dict(spec, mode="laminar"),
                         {"SETTING.engine_tp_scale": 0.5})["engine_tp"] == 1  # at least 1
    assert with_settings(dict(model="72B", mode="areal"),
                         {"SETTING.engine_tp_scale": 2.0})["engine_tp"] == 8  # a machine
    assert with_settings(dict(spec, mode="areal"), {"SETTING.areal_eta": 8})["eta"] == 8
    # AReaL's eta moves AReaL's runs only: the others reuse their base run
    assert unread({"SETTING.areal_eta": 4}, "laminar", "laminar")
    assert unread({"SETTING.areal_eta": 4}, "broadcast", "one_step")
    assert not unread({"SETTING.areal_eta": 4}, "broadcast", "areal")
    assert not unread({"SETTING.engine_tp_scale": 2.0}, "laminar", "laminar")
    assert not unread({"TRAINER.step_fixed_s": 0.12}, "broadcast", "one_step")
    # and the setting reaches the run: AReaL at eta 4 is the labelled row's run
    from laminar_mcore.sim.jobs import run_one

    w = Workload(batch_prompts=16)
    base = dict(model="7B", gpus=32, split_trainer_gpus=16, iterations=4, workload=w)
    a = run_one(dict(base, mode="areal", overrides={"SETTING.areal_eta": 4}))
    b = run_one(dict(base, mode="areal_eta4", overrides=None))
    assert (a["tokens_per_s"], a["staleness"]) == (b["tokens_per_s"], b["staleness"])
    c = run_one(dict(base, mode="one_step", overrides={"SETTING.engine_tp_scale": 0.5}))
    assert (c["engine_tp"], c["engines"]) == (1, 16)
