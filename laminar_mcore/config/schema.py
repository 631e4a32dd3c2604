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
    hidden_size: int = 64  # model width (the keys are config.json's names)
    intermediate_size: int = 128  # the dense MLP's width (SwiGLU)
    num_hidden_layers: int = 4  # transformer layers; parallel.pp must divide them
    num_attention_heads: int = 4  # query heads; parallel.tp must divide them
    num_key_value_heads: int = 2  # KV heads (GQA groups); parallel.tp must divide them
    head_dim: Optional[int] = None  # Qwen3 sets it explicitly; null means hidden/heads
    vocab_size: int = 128  # parallel.tp must divide it
    max_position_embeddings: int = 512  # the context length the engines serve
    rms_norm_eps: float = 1e-6  # epsilon of every RMSNorm
    rope_theta: float = 10000.0  # RoPE base frequency
    tie_word_embeddings: bool = False  # the output layer shares the embedding (Llama 3.2 style)
    # Mixture of experts (qwen3_moe only; 0 experts: a dense family). Qwen3-MoE's names.
    num_experts: int = 0  # experts per sparse layer
    num_experts_per_tok: int = 2  # top-k experts each token is routed to
    moe_intermediate_size: int = 32  # each expert's MLP width
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities
    decoder_sparse_step: int = 1  # every n-th layer is sparse
    mlp_only_layers: List[int] = field(default_factory=list)  # layer numbers kept dense


@dataclass
class ModelConfig:
    name: str = "tiny-qwen2"  # a label: job=plan prints it and writes it to plan.json
    # Hugging Face checkpoint directory (config.json + safetensors). Null: build from `arch`.
    # Mandatory (???) unless a model file sets it, so a recipe cannot silently fall back to `arch`.
    path: Optional[str] = MISSING
    arch: ArchConfig = field(default_factory=ArchConfig)  # used when path is null (and by job=plan)
    # auto: bf16 on GPUs, fp32 on CPU. Or one of fp32, bf16, fp16.
    dtype: str = "auto"


@dataclass
class ParallelConfig:
    """Trainer parallelism; data parallel size is world / (tp * pp * cp)."""

    tp: int = 1  # tensor parallel size
    pp: int = 1  # pipeline parallel size
    cp: int = 1  # context parallel size: only 1 for now (validation refuses more)
    sequence_parallel: bool = False  # split activations over TP (needs tp > 1; TE on GPUs)
    # Megatron's distributed optimizer (ZeRO-1: Adam state sharded over DP), on CPU as on GPUs.
    use_distributed_optimizer: bool = True
    # MoE models: expert parallelism (experts spread over ep ranks, tokens moved by Megatron's
    # all-to-all dispatcher) and the experts' own tensor parallelism. Megatron lays the expert
    # grid (expert_tp x ep x expert-DP x pp) over the same ranks as tp x cp x dp x pp.
    ep: int = 1
    expert_tp: int = 1  # tensor parallel size inside each expert (GPUs only)


