"""Multi-Trajectory Expectation (MTE, docs/method.md §4): after the rollout the frozen head is run
again from z_final (the z each token was generated from) with S fresh noise draws, recording the
same chosen diffusion steps, and the policy term of the most uncertain tokens is averaged over
those trajectories, per element:

    u_p    = mean_c std_s x0^(s)_{p,c},   M_unc = top-k% of positions by u_p       (masks.py)
    ρ^(s)  = exp(ℓ_θ(trajectory s) − sg ℓ),   evaluated under z_i of the trained AR step
    π-term = (1 − M_unc) · term(rollout trajectory) + M_unc · (1/S) Σ_s term(trajectory s)

with term the policy surrogate of grpo.py (ρ A without clipping). On P_i the trajectories' score
has zero mean whatever the advantage, so there MTE masks the uncertain tokens rather than
averaging a gradient (docs/method.md §4, "MTE on P_i").
"""

import torch

from diffloss import transition_logprob, transition_mean


@torch.no_grad()
def sample_trajectories(head, z_final, z_final_null, cfg_final, temperature, num_trajectories,
                        diff_steps, generator=None):
    """S fresh head trajectories for every position, in one batched call.

    head: the (frozen) DiffLoss; z_final: (B, L, D) the z each token was generated from;
    z_final_null: (B, L, D) the null-condition z for CFG, or None without guidance;
    cfg_final: (B, L) the guidance w of each token; temperature: τ; num_trajectories: S;
    diff_steps: the K recorded sampling steps (as the rollout's, ints); generator: torch.Generator.
    returns dict x_t, x_prev, std, logp (S, K, B, L, C) (logp: ℓ under the z they were drawn
    from) and x0 (S, B, L, C).
    """
    S, (B, L, D) = num_trajectories, z_final.shape
    z = z_final.expand(S, B, L, D).reshape(S * B * L, D)  # (S·B·L, D)
    cfg = 1.0
    if z_final_null is not None:
        z_null = z_final_null.expand(S, B, L, D).reshape(S * B * L, D)
        z = torch.cat([z, z_null], dim=0)  # (2·S·B·L, D) = [cond; null]
        cfg = cfg_final.expand(S, B, L).reshape(S * B * L)  # (S·B·L,)
    x0, traj = head.sample(z, temperature, cfg, generator, record_steps=diff_steps)
    K, C = len(diff_steps), x0.shape[-1]
    out = {key: traj[key].reshape(K, S, B, L, C).transpose(0, 1)
           for key in ("x_t", "x_prev", "std", "logp")}  # (S, K, B, L, C)
    out["x0"] = x0.reshape(S, B, L, C)
    return out


def trajectory_logprobs(head, trajectories, step, z, z_null, w, uncertain):
    """ℓ_θ of the S trajectories at one trained AR step, evaluated under that step's z_i
    (docs/method.md §4, ρ^(s) = exp(ℓ_θ(trajectory s) − sg ℓ); item 2 of the notes below), dense
    over U_i.

    head: the policy's head; trajectories: dict from `sample_trajectories`; step: a
    rollout.StepRecord (unk_idx (B, n), diff_steps (K ints)); z, z_null: (B, n, D) the recomputed
    z_i on U_i (z_null None without guidance); w: guidance; uncertain: (B, n) bool M_unc on U_i.
    returns ℓ^(s): (S, K, B, n, C). Only the uncertain positions are evaluated (the cost scales
    with k%); elsewhere ℓ^(s) is 0 without gradient, and `mte_policy_term` never selects it.
    """
    S, K, B, L, C = trajectories["x_t"].shape
    n = step.unk_idx.shape[1]
    idx = step.unk_idx[None, None, :, :, None].expand(S, K, B, n, C)
    # (S, K, B, n, C)
    x_t, x_prev, std = (trajectories[key].gather(3, idx) for key in ("x_t", "x_prev", "std"))
    sel = uncertain[None, None].expand(S, K, B, n)  # (S, K, B, n)
    N_u = int(uncertain.sum())  # positions with MTE in this step (a host sync, once per AR step)
    logp = torch.zeros(S, K, B, n, C, device=x_t.device)
    if N_u == 0:
        return logp
    x_t_u = x_t[sel].reshape(S, K, N_u, C).transpose(0, 1)  # (K, S, N_u, C)
    z_u = z[uncertain].expand(S, N_u, z.shape[-1])  # (S, N_u, D)
    z_null_u = None if z_null is None else z_null[uncertain].expand(S, N_u, z.shape[-1])
    # (S, K, N_u, C)
    mean_u = transition_mean(head, x_t_u, step.diff_steps, z_u, z_null_u, w).transpose(0, 1)
    logp_u = transition_logprob(x_prev[sel].reshape(S, K, N_u, C), mean_u,
                                std[sel].reshape(S, K, N_u, C))
    return logp.masked_scatter(sel[..., None].expand_as(logp), logp_u)


