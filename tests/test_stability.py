"""Why a run of released MAR-GRPO drifts away and when it does not (docs/method.md §4, "the MTE term
outside P_i"): on U_i outside P_i the MTE trajectories were drawn under z_final but are evaluated
under z_i, so their term is a fixed target, not the policy's own draws. With a negative advantage
the policy term pushes μ(z_i) away from that target, and nothing pulls it back but the KL: per
element the objective A·ℓ − β·KL has curvature −(A + β)/s², a runaway when β < −A. A gate on the
gap (`--mte-max-gap`) stops the term where the trajectories lie too far from z_i's transitions."""

import pytest
import torch

import grpo
import masks
import mte
import train
from diffloss import transition_logprob, transition_mean
from tests.helpers import make_rollout, settings, step_grad_with_uncertain, tiny_mar


def ascend(adv, beta, draws_from, steps=200, lr=0.05, S=256, target=1.0, max_gap=None):
    """Gradient ascent on one AR step's objective of 8 elements with μ as the parameter,
    A·mean_s ℓ(x_s; μ) − β·KL(μ, μ_ref), the draws x_s ~ N(centre, s²) made afresh each step around
    `draws_from`: "policy" (the current μ: the rollout's own trajectory) or a fixed `target` (the
    MTE trajectories outside P_i, from z_final). With `max_gap` δ an element's term counts only
    while its draws' mean ℓ under the target minus under μ (mte.trajectory_gap) is at most δ.
    Returns max |μ − μ_ref| after `steps` steps."""
    s, mu_ref = torch.tensor(0.5), torch.zeros(8)
    mu = mu_ref.clone()
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        mu.requires_grad_(True)
        centre = mu.detach() if draws_from == "policy" else torch.full((8,), target)
        x = centre + s * torch.randn(S, 8, generator=g)  # (S, 8)
        logp = transition_logprob(x, mu, s)
        term, _ = grpo.policy_surrogate(logp, logp.detach(), adv)  # ρ A, ρ ≡ 1 in value
        if max_gap is not None:  # (S, K=1, B=1, n=8, C=1) as the loss holds them
            drawn = transition_logprob(x, centre, s)
            gap = mte.trajectory_gap(drawn[:, None, None, :, None], logp[:, None, None, :, None])
            term = term * (gap[0] <= max_gap)  # (S, 8)
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


def test_a_gate_on_the_gap_bounds_the_push_and_keeps_the_pull():
    """--mte-max-gap δ: the term stops where the trajectories lie more than δ from μ, whatever the
    advantage's sign, so a negative advantage pushes μ only until (μ − target)² / (2s²) ≈ δ."""
    d, s, delta = 0.1, 0.5, 0.1  # the target d from μ_ref: a gap d²/(2s²) = 0.02 at the start

    def at_gap(gap):  # |μ − μ_ref| of a μ pushed away from the target to this gap
        return s * (2 * gap) ** 0.5 - d

    assert ascend(-1.0, beta=0.01, draws_from="target", target=d) > 1e3  # released: runs away
    for steps in (200, 1000):  # held: past δ only as far as the gap's estimate from S draws errs
        pushed = ascend(-1.0, beta=0.01, draws_from="target", target=d, max_gap=delta, steps=steps)
        assert at_gap(delta) < pushed < at_gap(3 * delta), (steps, pushed)
    # the pull is inside δ all the way and unchanged: to the target
    assert ascend(1.0, beta=0.01, draws_from="target", target=d, max_gap=delta) == pytest.approx(
        d, abs=0.02)
    assert ascend(1.0, beta=0.01, draws_from="target", target=d) == pytest.approx(d, abs=0.02)


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