@dataclass
class AlgoConfig:
    """Advantage estimation and the policy loss: AReaL's decoupled PPO by default, or one of
    verl's estimators and losses under verl's names (laminar_mcore/algos)."""

    # Advantage estimator: grpo (group-normalised rewards), rloo, reinforce_plus_plus,
    # reinforce_plus_plus_baseline, opo, gpg or grpo_passk. remax is refused: it needs an extra
    # greedy rollout of every prompt, which the rollout tier does not generate.
    advantage: str = "grpo"
    std_normalize: bool = True  # grpo(_passk): divide by the group's reward std (Dr. GRPO: false)
    leave_one_out: bool = False  # grpo: baseline is the mean of the group's other samples
    # Policy loss: decoupled_ppo (AReaL's), gspo, cispo, sapo, geo_mean, clip_cov or kl_cov.
    # Each uses the ratio pi_theta/pi_prox and the weight pi_prox/pi_behav (behav_imp_weight_cap).
    policy_loss: str = "decoupled_ppo"
    # How per-token losses make the batch's loss, over the whole batch (all micro-batches and
    # DP ranks): token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean or
    # seq-mean-token-sum-norm. sapo and geo_mean need seq-mean-token-mean.
    loss_agg_mode: str = "token-mean"
    # seq-mean-token-sum-norm divides each sequence's token sum by this constant (verl's
    # actor.loss_scale_factor; e.g. rollout.sampling.max_new_tokens); required by that mode.
    loss_scale_factor: Optional[float] = None
    use_decoupled_loss: bool = True  # false: pi_prox = pi_behav (plain PPO/GRPO)
    eps_clip: float = 0.2  # lower clip of the ratio pi_theta/pi_prox (sapo, kl_cov: none)
    eps_clip_high: Optional[float] = 0.28  # upper clip (clip-higher); null: eps_clip
    dual_clip: Optional[float] = None  # dual-clip bound c > 1 on negative advantages; null: off
    behav_imp_weight_cap: Optional[float] = None  # cap on pi_prox/pi_behav (AReaL: 5.0); null: none
    cap_mode: str = "mask"  # mask | clamp
    cap_level: str = "token"  # token | sequence
    sapo_tau_pos: float = 1.0  # sapo: gate temperature for positive advantages
    sapo_tau_neg: float = 1.05  # sapo: gate temperature for negative advantages
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # clip_cov: lower bound of the covariance of the cut tokens
    clip_cov_ub: float = 5.0  # clip_cov: upper bound of the covariance of the cut tokens
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of tokens given the |log ratio| penalty
    kl_cov_coef: float = 0.1  # kl_cov: coefficient of that penalty (verl's ppo_kl_coef)
    # eta: mode=laminar trains on nothing more than eta versions stale (older is discarded as
    # "stale"); mode=areal: AReaL's admission control. null: unbounded, as in Laminar.
    max_staleness: Optional[int] = None
    n_samples_per_prompt: int = 8  # GRPO group size: trajectories per prompt
    # MoE routing replay (R3): engines return the experts they routed each token to (SGLang's
    # return_routed_experts) and the trainer routes the same way (Megatron's router replay).
    routing_replay: bool = False
    # Train/inference mismatch: |log pi_engine - log pi_trainer| on tokens of the trainer's own
    # version; metrics report the fraction of such tokens above this threshold.
    mismatch_threshold: float = 0.1
    # Entropy bonus: the loss subtracts entropy_coef x the policy's per-token entropy, aggregated
    # like the policy loss (verl's actor.entropy_coeff). 0: the entropy is only logged.
    entropy_coef: float = 0.0
    # KL penalty against a frozen reference policy (the initial weights, sharded like the actor):
    # the loss adds kl_coef x kl_estimator(pi_theta, pi_ref), aggregated like the policy loss
    # (verl's actor.use_kl_loss, kl_loss_coef, kl_loss_type). 0: no reference model is built.
    kl_coef: float = 0.0
    # k1, k2 or k3 (verl's kl, mse, low_var_kl; also abs); a '+' suffix (k3+) keeps the value and
    # takes k2's gradient, the unbiased gradient of KL.
    kl_estimator: str = "k3"
    # true: the reference weights wait in host memory and visit the accelerator for their
    # forward pass only (accelerator memory for host memory and a copy per step).
    ref_offload: bool = False


@dataclass
class SamplingConfig:
    max_new_tokens: int = 64  # response cap per trajectory
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling; 1: off
    top_k: int = -1  # -1: off


