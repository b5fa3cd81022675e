"""Why a run of released MAR-GRPO drifts away and when it does not (docs/method.md §4, "the MTE term
outside P_i"): on U_i outside P_i the MTE trajectories were drawn under z_final but are evaluated
under z_i, so their term is a fixed target, not the policy's own draws. With a negative advantage
the policy term pushes μ(z_i) away from that target, and nothing pulls it back but the KL: per
element the objective A·ℓ − β·KL has curvature −(A + β)/s², a runaway when β < −A."""

import pytest
import torch

import grpo
import mte
from diffloss import transition_logprob, transition_mean
from tests.helpers import make_rollout, settings, tiny_mar


def ascend(adv, beta, draws_from, steps=200, lr=0.05, S=256):
    """Gradient ascent on one AR step's objective of 8 elements with μ as the parameter,
    A·mean_s ℓ(x_s; μ) − β·KL(μ, μ_ref), the draws x_s ~ N(centre, s²) made afresh each step around
    `draws_from`: "policy" (the current μ: the rollout's own trajectory) or a fixed target 1.0 (the
    MTE trajectories outside P_i, from z_final). Returns max |μ − μ_ref| after `steps` steps."""
    s, mu_ref = torch.tensor(0.5), torch.zeros(8)
    mu = mu_ref.clone()
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        mu.requires_grad_(True)
        centre = mu.detach() if draws_from == "policy" else torch.ones(8)
        x = centre + s * torch.randn(S, 8, generator=g)  # (S, 8)
        logp = transition_logprob(x, mu, s)
        term, _ = grpo.policy_surrogate(logp, logp.detach(), adv)  # ρ A, ρ ≡ 1 in value
        J = term.mean(0).sum() - beta * grpo.kl_gaussian(mu, mu_ref, s).sum()  # per element
        (grad,) = torch.autograd.grad(J, mu)
        mu = (mu + lr * s ** 2 * grad).detach()  # a step in units of s², the curvature's
    return (mu - mu_ref).abs().max().item()


def test_a_negative_advantage_on_a_fixed_target_runs_away_unless_beta_exceeds_it():
    # the released MTE term outside P_i: repelled from the target without bound when β < |A|
    assert ascend(-1.0, beta=0.01, draws_from="target") > 1e3
    assert ascend(-1.0, beta=0.5, draws_from="target") > 1e1
    # β > |A|: the objective is concave, its maximum μ* = (A·1 + β·0) / (A + β) = −1 for β = 2
    assert ascend(-1.0, beta=2.0, draws_from="target") == pytest.approx(1.0, abs=0.1)
    # a positive advantage pulls toward the target, bounded whatever β
    assert ascend(1.0, beta=0.01, draws_from="target") == pytest.approx(1.0, abs=0.1)
    # the policy's own draws: the score has zero mean, so a negative advantage moves μ by noise
    assert ascend(-1.0, beta=0.01, draws_from="policy") < 0.5


def test_mte_gap_is_the_kl_between_the_steps_transitions_and_the_trajectories():
    """The logged mte_gap: on the uncertain tokens outside P_i, ℓ of the rollout's own draws minus
    the trajectories' mean ℓ, both under z_i; in expectation (μ(x^k, z_i) − μ(x^k, z_final))² / (2s²)
    over the trajectories' states, which this test computes from the same trajectories."""
    model = tiny_mar()
    model.diffloss.requires_grad_(False)
    record, cond = make_rollout(model, bsz=4)
    S = 64
    traj = mte.sample_trajectories(model.diffloss, record.z_final, record.z_final_null,
                                   record.cfg_final, 0.9, S, record.steps[0].diff_steps,
                                   torch.Generator().manual_seed(1))
    cfg = settings("mar-grpo", top_k=1.0)  # every position uncertain: the most elements
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    checked = 0
    for j, step in enumerate(record.steps):
        off = step.unknown & ~step.written  # (B, L) U_i outside P_i
        if not off.any():
            continue
        with torch.no_grad():
            _, stats, _ = grpo.ar_step_loss(model, model, record, j, cond, adv, cfg, traj)
            z, z_null = grpo.recompute_z(model, step, cond, True)  # z_i on U_i, (B, n, D)
            idx = step.unk_idx[..., None].expand(-1, -1, z.shape[-1])
            z_f, z_f_null = record.z_final.gather(1, idx), record.z_final_null.gather(1, idx)
            x_t = traj["x_t"].gather(3, step.unk_idx[None, None, :, :, None].expand(
                S, len(step.diff_steps), -1, -1, traj["x_t"].shape[-1]))  # (S, K, B, n, C)
            std = traj["std"].gather(3, step.unk_idx[None, None, :, :, None].expand_as(x_t))
            kls = []
            for s in range(S):
                mu_i = transition_mean(model.diffloss, x_t[s], step.diff_steps, z, z_null, step.cfg)
                w_f = record.cfg_final.gather(1, step.unk_idx).reshape(-1)  # (B·n,) each token's w
                mu_f = transition_mean(model.diffloss, x_t[s], step.diff_steps, z_f, z_f_null, w_f)
                kls.append((mu_i - mu_f) ** 2 / (2 * std[s] ** 2))  # (K, B, n, C)
            want = grpo.masked_mean(torch.stack(kls).mean(0), off.gather(1, step.unk_idx))
        got = stats["mte_gap"].item()
        assert got > 0 and got == pytest.approx(want.item(), rel=0.15), (j, got, want.item())
        checked += 1
    assert checked >= 2