def test_trajectory_gap_is_the_mean_log_ratio_per_token():
    """mte.trajectory_gap: per token, the mean over trajectories, steps and channels of ℓ under
    z_final − ℓ under z_i (hand-built values), without gradient."""
    drawn = torch.zeros(2, 3, 1, 2, 4)  # (S, K, B, n, C)
    at_zi = torch.zeros(2, 3, 1, 2, 4, requires_grad=True)
    shift = torch.tensor([-0.5, -2.0])[None, None, None, :, None]  # ℓ under z_i per token
    gap = mte.trajectory_gap(drawn, at_zi + shift)
    assert gap.shape == (1, 2) and torch.equal(gap, torch.tensor([[0.5, 2.0]]))
    assert not gap.requires_grad


def test_mte_max_gap_keeps_mte_outside_p_i_only_within_delta():
    """--mte-max-gap δ = the released MTE with M_unc ∧ (P_i ∨ gap ≤ δ): an uncertain token outside
    P_i whose trajectories lie more than δ from z_i's transitions (mte.trajectory_gap, computed
    in this test from the trajectories' ℓ) keeps its rollout trajectory's term; on P_i nothing
    changes."""
    model = tiny_mar()
    model.diffloss.requires_grad_(False)
    record, cond = make_rollout(model)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    traj = mte.sample_trajectories(model.diffloss, record.z_final, record.z_final_null,
                                   record.cfg_final, 0.9, 3, record.steps[0].diff_steps,
                                   torch.Generator().manual_seed(1))
    uncertain = masks.uncertainty_mask(traj["x0"], 0.5)  # (B, L) M_unc, as the loss builds it

    def grad(j, cfg, unc):  # the loss's gradient at AR step j with M_unc = unc
        return step_grad_with_uncertain(model, record, j, cond, adv, cfg, traj, unc)

    split = 0
    for j, step in enumerate(record.steps):
        outside = (uncertain & step.unknown & ~step.written).gather(1, step.unk_idx)  # (B, n)
        if not outside.any():
            continue
        with torch.no_grad():  # each token's gap from its trajectories' ℓ under z_final and z_i
            z, z_null = grpo.recompute_z(model, step, cond, True)
            unc_n = uncertain.gather(1, step.unk_idx)
            at_zi = mte.trajectory_logprobs(model.diffloss, traj, step, z, z_null, step.cfg, unc_n)
            drawn = traj["logp"].gather(3, step.unk_idx[None, None, :, :, None].expand_as(at_zi))
            gap = (drawn - at_zi).mean(dim=(0, 1, 4))  # (B, n)
        delta = gap[outside].median().item()
        far = outside & (gap > delta)  # (B, n)
        kept = uncertain.clone()  # (B, L): M_unc without the far tokens
        kept.scatter_(1, step.unk_idx, unc_n & ~far)
        got, stats = grad(j, settings("mar-grpo", top_k=0.5, mte_max_gap=delta), uncertain)
        want, _ = grad(j, settings("mar-grpo", top_k=0.5), kept)
        assert torch.equal(got, want)
        share = far.sum().item() / outside.sum().item()
        assert stats["mte_far_frac"].item() == pytest.approx(share)
        wide, _ = grad(j, settings("mar-grpo", top_k=0.5, mte_max_gap=1e9), uncertain)
        released, _ = grad(j, settings("mar-grpo", top_k=0.5), uncertain)
        assert torch.equal(wide, released)
        if far.any() and (outside & ~far).any():
            assert not torch.allclose(got, released)
            split += 1
    assert split  # a step with tokens on both sides of δ


def test_mte_max_gap_flag():
    assert settings("mar-grpo").mte_max_gap is None  # released: no gate
    assert train.grpo_settings(train.parse_args(["--mte-max-gap", "0.05"])).mte_max_gap == 0.05
    assert train.grpo_settings(train.parse_args(["--mte-max-gap", "off"])).mte_max_gap is None
    with pytest.raises(ValueError, match="--mte-max-gap 0: must be"):
        train.parse_args(["--mte-max-gap", "0"])
    with pytest.raises(ValueError, match="--mte-max-gap"):
        settings("mar-grpo", mte_max_gap=-1.0).validate()
