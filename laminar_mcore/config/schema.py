"""Typed configuration of a laminar_mcore run: one dataclass per component.

These dataclasses are registered in Hydra's ConfigStore (``register_configs``), so every YAML
file under ``conf/`` and every command-line override is checked against them: an unknown key
or a value of the wrong type is an error, never a silently ignored typo. Semantic checks that
span several sections (divisibility, paths) live in ``config/validate.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

try:
    from omegaconf import MISSING
except ImportError:  # bare GPU machines (bench.gpu) import the schemas without OmegaConf
    MISSING = "???"


@dataclass
class ArchConfig:
    """Architecture of a model built from scratch (used when ``model.path`` is null)."""

    family: str = "qwen2"  # a known model_type: qwen2, llama, qwen3, qwen3_moe
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: Optional[int] = None  # Qwen3 sets it explicitly; null means hidden/heads
    vocab_size: int = 128
    max_position_embeddings: int = 512
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    # Mixture of experts (qwen3_moe only; 0 experts: a dense family). Qwen3-MoE's names.
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: List[int] = field(default_factory=list)


@dataclass
class ModelConfig:
    name: str = "tiny-qwen2"
    # Hugging Face checkpoint directory (config.json + safetensors). Null: build from `arch`.
    # Mandatory (???) unless a model file sets it, so a recipe cannot silently fall back to `arch`.
    path: Optional[str] = MISSING
    arch: ArchConfig = field(default_factory=ArchConfig)
    # auto: bf16 on GPUs, fp32 on CPU. Or one of fp32, bf16, fp16.
    dtype: str = "auto"


@dataclass
class ParallelConfig:
    """Trainer parallelism; data parallel size is world / (tp * pp * cp)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    # Megatron's distributed optimizer (ZeRO-1: Adam state sharded over DP), on CPU as on GPUs.
    use_distributed_optimizer: bool = True
    # MoE models: expert parallelism (experts spread over ep ranks, tokens moved by Megatron's
    # all-to-all dispatcher) and the experts' own tensor parallelism. Megatron lays the expert
    # grid (expert_tp x ep x expert-DP x pp) over the same ranks as tp x cp x dp x pp.
    ep: int = 1
    expert_tp: int = 1


@dataclass
class AlgoConfig:
    """Advantage estimation and the (decoupled) PPO objective, as in AReaL."""

    advantage: str = "grpo"
    std_normalize: bool = True
    leave_one_out: bool = False
    use_decoupled_loss: bool = True
    eps_clip: float = 0.2
    eps_clip_high: Optional[float] = 0.28
    dual_clip: Optional[float] = None
    behav_imp_weight_cap: Optional[float] = None
    cap_mode: str = "mask"  # mask | clamp
    cap_level: str = "token"  # token | sequence
    # AReaL's admission control eta; null: unbounded, as in Laminar.
    max_staleness: Optional[int] = None
    n_samples_per_prompt: int = 8
    # MoE routing replay (R3): engines return the experts they routed each token to (SGLang's
    # return_routed_experts) and the trainer routes the same way (Megatron's router replay).
    routing_replay: bool = False
    # Train/inference mismatch: |log pi_engine - log pi_trainer| on tokens of the trainer's own
    # version; metrics report the fraction of such tokens above this threshold.
    mismatch_threshold: float = 0.1


@dataclass
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1


