"""The policy under GRPO: evaluate a recorded rollout with the current weights and form the loss
of one trained AR step (docs/method.md §2–§6). Model-agnostic: it calls only the policy interface of
rollout.py (MAR, Harmon and NOVA implement it). This is where z from the model, the head's
transition Gaussians, mte.py, masks.py and grpo.py meet; train.py only calls `rollout_loss`.

Layout: at AR step i the record holds the n = |U_i| unknown positions of each image, packed as
(B, n) (`unk_idx`), and K chosen diffusion steps, so per-element tensors are (K, B, n, C).

What this file decides, and why:
1. The transformer runs in eval mode (no dropout, no condition drop) with gradients, so the
   recomputed ℓ of a fresh rollout equals the recorded one (the parity of docs/method.md §2), and the first
   inner epoch has ρ ≡ 1 exactly.
2. `--train-cfg rollout` (default) recomputes μ with the rollout's guidance: z of the condition
   and of the null condition both come from the policy, mixed with the step's w. `--train-cfg 1`
   recomputes without guidance from the conditional z alone, as the released Harmon trainer does
   although it sampled with guidance (then ℓ no longer matches the recorded value).
3. The reference policy of the KL runs the same computation without gradients.
4. MTE terms are evaluated only at the uncertain unknown positions, so their cost scales with
   k%, not with L (mte.seed_logprobs), then combined densely (mte.mte_policy_term).
   `--mte-positions predicted` restricts them further to the tokens written at this step, P_i,
   the only positions whose z_final is this step's z_i; on U_i outside P_i the seeds come from
   the z of a later step, which the released code (and the default of this code) evaluates under z_i
   anyway (mte.py, item 2; docs/research_log.md measured it pulling the reward down).
"""

import contextlib

import torch
import torch.nn as nn

import grpo
import masks
import mte
from diffloss import transition_logprob
from rollout import cat_rows, transition_mean


def recompute_z(model, step, inputs, guided):
    """z at the unknown positions of a recorded canvas, differentiable in the model.

    model: implements rollout.py's policy interface; step: a rollout.StepRecord; inputs: the
    rollout's condition inputs (embedded by `model` itself); guided: also return the null z.
    returns z (B, n, D) and z_null (B, n, D) or None
    """
    tokens, mask = step.tokens, step.unknown.to(step.tokens.dtype)  # (B, L, C), (B, L)
    bsz = tokens.shape[0]
    cond = model.condition(**inputs)
    if guided:
        tokens, mask = torch.cat([tokens, tokens]), torch.cat([mask, mask])
        cond = cat_rows(cond, model.null_condition_like(cond))
    z = model.predict_z(tokens, mask, cond).float()  # (B or 2B, L, D)
    idx = step.unk_idx[..., None].expand(-1, -1, z.shape[-1])  # (B, n, D)
    z_cond = z[:bsz].gather(1, idx)
    return z_cond, (z[bsz:].gather(1, idx) if guided else None)


