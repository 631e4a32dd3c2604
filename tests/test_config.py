"""Hydra configuration: composition against the schemas, and the errors promised to users."""

import json
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from laminar_mcore.config import ConfigError, register_configs, validate_config
from laminar_mcore.config.overrides import check_overrides
from laminar_mcore.config.paths import conf_dir

register_configs()
CONF = conf_dir()


def _compose(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def test_default_config_composes_and_is_valid():
    cfg = _compose()
    assert cfg.run_name == "cpu_demo" and cfg.mode == "laminar"
    assert cfg.model.arch.family == "qwen2" and cfg.rollout.backend == "cpu"
    assert cfg.algo.eps_clip_high == 0.28 and cfg.job == "train"
    assert cfg.algo.max_staleness == 4  # the CPU demo bounds it; the algo default does not
    assert _compose("experiment=cpu_smoke").algo.max_staleness is None
    assert cfg.data.task == "reverse_longtail" and cfg.trainer.eval_interval > 0
    validate_config(cfg)


def test_modes_tasks_and_eval_interval_are_checked():
    validate_config(_compose("mode=areal"))
    with pytest.raises(ConfigError, match=r"mode.*laminar.*areal"):
        validate_config(_compose("mode=aereal"))
    with pytest.raises(ConfigError, match=r"data.task.*reverse_longtail"):
        validate_config(_compose("data.task=sort"))
    with pytest.raises(ConfigError, match=r"long_digits > digits"):
        validate_config(_compose("data.long_digits=2"))
    with pytest.raises(ConfigError, match=r"trainer.eval_interval must be >= 0"):
        validate_config(_compose("trainer.eval_interval=-1"))


def test_skipping_zero_advantage_is_refused_where_a_term_reads_every_token():
    """The demo skips zero-advantage trajectories (exact there); an entropy bonus, a KL penalty,
    an MoE auxiliary loss or a covariance-selecting loss would make it change the update."""
    assert _compose().trainer.skip_zero_advantage is True
    validate_config(_compose("algo.entropy_coef=0.01", "trainer.skip_zero_advantage=false"))
    for override, named in (("algo.entropy_coef=0.01", "algo.entropy_coef=0.01"),
                            ("algo.kl_coef=0.1", "algo.kl_coef=0.1"),
                            ("trainer.moe_aux_loss_coeff=0.01", "trainer.moe_aux_loss_coeff"),
                            ("algo.policy_loss=kl_cov", "algo.policy_loss=kl_cov")):
        with pytest.raises(ConfigError, match=rf"skip_zero_advantage=true .*{named}.*"
                                              r"trainer.skip_zero_advantage=false"):
            validate_config(_compose(override))


def test_fault_isolation_settings_are_checked():
    cfg = _compose()
    assert cfg.trainer.max_restarts >= 1 and cfg.rollout.engine_restarts_per_hour >= 1
    for override, message in (("rollout.engine_heartbeat_s=0", "engine_heartbeat_s=0.0 must be > 0"),
                              ("weight_sync.publish_timeout_s=-1", "publish_timeout_s=-1.0"),
                              ("trainer.max_restarts=-1", "max_restarts=-1 must be >= 0"),
                              ("rollout.start_timeout_s=0", r"start_timeout_s=0(\.0)? must be > 0 "
                               r"\(seconds\), or null for the backend's default"),
                              ("rollout.cpu_startup_delay_s=-1", "cpu_startup_delay_s=-1.0"),
                              ("cluster.rollout_nodes=0", "rollout_nodes=0 must be >= 1")):
        with pytest.raises(ConfigError, match=message):
            validate_config(_compose(override))


@pytest.mark.parametrize("experiment", ["cpu_demo", "cpu_reverse", "cpu_smoke", "cpu_tp2_pp2",
                                        "cpu_moe"])
def test_cpu_experiments_are_valid(experiment):
    validate_config(_compose(f"experiment={experiment}"))


def test_gpu_recipes_compose_and_ask_for_the_model_path():
    cfg = _compose("experiment=qwen2_5_72b_math")
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.rollout.backend) == (8, 4, "sglang")
    with pytest.raises(ConfigError, match=r"mandatory values are not set: cluster.controller_addr, "
                                          r"model.path; .* model.path=\.\.\."):
        validate_config(cfg)


def test_world_size_must_divide_by_model_parallel_size():
    cfg = _compose("parallel.tp=2", "parallel.pp=2", "cluster.trainer.nproc_per_node=6")
    with pytest.raises(ConfigError, match=r"world size 6 .* not divisible by tp\*pp\*cp = 2\*2\*1"):
        validate_config(cfg)