@dataclass
class RolloutConfig:
    backend: str = "cpu"  # cpu (built-in engine) | sglang
    num_engines: int = 2
    engine_tp: int = 1
    mem_fraction_static: float = 0.8
    kv_capacity_tokens: int = 16384  # CPU engine KV cache size
    max_running_requests: int = 64
    base_port: int = 0  # 0: pick free ports
    host: str = "127.0.0.1"
    # Where a rollout node's engines take weights from: local (a relay on this node, the
    # default) or remote (no relay here: a relay on another node, read through Mooncake's
    # transfer engine; needs weight_sync.mooncake_protocol; job=rollout only).
    relay: str = "local"
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    extra_args: List[str] = field(default_factory=list)  # passed to sglang.launch_server
    # Engines stream only new tokens (--incremental-streaming-output), a chunk every
    # stream_interval tokens: the controller's cost stays O(L) for an L-token response.
    stream_interval: int = 8
    # Engines honour per-trajectory sampling seeds (--enable-deterministic-inference; SGLang
    # ignores sampling_seed without it). Free on the CPU engine; on GPUs SGLang's
    # batch-invariant kernels cost decode throughput: set false to trade reproducibility for it.
    deterministic_inference: bool = True
    # Laminar's long-tail repack (mode=laminar): checked every repack_interval_s and after each
    # new weight version; an engine waiting on at most repack_max_requests trajectories
    # (0: a quarter of max_running_requests) hands them to the densest engine of its version.
    repack: bool = True
    repack_interval_s: float = 5.0
    repack_max_requests: int = 0
    # Replay a long-tailed response-length distribution (benchmarks): 0 disables. Each
    # trajectory then generates exactly this many tokens (EOS ignored): ``forced_long_length``
    # with probability ``forced_long_fraction``, else about ``forced_short_length``.
    forced_short_length: int = 0
    forced_long_length: int = 0
    forced_long_fraction: float = 0.0
    # Fault isolation (rollout/supervisor.py): each node's supervisor checks its engines every
    # engine_heartbeat_s (the process, and /health_generate, which must answer within
    # engine_heartbeat_timeout_s; two failures in a row count); a dead or hung engine is
    # restarted, re-registers and pulls the newest version. An engine restarted more than
    # engine_restarts_per_hour times within an hour is evicted (the run goes on without it;
    # the reason is in the summary). A dead relay is restarted the same way (its shared
    # memory is reclaimed first).
    engine_heartbeat_s: float = 2.0
    engine_heartbeat_timeout_s: float = 60.0
    engine_restarts_per_hour: int = 3
    # Engines start no new trajectory while this many batches (train_batch_prompts x
    # n_samples) wait in the experience buffer: a trainer that is down or restarting does not
    # make the buffer grow without end (with algo.max_staleness set, that bound usually binds
    # first). 0: no cap.
    max_buffered_batches: int = 8


@dataclass
class WeightSyncConfig:
    bucket_mb: int = 512
    # Chunk size of the trainer -> master relay stream (staged on the sender's own CUDA stream
    # over NCCL): larger chunks mean fewer round trips, more staging memory on one GPU.
    chunk_mb: int = 64
    chain_chunks: Optional[int] = None  # null: from Laminar's T(p, k) model
    # Trainer -> master relay transport: auto (NCCL when the relay's machine has a GPU, else
    # gloo), nccl or gloo. The relay announces it; trainers follow.
    publish_backend: str = "auto"
    # The GPU a relay keeps its CUDA context and NCCL publish staging on: auto (the machine's
    # last GPU; engines are placed from GPU 0 up), cpu (none: gloo publishes only), or cuda:N.
    # Leave it a GPU no engine uses when one is free (job=plan shows the map).
    relay_device: str = "auto"
    # Relays also serve cross-node pulls through Mooncake's transfer engine: null (off), tcp or
    # rdma; mooncake_device names the RDMA NIC(s), e.g. mlx5_0 (empty: auto-discover).
    mooncake_protocol: Optional[str] = None
    mooncake_device: str = ""
    # How engines take a version from their relay (relay/transports): auto (sglang_cuda_ipc
    # for SGLang, shm for the CPU engine, from the relay on their machine), or mooncake (reads
    # through Mooncake's transfer engine, as from a relay on another machine; needs
    # mooncake_protocol), or any registered transport.
    engine_transport: str = "auto"
    # Deadlines: a trainer's send to the master relay (forming the group, each bucket) fails
    # after publish_timeout_s with an error naming the relay; when the master relay is gone,
    # the publisher asks the controller for the new one (elected among the remaining relays,
    # or the restarted one) for up to failover_timeout_s and sends the version again, whole.
    publish_timeout_s: float = 300.0
    failover_timeout_s: float = 180.0


@dataclass
class NodeGroupConfig:
    nnodes: int = 1
    nproc_per_node: int = 1


@dataclass
class ClusterConfig:
    """Where the roles run. ``controller_addr`` is how multi-node roles find each other."""

    name: str = "local_cpu"
    trainer: NodeGroupConfig = field(default_factory=NodeGroupConfig)
    rollout_nodes: int = 1
    controller_addr: str = MISSING  # local_cpu sets 127.0.0.1; multi-node runs must set it
    controller_port: int = 0  # job=controller listens here; 0: pick one (single machine only)
    join_timeout_s: float = 600.0  # how long roles wait for each other to start
    shutdown_grace_s: float = 60.0  # a rollout node stops this long after its controller went
    # CPU threads per process on a shared machine; 0: leave torch's default.
    threads_per_process: int = 1
    # The GPUs of one node, for the capacity plan (job=plan) and the check that refuses a run
    # that does not fit before anything starts. 0: no GPU (CPU runs; nothing to check).
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0


