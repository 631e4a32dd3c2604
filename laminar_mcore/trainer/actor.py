"""The Megatron-Core actor: decoupled-PPO train steps on packed trajectories at any TP x PP x DP.

Owns the model (wrapped in Megatron's DistributedDataParallel), Megatron's optimizer and LR
schedule, the weight version counter, and one train step:

  1. rank 0 computes advantages, plans balanced micro-batches per DP rank and scatters them
     (with ``trainer.skip_zero_advantage``, leaving out trajectories of advantage exactly 0,
     whose loss tokens still count in the denominator: ``skip_zero_advantage``);
  2. pi_prox is recomputed once per batch with a forward-only pass (skipped, pi_prox = pi_behav,
     when ``use_decoupled_loss`` is false);
  3. with ``algo.kl_coef > 0``, the frozen reference policy (the initial weights, sharded like
     the actor; in host memory between passes with ``algo.ref_offload``) gives its log-probs in
     one more forward-only pass;
  4. Megatron's forward-backward schedule computes vocab-parallel log-probs and entropy (one
     fused pass) and the policy loss (``algo.policy_loss``: AReaL's decoupled PPO by default),
     minus ``algo.entropy_coef`` x entropy, plus ``algo.kl_coef`` x the KL estimate against the
     reference, each aggregated over the whole batch (``algo.loss_agg_mode``; default: over the
     global loss-token count), so that splitting into micro-batches and DP ranks does not change
     the gradient;
  5. a non-finite loss or gradient norm skips the step (warned and counted); too many in a row
     stop the run with a clear error.

The batch's plan (advantages, skipped trajectories, micro-batches) is ``batch_plan``'s and the
step's statistics are ``step_stats``'s; this module builds, scatters, runs and steps.

It never imports engine code; weights leave it only through ``laminar_mcore.weights`` formats.
"""

from __future__ import annotations

import logging
import math
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..algos import (aggregate_terms, batch_counts, denominator, policy_loss_fn,
                     policy_loss_options, regularized_sums)
from ..algos.spec import skip_zero_advantage_problem
from ..config.schema import AlgoConfig, ParallelConfig, TrainerConfig
from ..data.trajectory import Trajectory
from ..parallel import apply_cpu_compat, device
from .batch_plan import plan_batch, skip_zero_advantage
from .logprobs import megatron_vocab_parallel_logprobs
from .model import (build_gpt_model, check_parameter_dtypes, load_full_state, memory_config,
                    te_available)
from .packing import PackedMicroBatch, pack_routed_experts, pack_trajectories
from .step_stats import MISMATCH_EDGES, mismatch_summary, mismatch_terms, reduce_step_stats

# the planning and statistics names, importable from here as before the split
__all__ = ["MegatronActor", "NonFiniteLossError", "MISMATCH_EDGES", "mismatch_summary",
           "mismatch_terms", "skip_zero_advantage"]

