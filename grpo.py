"""The GRPO loss of MAR-GRPO, whole, for one trained AR step i of a recorded rollout (§3), with
chosen diffusion steps k, images b, positions p and channels c (docs/method.md §2–§7):

    ℓ      = −(x − μ)²/(2s²) − log s − ½ log 2π          (§2, per element; s from the rollout)
    A_b    = (r_b − mean_group r) / (std_group r + 1e-4)   (§6)
    ρ      = exp(ℓ_θ − ℓ_old)                              (per element)
    term   = min(ρ A, clip(ρ, 1 − ε, 1 + ε) A)             (ρ A without clipping)
    π-term = term; on M_unc its MTE average               (§4: M_unc top-k% by mean_c std_s x0)
    W      = U_i ∧ (1[Δsim > κ] ∨ P_i)                     (§5)
    P_i    = Σ W · π-term / Σ W
    KL_i   = Σ_{U_i} KL-term / Σ_{U_i} 1
    L      = −mean_i (P_i − β KL_i)                        (§6; §7: the variants, `METHODS`)
"""

from dataclasses import dataclass

import torch

import masks
import mte
from diffloss import transition_logprob, transition_mean


@dataclass
class GRPOSettings:
    """Everything the objective needs to know (train.py's `paper_flags` hold the released values as
    their defaults; `METHODS` name the paper's variants, docs/method.md §7: grpo trains the head,
    grpo-fixed-head freezes it, mar-grpo adds MTE and the consistency mask)."""
    beta: float                   # KL weight β
    kl: str                       # "gaussian" | "k3" | "mean-k3"
    clip_eps: float               # PPO ratio clipping (binds only when inner_epochs > 1)
    inner_epochs: int             # optimizer steps per rollout
    train_head: bool              # does the diffusion head get gradients?
    mte_trajectories: int         # S; 0 = no multi-trajectory expectation
    top_k: float                  # fraction of tokens that get MTE (uncertainty mask)
    # MTE on uncertain U_i ("unknown", released) or P_i only ("predicted")
    mte_positions: str
    consistency_threshold: float | None  # κ of the consistency mask; None = no consistency mask
    # policy term on U_i ("unknown", released) or on P_i only ("predicted")
    policy_positions: str
    # recompute ℓ with the rollout's guidance ("rollout"), or "1" (released)
    train_cfg: str
    # δ: MTE outside P_i only on tokens whose trajectories lie within δ nats per element of z_i's
    # transitions (mte.trajectory_gap); None = everywhere (released)
    mte_max_gap: float | None = None

    def validate(self):
        """Raise ValueError naming the flag for contradictory settings."""
        if self.kl not in KL_KINDS:
            raise ValueError(f"--kl {self.kl!r}: choose from {', '.join(KL_KINDS)}")
        if self.mte_trajectories == 1 or self.mte_trajectories < 0:
            raise ValueError(f"--mte-trajectories {self.mte_trajectories}: MTE needs S >= 2 "
                             "trajectories (0 turns it off)")
        if self.mte_trajectories >= 2 and not 0 < self.top_k <= 1:
            raise ValueError(f"--top-k {self.top_k}: MTE needs a fraction in (0, 1]")
        if self.inner_epochs < 1:
            raise ValueError(f"--inner-epochs {self.inner_epochs}: must be >= 1")
        for name in ("mte_positions", "policy_positions"):
            if getattr(self, name) not in ("unknown", "predicted"):
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: "
                                 "choose 'unknown' or 'predicted'")
        if self.train_cfg not in ("rollout", "1"):
            raise ValueError(f"--train-cfg {self.train_cfg!r}: choose 'rollout' or '1'")
        if self.clip_eps <= 0:
            raise ValueError(f"--clip-eps {self.clip_eps}: must be > 0")
        if self.mte_max_gap is not None and not self.mte_max_gap > 0:
            raise ValueError(f"--mte-max-gap {self.mte_max_gap}: must be > 0 (or off)")
        return self


# the variants the paper compares (docs/method.md §7: grpo trains the head, grpo-fixed-head
# freezes it, mar-grpo adds MTE and the consistency mask), as what each changes of MAR-GRPO as
# released (train.py's defaults); every field can still be set by its own flag
METHODS = {
    "mar-grpo": {},
    "grpo-fixed-head": dict(mte_trajectories=0, consistency_threshold=None),
    "grpo": dict(train_head=True, mte_trajectories=0, consistency_threshold=None),
}