@dataclass
class DataConfig:
    """Prompts from JSONL/Parquet files, or (with no train_files) a built-in synthetic task."""

    train_files: List[str] = field(default_factory=list)
    eval_files: List[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    max_prompt_len: int = 64
    # Dotted path of the reward function: fn(response_text, answer, **row) -> float.
    reward_fn: str = "laminar_mcore.reward.builtin:exact_match"
    reward_workers: int = 1
    # A reward call running longer than this is abandoned (its worker killed, the trajectory
    # discarded with reason reward_error); a worker that dies is replaced and its calls retried.
    reward_timeout_s: float = 60.0
    # The built-in task (character tokenizer) used when train_files is empty.
    task: str = "reverse"  # reverse | addition | reverse_longtail (data/tasks.py)
    digits: int = 5  # reverse_longtail: the short strings have 1 to `digits` digits
    # reverse_longtail: a fraction `long_fraction` of the strings has long_digits/2..long_digits
    long_digits: int = 0
    long_fraction: float = 0.0
    num_train: int = 4000
    num_eval: int = 128
    # Supervised warm-up that builds the starting checkpoint when model.path is null.
    warmup_steps: int = 200
    warmup_wrong_fraction: float = 0.5


@dataclass
class TrainerConfig:
    lr: float = 1e-5
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"  # constant | linear | cosine (Megatron's scheduler)
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    # Tokens per chunk of the vocab-parallel log-prob pass on CPU; 0: fit 32 MiB of logits.
    logprob_chunk_size: int = 0
    train_batch_prompts: int = 32
    max_tokens_per_microbatch: int = 4096
    # Activation recompute: none | selective (attention core) | full (every layer's forward is
    # rerun in backward; recompute_num_layers per checkpointed group). See job=plan.
    recompute: str = "none"
    recompute_num_layers: int = 1
    total_steps: int = 100
    save_interval: int = 0  # 0: never
    # Evaluate the policy on the held-out set every eval_interval steps (greedy and sampled
    # accuracy, on a rollout engine once it holds that step's version); 0: only before and
    # after training. verl's test_freq.
    eval_interval: int = 0
    resume: str = "none"  # none | auto | a checkpoint directory
    # Optimizer checkpoint format (Megatron's distrib_optim_sharding_type): dp_reshardable
    # (each rank writes its shard; resume at any DP size) or fully_reshardable (gathered in
    # model space over DP at save; resume at any TP/PP/DP, more memory and time per save).
    ckpt_optim_sharding: str = "dp_reshardable"
    max_consecutive_nonfinite: int = 3
    # MoE: Megatron's load-balancing auxiliary loss (0: off) and router z-loss (0: off); their
    # values are reported in the step's metrics (moe_load_balancing_loss, moe_z_loss).
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    # How long the trainer waits for one batch before failing the run (a batch of 512 prompts x
    # 16 samples x 8k tokens can take many minutes). The other ranks wait without a timeout of
    # their own tripping (parallel/groups.py: wait_group).
    batch_timeout_s: float = 3600.0
    # Trainer collectives (NCCL/gloo) fail after this long: a hung rank ends the run.
    collective_timeout_s: float = 600.0
    # A trainer process that dies restarts the trainer world (job=train on one machine: the
    # launcher does it, up to max_restarts times; on a cluster the scheduler re-runs torchrun)
    # from the newest complete checkpoint, while the engines keep generating. The restarted
    # trainer publishes a version newer than any the relays hold.
    max_restarts: int = 2


@dataclass
class LaminarConfig:
    """The whole run. ``mode`` picks laminar / areal / one_step / sync on one code base."""

    run_name: str = "default"
    output_dir: str = "outputs"
    mode: str = "laminar"
    seed: int = 1234
    # What `python -m laminar_mcore.launch` runs; `smoke` is the parallel Megatron check.
    job: str = "smoke"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


_GROUP_SCHEMAS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "algo": AlgoConfig,
    "rollout": RolloutConfig,
    "cluster": ClusterConfig,
}


def register_configs() -> None:
    """Register the schemas: ``base_config`` for the root and ``<group>/schema`` per group."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=LaminarConfig)
    for group, schema in _GROUP_SCHEMAS.items():
        cs.store(group=group, name="schema", node=schema)


__all__ = [name for name in dir() if name.endswith("Config")] + ["register_configs", "MISSING"]
