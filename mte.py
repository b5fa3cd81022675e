"""Multi-Trajectory Expectation (MTE, SPEC §4): average the policy term of uncertain tokens over
several diffusion trajectories of the frozen head, to cut the noise the head's sampling puts into
the policy gradient.

After the rollout, the frozen head is re-run from z_final (the condition each token was generated
from) with S fresh noise draws, recording the same chosen diffusion steps. Then, per element,

    π-term = (1 − M_unc) · term(rollout trajectory) + M_unc · (1/S) Σ_s term(trajectory s)

where term is the policy surrogate of grpo.py (ρ A without clipping) and M_unc the top-k% mask of
masks.py on u_p = mean_c std_s x0^(s).

What the paper says, what the released code does, and what this file does:
1. Paper: estimate the optimisation direction by an expectation over S trajectories, only for
   the most uncertain tokens. Released: S = 3 (NOVA) or 5 (Harmon) re-runs from z_final, one
   Python loop over seeds that reseeds the global RNG. Here: one batched head call over
   S × B × L rows with a passed generator (`sample_trajectories`).
2. Released: the seed trajectories were drawn under z_final but their log-probabilities are
   evaluated under z_i of the trained AR step. Here: the same, as the default (it is what was
   published; SPEC §4); policy.py does the evaluation.
3. Released: every seed's log-probability uses the rollout trajectory's s. Here: each seed uses
   its own s = τ σ (the std it was sampled with); both are detached, so only the gradient's scale
   per element can differ, and only where σ depends on x^t.
4. Released: the seeds are guided with the w of the last AR step for every token. Here: each
   token is guided with the w it was generated with (`cfg_final`).
"""

import torch


@torch.no_grad()
def sample_trajectories(head, z_final, z_final_null, cfg_final, temperature, num_seeds, diff_steps, generator=None):
    """S fresh head trajectories for every position, in one batched call.

    head: the (frozen) DiffLoss; z_final: (B, L, D) the z each token was generated from;
    z_final_null: (B, L, D) the null-condition z for CFG, or None without guidance;
    cfg_final: (B, L) the guidance w of each token; temperature: τ; num_seeds: S;
    diff_steps: (K,) recorded sampling steps (as the rollout's); generator: torch.Generator.
    returns dict x_t, x_prev, std (S, K, B, L, C) and x0 (S, B, L, C).
    """
    S, (B, L, D) = num_seeds, z_final.shape
    z = z_final.expand(S, B, L, D).reshape(S * B * L, D)  # (S·B·L, D)
    cfg = 1.0
    if z_final_null is not None:
        z_null = z_final_null.expand(S, B, L, D).reshape(S * B * L, D)
        z = torch.cat([z, z_null], dim=0)  # (2·S·B·L, D) = [cond; null]
        cfg = cfg_final.expand(S, B, L).reshape(S * B * L)  # (S·B·L,)
    x0, traj = head.sample(z, temperature, cfg, generator, record_steps=diff_steps)
    K, C = len(diff_steps), x0.shape[-1]
    out = {key: traj[key].reshape(K, S, B, L, C).transpose(0, 1) for key in ("x_t", "x_prev", "std")}  # (S, K, B, L, C)
    out["x0"] = x0.reshape(S, B, L, C)
    return out


def gather_positions(seeds, unk_idx):
    """The seed trajectories at the unknown positions of one AR step (the packed layout).

    seeds: dict from `sample_trajectories`; unk_idx: (B, n) positions of U_i
    returns dict x_t, x_prev, std: (S, K, B, n, C)
    """
    out = {}
    for key in ("x_t", "x_prev", "std"):
        S, K, B, L, C = seeds[key].shape
        idx = unk_idx[None, None, :, :, None].expand(S, K, B, unk_idx.shape[1], C)
        out[key] = seeds[key].gather(3, idx)  # (S, K, B, n, C)
    return out


def mte_policy_term(term_rollout, term_seeds, uncertain):
    """(1 − M) · term_rollout + M · mean_s term_seeds, per element.

    term_rollout: (K, B, n, C) surrogate of the rollout trajectory;
    term_seeds: (S, K, N_u, C) surrogates of the seed trajectories at the uncertain positions
      only, in the order of `uncertain.nonzero()`; uncertain: (B, n) bool M_unc on U_i.
    returns (K, B, n, C)
    """
    out = term_rollout.clone()
    out[:, uncertain] = term_seeds.mean(dim=0)  # (K, N_u, C)
    return out