def group_advantages(rewards, group_size, eps=1e-4):
    """A_b = (r_b − mean_group r) / (std_group r + eps), groups of `group_size` consecutive
    images.

    rewards: (B,) with B = (#prompts) × G, each prompt's G images adjacent
    returns (B,) advantages
    """
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"group size {group_size} must be >= 2 and divide the batch of "
                         f"{rewards.numel()}")
    r = rewards.reshape(-1, group_size)  # (#prompts, G)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def min_max_combined(components, weights, group_size, eps=1e-8):
    """The reward of a step with every component min-max normalised within its group first,

        r_b = sum_k w_k (r_k,b − min_g r_k) / (max_g r_k − min_g r_k + eps),

    a component constant over a group (range < eps) counting 0 there: the released trainers'
    `normalize_multi_rewards` (off in the released runs), over the batch each process scores,
    which there is one group; per group in this function, so that a reward does not depend on
    the world size or --grad-accum.

    components: {name: (B,)}; weights: {name: w}; returns (B,)
    """
    total = 0
    for name, r in components.items():
        r = r.reshape(-1, group_size).float()                                 # (#prompts, G)
        low, high = r.min(dim=1, keepdim=True).values, r.max(dim=1, keepdim=True).values
        norm = torch.where(high - low < eps, torch.zeros_like(r), (r - low) / (high - low + eps))
        total = total + weights[name] * norm.reshape(-1)
    return total