@dataclass
class RolloutConfig:
    backend: str = "cpu"  # cpu (built-in engine) | sglang
    num_engines: int = 2  # engines per rollout node
    engine_tp: int = 1  # an engine's TP ranks (SGLang: its GPUs; the CPU engine: its payloads)
    engine_ep: int = 1  # SGLang's --ep-size: its experts split over this many of its TP ranks
    moe_runner_backend: str = "auto"  # SGLang's --moe-runner-backend (auto: SGLang picks)
    mem_fraction_static: float = 0.8  # SGLang's --mem-fraction-static (weights + KV)
    kv_capacity_tokens: int = 16384  # CPU engine KV cache size
    max_running_requests: int = 64  # an engine's concurrent requests: its capacity
    base_port: int = 0  # 0: pick free ports
    host: str = "127.0.0.1"  # address engines and relay bind to and advertise
    # Where a node's engines take weights from: local (a relay on this node) or remote (a relay
    # on another node, read through Mooncake; needs weight_sync.mooncake_protocol; job=rollout).
    relay: str = "local"
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # every trajectory's
    # Agent episodes (data.agent): limits per episode. An episode that reaches one ends with
    # it as its reason (the books count them), keeping the reward its agent returns (0 if the
    # agent gives none). sampling.max_new_tokens caps each turn.
    max_turns: int = 8  # model calls (assistant turns) per episode
    max_tool_calls: int = 8  # tool calls the model may make per episode
    max_episode_tokens: int = 4096  # prompt, turns and tool outputs of one episode
    # Seconds an episode (its agent, tools included) may take; over it, it is discarded
    # (episode_timeout): a hung tool never keeps its engine from pulling. null: no limit.
    max_episode_s: Optional[float] = 3600.0
    # Where agents' tool code runs (agents/sandbox.py): bubblewrap (namespaces of its own, no
    # network, no host files, an unprivileged user; an agent job refuses to start without a
    # working bwrap) or unsafe-local (a plain child process: no isolation at all, only for
    # code you trust; warned at start and in summary.json).
    sandbox: str = "bubblewrap"
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
    repack_interval_s: float = 5.0  # seconds between repack checks
    repack_max_requests: int = 0  # repack an engine down to this many; 0: a quarter
    # Replay a long-tailed response-length distribution (benchmarks): 0 disables. Each
    # trajectory then generates exactly this many tokens (EOS ignored): ``forced_long_length``
    # with probability ``forced_long_fraction``, else about ``forced_short_length``.
    forced_short_length: int = 0
    forced_long_length: int = 0  # the long responses' length; 0: off
    forced_long_fraction: float = 0.0  # the fraction of long responses
    # Fault isolation (rollout/supervisor.py): each node's supervisor checks its engines every
    # engine_heartbeat_s (the process, and /health_generate, which must answer within
    # engine_heartbeat_timeout_s; two failures in a row count, and a check that fails while
    # the controller reports the engine paused, pulling or updating does not count); a dead
    # or hung engine is restarted, re-registers and pulls the newest version. An engine
    # restarted more than engine_restarts_per_hour times within an hour is evicted (the run
    # goes on without it; the reason is in the summary). A dead relay is restarted the same
    # way (its shared memory is reclaimed first).
    engine_heartbeat_s: float = 2.0
    # A /health_generate slower than this fails. Floor: SGLang's own health window
    # (env SGLANG_HEALTH_CHECK_TIMEOUT, 20 s by default, checked every second) + 5 s; a
    # smaller value is raised to it, with a note in the node's log.
    engine_heartbeat_timeout_s: float = 60.0
    engine_restarts_per_hour: int = 3  # more restarts within an hour evict the engine
    # Seconds an engine may take to start (its first start and every restart by its node's
    # supervisor) until it answers SGLang's /ready (which does not generate); over it, the
    # start fails with the engine's log tail. null: by backend, 1800 for sglang (a big
    # checkpoint loads and captures CUDA graphs for many minutes), 180 for the CPU engine.
    start_timeout_s: Optional[float] = None
    # Seconds a pause_generation / continue_generation call may take (separate from the
    # per-request timeouts): SGLang's abort-mode pause aborts every request and re-checks
    # once a second until the update lock is free; a slower pause is logged, and only one
    # over this budget takes the engine out of service.
    pause_timeout_s: float = 60.0
    # Test/twin knob of the CPU engine (backend=cpu only; sglang ignores it): its HTTP server
    # answers 503 ("Starting") on /health, /health_generate and /ready for this many seconds
    # after it binds, as a big model's start-up does. 0: none.
    cpu_startup_delay_s: float = 0.0
    # Engines start no new trajectory while this many batches (train_batch_prompts x
    # n_samples) wait in the experience buffer: a trainer that is down or restarting does not
    # make the buffer grow without end (with algo.max_staleness set, that bound usually binds
    # first). 0: no cap.
    max_buffered_batches: int = 8
    # true: engines generate as soon as they are up, so the trainer's start-up overlaps the
    # first batches; false: generation waits for the trainer's first batch request, so that
    # every mode starts alike from that moment (bench.convergence times from it).
    generate_before_trainer: bool = True


