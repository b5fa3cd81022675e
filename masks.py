"""Token masks of MAR-GRPO (docs/method.md §4 and §5, whose formulas follow): which positions get
the multi-trajectory term, and which positions the policy term keeps; plain tensors, nothing in it
knows about MAR.

    u_p    = mean_c std_s x0^(s)_{p,c}                    per-token uncertainty over S trajectories
    M_unc  = top-k% of positions by u_p, per image
    Δsim_p = cos(x̂0^(i)_p, x_final,p) − cos(x̂0^(i−1)_p, x_final,p)
    H_p    = 1[Δsim_p > κ]                                κ: the consistency threshold
    W      = U_i ∧ (H ∨ P_i)   for i ≥ 1;   W = U_i at the first AR step
"""

import torch
import torch.nn.functional as F


def token_uncertainty(x0_traj):
    """u_p = mean over channels of the population std across trajectories.

    x0_traj: (S, B, L, C) final tokens of S head trajectories per position
    returns u: (B, L)
    """
    return x0_traj.std(dim=0, unbiased=False).mean(dim=-1)


def top_k_mask(u, frac):
    """M_unc: the max(1, int(L·frac)) most uncertain positions of each image (ties: lower position
    first). frac = 0 gives an all-False mask.

    u: (B, L) uncertainties; frac: fraction k% in [0, 1]
    returns (B, L) bool
    """
    bsz, seq_len = u.shape
    mask = torch.zeros(bsz, seq_len, dtype=torch.bool, device=u.device)
    if frac <= 0:
        return mask
    k = min(seq_len, max(1, int(seq_len * frac)))
    order = torch.sort(u, dim=1, descending=True, stable=True).indices  # (B, L)
    return mask.scatter(1, order[:, :k], True)


def uncertainty_mask(x0_traj, frac):
    """M_unc = top-k% of positions by u_p, per image (`token_uncertainty`, `top_k_mask`).

    x0_traj: (S, B, L, C) final tokens of S head trajectories; frac: k% in [0, 1]
    returns (B, L) bool
    """
    return top_k_mask(token_uncertainty(x0_traj), frac)


def delta_sim(preview, preview_prev, final):
    """Δsim_p = cos(x̂0^(i)_p, x_p) − cos(x̂0^(i−1)_p, x_p), cosine over channels.

    preview, preview_prev, final: (B, L, C)   returns (B, L)
    """
    return (F.cosine_similarity(preview, final, dim=-1)
            - F.cosine_similarity(preview_prev, final, dim=-1))


def consistency_mask(preview, preview_prev, final, unknown, written, threshold=0.0):
    """W = U ∧ (H ∨ P) with H = 1[Δsim > κ], κ = threshold; W = U when there is no previous
    preview (i = 0) or when threshold is None (the mask switched off).

    preview: (B, L, C) x̂0 at AR step i; preview_prev: (B, L, C) at step i−1, or None;
    final: (B, L, C) the rollout's final tokens; unknown: (B, L) bool U_i; written: (B, L) bool P_i,
    the positions written at step i
    returns W: (B, L) bool
    """
    if preview_prev is None or threshold is None:
        return unknown.clone()
    keep = delta_sim(preview, preview_prev, final) > threshold  # H, (B, L)
    return unknown & (keep | written)


# -----------------------------------------------------------------------------
# Notes: the paper, the released code, and this file
#
# "Released" is the MAR-GRPO code, GitHub `AMAP-ML/mar-grpo@fcb7969`: the trainers
# src/grpo/src/open_r1/trainer/grpo_trainer_nova_v1_2.py and grpo_trainer_harmon_v1_2.py (the
# uncertainty `std(dim=0, unbiased=False)`, `select_top_tokens_via_std`, the consistency mask under
# `use_latent_sim_coef`) and the runs' settings (`--top_mask_percent 0.3`,
# `--latent_sim_thresh 0.0`) in scripts/debug_entry_{nova,harmon,nova_mix}.py.
#
# What the paper says, what the released code does, and what this file does:
# 1. Uncertainty. Paper: the spread of the S trajectories' predictions. Released: population std
#    (unbiased=False) across trajectories of each token's final sample, averaged over channels.
#    This file: the same (`token_uncertainty`).
# 2. Top-k%. Released: k = max(1, int(L · k%)) positions per image by `topk`, whose order among
#    ties is unspecified. This file: the same k, with ties broken by position (a stable sort), so
#    the mask is a deterministic function of u.
# 3. Consistency. Paper: drop tokens whose intermediate prediction does not move toward the final
#    image (Δsim ≤ κ). Released: compares the head's last denoised latents of AR steps i and i−1
#    with the final latents, keeps hard-mask ∨ written-this-step inside the unknown set, and applies
#    it only for i > 1 (a commented-out variant thresholds 0.5·cos + 0.5; ignored). This file: the
#    same rule from i ≥ 1, the first step at which a previous preview exists (docs/method.md §5,
#    W = U_i ∧ (1[Δsim > κ] ∨ P_i)); at i = 0, W = U.
# 4. Only the policy term is masked by W; the KL term keeps all of U_i (grpo.py).