def trajectory_gap(logp_drawn, logp_traj):
    """How far each token's trajectories lie from the trained step's transitions: the mean over
    trajectories, recorded steps and channels of ℓ under the z_final they were drawn from minus ℓ
    under z_i, a Monte Carlo estimate of the KL (μ(x^k, z_final) − μ(x^k, z_i))² / (2s²) per
    element (docs/method.md §4, "A gate on the gap").

    logp_drawn: (S, K, B, n, C) ℓ under z_final (`sample_trajectories`' logp on U_i);
    logp_traj: (S, K, B, n, C) ℓ under z_i (`trajectory_logprobs`).
    returns (B, n), detached
    """
    return (logp_drawn - logp_traj.detach()).mean(dim=(0, 1, 4))


def mte_policy_term(term_rollout, term_traj, uncertain):
    """π-term = (1 − M_unc) · term⁽⁰⁾ + M_unc · (1/S) Σ_s term⁽ˢ⁾, per element
    (docs/method.md §4).

    term_rollout: (K, B, n, C) surrogate ρ⁽⁰⁾A of the rollout trajectory;
    term_traj: (S, K, B, n, C) surrogates ρ⁽ˢ⁾A of the S trajectories (same advantages);
    uncertain: (B, n) bool M_unc on U_i.
    returns (K, B, n, C)
    """
    return torch.where(uncertain[None, :, :, None], term_traj.mean(dim=0), term_rollout)


# -----------------------------------------------------------------------------
# Notes: the paper, the released code, and this file
#
# This file cuts the noise the head's sampling puts into the policy gradient by averaging the
# policy term of uncertain tokens over several diffusion trajectories of the frozen head.
#
# "Released" is the MAR-GRPO code, GitHub `AMAP-ML/mar-grpo@fcb7969`: the trajectories are drawn in
# src/grpo/src/diffnext/models/transformers/transformer_3d.py (NOVA, `generate_frame`,
# `num_seed=3`) and src/grpo/src/harmon/harmon_generate_image_with_logp.py (Harmon,
# `sample_with_logp`, `num_seed=5`); their term is evaluated in the trainers
# src/grpo/src/open_r1/trainer/grpo_trainer_nova_v1_2.py and grpo_trainer_harmon_v1_2.py
# (`use_critic_token`, on in scripts/debug_entry_{nova,harmon,nova_mix}.py).
#
# What the paper says, what the released code does, and what this file does:
# 1. Paper: estimate the optimisation direction by an expectation over S trajectories, only for
#    the most uncertain tokens. Released: S = 3 (NOVA) or 5 (Harmon) re-runs from z_final, one
#    Python loop that reseeds the global RNG per trajectory. This file: one batched head call over
#    S × B × L rows with a passed generator (`sample_trajectories`).
# 2. Released: the trajectories were drawn under z_final but their log-probabilities are evaluated
#    under z_i of the trained AR step. This file: the same, as the default (it is what was
#    published; docs/method.md §4, ρ^(s) = exp(ℓ_θ(trajectory s) − sg ℓ) under z_i):
#    `trajectory_logprobs`; `--mte-positions predicted` restricts it to P_i (grpo.ar_step_loss).
# 3. Released: every trajectory's log-probability uses the rollout trajectory's s. This file: each
#    uses its own s = τ σ (the std it was sampled with); both are detached, so only the gradient's
#    scale per element can differ, and only where σ depends on x^t.
# 4. Released: the trajectories are guided with the w of the last AR step for every token. This
#    file: each token is guided with the w it was generated with (`cfg_final`).
# 5. On P_i, MTE acts as a mask (a property, not a choice): docs/method.md §4, "MTE on P_i".
# 6. Outside P_i the trajectories are a target that does not move with z_i: with a negative
#    advantage their term pushes z_i's transitions away without bound, which is how a long run of
#    the released objective drifts away (docs/method.md §4, "The MTE term outside P_i";
#    grpo.ar_step_loss logs the distance as mte_gap).
# 7. Not in the paper or the released code: `--mte-max-gap δ` (off by default) keeps the term
#    outside P_i only on tokens whose trajectories lie within δ of z_i's transitions
#    (`trajectory_gap`), whatever the advantage's sign; a token past δ keeps its rollout
#    trajectory's term, so the push of note 6 stops near a gap of δ and the pull inside it is
#    unchanged (grpo.ar_step_loss logs the share it drops as mte_far_frac; docs/method.md §4).