logger = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps had a NaN/inf loss or gradient norm."""


class MegatronActor:
    """One pipeline stage of the policy on this rank, with its optimizer. Collective: every
    trainer rank constructs it and calls ``train_step`` together."""

    def __init__(self, hf_config, algo: AlgoConfig, trainer: TrainerConfig,
                 parallel: Optional[ParallelConfig] = None, *, full_state=None,
                 init_weights=None, dtype: torch.dtype = torch.float32,
                 use_te: Optional[bool] = None):
        """``full_state`` (full Megatron tensors) or ``init_weights(model)`` set the starting
        weights before the optimizer takes its (fp32 master) copies of them. ``parallel``: the
        run's section, of which the actor reads ``use_distributed_optimizer`` and
        ``sequence_parallel`` (the layout itself is the process groups')."""
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig, finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        apply_cpu_compat()
        self.hf_config = hf_config
        self.algo = algo
        self.trainer = trainer
        t = trainer
        self.use_te = te_available() if use_te is None else use_te
        self.version = 0
        self._skipped = (0.0, 0.0)  # this step's skipped (loss tokens, sequences): distribute
        self.consecutive_nonfinite = 0
        self.total_nonfinite = 0
        # The same Megatron optimizer on CPU (gloo) as on GPUs (see parallel/cpu_compat.py).
        parallel = parallel or ParallelConfig()
        use_dist_opt = self.use_distributed_optimizer = bool(parallel.use_distributed_optimizer)

        from ..models import get_adapter

        self.moe = get_adapter(hf_config).is_moe
        self.routing_replay = bool(algo.routing_replay)
        if self.routing_replay and not self.moe:
            raise ValueError("LMC-E113: algo.routing_replay=true needs a mixture-of-experts model")
        self.sequence_parallel = bool(parallel.sequence_parallel)
        skip = skip_zero_advantage_problem(algo, t)
        if skip:
            raise ValueError(skip)
        moe_kwargs = dict(
            moe_router_load_balancing_type="aux_loss" if t.moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=float(t.moe_aux_loss_coeff),
            moe_z_loss_coeff=float(t.moe_z_loss_coeff) or None,
            moe_enable_routing_replay=self.routing_replay) if self.moe else {}
        build = dict(dtype=dtype, use_te=self.use_te, **memory_config(
            sequence_parallel=parallel.sequence_parallel, recompute=t.recompute,
            recompute_num_layers=t.recompute_num_layers), **moe_kwargs)
        model = build_gpt_model(hf_config, **build)
        # this model's routers (Megatron's RouterReplay keeps a process-wide list of every
        # router ever built; ours are the ones of this stage)
        self._replays = _router_replays(model)
        if full_state is not None:
            load_full_state(model, hf_config, full_state)
        if init_weights is not None:
            init_weights(model)
        self.ref_model, self._ref_replays = None, []
        if algo.kl_coef > 0:
            self.ref_model = _frozen_copy(model, hf_config, build, offload=algo.ref_offload)
            self._ref_replays = _router_replays(self.ref_model)
        check_parameter_dtypes(model)  # before Megatron groups them (LMC-E333)
        self.model = DistributedDataParallel(
            model.config,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                          use_distributed_optimizer=use_dist_opt),
            model)
        self.config = model.config
        self.config.finalize_model_grads_func = finalize_model_grads
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=t.lr, min_lr=t.min_lr,
                            weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
                            adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
                            clip_grad=t.grad_clip, bf16=dtype == torch.bfloat16,
                            fp16=False, params_dtype=dtype,
                            use_distributed_optimizer=use_dist_opt),
            [self.model])
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if t.lr_warmup_steps else t.lr,
            max_lr=t.lr, min_lr=t.min_lr, lr_warmup_steps=t.lr_warmup_steps,
            lr_decay_steps=max(t.total_steps, 1), lr_decay_style=t.lr_decay_style,
            start_wd=t.weight_decay, end_wd=t.weight_decay,
            wd_incr_steps=max(t.total_steps, 1), wd_incr_style="constant")
        apply_cpu_compat()  # modules imported by DDP / optimizer construction
        self.ps = ps
        # The data-parallel rank of every global rank, for scattering rank 0's batch.
        self._dp_ranks = [None] * dist.get_world_size()
        dist.all_gather_object(self._dp_ranks, ps.get_data_parallel_rank())

    def describe(self) -> str:
        """Where and how this rank trains, in one line (the job's log; bench.gpu's loop)."""
        from .attention import choose_kernel

        param = next(self.model.parameters())
        inner = type(self.optimizer.chained_optimizers[0].optimizer)
        attn = "transformer_engine" if self.use_te else choose_kernel(
            device_type=param.device.type, dtype=param.dtype)
        return (f"model on {param.device} in {str(param.dtype).replace('torch.', '')}, "
                f"attention {attn}, optimizer {inner.__module__}.{inner.__qualname__}, "
                f"world {dist.get_world_size()} ({dist.get_backend()})")

    # ------------------------------------------------------------------ batch distribution
    def _plan(self, trajectories: Sequence[Trajectory]):
        return plan_batch(trajectories, self.algo, self.trainer,
                          tp=self.ps.get_tensor_model_parallel_world_size(),
                          cp=self.ps.get_context_parallel_world_size(),
                          dp=self.ps.get_data_parallel_world_size())

    def distribute(self, trajectories: Optional[Sequence[Trajectory]]) -> List[PackedMicroBatch]:
        """Rank 0's batch -> this rank's packed micro-batches (scattered with torch.distributed:
        the Trajectory objects themselves, pickled once, no dict round trip)."""
        world = dist.get_world_size()
        payload = [None] * world
        if dist.get_rank() == 0:
            if not trajectories:
                raise ValueError("train_step needs a non-empty batch on rank 0")
            adv, plan, skipped = self._plan(trajectories)
            for rank in range(world):
                payload[rank] = ([[(trajectories[i], adv[i], i) for i in mb]
                                  for mb in plan[self._dp_ranks[rank]]], skipped)
        received = [None]
        dist.scatter_object_list(received, payload if dist.get_rank() == 0 else None, src=0)
        received[0], self._skipped = received[0]
        tp = self.ps.get_tensor_model_parallel_world_size()
        cp = self.ps.get_context_parallel_world_size()
        out = []
        for mb in received[0]:
            trajs = [t for t, _, _ in mb]
            # packed where the model is: the Triton packing kernel on GPUs, torch on CPU
            packed = pack_trajectories(trajs, [a for _, a, _ in mb], [i for _, _, i in mb],
                                       tp=tp, cp=cp, device=device())
            # tokens of trajectories generated by exactly the trainer's current version: where
            # the engine's and the trainer's log-probs are of the same weights (a lookup by
            # batch index; padding's -1 reads the last entry, always False)
            lookup = torch.zeros(max(i for _, _, i in mb) + 2, dtype=torch.bool)
            for t, _, i in mb:
                lookup[i] = t.weight_version == self.version and len(t.versions_seen()) <= 1
            packed.extras["same_version"] = lookup.to(packed.seq_ids.device)[packed.seq_ids]
            if self.routing_replay:
                c = self.config
                packed.extras["routed_experts"] = pack_routed_experts(
                    trajs, c.num_layers, c.moe_router_topk, packed.cu_seqlens_padded.cpu())
            out.append(packed)
        return out

    # ------------------------------------------------------------------ forward passes
    def _model_inputs(self, mb: PackedMicroBatch):
        # Transformer Engine's attention takes THD; without TE, trainer.attention's packed
        # kernels take the row in sbhd with its boundaries (RoPE in one op, not per sequence)
        return dict(attention_mask=None, packed_seq_params=mb.packed_seq_params()
                    if self.use_te else mb.local_packed_seq_params())

    def _run_schedule(self, micro_batches, loss_func_factory, forward_only: bool, model=None):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        dev = device()
        model = self.model if model is None else model
        replays = self._ref_replays if model is self.ref_model else self._replays

        if self.routing_replay:  # one FIFO of routes per schedule (see _replay)
            for replay in replays:
                replay.clear_indices()

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            mb.to(dev)
            if self.routing_replay:
                self._replay(mb, replays)
            output = model(mb.tokens, mb.position_ids, **self._model_inputs(mb))
            if self.routing_replay and not forward_only:
                self._replay_backward(replays)
            return output, loss_func_factory(mb)

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
            num_microbatches=len(micro_batches),
            seq_length=max(mb.num_tokens for mb in micro_batches), micro_batch_size=1,
            forward_only=forward_only)

    def _replay(self, mb: PackedMicroBatch, replays) -> None:
        """Route this micro-batch's tokens to the experts the engine chose (Megatron's router
        replay, forward pass): each router takes its own layer's [T, top-k] slice -- with
        sequence parallelism, this TP rank's contiguous part of the sequence, the tokens its
        router sees. Each micro-batch's routes also join the router's FIFO, from which an
        activation recompute (``trainer.recompute``) in the backward pass takes them again,
        micro-batch by micro-batch in forward order (1F1B keeps it)."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        routed = mb.extras["routed_experts"]
        tp = ps.get_tensor_model_parallel_world_size()
        if self.sequence_parallel and tp > 1:
            n = routed.shape[0] // tp
            rank = ps.get_tensor_model_parallel_rank()
            routed = routed[rank * n:(rank + 1) * n]
        for replay in replays:
            replay.set_target_indices(routed[:, replay.layer_number - 1].to(device()))
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    @staticmethod
    def _replay_backward(replays) -> None:
        """After a training forward: what runs next of this micro-batch is its backward, whose
        recomputed forward (if any) replays from the FIFO."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for replay in replays:
            replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def _end_replay(self) -> None:
        for replay in self._replays + self._ref_replays:
            replay.clear_indices()
            replay.clear_router_replay_action()

    def _logprobs(self, logits: torch.Tensor, mb: PackedMicroBatch):
        return megatron_vocab_parallel_logprobs(logits[0], mb.labels[0],
                                                chunk_size=self.trainer.logprob_chunk_size)

    @torch.no_grad()
    def compute_logprobs(self, micro_batches: List[PackedMicroBatch]) -> None:
        """Forward only: store the current policy's log-probs as ``mb.prox_logprobs``."""
        self.model.eval()

        def factory(mb):
            def loss_func(logits):
                lp, _ = self._logprobs(logits, mb)
                mb.prox_logprobs = lp.detach().float().unsqueeze(0)
                return torch.zeros((), device=logits.device), {}

            return loss_func

        self._run_schedule(micro_batches, factory, forward_only=True)
        self._end_replay()
        self.model.train()

    @torch.no_grad()
    def compute_ref_logprobs(self, micro_batches: List[PackedMicroBatch]) -> None:
        """Forward only through the frozen reference policy: ``mb.extras["ref_logprobs"]``.
        With ``algo.ref_offload`` its weights come to the accelerator for this pass only."""
        if self.ref_model is None:
            raise RuntimeError("no reference model: it is built when algo.kl_coef > 0")

        def factory(mb):
            def loss_func(logits):
                lp, _ = self._logprobs(logits, mb)
                mb.extras["ref_logprobs"] = lp.detach().float().unsqueeze(0)
                return torch.zeros((), device=logits.device), {}

            return loss_func

        offload = self.algo.ref_offload  # (on CPU both moves are no-ops)
        failed = True
        try:
            if offload:
                self.ref_model.to(device())
            self._run_schedule(micro_batches, factory, forward_only=True, model=self.ref_model)
            failed = False
        finally:
            self._end_replay()
            if offload:
                try:  # back to host memory, also after a failed load or pass (all of it)
                    self.ref_model.to("cpu")
                except Exception:  # noqa: BLE001 - never hide the first error
                    if not failed:
                        raise

    # ------------------------------------------------------------------ train step
    def train_step(self, trajectories: Optional[Sequence[Trajectory]]) -> Dict[str, float]:
        """One optimizer step on rank 0's batch. Returns the same stats on every rank."""
        s = self.algo
        loss_fn, loss_options = policy_loss_fn(s.policy_loss), policy_loss_options(s)
        mode = s.loss_agg_mode
        micro_batches = self.distribute(trajectories)
        num_mb = len(micro_batches)
        dp_group = self.ps.get_data_parallel_group()
        dp_size = self.ps.get_data_parallel_world_size()
        # The whole batch's loss tokens (and, for the seq-* modes, sequences with one): the
        # aggregation's denominator, so that splitting does not change the loss.
        counts = [batch_counts(mb.loss_mask[0], mb.seq_ids[0] if mode.startswith("seq-") else None)
                  for mb in micro_batches]
        count = torch.tensor([sum(c[0] for c in counts), sum(c[1] for c in counts)],
                             dtype=torch.float64)
        if self.ps.get_data_parallel_rank() == 0:  # trajectories not run (zero advantage):
            count += torch.tensor(self._skipped, dtype=torch.float64)  # counted once per DP
        dist.all_reduce(count, group=dp_group)
        global_tokens = float(count[0].item())
        norm = denominator(mode, global_tokens, float(count[1].item()), s.loss_scale_factor)

        if s.use_decoupled_loss:
            self.compute_logprobs(micro_batches)
        if self.ref_model is not None:
            self.compute_ref_logprobs(micro_batches)
        sums: Dict[str, torch.Tensor] = {}

        def factory(mb):
            def loss_func(logits):
                lp, entropy = self._logprobs(logits, mb)
                mask = mb.loss_mask[0]
                prox = mb.prox_logprobs[0] if mb.prox_logprobs is not None else mb.behav_logprobs[0]
                terms, stats = loss_fn(lp, prox, mb.behav_logprobs[0], mb.advantages[0], mask,
                                       seq_ids=mb.seq_ids[0], **loss_options)
                pg_sum = aggregate_terms(terms, mask, mb.seq_ids[0], mode)  # token-mean: sum
                ref = mb.extras.get("ref_logprobs")
                loss_sum, parts = regularized_sums(
                    pg_sum, lp, entropy, None if ref is None else ref[0], mask, mb.seq_ids[0],
                    mode, entropy_coef=s.entropy_coef, kl_coef=s.kl_coef,
                    kl_estimator=s.kl_estimator)
                stats.update(parts, loss=loss_sum.detach())
                # _reduce_stats reports each numerator / the token count: scaled, it is the
                # numerator / the batch's denominator (token-mean: the token count itself)
                for key in ("loss", *parts):
                    stats[key] = stats[key] * (global_tokens / norm)
                stats["entropy"] = (entropy.detach() * mask).sum()
                stats.update(mismatch_terms(lp.detach(), mb.behav_logprobs[0],
                                            mask * mb.extras["same_version"][0].to(mask.dtype),
                                            s.mismatch_threshold))
                for key, value in stats.items():
                    value = value.detach().double().cpu()
                    if key in ("imp_weight_max", "mismatch_max"):
                        sums[key] = torch.maximum(sums.get(key, value), value)
                    else:
                        sums[key] = sums.get(key, torch.zeros((), dtype=torch.float64)) + value
                # The schedule divides by num_mb and DDP averages over DP: undo both so that the
                # gradient is that of (sum over all loss tokens) / (the whole batch's
                # denominator; token-mean: its loss-token count).
                scale = num_mb * dp_size / norm
                return loss_sum * scale, {}

            return loss_func

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run_schedule(micro_batches, factory, forward_only=False)
        self._end_replay()
        stats = self._reduce_stats(sums)
        stats.update(self._moe_metrics(num_mb))
        finite = torch.tensor([1.0 if math.isfinite(stats["loss"]) else 0.0])
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)

        result = dict(stats, num_microbatches=float(num_mb), global_tokens=global_tokens)
        if self.trainer.skip_zero_advantage:
            result["skipped_tokens"] = float(self._skipped[0])
        if global_tokens == 0:
            logger.warning("batch has no loss tokens; optimizer step skipped")
            result.update(skipped=1.0, grad_norm=0.0, lr=self.scheduler.get_lr(
                self.optimizer.param_groups[0]))
            return result
        grad_norm = float("nan")
        if finite.item() == 1.0:
            ok, grad_norm, _ = self.optimizer.step()
            grad_norm = float(grad_norm) if grad_norm is not None else 0.0
            if ok and math.isfinite(grad_norm):
                self.scheduler.step(increment=1)
                self.version += 1
                self.consecutive_nonfinite = 0
                result.update(skipped=0.0, grad_norm=grad_norm, version=float(self.version),
                              lr=self.optimizer.param_groups[0]["lr"])
                return result
        self._skip_nonfinite(stats["loss"], grad_norm)
        result.update(skipped=1.0, grad_norm=grad_norm, version=float(self.version),
                      nonfinite_total=float(self.total_nonfinite))
        return result

    def _skip_nonfinite(self, loss: float, grad_norm: float) -> None:
        self.consecutive_nonfinite += 1
        self.total_nonfinite += 1
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        logger.warning("non-finite loss %s or grad norm %s: step skipped (%d in a row, %d total)",
                       loss, grad_norm, self.consecutive_nonfinite, self.total_nonfinite)
        if self.consecutive_nonfinite >= self.trainer.max_consecutive_nonfinite:
            raise NonFiniteLossError(
                f"LMC-E300: {self.consecutive_nonfinite} consecutive steps had a non-finite loss "
                f"or gradient norm (last loss {loss}, grad norm {grad_norm}); lower trainer.lr, "
                "check the rewards and behaviour log-probs of the data, or raise "
                "trainer.max_consecutive_nonfinite")

    def _moe_metrics(self, num_mb: int) -> Dict[str, float]:
        """Megatron's MoE auxiliary losses of this step (averaged over MoE layers and
        micro-batches), when enabled: moe_load_balancing_loss, moe_z_loss. Collective."""
        t = self.trainer
        names = (["load_balancing_loss"] if t.moe_aux_loss_coeff > 0 else []) + \
            (["z_loss"] if t.moe_z_loss_coeff > 0 else [])
        if not self.moe or not names:
            return {}
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        totals: Dict[str, torch.Tensor] = {}
        get_moe_metrics_tracker().report(
            loss_scale=1.0 / max(num_mb, 1), iteration=self.version, total_loss_dict=totals,
            force_initialize=True, track_names=names, num_layers=self.config.num_layers,
            moe_layer_freq=self.config.moe_layer_freq)
        return {f"moe_{k}": float(v) for k, v in totals.items()}

    def _reduce_stats(self, sums: Dict[str, torch.Tensor]) -> Dict[str, float]:
        """Sum the per-micro-batch stats over DP on the last stage, then share them over PP."""
        return reduce_step_stats(sums, self.ps, float(self._skipped[0]),
                                 entropy_coef=self.algo.entropy_coef,
                                 has_reference=self.ref_model is not None)


def _router_replays(model) -> list:
    return [m.router_replay for m in model.modules()
            if getattr(m, "router_replay", None) is not None]


def _frozen_copy(model, hf_config, build: dict, *, offload: bool):
    """The reference policy: a second stage of the same layout holding ``model``'s (initial)
    weights, without gradients; built without random initialisation (its weights are copied)
    and without touching the RNG streams the actor's own run draws from."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    states = tracker.get_states()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()]
                               if torch.cuda.is_available() else []):
        ref = build_gpt_model(hf_config, perform_initialization=False, **build)
    tracker.set_states(states)
    ref.load_state_dict(model.state_dict(), strict=True)
    for p in ref.parameters():
        p.requires_grad_(False)
    ref.eval()
    if offload:
        ref.to("cpu")
    return ref