@dataclass
class WeightSyncConfig:
    bucket_mb: int = 512  # host bucket size (MiB) of a published version
    # Chunk size of the trainer -> master relay stream (staged on the sender's own CUDA stream
    # over NCCL): larger chunks mean fewer round trips, more staging memory on one GPU.
    chunk_mb: int = 64
    chain_chunks: Optional[int] = None  # null: from Laminar's T(p, k) model
    # Trainer -> master relay channel: auto (per trainer from both ends: shm, writing into the
    # relay's shared memory, on one host; NCCL across hosts when both have a GPU; else gloo),
    # or forced: shm, nccl, gloo (never NCCL on one GPU: refused).
    publish_backend: str = "auto"
    # The GPU an NCCL publish session stages on (no CUDA context before one forms): auto (a GPU
    # of the node no trainer or engine holds, if any), cpu (none: no NCCL), or cuda:N (the
    # node's GPU N, held by no other role). job=plan shows the GPU map.
    relay_device: str = "auto"
    # Relays also serve cross-node pulls through Mooncake's transfer engine: null, tcp, rdma.
    mooncake_protocol: Optional[str] = None
    mooncake_device: str = ""  # RDMA NIC(s), e.g. mlx5_0; empty: auto
    # How engines take a version from their relay (relay/transports): auto (sglang_cuda_ipc
    # for SGLang, shm for the CPU engine, from the relay on their machine), or mooncake (reads
    # from a relay on another machine; needs mooncake_protocol), or any registered transport.
    engine_transport: str = "auto"
    # What each engine GPU copies: shard (its TP rank's own parameters, SGLang's per-rank
    # layout, load_format=direct), whole (every tensor), auto (shard at rollout.engine_tp > 1
    # pulling from the node's relay, for MoE where rollout.moe_runner_backend's layout is known).
    engine_pull: str = "auto"
    # Deadlines: a trainer's send to the master relay (forming the group, each bucket) fails
    # after publish_timeout_s with an error naming the relay; when the master relay is gone,
    # the publisher asks the controller for the new one (elected among the remaining relays,
    # or the restarted one) for up to failover_timeout_s and sends the version again, whole.
    publish_timeout_s: float = 300.0
    failover_timeout_s: float = 180.0  # how long to look for a new master relay
    # Versions a relay keeps in /dev/shm at once (>= 2: the newest complete one, which pulls
    # lease, and the one being received). A version arriving while an older one is leased by a
    # slow pull (or pinned by a push down the chain) waits until that lease is released or
    # lapses (never overwritten); a trainer's publish is refused there after relay_full_wait_s.
    # One more lets a slow pull hold on, for one more model's /dev/shm per node (job=plan).
    relay_versions: int = 2
    # Seconds a version waits at a relay whose relay_versions are all held before it is refused.
    relay_full_wait_s: float = 30.0
    # Benchmark knob (bench.staleness): at step v publish step v - publish_lag's weights (the
    # final ones at the end), so trajectories are publish_lag versions stale. 0: off.
    publish_lag: int = 0
    # Delta publication (weights/delta.py): auto (on where a version reaches the relays sooner
    # as deltas than whole over link_gbit; job=plan says which and why), on, off. A bucket
    # then goes as its changed elements' positions and bits, zstd-compressed, when that is at
    # most half its size; every relay rebuilds it and checks its digest (else fetches it whole).
    delta: str = "auto"
    # Gbit/s of the slowest link a version crosses to the relays (the master relay's ingress;
    # a hop of the chain): what delta=auto weighs deltas against (weights/delta.py,
    # choose_delta). 0: not named, and auto sends whole versions.
    link_gbit: float = 0.0
    # Every anchor_interval-th version travels whole (1: every version).
    anchor_interval: int = 16
    # How the trainer exports a version: stage_lead (a stage's TP ranks gather onto its lead,
    # which publishes the stage) or per_rank (every rank of the first data-parallel replica
    # publishes its own shard: no gather, blocked for its local copy only; relays put the
    # slices together as engines pull; MoE at parallel.tp=1: each EP rank its own experts).
    export: str = "stage_lead"
    # Master relays a version is striped over (whole pipeline stages each, one relay per stripe
    # on every rollout node; divides parallel.pp). null: gcd(trainer nodes, pp); 1 for Mooncake.
    master_relays: Optional[int] = None