def rollout_loss(model, ref_model, rollout, j, inputs, adv, settings, seeds=None, uncertain=None, old=None):
    """The loss of trained AR step j of a rollout: −(P_i − β KL_i) (grpo.ar_step_objective).

    model / ref_model: the policy and the frozen reference (the policy interface of rollout.py);
    rollout: a rollout.Rollout; j: index into rollout.steps; inputs: the rollout's condition
    inputs; adv: (B,) advantages; settings: grpo.GRPOSettings (the method's settings; the guidance
    weight is `w`, the step's own); seeds: MTE trajectories from `mte.sample_trajectories` (or
    None); uncertain: (B, L) bool M_unc (or None);
    old: this step's ℓ_old from the first inner epoch (None in the first epoch).
    returns (loss, stats: dict of 0-dim tensors, detached (no host sync in it), old for later epochs)
    """
    step = rollout.steps[j]
    guided = rollout.z_final_null is not None and settings.train_cfg == "rollout"
    w = step.cfg if guided else 1.0
    clip = settings.clip_eps if settings.inner_epochs > 1 else None
    A = adv[None, :, None, None]  # (1, B, 1, 1)

    # the rollout trajectory: ℓ_θ per element, (K, B, n, C)
    z, z_null = recompute_z(model, step, inputs, guided)
    mean = transition_mean(model.diffloss, step.x_t, step.diff_steps, z, z_null, w)
    logp = transition_logprob(step.x_prev, mean, step.std)
    logp_old = logp.detach() if old is None else old["logp"]
    pi_term, ratio = grpo.policy_surrogate(logp, logp_old, A, clip)
    new_old = {"logp": logp_old}
    stats = {"logp_parity_err": (logp.detach() - step.logp).abs().max()}
    pred = step.pred.gather(1, step.unk_idx)  # (B, n) P_i on U_i: the tokens this step wrote

    # multi-trajectory expectation on the uncertain unknown positions (mte.py)
    if seeds is not None:
        unc = uncertain.gather(1, step.unk_idx)  # (B, n) M_unc on U_i
        if settings.mte_positions == "predicted":  # only where the seeds' z_final is this step's z_i
            unc = unc & pred
        logp_s = mte.seed_logprobs(model.diffloss, seeds, step, z, z_null, w, unc)  # (S, K, B, n, C)
        logp_s_old = logp_s.detach() if old is None else old["logp_seeds"]
        term_s, _ = grpo.policy_surrogate(logp_s, logp_s_old, A[None], clip)  # (S, K, B, n, C)
        pi_term = mte.mte_policy_term(pi_term, term_s, unc)
        new_old["logp_seeds"] = logp_s_old
        stats["uncertain_frac"] = unc.float().mean()

    # consistency-aware token selection: W on the unknown positions
    keep = masks.consistency_mask(step.preview, step.preview_prev, rollout.tokens,
                                  step.unknown, step.pred, settings.tau).gather(1, step.unk_idx)  # (B, n)
    if settings.policy_positions == "predicted":  # only the tokens this step wrote into the image
        keep = keep & pred
    stats["keep_frac"] = keep.float().mean()

    # KL to the reference policy, on the rollout trajectory over all of U_i
    kl = None
    if settings.beta > 0:
        with torch.no_grad():
            z_ref, z_ref_null = recompute_z(ref_model, step, inputs, guided)
            mean_ref = transition_mean(ref_model.diffloss, step.x_t, step.diff_steps, z_ref, z_ref_null, w)
            logp_ref = transition_logprob(step.x_prev, mean_ref, step.std)
        kl = grpo.kl_term(settings.kl, mean, mean_ref, step.std, logp, logp_ref)

    loss, p, k = grpo.ar_step_objective(pi_term, keep, kl, settings.beta)
    stats.update(policy_term=p.detach(), kl=k.detach(), ratio_max_dev=(ratio.detach() - 1).abs().max())
    if clip is not None:
        stats["clip_frac"] = ((ratio.detach() - 1).abs() > clip).float().mean()
    return loss, stats, new_old


class PolicyLoss(nn.Module):
    """The policy as a module whose forward is one AR step's GRPO loss, so DDP can wrap it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ref, record, j, inputs, adv, settings, seeds=None, uncertain=None, old=None):
        return rollout_loss(self.model, ref, record, j, inputs, adv, settings, seeds, uncertain, old)


def backward_rollout(loss_module, ddp, ref, record, inputs, adv, settings, seeds, uncertain, olds, autocast,
                     scale=1.0, sync=True):
    """L = −mean_i (P_i − β KL_i): backward through each trained AR step's loss / #steps, one step
    at a time (each graph is freed before the next); DDP's all-reduce happens once, on the last.
    Forward passes run under `autocast`, backward outside it. scale: multiplies the loss (1/A for
    one of A accumulated micro-batches); sync: whether DDP all-reduces on this rollout's last step
    (False for all but a step's last micro-batch). Returns (stats, olds): stats is a list of dicts
    of 0-dim tensors (each with the step's "loss"), read with one sync by the caller."""
    n = len(record.steps)
    stats, new_olds = [], []
    for j in range(n):
        reduce = not ddp or (sync and j == n - 1)
        with contextlib.nullcontext() if reduce else loss_module.no_sync():
            with autocast():
                loss, s, old = loss_module(ref, record, j, inputs, adv, settings, seeds, uncertain, olds[j])
            (loss / n * scale).backward()
        stats.append({**s, "loss": loss.detach()})
        new_olds.append(old)
    return stats, new_olds