def test_vocab_heads_and_layers_must_divide():
    cfg = _compose("parallel.tp=3", "cluster.trainer.nproc_per_node=3")
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert "vocab size 128 (model.arch) is not divisible by parallel.tp=3" in str(err.value)
    assert "num_attention_heads 4" in str(err.value)
    cfg = _compose("parallel.pp=3", "cluster.trainer.nproc_per_node=3")
    with pytest.raises(ConfigError, match="num_hidden_layers 4 .* parallel.pp=3"):
        validate_config(cfg)


def test_model_path_must_exist_and_be_a_checkpoint(tmp_path):
    cfg = _compose("model=hf", f"model.path={tmp_path / 'nope'}")
    with pytest.raises(ConfigError, match="does not exist"):
        validate_config(cfg)
    cfg = _compose("model=hf", f"model.path={tmp_path}")
    with pytest.raises(ConfigError, match="has no config.json"):
        validate_config(cfg)


def test_vocab_check_reads_the_checkpoint_config(tmp_path):
    from laminar_mcore.models.hf import tiny_hf_config

    tiny_hf_config("qwen3", vocab_size=129).save_pretrained(tmp_path)
    cfg = _compose("model=hf", f"model.path={tmp_path}", "parallel.tp=2",
                   "cluster.trainer.nproc_per_node=2")
    with pytest.raises(ConfigError, match=r"vocab size 129 \(model.path\) is not divisible"):
        validate_config(cfg)


def test_unknown_keys_and_wrong_types_are_refused():
    with pytest.raises(ConfigError, match="did you mean model.arch.hidden_size"):
        check_overrides(["model.arch.hiden_size=3"], CONF)
    with pytest.raises(ConfigError, match="'parallel' has no field 'foo'"):
        check_overrides(["+parallel.foo=1"], CONF)
    check_overrides(["model=tiny_llama", "experiment=cpu_tp2_pp2", "parallel.tp=2",
                     "hydra.run.dir=x", "--cfg", "job"], CONF)
    with pytest.raises(ConfigCompositionException, match="parallel.tp"):
        _compose("parallel.tp=two")
    with pytest.raises(ConfigCompositionException, match="hiden_size"):
        _compose("model.arch.hiden_size=3")
    cfg = _compose("+trainer.lr_typo=1")  # Hydra lets `+` through; validation does not
    with pytest.raises(ConfigError, match="lr_typo"):
        validate_config(cfg)
    with pytest.raises(ConfigError, match="mode='async' is not one of laminar, one_step, sync, areal"):
        validate_config(_compose("mode=async"))


def _launch(*args, cwd):
    return subprocess.run([sys.executable, "-m", "laminar_mcore.launch", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))