@dataclass
class NodeGroupConfig:
    nnodes: int = 1  # trainer nodes (torchrun --nnodes)
    nproc_per_node: int = 1  # trainer processes per node, one per GPU


@dataclass
class ClusterConfig:
    """Where the roles run. ``controller_addr`` is how multi-node roles find each other."""

    name: str = "local_cpu"  # a label of the cluster preset
    # The trainer world: nnodes x nproc_per_node ranks.
    trainer: NodeGroupConfig = field(default_factory=NodeGroupConfig)
    rollout_nodes: int = 1  # rollout nodes (each a relay and num_engines engines)
    controller_addr: str = MISSING  # local_cpu sets 127.0.0.1; multi-node runs must set it
    controller_port: int = 0  # job=controller listens here; 0: pick one (single machine only)
    # How long roles wait for each other to start. null: the engines' start budget
    # (rollout.start_timeout_s) + 300 s; never below that budget (the check refuses it).
    join_timeout_s: Optional[float] = None
    shutdown_grace_s: float = 60.0  # a rollout node stops this long after its controller went
    # CPU threads per process on a shared machine; 0: leave torch's default.
    threads_per_process: int = 1
    # The GPUs of one node, for the capacity plan (job=plan), the GPU map (each role started on
    # a node gets GPUs of its own) and the checks that refuse a run that does not fit before
    # anything starts. 0: no GPU (CPU runs: only host memory is checked, when host_memory_gb > 0).
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0  # one GPU's memory (GB), for job=plan and that check
    # One node's RAM (GB), for job=plan and the same check: a rollout node's relay versions in
    # /dev/shm and a trainer node's pinned publish buffers (and an offloaded reference model)
    # must fit it, with or without GPUs. 0: not checked (local_cpu: the machine is shared
    # with everything else).
    host_memory_gb: float = 2048.0
    # The size of /dev/shm (a tmpfs) on a rollout node (GB), which holds the relay's versions;
    # null: half of host_memory_gb, Linux's default. Larger only after remounting it, e.g.
    # mount -o remount,size=1100G /dev/shm (docker: --shm-size=1100g). A relay also checks the
    # real free space and refuses, naming the mount, rather than die of SIGBUS when it fills.
    shm_gb: Optional[float] = None


