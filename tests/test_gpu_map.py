"""The GPU map (laminar_mcore/config/gpu_map.py): on one node every role gets GPUs of its own --
trainers first, then the engines, then a free GPU for the relay or none -- passed to each process
as CUDA_VISIBLE_DEVICES; a layout that cannot be disjoint is refused before anything starts.
Checked on CPU with the devices a patched ``torch.cuda`` reports, for the three GPU recipes on
a 1-, 2- and 8-GPU node, and through the real command/env builders of the engines, the relay
and the trainer world."""

import json
import os

import pytest
import torch
from hydra import compose, initialize_config_dir

from laminar_mcore.config import ConfigError, register_configs, typed, validate_config
from laminar_mcore.config.gpu_map import (FIX, GpuMapError, build_gpu_map, config_gpu_map,
                                          machine_gpu_map, visible_gpus)
from laminar_mcore.config.paths import conf_dir

register_configs()
RECIPES = ("qwen2_5_7b_math", "qwen2_5_72b_math", "qwen3_235b_a22b_math")
CLUSTER = ("model.path=null", "cluster.controller_addr=127.0.0.1")
# the 7B recipe scaled to one 8-GPU node: 4 trainer ranks (TP4) and three TP1 engines
FITS_ONE_NODE = ("cluster.trainer.nproc_per_node=4", "cluster.rollout_nodes=1",
                 "rollout.num_engines=3")