def test_cli_prints_the_composed_config(tmp_path):
    proc = _launch("--cfg", "job", "model=tiny_qwen3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "name: tiny-qwen3" in proc.stdout and "head_dim: 16" in proc.stdout


def test_cli_reports_invalid_config_before_starting_anything(tmp_path):
    proc = _launch("parallel.tp=3", "cluster.trainer.nproc_per_node=4", "output_dir=out", cwd=tmp_path)
    assert proc.returncode == 2
    assert "not divisible by tp*pp*cp" in proc.stderr
    assert "smoke" not in proc.stdout  # the job never started
    proc = _launch("paralel.tp=2", cwd=tmp_path)
    assert proc.returncode == 2 and "did you mean parallel" in proc.stderr


@pytest.mark.multiprocess
@pytest.mark.slow
def test_launcher_runs_the_smoke_job_at_tp2_pp2(tmp_path):
    proc = _launch("experiment=cpu_tp2_pp2", "model=tiny_llama", "output_dir=out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "cpu_tp2_pp2" / "smoke.json").read_text())
    assert summary["world_size"] == 4 and (summary["tp"], summary["pp"]) == (2, 2)
    assert summary["abs_diff"] <= 1e-5 and summary["max_rank_spread"] == 0.0


def test_algorithm_and_trainer_values_are_typed_and_checked():
    from omegaconf import OmegaConf

    from laminar_mcore.config.schema import AlgoConfig, TrainerConfig

    cfg = _compose("algo.behav_imp_weight_cap=5.0", "trainer.lr=3e-6", "trainer.max_tokens_per_microbatch=512")
    algo, trainer = OmegaConf.to_object(cfg.algo), OmegaConf.to_object(cfg.trainer)
    assert isinstance(algo, AlgoConfig) and isinstance(trainer, TrainerConfig)
    assert (algo.behav_imp_weight_cap, trainer.lr, trainer.max_tokens_per_microbatch) == (5.0, 3e-6, 512)
    assert algo.eps_clip_high == 0.28 and algo.use_decoupled_loss is True
    with pytest.raises(ConfigError, match="algo.dual_clip=0.5 must be > 1"):
        validate_config(_compose("algo.dual_clip=0.5"))
    with pytest.raises(ConfigError, match="behav_imp_weight_cap=0.9"):
        validate_config(_compose("algo.behav_imp_weight_cap=0.9"))
    with pytest.raises(ConfigError, match="lr_decay_style='exp'"):
        validate_config(_compose("trainer.lr_decay_style=exp"))
    with pytest.raises(ConfigError, match="weight_sync.mooncake_protocol='udp' must be null, tcp"):
        validate_config(_compose("weight_sync.mooncake_protocol=udp"))
    validate_config(_compose("weight_sync.mooncake_protocol=rdma", "weight_sync.mooncake_device=mlx5_0"))


def test_engine_transport_and_remote_relay_choices_are_checked():
    """How engines take weights is validated before anything starts, each error with its fix;
    the resolved transport is what the engines' pullers use."""
    from laminar_mcore.config import typed
    from laminar_mcore.rollout.launcher import engine_pull_spec

    with pytest.raises(ConfigError, match="engine_transport='ftp' must be auto or one of shm, "
                                          "sglang_cuda_ipc, mooncake"):
        validate_config(_compose("weight_sync.engine_transport=ftp"))
    with pytest.raises(ConfigError, match="engine_transport=mooncake needs "
                                          "weight_sync.mooncake_protocol"):
        validate_config(_compose("weight_sync.engine_transport=mooncake"))
    with pytest.raises(ConfigError, match="sglang_cuda_ipc needs rollout.backend=sglang"):
        validate_config(_compose("weight_sync.engine_transport=sglang_cuda_ipc"))
    with pytest.raises(ConfigError, match="rollout.relay=remote is for job=rollout"):
        validate_config(_compose("job=train", "rollout.relay=remote",
                                 "weight_sync.mooncake_protocol=tcp"))
    with pytest.raises(ConfigError, match="rollout.relay=remote reads weights through Mooncake"):
        validate_config(_compose("job=rollout", "rollout.relay=remote",
                                 "weight_sync.engine_transport=shm"))
    cfg = _compose("job=rollout", "rollout.relay=remote", "weight_sync.mooncake_protocol=tcp")
    validate_config(cfg)
    t = typed(cfg)
    spec = engine_pull_spec(t.rollout, 0, t.weight_sync)
    assert spec.fmt == "mooncake" and spec.option("protocol") == "tcp"
    default = typed(_compose())
    assert engine_pull_spec(default.rollout, 0, default.weight_sync).fmt == "shm"  # CPU engines
    # what each engine rank copies (issue 52): checked too
    with pytest.raises(ConfigError, match="engine_pull='half' must be auto, shard or whole"):
        validate_config(_compose("weight_sync.engine_pull=half"))
    with pytest.raises(ConfigError, match="engine_pull=shard needs engines pulling from their "
                                          "own node's relay"):
        validate_config(_compose("job=rollout", "rollout.relay=remote",
                                 "weight_sync.mooncake_protocol=tcp",
                                 "weight_sync.engine_pull=shard"))
    with pytest.raises(ConfigError, match="CPU engine of rollout.engine_tp > 1 takes one payload"):
        validate_config(_compose("rollout.engine_tp=2", "weight_sync.mooncake_protocol=tcp",
                                 "weight_sync.engine_transport=mooncake"))
    with pytest.raises(ConfigError, match="engine_ep=3 must be >= 1, engine_ep dividing"):
        validate_config(_compose("rollout.engine_tp=4", "rollout.engine_ep=3"))
    validate_config(_compose("rollout.engine_tp=4", "rollout.engine_ep=2"))


def test_plan_job_needs_no_checkpoint_and_the_gpu_recipes_fit(tmp_path):
    """`job=plan` runs from the recipes' published architectures alone and writes plan.json;
    both GPU recipes fit an 8 x 80 GB node as shipped."""
    for experiment, params in (("qwen2_5_72b_math", 72.7), ("qwen2_5_7b_math", 7.6),
                               ("qwen3_235b_a22b_math", 235.1)):
        proc = _launch("job=plan", f"experiment={experiment}", "output_dir=out", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        plan = json.loads((tmp_path / "out" / experiment / "plan.json").read_text())
        assert {"trainer_gpu_peak_gb", "engine_gpus_per_node", "gpus_per_node", "gpu_memory_gb",
                "fits"} <= set(plan)
        assert plan["fits"] and plan["trainer_gpu_peak_gb"] < plan["gpu_memory_gb"] == 80
        assert plan["engine_gpus_per_node"] <= plan["gpus_per_node"] == 8
        assert plan["params_b"] == pytest.approx(params, abs=0.1)
        assert "fits: yes" in proc.stdout


def test_moe_plan_counts_experts_and_layouts_are_checked():
    """Qwen3-235B-A22B: 235 B parameters, 22 B active; each trainer GPU holds 128 / EP experts
    of its stage, and Adam for them is sharded over the experts' own DP; bad EP layouts are
    refused with the key to change."""
    from laminar_mcore.config.plan import capacity_plan

    plan = capacity_plan(_compose("experiment=qwen3_235b_a22b_math"))
    assert plan["active_params_b"] == pytest.approx(22.2, abs=0.1)
    assert (plan["ep"], plan["expert_dp"], plan["dp"]) == (32, 2, 16)
    doubled = capacity_plan(_compose("experiment=qwen3_235b_a22b_math", "parallel.ep=16"))
    assert doubled["trainer_first_weights_gb"] > plan["trainer_first_weights_gb"] * 1.7
    for override, message in (
            (["parallel.ep=3"], r"num_experts 128 .* not divisible by parallel.ep=3"),
            (["parallel.sequence_parallel=false"], r"needs parallel.sequence_parallel=true"),
            (["cluster.trainer.nnodes=3", "parallel.ep=32"],
             r"not divisible by expert_tp\*ep\*pp = 1\*32\*2")):
        cfg = \
            _compose("experiment=qwen3_235b_a22b_math", "model.path=null",
                     "cluster.controller_addr=127.0.0.1", *override)
        with pytest.raises(ConfigError, match=message):
            validate_config(cfg)
    with pytest.raises(ConfigError, match=r"parallel.ep=2 .* need a mixture-of-experts model"):
        validate_config(_compose("experiment=cpu_demo", "parallel.ep=2",
                                 "cluster.trainer.nproc_per_node=2"))


def test_plan_matches_megatrons_published_memory_formulas():
    """Megatron-LM's distributed-optimizer table (bf16 params, fp32 grads: 6 + 12/DP bytes per
    parameter) and Korthikanti et al.'s activations (TP + SP: 34/t bytes per token, layer and
    hidden unit for a GPT layer; here the SwiGLU/GQA widths of the same terms)."""
    from laminar_mcore.config.plan import _activation_bytes_per_token_layer, capacity_plan, param_counts

    cfg = _compose("experiment=qwen2_5_72b_math", "cluster.trainer.nnodes=8")
    plan = capacity_plan(cfg)
    assert plan["dp"] == 2
    static = (plan["trainer_first_weights_gb"] + plan["trainer_first_grads_gb"]
              + plan["trainer_first_optimizer_gb"])
    per_param = static * 1e9 / (plan["trainer_first_weights_gb"] * 1e9 / 2)
    assert per_param == pytest.approx(6 + 12 / 2, rel=1e-3)
    gpt = dict(family="qwen2", hidden=4096, ffn=4 * 4096 * 2 // 3, layers=1, heads=32,
               kv_heads=32, head_dim=128, vocab=32000, tied=False)
    # A GPT layer with ffn 4h (SwiGLU at 8h/3) and MHA: ~34 bytes/token/hidden unit (no SP).
    assert _activation_bytes_per_token_layer(gpt, 1, False) / 4096 == pytest.approx(34, rel=0.05)
    assert param_counts(dict(gpt, layers=32))["total"] == pytest.approx(6.74e9, rel=0.01)


def test_a_run_that_does_not_fit_is_refused_naming_the_item_and_the_knob():
    cfg = _compose("experiment=qwen2_5_72b_math", "model.path=null",
                   "cluster.controller_addr=10.0.0.1", "trainer.recompute=none")
    with pytest.raises(ConfigError, match=r"first pipeline stage\) needs 10\d\.\d GB.*largest item "
                                          r"is activations .*trainer.recompute=full"):
        validate_config(cfg)
    cfg = _compose("experiment=qwen2_5_72b_math", "model.path=null",
                   "cluster.controller_addr=10.0.0.1", "rollout.num_engines=12")
    with pytest.raises(ConfigError, match=r"96 GPUs per rollout node, cluster.gpus_per_node=8"):
        validate_config(cfg)
    cfg.rollout.num_engines = 1
    validate_config(cfg)  # as shipped (with a model built from arch) it fits


def test_loggers_are_checked_before_the_run_starts(monkeypatch):
    cfg = _compose("trainer.loggers=[jsonl,wandb,mlflow]", "trainer.wandb_project=rl")
    assert cfg.trainer.wandb_project == "rl" and cfg.trainer.mlflow_tracking_uri is None
    assert list(_compose().trainer.loggers) == ["tensorboard", "jsonl"]
    with pytest.raises(ConfigError, match=r"unknown logger\(s\) 'neptune'; the known ones are "
                                          r"tensorboard, jsonl, wandb, mlflow"):
        validate_config(_compose("trainer.loggers=[jsonl,neptune]"))
    with pytest.raises(ConfigError, match=r"lacks jsonl: metrics.jsonl is the run's own record"):
        validate_config(_compose("trainer.loggers=[wandb]"))
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"'mlflow' package is not installed: pip install "
                                          r"mlflow-skinny"):
        validate_config(cfg)
    validate_config(_compose("trainer.loggers=[jsonl,mlflow]", "job=smoke"))  # writes no metrics


def test_plan_counts_the_reference_model_held_or_offloaded():
    """algo.kl_coef > 0 keeps a frozen copy of the stage's weights (2 bytes per parameter in
    bf16, no gradients or optimizer state); offloaded, it costs host memory instead, and the GPU
    holds it only for the reference's forward pass (beside that pass's logits)."""
    from laminar_mcore.config.plan import capacity_plan
    from laminar_mcore.config.plan_text import format_plan

    base = capacity_plan(_compose("experiment=qwen2_5_7b_math"), digits=None)
    held = capacity_plan(_compose("experiment=qwen2_5_7b_math", "algo.kl_coef=0.001"),
                         digits=None)
    off = capacity_plan(_compose("experiment=qwen2_5_7b_math", "algo.kl_coef=0.001",
                                 "algo.ref_offload=true"), digits=None)
    for stage in ("first", "last"):
        assert base[f"trainer_{stage}_reference_gb"] == 0.0
        assert held[f"trainer_{stage}_reference_gb"] == pytest.approx(
            held[f"trainer_{stage}_weights_gb"])
        assert off[f"trainer_{stage}_reference_gb"] == 0.0
    gained = held["trainer_gpu_peak_gb"] - base["trainer_gpu_peak_gb"]
    stage = held["trainer_peak_stage"]
    assert gained == pytest.approx(held[f"trainer_{stage}_reference_gb"] * 1.08, rel=0.01)
    assert base["trainer_gpu_peak_gb"] <= off["trainer_gpu_peak_gb"] < held["trainer_gpu_peak_gb"]
    assert (base["reference_model"], held["reference_model"], off["reference_model"]) == (
        "none", "held", "offloaded")
    per_node = 8 * off["trainer_first_weights_gb"]  # 8 ranks a node, one stage each
    assert off["reference_host_gb_per_trainer_node"] == pytest.approx(per_node, abs=0.1)
    assert "offloaded reference model" in format_plan(off)
    assert "reference" in format_plan(held)


def test_per_rank_export_is_checked():
    """weight_sync.export: one of its two ways; per_rank accepted for a dense model at TP2 and
    a mixture-of-experts one at TP1, EP2 (each EP rank sends its experts whole), refused for
    one whose experts or layers are cut by TP (expert_tp=2)."""
    validate_config(_compose("weight_sync.export=per_rank", "parallel.tp=2",
                             "cluster.trainer.nproc_per_node=2"))
    with pytest.raises(ConfigError, match=r"LMC-E102: weight_sync.export='gather'"):
        validate_config(_compose("weight_sync.export=gather"))
    validate_config(_compose("experiment=cpu_moe", "weight_sync.export=per_rank"))
    with pytest.raises(ConfigError, match=r"LMC-E112: weight_sync.export=per_rank .*mixture"
                                          r".*expert_tp=2"):
        validate_config(_compose("experiment=cpu_moe", "weight_sync.export=per_rank",
                                 "parallel.ep=1", "parallel.expert_tp=2"))