@dataclass
class DataConfig:
    """Prompts from JSONL/Parquet files, or (with no train_files) a built-in synthetic task."""

    # JSONL/Parquet prompt files; empty: the built-in task.
    train_files: List[str] = field(default_factory=list)
    # An agent written against the OpenAI client, "module:function": ``async def agent(client,
    # row) -> reward`` (a float) or a final answer (a str the reward_fn scores against the row's
    # answer). ``client`` is an openai.AsyncOpenAI pointed at the controller's gateway, with
    # this trajectory's own key; null: single-turn episodes (one prompt, one completion).
    agent: Optional[str] = None
    # Held-out prompts; empty: the first num_eval rows.
    eval_files: List[str] = field(default_factory=list)
    prompt_key: str = "prompt"  # the prompt's field in a row
    answer_key: str = "answer"  # the answer's field in a row (the reward function's answer)
    max_prompt_len: int = 64  # prompt tokens job=plan assumes per sequence
    # Dotted path of the reward function: fn(response_text, answer, **row) -> float.
    reward_fn: str = "laminar_mcore.reward.builtin:exact_match"
    reward_workers: int = 1  # reward processes
    # A reward call running longer than this is abandoned (its worker killed, the trajectory
    # discarded with reason reward_error); a worker that dies is replaced and its calls retried.
    reward_timeout_s: float = 60.0
    # The built-in task (character tokenizer) used when train_files is empty.
    task: str = "reverse"  # reverse | addition | reverse_longtail (data/tasks.py)
    digits: int = 5  # reverse_longtail: the short strings have 1 to `digits` digits
    # reverse_longtail: a fraction `long_fraction` of the strings has long_digits/2..long_digits
    long_digits: int = 0
    long_fraction: float = 0.0  # reverse_longtail: the share of long strings
    num_train: int = 4000  # built-in task: training problems
    num_eval: int = 128  # built-in task: held-out problems
    # Supervised warm-up that builds the starting checkpoint when model.path is null.
    warmup_steps: int = 200
    warmup_wrong_fraction: float = 0.5  # share of warm-up demos with a wrong digit


@dataclass
class TrainerConfig:
    lr: float = 1e-5  # peak learning rate (Adam)
    min_lr: float = 0.0  # floor of the linear/cosine decay
    lr_warmup_steps: int = 0  # linear warm-up from 0
    lr_decay_style: str = "constant"  # constant | linear | cosine (Megatron's scheduler)
    weight_decay: float = 0.0  # Adam's decoupled weight decay
    adam_beta1: float = 0.9  # Adam's beta1
    adam_beta2: float = 0.999  # Adam's beta2
    adam_eps: float = 1e-8  # Adam's epsilon
    grad_clip: float = 1.0  # max global gradient norm; 0: off
    # Tokens per chunk of the vocab-parallel log-prob pass on CPU; 0: fit 32 MiB of logits.
    logprob_chunk_size: int = 0
    train_batch_prompts: int = 32  # prompts per step (x n_samples_per_prompt)
    max_tokens_per_microbatch: int = 4096  # token budget of one packed micro-batch
    # Run no forward/backward for trajectories whose advantage is exactly 0 (a group whose
    # samples all got the same reward): they add exactly 0 to the policy loss and its gradient;
    # their tokens still count in the loss's denominator, so the update is the whole batch's.
    # Needs algo.entropy_coef = algo.kl_coef = 0, no MoE auxiliary/z-loss (terms that read
    # every token) and a policy loss other than clip_cov/kl_cov (they select tokens by the
    # batch's covariance). Reported per step as skipped_tokens.
    skip_zero_advantage: bool = False
    # Activation recompute: none | selective (attention core) | full (every layer's forward is
    # rerun in backward; recompute_num_layers per checkpointed group). See job=plan.
    recompute: str = "none"
    recompute_num_layers: int = 1  # layers per recompute group (full only)
    total_steps: int = 100  # trainer steps of the run
    save_interval: int = 0  # 0: never
    # Evaluate the policy on the held-out set every eval_interval steps (greedy and sampled
    # accuracy, on a rollout engine once it holds that step's version); 0: only before and
    # after training. verl's test_freq.
    eval_interval: int = 0
    # true: those evaluations run after training, on weight snapshots the trainer writes at
    # each eval_interval step (Hugging Face directories in <run>/eval_snapshots; on several
    # machines, a filesystem the trainer nodes write and the rollout nodes read), so that
    # evaluating costs the run's clock only the save: a time to target is training time alone.
    eval_offline: bool = False
    # false: the evaluations between the first and the last are sampled only (greedy, about
    # half of an evaluation's time, is then measured before and after training)
    eval_greedy: bool = True
    resume: str = "none"  # none | auto | a checkpoint directory
    # Optimizer checkpoint format (Megatron's distrib_optim_sharding_type): dp_reshardable
    # (each rank writes its shard; resume at any DP size) or fully_reshardable (gathered in
    # model space over DP at save; resume at any TP/PP/DP, more memory and time per save).
    ckpt_optim_sharding: str = "dp_reshardable"
    max_consecutive_nonfinite: int = 3  # NaN/inf steps in a row that stop the run
    # MoE: Megatron's load-balancing auxiliary loss (0: off) and router z-loss (0: off); their
    # values are reported in the step's metrics (moe_load_balancing_loss, moe_z_loss).
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0  # router z-loss coefficient; 0: off
    # How long the trainer waits for one batch before failing the run (a batch of 512 prompts x
    # 16 samples x 8k tokens can take many minutes). The other ranks wait without a timeout of
    # their own tripping (parallel/groups.py: wait_group).
    batch_timeout_s: float = 3600.0
    # Trainer collectives (NCCL/gloo: the world and Megatron's TP/PP/DP/EP groups, the
    # publish-time gathers included) fail after this long: a hung rank ends the run.
    collective_timeout_s: float = 600.0
    # A trainer process that dies restarts the trainer world (job=train on one machine: the
    # launcher does it, up to max_restarts times; on a cluster the scheduler re-runs torchrun)
    # from the newest complete checkpoint, while the engines keep generating. The restarted
    # trainer publishes a version newer than any the relays hold.
    max_restarts: int = 2
    # Where the run's records go; each logger gets the same ones (metrics/loggers.py):
    # tensorboard (<out>/tensorboard), jsonl (<out>/metrics.jsonl), wandb, mlflow. jsonl is
    # required: it is the run's own record (the summary, chaos tests and benchmarks read it).
    # wandb and mlflow need their package (pip install wandb / mlflow-skinny), checked before the
    # run starts; one that fails mid-run is reported once and never stops training.
    loggers: List[str] = field(default_factory=lambda: ["tensorboard", "jsonl"])
    # W&B project; null: $WANDB_PROJECT, else laminar_mcore. The W&B run is named run_name and
    # writes to <out>/wandb; $WANDB_MODE (online | offline | disabled) applies.
    wandb_project: Optional[str] = None
    # MLflow tracking URI; null: $MLFLOW_TRACKING_URI, else a file store in <out>/mlruns.
    mlflow_tracking_uri: Optional[str] = None
    # MLflow experiment; null: $MLFLOW_EXPERIMENT_NAME, else laminar_mcore.
    mlflow_experiment: Optional[str] = None