def _compose(*overrides):
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def gpus(monkeypatch):
    """Make ``torch.cuda`` report ``n`` GPUs (and nothing else of CUDA)."""
    def report(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return report


def _held(gmap) -> list:
    """Every GPU position a role holds, once per role that holds it."""
    held = list(gmap.trainers)
    for node, relay in zip(gmap.engines, gmap.relays):
        held += [g for engine in node for g in engine] + ([relay] if relay is not None else [])
    return held


def _refusal(job, n, source, trainers=0, engines=0, tp=1, nodes=1):
    parts = []
    if trainers:
        parts.append(f"{trainers} for the trainers (cluster.trainer.nproc_per_node={trainers})")
    if engines:
        prefix = f"cluster.rollout_nodes={nodes} x " if job == "train" else ""
        parts.append(f"{nodes * engines * tp} for the engines ({prefix}rollout.num_engines="
                     f"{engines} x rollout.engine_tp={tp})")
    need = trainers + nodes * engines * tp
    return (f"LMC-E126: job={job} on one node gives each role GPUs of its own: "
            f"{' + '.join(parts)} = {need} GPUs, but the node has {n} ({source}); {FIX}")


# ---------------------------------------------------------------------- the recipes
@pytest.mark.parametrize("n", [1, 2, 8])
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_gpu_recipes_on_a_node_of_1_2_and_8_gpus(recipe, n, gpus):
    """Each role of a recipe on a node of n GPUs (as torch.cuda reports them): disjoint GPUs or
    a refusal naming what each role needs."""
    gpus(n)
    cfg = typed(_compose(f"experiment={recipe}", *CLUSTER))
    source = f"{n} visible GPUs"
    r, t = cfg.rollout, cfg.cluster.trainer
    for job in ("train", "trainer", "rollout"):
        if job == "train" and t.nnodes != 1:  # the local launcher refuses it (LMC-E203)
            assert machine_gpu_map(cfg, job) is None
            continue
        trainers = t.nproc_per_node if job != "rollout" else 0
        engines = r.num_engines if job != "trainer" else 0
        nodes = cfg.cluster.rollout_nodes if job == "train" else 1
        need = trainers + nodes * engines * r.engine_tp
        if need > n:
            with pytest.raises(GpuMapError) as err:
                machine_gpu_map(cfg, job)
            assert str(err.value) == _refusal(job, n, source, trainers, engines, r.engine_tp,
                                              nodes)
            continue
        gmap = machine_gpu_map(cfg, job)
        held = _held(gmap)
        assert len(held) == len(set(held)) and set(held) <= set(range(n))  # disjoint
        assert gmap.trainers == tuple(range(trainers))  # trainers first
        if job == "rollout":  # engines from GPU 0, TP consecutive GPUs each; no GPU left
            (node,) = gmap.engines
            assert node == tuple(tuple(range(i * r.engine_tp, (i + 1) * r.engine_tp))
                                 for i in range(engines))
            assert gmap.relays == (None,) and gmap.node(0).relay_device == "cpu"
            assert gmap.node(0).relay == ",".join(str(g) for g in range(n))  # its engines'


@pytest.mark.parametrize("n", [1, 2, 8])
def test_validation_refuses_before_anything_starts_naming_each_role(n):
    """The same refusals from the config alone (cluster.gpus_per_node) for job=train: the 7B
    recipe on a node of n GPUs, and the demo's tiny model with one SGLang engine, whose trainer
    and engine each fit one GPU but not both."""
    recipe = _compose("experiment=qwen2_5_7b_math", *CLUSTER, f"cluster.gpus_per_node={n}")
    with pytest.raises(ConfigError) as err:
        validate_config(recipe)
    if n == 8:
        assert _refusal("train", 8, "cluster.gpus_per_node=8", 8, 8, 1, 3) in str(err.value)
    else:  # each role alone is already too many (the capacity plan's LMC-E121)
        assert f"cluster.trainer.nproc_per_node=8 is more than cluster.gpus_per_node={n}" in \
            str(err.value)
    tiny = _compose("rollout=sglang", "cluster=multinode", "cluster.controller_addr=127.0.0.1",
                    "cluster.trainer.nnodes=1", "cluster.trainer.nproc_per_node=1",
                    "cluster.rollout_nodes=1", "rollout.num_engines=1",
                    f"cluster.gpus_per_node={n}")
    if n == 1:
        with pytest.raises(ConfigError) as err:
            validate_config(tiny)
        assert _refusal("train", 1, "cluster.gpus_per_node=1", 1, 1) in str(err.value)
    else:  # one trainer, one engine; the relay takes the 3rd GPU of 8, none of 2
        validate_config(tiny)
        gmap = config_gpu_map(tiny)
        assert (gmap.trainers, gmap.engines, gmap.relays) == ((0,), (((1,),),),
                                                              (2 if n == 8 else None,))
    validate_config(_compose("experiment=qwen2_5_7b_math", *CLUSTER, *FITS_ONE_NODE))


def test_a_relay_device_another_role_holds_or_nccl_without_a_free_gpu_is_refused():
    base = ("experiment=qwen2_5_7b_math", *CLUSTER, "job=rollout")
    with pytest.raises(ConfigError, match=r"LMC-E126: (does not fit .*: )?weight_sync.relay_device=cuda:3 names GPU "
                                          r"3 of a node with 8 \(cluster.gpus_per_node=8\), which "
                                          r"an engine holds \(engines: 0,1,2,3,4,5,6,7\); no other "
                                          r"role may share the relay's GPU"):
        validate_config(_compose(*base, "weight_sync.relay_device=cuda:3"))
    with pytest.raises(ConfigError, match=r"names GPU 9 of a node with 8 "):
        validate_config(_compose(*base, "rollout.num_engines=4", "weight_sync.relay_device=cuda:9"))
    fits = _compose(*base, "rollout.num_engines=4", "weight_sync.relay_device=cuda:6")
    validate_config(fits)
    assert config_gpu_map(fits).node(0).relay == "0,1,2,3,6"
    with pytest.raises(ConfigError, match=r"\+ 1 for the relays \(weight_sync.publish_backend=nccl "
                                          r"stages on a GPU of their own; gloo needs none\) = 9 "
                                          r"GPUs, but the node has 8"):
        validate_config(_compose(*base, "weight_sync.publish_backend=nccl"))


# ---------------------------------------------------------------------- what each process gets
def test_each_process_gets_its_mask_engines_base_gpu_0_relay_sees_its_engines(gpus, tmp_path):
    """The 7B recipe scaled to one 8-GPU node: the env and command lines the launchers build."""
    from laminar_mcore.controller.client import ControllerClient
    from laminar_mcore.rollout.launcher import engine_process, engine_pull_spec
    from laminar_mcore.rollout.supervisor import NodeSupervisor

    gpus(8)
    cfg = typed(_compose("experiment=qwen2_5_7b_math", *CLUSTER, *FITS_ONE_NODE))
    gmap = machine_gpu_map(cfg, "train")
    assert gmap.describe() == "trainers 0,1,2,3; engines 4 | 5 | 6; relay 7 (sees 4,5,6,7); " \
                              "free: none"
    assert gmap.trainer_env() == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    node = gmap.node(0)
    sup = NodeSupervisor(cfg, ControllerClient("http://127.0.0.1:9", "token-0123456789"), "/m",
                         str(tmp_path), "node0", log=lambda msg: None, gpus=node)
    for i in range(3):
        engine = sup._new_engine(i)
        assert engine.env["CUDA_VISIBLE_DEVICES"] == str(4 + i)
        assert engine.command[engine.command.index("--base-gpu-id") + 1] == "0"
        # the relay numbers it cuda:i (its mask lists the engines' GPUs first)
        assert engine_pull_spec(cfg.rollout, i).devices == (f"cuda:{i}",)
    relay = sup._relay_process(True, None)
    assert relay.env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    sent = json.loads(relay.command[relay.command.index("--config-json") + 1])
    assert sent["weight_sync"]["relay_device"] == "cuda:3"  # its own GPU, last in its mask
    # TP2 engines: each sees its two GPUs; the relay numbers engine 1's ranks cuda:2, cuda:3
    tp2 = typed(_compose("experiment=qwen2_5_7b_math", *CLUSTER, *FITS_ONE_NODE,
                         "rollout.num_engines=2", "rollout.engine_tp=2"))
    node = machine_gpu_map(tp2, "train").node(0)
    assert node.engines == ("4,5", "6,7") and node.relay == "4,5,6,7"
    assert node.relay_device == "cpu"  # no GPU left for it: host staging
    assert engine_pull_spec(tp2.rollout, 1).devices == ("cuda:2", "cuda:3")
    engine = engine_process(tp2, "/m", str(tmp_path / "e1.log"), 1, visible=node.engines[1])
    assert engine.env["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert engine.command[engine.command.index("--base-gpu-id") + 1] == "0"
    assert node.relay_weight_sync(tp2.weight_sync).relay_device == "cpu"


def test_an_inherited_mask_is_divided_by_its_entries(gpus, monkeypatch):
    gpus(4)  # the scheduler gave the launcher GPUs 4-7 of the node
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,GPU-1a2b,7")
    assert visible_gpus() == ["4", "5", "GPU-1a2b", "7"]
    cfg = typed(_compose("experiment=qwen2_5_7b_math", *CLUSTER, "parallel.tp=2",
                         "parallel.sequence_parallel=true", "cluster.trainer.nproc_per_node=2",
                         "cluster.rollout_nodes=1", "rollout.num_engines=1"))
    gmap = machine_gpu_map(cfg, "train")
    assert gmap.source == "CUDA_VISIBLE_DEVICES=4,5,GPU-1a2b,7"
    assert gmap.trainer_env() == {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert gmap.node(0).engine_env(0) == {"CUDA_VISIBLE_DEVICES": "GPU-1a2b"}
    assert gmap.node(0).relay_env() == {"CUDA_VISIBLE_DEVICES": "GPU-1a2b,7"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    gpus(2)
    with pytest.raises(GpuMapError, match=r"= 3 GPUs, but the node has 2 "
                                          r"\(CUDA_VISIBLE_DEVICES=4,5\)"):
        machine_gpu_map(cfg, "train")


def test_without_gpus_there_is_no_map_and_nothing_is_masked(gpus, tmp_path):
    """The CPU demo: no map, engines and their commands exactly as before."""
    from laminar_mcore.rollout.launcher import engine_command_from_config, engine_process

    gpus(0)
    demo = typed(_compose())
    assert machine_gpu_map(demo, "train") is None and config_gpu_map(_compose()) is None
    assert visible_gpus() == []
    engine = engine_process(demo, "/m", str(tmp_path / "e.log"), 0)
    assert "CUDA_VISIBLE_DEVICES" not in engine.env or \
        engine.env["CUDA_VISIBLE_DEVICES"] == os.environ["CUDA_VISIBLE_DEVICES"]
    sglang = _compose("rollout=sglang", "rollout.engine_tp=2")
    cmd = engine_command_from_config(sglang.rollout, "/m", port=1, index=3)
    assert cmd[cmd.index("--base-gpu-id") + 1] == "6"  # no mask: the node's numbering
    # the demo on a 1-GPU machine: the trainer takes it, the CPU engines and relay see none
    gpus(1)
    gmap = machine_gpu_map(demo, "train")
    assert gmap.trainer_env() == {"CUDA_VISIBLE_DEVICES": "0"}
    assert gmap.node(0).engines == ("", "") and gmap.node(0).relay == ""
    assert gmap.node(0).relay_device == "cpu"


def test_plan_prints_the_map_and_plan_json_carries_it(tmp_path, capsys):
    from laminar_mcore.launch.plan import run_plan

    cfg = _compose("experiment=qwen2_5_7b_math", "job=plan", f"output_dir={tmp_path}",
                   *FITS_ONE_NODE)
    run_plan(cfg)
    out = capsys.readouterr().out
    assert "job=train, every role on one node: trainers 0,1,2,3; engines 4 | 5 | 6; relay 7 " \
           "(sees 4,5,6,7); free: none" in out
    assert "a rollout node (job=rollout): engines 0 | 1 | 2; relay 3 (sees 0,1,2,3); free: " \
           "4,5,6,7" in out
    written = json.loads((tmp_path / cfg.run_name / "plan.json").read_text())["gpu_map"]
    assert written["train"]["trainers"] == "0,1,2,3"
    assert written["train"]["rollout_nodes"] == [{"engines": ["4", "5", "6"], "relay": "7",
                                                  "relay_visible": "4,5,6,7",
                                                  "relay_device": "cuda:3"}]
    assert written["trainer_node"]["trainers"] == "0,1,2,3"
    recipe = _compose("experiment=qwen2_5_7b_math", "job=plan", f"output_dir={tmp_path}")
    assert run_plan(recipe)["gpu_map"]["train"]["refused"] == _refusal(
        "train", 8, "cluster.gpus_per_node=8", 8, 8, 1, 3)


def test_build_gpu_map_is_a_pure_function_of_the_facts():
    gmap = build_gpu_map([str(i) for i in range(8)], trainers=2, rollout_nodes=2, engines=2,
                         engine_tp=1)
    assert gmap.engines == (((2,), (3,)), ((4,), (5,))) and gmap.relays == (6, 7)
    assert [gmap.node(k).relay for k in (0, 1)] == ["2,3,6", "4,5,7"]
    assert gmap.describe() == ("trainers 0,1; node0 engines 2 | 3; relay 6 (sees 2,3,6); node1 "
                               "engines 4 | 5; relay 7 (sees 4,5,7); free: none")
    remote = build_gpu_map(["0", "1"], rollout_nodes=1, engines=2, relay=False, job="rollout")
    assert remote.node(0).engines == ("0", "1") and "no relay" in remote.describe()


# ---------------------------------------------------------------------- trainer ranks
def test_a_rank_takes_local_rank_modulo_the_devices_it_sees(monkeypatch):
    from laminar_mcore.parallel.groups import local_device_index

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert local_device_index({"LOCAL_RANK": "5"}) == 5
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a per-rank mask
    assert local_device_index({"LOCAL_RANK": "5"}) == 0
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # 4 trainer GPUs of 8 ranks' node
    assert [local_device_index({"LOCAL_RANK": str(r)}) for r in range(4)] == [0, 1, 2, 3]
    assert local_device_index({}) == 0


def _visible_here():
    return os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("LOCAL_RANK")


@pytest.mark.multiprocess
def test_the_trainer_world_runs_under_the_maps_mask(monkeypatch):
    """launch_trainer_world's env reaches each rank before its entry point runs; the launcher's
    own environment is left alone."""
    from laminar_mcore.launch.local import launch_trainer_world

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    results = launch_trainer_world(_visible_here, (), 1, env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert results == {0: ("0,1,2,3", "0")}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
