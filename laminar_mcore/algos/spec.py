"""The names of the advantage estimators, policy losses and loss aggregations, and which
combinations of ``algo.*`` keys make sense. Torch-free: ``config/validate.py`` reads it before
any process starts; the registries (``advantages.py``, ``losses.py``) hold exactly these names
(tests/test_algos.py checks it).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

# verl's names (verl.trainer.ppo.core_algos), so that a verl config's key carries over.
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                        "opo", "gpg", "grpo_passk")
# Known to verl but not offered here: name -> why.
REFUSED_ADVANTAGES: Dict[str, str] = {
    "remax": "ReMax's baseline is the reward of one extra greedy (temperature 0) rollout of "
             "every prompt, which the rollout tier does not generate: it samples "
             "algo.n_samples_per_prompt trajectories per prompt with rollout.sampling and nothing "
             "else, so the baseline would cost a second generation pass per batch; use "
             "algo.advantage=rloo or grpo, whose baselines come from the sampled group",
}
# The estimators that take algo.std_normalize=false (GRPO's division by the group std, which
# Dr. GRPO drops); the others either always whiten (reinforce_plus_plus*) or never divide.
STD_NORMALIZED = ("grpo", "grpo_passk")

POLICY_LOSSES = ("decoupled_ppo", "gspo", "cispo", "sapo", "geo_mean", "clip_cov", "kl_cov")
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")
# verl's kl_penalty names (each also with a '+' suffix: k2's gradient, the estimate's value).
KL_ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
# Losses whose verl implementation fixes its aggregation whatever loss_agg_mode says.
FIXED_AGGREGATION = {"sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean"}


def algo_problems(algo: Any) -> List[str]:
    """Every problem of an ``algo`` section (the dataclass or its DictConfig), each naming the
    key and the fix; empty when the combination is valid."""
    out: List[str] = []
    adv, loss, mode = algo.advantage, algo.policy_loss, algo.loss_agg_mode
    if adv in REFUSED_ADVANTAGES:
        out.append(f"LMC-E104: algo.advantage={adv} is not supported: {REFUSED_ADVANTAGES[adv]}")
    elif adv not in ADVANTAGE_ESTIMATORS:
        out.append("LMC-E102: "
                   f"algo.advantage={adv!r} is not one of {', '.join(ADVANTAGE_ESTIMATORS)}")
    if loss not in POLICY_LOSSES:
        out.append(f"LMC-E102: algo.policy_loss={loss!r} is not one of {', '.join(POLICY_LOSSES)}")
    if mode not in LOSS_AGG_MODES:
        out.append("LMC-E102: "
                   f"algo.loss_agg_mode={mode!r} is not one of {', '.join(LOSS_AGG_MODES)}")
    if algo.leave_one_out and adv in ADVANTAGE_ESTIMATORS and adv != "grpo":
        out.append(f"LMC-E104: algo.leave_one_out=true is GRPO's leave-one-out baseline; with "
                   f"algo.advantage={adv} set it false (algo.advantage=rloo is RLOO)")
    if not algo.std_normalize and adv in ADVANTAGE_ESTIMATORS and adv not in STD_NORMALIZED:
        out.append("LMC-E104: "
                   f"algo.std_normalize=false applies to {' and '.join(STD_NORMALIZED)} only: "
                   f"algo.advantage={adv} "
                   + ("always whitens over the batch's tokens" if adv.startswith("reinforce")
                      else "never divides by a standard deviation") + "; set it true")
    if adv == "grpo_passk" and algo.n_samples_per_prompt < 2:
        out.append("LMC-E104: "
                   "algo.advantage=grpo_passk compares the best two samples of each prompt: "
                   "it needs algo.n_samples_per_prompt >= 2")
    fixed = FIXED_AGGREGATION.get(loss)
    if fixed and mode in LOSS_AGG_MODES and mode != fixed:
        out.append("LMC-E104: "
                   f"algo.policy_loss={loss} aggregates per sequence ({fixed}, as verl fixes "
                   f"it); set algo.loss_agg_mode={fixed}")
    if algo.dual_clip is not None and loss in POLICY_LOSSES and loss != "decoupled_ppo":
        out.append("LMC-E104: "
                   f"algo.dual_clip bounds the clipped PPO objective of decoupled_ppo only; "
                   f"algo.policy_loss={loss} has no dual clip: set algo.dual_clip=null")
    if loss == "geo_mean" and algo.behav_imp_weight_cap is not None and algo.cap_level == "token":
        out.append("LMC-E104: "
                   "algo.policy_loss=geo_mean uses one behaviour weight per sequence (the "
                   "geometric mean of pi_prox/pi_behav over its tokens); a token-level cap would "
                   "zero or clamp single tokens inside that mean: set algo.cap_level=sequence")
    if mode == "seq-mean-token-sum-norm" and fixed is None:
        if algo.loss_scale_factor is None:
            out.append("LMC-E104: "
                       "algo.loss_agg_mode=seq-mean-token-sum-norm divides every sequence's "
                       "token sum by a constant: set algo.loss_scale_factor (verl's default is "
                       "the padded response length, rollout.sampling.max_new_tokens; Dr. GRPO "
                       "uses the generation budget)")
    if algo.loss_scale_factor is not None and not algo.loss_scale_factor > 0:
        out.append("LMC-E103: "
                   f"algo.loss_scale_factor={algo.loss_scale_factor} must be > 0 (or null)")
    if loss == "sapo" and not (algo.sapo_tau_pos > 0 and algo.sapo_tau_neg > 0):
        out.append(f"LMC-E103: algo.sapo_tau_pos={algo.sapo_tau_pos} and algo.sapo_tau_neg="
                   f"{algo.sapo_tau_neg} must be > 0 (SAPO's gate temperatures)")
    if loss == "clip_cov" and not (algo.clip_cov_ratio > 0 and algo.clip_cov_lb < algo.clip_cov_ub):
        out.append("LMC-E103: "
                   f"algo.clip_cov_ratio={algo.clip_cov_ratio} must be > 0 and algo.clip_cov_lb="
                   f"{algo.clip_cov_lb} < algo.clip_cov_ub={algo.clip_cov_ub}")
    if loss == "kl_cov" and not (algo.kl_cov_ratio > 0 and algo.kl_cov_coef >= 0):
        out.append("LMC-E103: "
                   f"algo.kl_cov_ratio={algo.kl_cov_ratio} must be > 0 and algo.kl_cov_coef="
                   f"{algo.kl_cov_coef} >= 0")
    out += _regularizer_problems(algo)
    return out


def _regularizer_problems(algo: Any) -> List[str]:
    """The entropy bonus and the KL penalty against the reference policy."""
    out: List[str] = []
    ec, kc = float(algo.entropy_coef), float(algo.kl_coef)
    if not math.isfinite(ec):
        out.append("LMC-E103: "
                   f"algo.entropy_coef={ec} must be a finite number (0: entropy only logged)")
    if not (math.isfinite(kc) and kc >= 0):
        out.append("LMC-E103: "
                   f"algo.kl_coef={kc} must be >= 0 (0: no reference model, no KL penalty)")
    est = str(algo.kl_estimator)
    if (est[:-1] if est.endswith("+") else est) not in KL_ESTIMATORS:
        out.append("LMC-E102: "
                   f"algo.kl_estimator={est!r} is not one of {', '.join(KL_ESTIMATORS)} (each "
                   "with an optional '+': the value of the estimate, the gradient of k2)")
    if algo.ref_offload and not kc > 0:
        out.append("LMC-E104: algo.ref_offload=true offloads the reference model, which only "
                   "algo.kl_coef > 0 builds: set algo.kl_coef or algo.ref_offload=false")
    return out


def skip_zero_advantage_problem(algo, trainer) -> Optional[str]:
    """Why ``trainer.skip_zero_advantage`` would change the update (None: it would not)."""
    reads_all = {k: v for k, v in (("algo.entropy_coef", algo.entropy_coef),
                                   ("algo.kl_coef", algo.kl_coef),
                                   ("trainer.moe_aux_loss_coeff", trainer.moe_aux_loss_coeff),
                                   ("trainer.moe_z_loss_coeff", trainer.moe_z_loss_coeff)) if v}
    if algo.policy_loss in ("clip_cov", "kl_cov"):  # token selection by batch covariance
        reads_all["algo.policy_loss"] = algo.policy_loss
    if not trainer.skip_zero_advantage or not reads_all:
        return None
    return ("LMC-E104: "
            "trainer.skip_zero_advantage=true skips trajectories whose policy-loss gradient is "
            f"0, but {', '.join(f'{k}={v}' for k, v in reads_all.items())} reads every token (a "
            "term over all of them, or the batch's covariance), so skipping would change the "
            "update: set those to 0 (another policy loss) or trainer.skip_zero_advantage=false")