@dataclass
class PlanConfig:
    """Allowances of the capacity plan (job=plan and the fit check) that no config fixes."""

    # Routed-token activations of an MoE layer on the busiest expert-parallel rank, over a
    # perfectly balanced router: tokens land unevenly even with an auxiliary load-balancing
    # loss. 1.25 is a stated allowance (Megatron's own capacity-factor examples run 1.0-1.5, and
    # its moe_router load-balancing metrics show the busiest expert near 1.2x the mean in
    # aux-loss-balanced training); raise it for a router without balancing.
    moe_imbalance: float = 1.25


@dataclass
class LaminarConfig:
    """The whole run. ``mode`` picks laminar / areal / one_step / sync on one code base."""

    run_name: str = "default"  # outputs go to output_dir/run_name
    output_dir: str = "outputs"  # every run's outputs; warm-ups cached in .cache ($LAMINAR_CACHE_DIR)
    mode: str = "laminar"  # laminar | areal | one_step | sync (modes.py)
    seed: int = 1234  # trajectories sample with seeds derived from (seed, group, index)
    # What `python -m laminar_mcore.launch` runs; `smoke` is the parallel Megatron check.
    job: str = "smoke"
    # The policy: a checkpoint or an architecture.
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # the trainer's layout
    algo: AlgoConfig = field(default_factory=AlgoConfig)  # advantages and the loss
    # Engines, sampling, repack, supervision.
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    # Publication, relays, pulls.
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # where the roles run
    data: DataConfig = field(default_factory=DataConfig)  # prompts, rewards, built-in task
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # optimizer, batches, checkpoints
    plan: PlanConfig = field(default_factory=PlanConfig)  # the capacity plan's allowances


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