def policy_surrogate(logp, logp_old, adv, clip_eps=None):
    """Per-element PPO surrogate to maximise: min(ρ A, clip(ρ, 1−ε, 1+ε) A),
    ρ = exp(ℓ − ℓ_old).

    logp: (...) ℓ_θ with gradient; logp_old: (...) detached, broadcastable; adv: broadcastable
    (e.g. (1, B, 1, 1)); clip_eps: None for the unclipped ρ A.
    returns (surrogate (...), ratio (...) detached)
    """
    ratio = torch.exp(logp - logp_old)
    surrogate = ratio * adv
    if clip_eps is not None:
        surrogate = torch.minimum(surrogate, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    return surrogate, ratio.detach()


def kl_gaussian(mean, mean_ref, std):
    """(μ_θ − μ_ref)² / (2 s²): the exact KL of N(μ_θ, s²) from N(μ_ref, s²), per
    element."""
    return (mean - mean_ref) ** 2 / (2 * std ** 2)


def kl_k3(logp, logp_ref):
    """e^{ℓ_ref − ℓ_θ} − (ℓ_ref − ℓ_θ) − 1 at the recorded x^{t−1}: the GRPO
    estimator, per element."""
    d = logp_ref - logp
    return torch.exp(d) - d - 1


def kl_mean_k3(mean, mean_ref):
    """e^{Δμ} − Δμ − 1 with Δμ = μ_ref − μ_θ: the released code's term (not a KL of
    the Gaussians)."""
    d = mean_ref - mean
    return torch.exp(d) - d - 1


KL_KINDS = ("gaussian", "k3", "mean-k3")


def kl_term(kind, mean, mean_ref, std, logp=None, logp_ref=None):
    """The per-element KL penalty of docs/method.md §6 (the KL_i of
    L = −mean_i (P_i − β KL_i)) named by --kl; all inputs of one shape, returns it."""
    if kind == "gaussian":
        return kl_gaussian(mean, mean_ref, std)
    if kind == "k3":
        return kl_k3(logp, logp_ref)
    if kind == "mean-k3":
        return kl_mean_k3(mean, mean_ref)
    raise ValueError(f"--kl {kind!r}: choose from {', '.join(KL_KINDS)}")


def masked_mean(x, mask):
    """Σ x·mask / Σ mask with mask broadcast over x (0 when the mask is empty).

    x: (K, B, n, C) per-element values; mask: (B, n) bool or float over positions.
    """
    m = mask.to(x.dtype)[None, :, :, None].expand_as(x)  # (K, B, n, C)
    return (x * m).sum() / m.sum().clamp(min=1.0)


def ar_step_objective(pi_term, keep, kl, beta):
    """The loss of one trained AR step: −(P_i − β KL_i).

    pi_term: (K, B, n, C) policy term per element (surrogate, MTE-averaged where chosen);
    keep: (B, n) W on the unknown positions of this step; kl: (K, B, n, C) KL-term, or None
    when β = 0. All positions of the packed layout are unknown, so KL_i is a plain mean.
    returns (loss, P_i, KL_i), scalars.
    """
    p = masked_mean(pi_term, keep)
    k = kl.mean() if kl is not None else torch.zeros((), device=pi_term.device)
    return -(p - beta * k), p.detach(), k.detach()


def choose_train_steps(num_ar_steps, n_trained, trainable, n_diff, generator, below=0):
    """Which AR steps and diffusion steps a rollout records (docs/method.md §3: per chosen AR
    step the canvas, U_i, P_i, the head's transitions on U_i and the previews), before it starts.

    num_ar_steps: the rollout's AR steps N; n_trained: how many of them to train (all if >= N);
    trainable: the recordable diffusion steps (`diffloss.trainable_steps(T)`); n_diff: how many of
    them; below: if > 0, the AR steps are drawn from 0 .. below − 1 only (`--train-ar-below`, not
    in the paper: the first steps, which place the objects; 0 draws from all N, as released).
    returns (sorted list of AR steps, descending list of diffusion steps); the draws happen on the
    generator's device (a CUDA generator works), and reading them back is one host sync.
    """
    device = generator.device
    pool = min(below, num_ar_steps) if below > 0 else num_ar_steps
    ar = torch.randperm(pool, generator=generator, device=device)[:min(n_trained, pool)]
    ar = ar.sort().values
    trainable = torch.as_tensor(list(trainable), dtype=torch.long, device=device)
    if len(trainable) == 0:
        raise ValueError("no trainable diffusion steps: --num-sampling-steps must be >= 3")
    pick = torch.randperm(len(trainable), generator=generator,
                          device=device)[:min(n_diff, len(trainable))]
    both = torch.cat([ar, trainable[pick].sort(descending=True).values]).tolist()
    return both[:len(ar)], both[len(ar):]


# -----------------------------------------------------------------------------
# The loss of one trained AR step, from a rollout record (rollout.py)

def recompute_z(model, step, inputs, guided):
    """z at the unknown positions of a recorded canvas, differentiable in the model.

    model: a mar.MaskedAR; step: a rollout.StepRecord; inputs: the rollout's condition inputs
    (embedded by `model` itself, so gradients reach whatever part of it embeds them); guided: also
    return the null z. returns z (B, n, D) and z_null (B, n, D) or None
    """
    cond = model.condition(**inputs)
    if guided:
        cond = model.with_null(cond)  # [cond; null]
    # (B or 2B, L, D)
    z = model.guided_z(step.tokens, step.unknown.to(step.tokens.dtype), cond, guided)
    B, idx = step.tokens.shape[0], step.unk_idx[..., None].expand(-1, -1, z.shape[-1])  # (B, n, D)
    return z[:B].gather(1, idx), (z[B:].gather(1, idx) if guided else None)


def ar_step_loss(model, ref_model, record, j, inputs, adv, settings, trajectories=None,
                 old_logp=None):
    """The loss of trained AR step j of a rollout: −(P_i − β KL_i) (`ar_step_objective`).

    model / ref_model: the policy and the frozen reference (mar.MaskedAR); record: a
    rollout.RolloutRecord; j: index into record.steps; inputs: the rollout's condition inputs;
    adv: (B,) advantages; settings: GRPOSettings (the guidance w is the step's own);
    trajectories: MTE trajectories from `mte.sample_trajectories` (or None; M_unc is built from
    them in this function, beside W); old_logp: this step's ℓ_old from the first inner epoch,
    {"logp", "logp_traj"} (None in the first epoch).
    returns (loss, stats: dict of 0-dim tensors, detached (no host sync in it), the step's ℓ_old
    for the later epochs, {"logp", "logp_traj"})
    """
    step = record.steps[j]
    guided = record.z_final_null is not None and settings.train_cfg == "rollout"
    w = step.cfg if guided else 1.0
    clip = settings.clip_eps if settings.inner_epochs > 1 else None
    A = adv[None, :, None, None]  # (1, B, 1, 1)

    # the rollout trajectory: ℓ_θ per element, (K, B, n, C)
    z, z_null = recompute_z(model, step, inputs, guided)
    mean = transition_mean(model.diffloss, step.x_t, step.diff_steps, z, z_null, w)
    logp = transition_logprob(step.x_prev, mean, step.std)
    logp_old = logp.detach() if old_logp is None else old_logp["logp"]
    pi_term, ratio = policy_surrogate(logp, logp_old, A, clip)
    old_logp_next = {"logp": logp_old}  # ℓ_old of the later epochs
    stats = {"logp_parity_err": (logp.detach() - step.logp).abs().max()}
    written = step.written.gather(1, step.unk_idx)  # (B, n) P_i on U_i, written at this step

    # multi-trajectory expectation on the uncertain unknown positions (mte.py): M_unc, top-k% by
    # spread
    if trajectories is not None:
        uncertain = masks.uncertainty_mask(trajectories["x0"], settings.top_k)  # (B, L) M_unc
        unc = uncertain.gather(1, step.unk_idx)  # (B, n) M_unc on U_i
        # only where the trajectories' z_final is this step's z_i
        if settings.mte_positions == "predicted":
            unc = unc & written
        # (S, K, B, n, C)
        logp_s = mte.trajectory_logprobs(model.diffloss, trajectories, step, z, z_null, w, unc)
        logp_s_old = logp_s.detach() if old_logp is None else old_logp["logp_traj"]
        term_s, _ = policy_surrogate(logp_s, logp_s_old, A[None], clip)  # (S, K, B, n, C)
        old_logp_next["logp_traj"] = logp_s_old
        stats["uncertain_frac"] = unc.float().mean()
        # the MTE gap: on the uncertain tokens outside P_i, the trajectories' ℓ under the z_final
        # they were drawn from minus their ℓ under z_i, per element: a log-likelihood ratio whose
        # mean is the KL (μ(x^k, z_final) − μ(x^k, z_i))² / (2s²) over the trajectories' states,
        # how far this step's transitions sit from those the trajectories came from (docs/method.md
        # §4: what the released MTE term does there, and why a run whose gap grows collapses)
        drawn = trajectories["logp"].gather(3, step.unk_idx[None, None, :, :, None].expand_as(
            logp_s))  # (S, K, B, n, C)
        outside = unc & ~written  # (B, n) the uncertain tokens outside P_i
        stats["mte_gap"] = masked_mean((drawn - logp_s.detach()).mean(0), outside)
        if settings.mte_max_gap is not None:  # a token past δ keeps its rollout trajectory's term
            far = outside & (mte.trajectory_gap(drawn, logp_s) > settings.mte_max_gap)  # (B, n)
            stats["mte_far_frac"] = far.sum() / outside.sum().clamp(min=1)
            unc = unc & ~far
        pi_term = mte.mte_policy_term(pi_term, term_s, unc)

    # consistency-aware token selection: W on the unknown positions
    keep = masks.consistency_mask(step.preview, step.preview_prev, record.tokens, step.unknown,
                                  step.written,
                                  settings.consistency_threshold).gather(1, step.unk_idx)  # (B, n)
    if settings.policy_positions == "predicted":  # only the tokens this step wrote into the image
        keep = keep & written
    stats["keep_frac"] = keep.float().mean()

    # KL to the reference policy, on the rollout trajectory over all of U_i
    kl = None
    if settings.beta > 0:
        with torch.no_grad():
            z_ref, z_ref_null = recompute_z(ref_model, step, inputs, guided)
            mean_ref = transition_mean(ref_model.diffloss, step.x_t, step.diff_steps, z_ref,
                                       z_ref_null, w)
            logp_ref = transition_logprob(step.x_prev, mean_ref, step.std)
        kl = kl_term(settings.kl, mean, mean_ref, step.std, logp, logp_ref)

    loss, p, k = ar_step_objective(pi_term, keep, kl, settings.beta)
    stats.update(policy_term=p.detach(), kl=k.detach(),
                 ratio_max_dev=(ratio.detach() - 1).abs().max())
    if clip is not None:
        stats["clip_frac"] = ((ratio.detach() - 1).abs() > clip).float().mean()
    return loss, stats, old_logp_next


# -----------------------------------------------------------------------------
# Notes: what this file holds, and where it stands between the paper and the released code
#
# This file: advantages, the ratio and its surrogate, the KL choices, the per-AR-step objective,
# and `ar_step_loss`, which recomputes z under the policy for a recorded AR step and forms
# −(P_i − β KL_i) from the method files (diffloss.py, mte.py, masks.py). It calls only the policy
# interface of mar.MaskedAR (MAR, Harmon and NOVA alike).
#
# "Released" is the MAR-GRPO code, GitHub `AMAP-ML/mar-grpo@fcb7969`: the trainers
# src/grpo/src/open_r1/trainer/grpo_trainer_nova_v1_2.py and grpo_trainer_harmon_v1_2.py (rewards,
# advantages, ratios, KL, masks and loss) and the runs' settings in
# scripts/debug_entry_{nova,harmon,nova_mix}.py.
#
# What the paper says, what the released code does, and what this file does:
# 1. Advantages. Released: (r − mean) / (std + 1e-4) over the G images of a prompt, with torch's
#    default (Bessel-corrected) std. This file: the same; a group whose rewards are all equal gets
#    exactly zero advantage (its numerator is zero), never NaN; G = 1 is rejected (no group).
# 2. Ratios. Released: one optimizer step per rollout, ρ = exp(ℓ − sg ℓ) ≡ 1, no clipping.
#    This file: ℓ_old is the detached ℓ of the first inner epoch, so `--inner-epochs 1` is
#    exactly the released objective (value and gradient), and E > 1 is PPO with ratio clipping
#    `--clip-eps`.
# 3. KL. Released: e^{Δμ} − Δμ − 1 with Δμ = μ_ref − μ_θ ("mean-k3", not a KL between
#    the transition Gaussians). This file: the exact KL (μ_θ − μ_ref)² / (2 s²) by default
#    ("gaussian"), with "k3" (the GRPO estimator on log-probabilities) and "mean-k3" one flag away.
# 4. Normalisation. As released, each AR step's policy term is normalised by its kept elements and
#    its KL by its unknown elements, and each step is backpropagated on its own. Released: the
#    per-step gradients add up (12 trained steps give 12× one step's gradient; only the logged loss
#    is their mean). This file: L = −mean_i (P_i − β KL_i) as docs/method.md §6 writes it
#    (train.py divides each step's loss by their number): the same direction, 1/#steps the size
#    before clipping.
# 5. Which steps train. Released: a random subset of AR steps and 10 random diffusion steps. This
#    file: drawn before the rollout from a seeded generator, diffusion steps from
#    `trainable_steps` (never the pure-noise step; see diffloss.py).
# 6. Which positions carry the policy term. Released: W ⊆ U_i, all unknown positions of the trained
#    step (docs/method.md §5, W = U_i ∧ (1[Δsim > κ] ∨ P_i)). But only P_i is written into
#    the image at step i; on U_i outside P_i the head's samples are previews that are thrown away
#    and drawn again later, so for grpo and grpo-fixed-head their term has zero mean whatever the
#    reward (pure variance), and under the consistency mask it becomes a reward-weighted pull of
#    z_i toward the final tokens. This file: the released W by default; `--policy-positions
#    predicted` keeps W = P_i, the policy gradient of the trajectory that made the image.
# 7. Recomputing ℓ. The transformer runs in eval mode (no dropout, no condition drop) with
#    gradients, so the recomputed ℓ of a fresh rollout equals the recorded one
#    (docs/method.md §2, ℓ = −(x − μ)²/(2s²) − log s − ½ log 2π) and the first inner
#    epoch has ρ ≡ 1 exactly. `--train-cfg rollout` (default) recomputes μ with the rollout's
#    guidance (z of the condition and of the null condition, mixed with the step's w);
#    `--train-cfg 1` recomputes from the conditional z alone, as the released Harmon trainer does
#    although it sampled with guidance (then ℓ no longer matches the recorded value). The
#    reference policy of the KL runs the same computation without gradients.
# 8. MTE terms are evaluated only at the uncertain unknown positions, so their cost scales with k%,
#    not with L (mte.trajectory_logprobs). `--mte-positions predicted` restricts them to the tokens
#    written at this step, P_i, the only positions whose z_final is this step's z_i; on U_i outside
#    P_i the trajectories come from the z of a later step, which the released code (and by default
#    this code) evaluates under z_i anyway (mte.py, item 2).
