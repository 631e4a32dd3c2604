"""The capacity plan as job=plan prints it: ``format_plan`` of ``config.plan.capacity_plan``'s
dict (every figure comes from that dict; nothing is computed here)."""

from __future__ import annotations

from .gpu_map import format_gpu_maps


def format_plan(plan: dict) -> str:
    """A human-readable table of ``plan``."""
    lines = [f"capacity plan: {plan['model']} ({plan['params_b']:.1f} B params, "
             f"{plan['arch_source']}), TP{plan['tp']} PP{plan['pp']} DP{plan['dp']}"
             + (f" EP{plan['ep']} expert-TP{plan['expert_tp']} expert-DP{plan['expert_dp']} "
                f"({plan['experts']} experts, {plan['active_params_b']:.1f} B active)"
                if plan["experts"] else "") + ", "
             f"SP={'on' if plan['sequence_parallel'] else 'off'}, recompute={plan['recompute']}, "
             f"{plan['micro_batch_tokens']} tokens/micro-batch, "
             f"{plan['in_flight_microbatches']} in flight on stage 0",
             f"  per trainer GPU (GB)        {'first stage':>12} {'last stage':>12}"]
    for item in ("weights", "grads", "optimizer", "reference", "activations", "logits",
                 "publish_gather", "delta_base", "overhead", "peak"):
        lines.append(f"    {item:<26} {plan[f'trainer_first_{item}_gb']:>12.1f} "
                     f"{plan[f'trainer_last_{item}_gb']:>12.1f}")
    lines += [
        f"  trainer GPU peak {plan['trainer_gpu_peak_gb']:.1f} GB ({plan['trainer_peak_stage']} "
        f"stage; largest item {plan['trainer_largest_item']}) of {plan['gpu_memory_gb']:g} GB",
        f"  rollout node: {plan['engine_gpus_per_node']} of {plan['gpus_per_node']} GPUs for "
        f"engines (TP{plan['engine_tp']}): {plan['engine_weights_gb_per_gpu']:.1f} GB weights + "
        f"{plan['engine_kv_gb_per_gpu']:.1f} GB KV per GPU, + at most "
        f"{plan['relay_buckets_gb_per_engine_gpu']:.2f} GB of relay buckets while pulling; relay "
        f"on {plan['relay_device']}", *format_gpu_maps(plan["gpu_map"]),
        f"  host: relay /dev/shm {plan['relay_shm_gb_per_rollout_node']:.0f} GB per rollout node "
        f"({plan['relay_versions']} versions)"
        + (f" of {plan['shm_gb']:g} GB" if plan["host_memory_gb"] else "") + "; "
        f"pinned publish buffers {plan['pinned_publish_gb_per_trainer_node']:.0f} GB per trainer "
        "node" + (f"; offloaded reference model {plan['reference_host_gb_per_trainer_node']:.0f} "
                  "GB per trainer node" if plan["reference_model"] == "offloaded" else ""),
        f"  host memory per node: rollout {plan['rollout_host_gb_per_node']:.0f} GB, trainer "
        f"{plan['trainer_host_gb_per_node']:.0f} GB"
        + (f", of {plan['host_memory_gb']:g} GB" if plan["host_memory_gb"] else
           " (not checked: cluster.host_memory_gb=0)"),
        f"  weight sync: {plan['weight_sync_delta_why']}",
        f"  relay tier: {plan['weight_sync_stripes']} master relay(s), each on a rollout node "
        "of its own up to the nodes, one relay per stripe on every node",
        f"  controller: up to {plan['controller_streams']} streams at once, "
        f"{plan['controller_open_files']} open files (RLIMIT_NOFILE: raised to the hard limit "
        "at start, which must be at least this)",
        "  fits: " + ("yes" if plan["fits"] else
                      f"NO (GPU: {'yes' if plan['fits_gpu'] else 'no'}, host: "
                      f"{'yes' if plan['fits_host'] else 'no'})\n    - "
                      + "\n    - ".join(plan["problems"]))]
    return "\n".join(lines)
