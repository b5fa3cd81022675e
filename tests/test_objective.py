"""The MAR-GRPO objective as a whole (docs/method.md §2–§6), pinned in value and gradient against a hand
computation written from the equations of docs/method.md.

One tiny rollout (a 16-token MAR with random weights, 4 images in 2 prompt groups, CFG on, 3 trained
AR steps, 2 diffusion steps each, S = 3 MTE trajectories) is recorded once; on it the loss the code
computes for every trained AR step is compared with

    ℓ     = −(x − μ)² / (2 s²) − log s − ½ log 2π          per element, s recorded (held fixed)
    ρ     = exp(ℓ − ℓ_old)                                   ℓ_old = sg ℓ in the first epoch
    term  = ρ A   (or min(ρ A, clip(ρ, 1 − ε, 1 + ε) A) in a later PPO epoch)
    π     = (1 − M_unc) term⁽⁰⁾ + M_unc · mean_s term⁽ˢ⁾
    P_i   = Σ W π / Σ W,    KL_i = Σ_U KL-term / Σ_U 1       over diffusion steps, images, positions, channels
    L     = −mean_i (P_i − β KL_i)

computed in this file densely over all L positions with plain tensor ops. From the code under test the
hand computation uses only what is not the objective: the model's `condition` / `predict_z` and
its head's `p_mean_variance` (for μ), and the recorded trajectories. The tiny case is built so
that every term is non-zero (`test_the_tiny_case_exercises_every_term` says so in assertions):
a reference that differs from the policy, advantages that differ per image and per group, MTE
trajectories that differ, w ≠ 1, masks that keep some tokens and drop others, each KL kind, and
a later PPO epoch whose ratios differ from 1 and are clipped in places.

Everything runs in float32, as training does. The code and the hand computation sum in different
orders and layouts and agree to ~3e-7 of the largest value or gradient entry; TOL = 1e-5 sits 30×
above that. A wrong sign, mask, index, average or detach moves the value or the gradient by 1e-3 …
1 relative (each such edit, applied to the code, fails a test below). How training combines the
per-step losses (mean over trained AR steps, once over DDP ranks): tests/test_update.py.
"""

import copy
import math
from argparse import Namespace

import pytest
import torch

import grpo
import mar
import mte
import rollout
from demo import shapes
from tests.helpers import settings

torch.set_num_threads(1)


# ADAPTERS: the only three places that call the code under test. After a refactor of how a rollout is
# recorded, how MTE trajectories are drawn or how a trained step's loss is computed, re-point these
# three functions; nothing below them reads the code's record layout.

def record_rollout(model, condition, ar_steps, diff_steps, num_iter, cfg, temperature, generator):
    """Record one rollout of the policy `model`.

    condition: dict(prompt_ids=(B, S)); ar_steps: trained AR steps; diff_steps: (K,) recorded
    sampling steps; cfg: guidance w (linear schedule); temperature: τ.
    returns (record: what the code's loss takes,
             view: dict final (B, L, C) tokens, steps: one dict per trained AR step, in order, with
               i, canvas (B, L, C) tokens fed to f_θ, unknown (B, L) U_i, written (B, L) P_i, w (float),
               k (K,) sampling steps, x_t / x_prev / std (K, B, L, C) the recorded transitions of
               U_i scattered to their positions (0 / 0 / 1 elsewhere), logp (K, B, L, C) the
               recorded ℓ (0 elsewhere), preview (B, L, C) x̂0^(i), preview_prev (B, L, C) x̂0^(i−1)
               or None)
    """
    plan = rollout.RolloutPlan(ar_steps=list(ar_steps), diff_steps=diff_steps)
    _, record = rollout.record_rollout(model, condition, num_iter, cfg=cfg, cfg_schedule="linear",
                                       temperature=temperature, plan=plan, generator=generator)
    L = record.tokens.shape[1]
    steps = []
    for s in record.steps:
        K, B, n, C = s.x_t.shape
        idx = s.unk_idx[None, :, :, None].expand(K, B, n, C)

        def scatter(packed, fill):  # (K, B, n, C) packed on U_i -> (K, B, L, C)
            return torch.full((K, B, L, C), fill, dtype=packed.dtype).scatter(2, idx, packed)
        steps.append(dict(i=s.i, canvas=s.tokens, unknown=s.unknown.bool(), written=s.written.bool(), w=float(s.cfg),
                          k=s.diff_steps, x_t=scatter(s.x_t, 0.0), x_prev=scatter(s.x_prev, 0.0),
                          std=scatter(s.std, 1.0), logp=scatter(s.logp, 0.0), preview=s.preview,
                          preview_prev=s.preview_prev))
    return record, dict(final=record.tokens, steps=steps)


def draw_mte(model, record, num_trajectories, top_k, temperature, generator):
    """S fresh head trajectories from z_final (float32); the loss builds M_unc from them.

    returns (mte_in: what the code's loss takes,
             view: dict x_t / x_prev / std (S, K, B, L, C) at every position, x0 (S, B, L, C))
    """
    traj = mte.sample_trajectories(model.diffloss, record.z_final, record.z_final_null, record.cfg_final,
                                    temperature, num_trajectories, record.steps[0].diff_steps, generator)
    return traj, {key: traj[key] for key in ("x_t", "x_prev", "std", "x0")}


def step_loss(model, ref, record, j, condition, adv, gcfg, mte_in, old_logp=None):
    """The code's loss of trained AR step j, −(P_i − β KL_i), and what a later inner epoch needs.

    model / ref: policy and reference; adv: (B,); gcfg: grpo.GRPOSettings; mte_in: from `draw_mte`
    (or None); old_logp: the step's ℓ_old, the second return value of its first-epoch call (None in it).
    returns (loss scalar with gradient, old_logp)
    """
    loss, _, old_logp = grpo.ar_step_loss(model, ref, record, j, condition, adv, gcfg, mte_in, old_logp)
    return loss, old_logp


# -----------------------------------------------------------------------------
# The hand computation (docs/method.md §2–§6), dense over all positions, plain tensor ops

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def hand_logp(x_prev, mu, s):
    """ℓ = −(x − μ)² / (2 s²) − log s − ½ log 2π, per element."""
    return -(x_prev - mu) ** 2 / (2 * s ** 2) - torch.log(s) - LOG_SQRT_2PI


def hand_mu(model, st, condition, x_t):
    """μ of the transitions x_t (..., K, B, L, C) at AR step `st`, guided with the step's w:
    z of the condition and of the null condition from two separate `predict_z` calls, then one
    `p_mean_variance` call per (trajectory, diffusion step)."""
    cond = model.condition(**condition)  # (B, S, D)
    mask = st["unknown"].to(st["canvas"].dtype)
    z_c = model.predict_z(st["canvas"], mask, cond)  # (B, L, D)
    z_u = model.predict_z(st["canvas"], mask, model.null_condition_like(cond))  # (B, L, D)
    B, L, D = z_c.shape
    z_rows = torch.cat([z_c.reshape(B * L, D), z_u.reshape(B * L, D)])  # (2·B·L, D) = [cond; null]
    K, C = x_t.shape[-4], x_t.shape[-1]
    flat = x_t.reshape(-1, K, B * L, C)  # (trajectories, K, B·L, C)
    mu = torch.stack([torch.stack([model.diffloss.p_mean_variance(x[kk], int(st["k"][kk]), z_rows, cfg=st["w"])[0]
                                   for kk in range(K)]) for x in flat])  # (trajectories, K, B·L, C)
    return mu.reshape(x_t.shape)


def hand_uncertain(x0, top_k):
    """M_unc: per image, the max(1, int(L·k)) positions of largest u_p = mean_c std_s x0 (population std)."""
    u = ((x0 - x0.mean(0)) ** 2).mean(0).sqrt().mean(-1)  # (B, L)
    B, L = u.shape
    M = torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):
        M[b, torch.topk(u[b], max(1, int(L * top_k))).indices] = True
    return M


def hand_delta_sim(st, final):
    """Δsim = cos(x̂0^(i), x_final) − cos(x̂0^(i−1), x_final), cosine over channels: (B, L)."""
    def cos(a, b):
        return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    return cos(st["preview"], final) - cos(st["preview_prev"], final)


def hand_keep(st, final, kappa):
    """W = U ∧ (1[Δsim > κ] ∨ P); W = U at the first AR step (no previous preview)."""
    if st["preview_prev"] is None:
        return st["unknown"].clone()
    return st["unknown"] & ((hand_delta_sim(st, final) > kappa) | st["written"])


def hand_objective(pol, ref, view, traj, condition, adv, beta, kl, kappa, top_k, old_pol=None, clip_eps=None):
    """L = −mean_i (P_i − β KL_i) over the trained AR steps of `view`.

    pol / ref: policy and reference (MAR); traj: the MTE view; adv: (B,); kl: docs/method.md §6 kind;
    old_pol: the policy of the first inner epoch (None: this is the first epoch, ℓ_old = sg ℓ);
    clip_eps: PPO ε (None: unclipped ρ A).
    returns (L, list of per-step dicts P, KL, P_unc (the uncertain part of P), W, M, ratio)
    """
    A = adv[None, :, None, None]  # (1, B, 1, 1)
    M_unc = hand_uncertain(traj["x0"], top_k)  # (B, L)

    def term(logp, logp_old):
        rho = torch.exp(logp - logp_old)
        if clip_eps is None:
            return rho * A, rho.detach()
        return torch.minimum(rho * A, torch.clamp(rho, 1 - clip_eps, 1 + clip_eps) * A), rho.detach()

    losses, parts = [], []
    for st in view["steps"]:
        U = st["unknown"]
        W = hand_keep(st, view["final"], kappa)
        M = M_unc & U
        # ℓ of the rollout trajectory (K, B, L, C) and of the MTE trajectories (S, K, B, L, C)
        mu = hand_mu(pol, st, condition, st["x_t"])
        logp = hand_logp(st["x_prev"], mu, st["std"])
        mu_s = hand_mu(pol, st, condition, traj["x_t"])
        logp_s = hand_logp(traj["x_prev"], mu_s, traj["std"])
        if old_pol is None:
            logp_old, logp_s_old = logp.detach(), logp_s.detach()
        else:
            with torch.no_grad():
                logp_old = hand_logp(st["x_prev"], hand_mu(old_pol, st, condition, st["x_t"]), st["std"])
                logp_s_old = hand_logp(traj["x_prev"], hand_mu(old_pol, st, condition, traj["x_t"]), traj["std"])
        term0, ratio = term(logp, logp_old)
        term_s, _ = term(logp_s, logp_s_old)
        Mf = M[None, :, :, None].to(logp.dtype)
        pi = (1 - Mf) * term0 + Mf * term_s.mean(0)  # (K, B, L, C)

        Wf = W[None, :, :, None].to(pi.dtype).expand_as(pi)
        P = (Wf * pi).sum() / Wf.sum()
        P_unc = (Wf * Mf * pi).sum() / Wf.sum()

        with torch.no_grad():
            mu_ref = hand_mu(ref, st, condition, st["x_t"])
            logp_ref = hand_logp(st["x_prev"], mu_ref, st["std"])
        if kl == "gaussian":
            kl_el = (mu - mu_ref) ** 2 / (2 * st["std"] ** 2)
        elif kl == "k3":
            kl_el = torch.exp(logp_ref - logp) - (logp_ref - logp) - 1
        else:  # mean-k3
            kl_el = torch.exp(mu_ref - mu) - (mu_ref - mu) - 1
        Uf = U[None, :, :, None].to(pi.dtype).expand_as(pi)
        KL = (Uf * kl_el).sum() / Uf.sum()

        losses.append(P - beta * KL)
        parts.append(dict(P=P, KL=KL, P_unc=P_unc, W=W, M=M, U=U, ratio=ratio))
    return -torch.stack(losses).mean(), parts


# -----------------------------------------------------------------------------
# The tiny case, built once

ADV = torch.tensor([1.3, -0.4, 0.9, -1.6])  # 2 groups of G = 2, all different, not summing to 0
PROMPTS = torch.tensor([[3, 5, 7, 0], [3, 5, 7, 0], [4, 9, 2, 11], [4, 9, 2, 11]])  # (B, S), 0 = padding
AR_STEPS, DIFF_STEPS, NUM_ITER, CFG, TEMPERATURE = (0, 1, 2), torch.tensor([4, 2]), 4, 3.0, 0.8
S, TOP_K, KAPPA, BETA = 3, 0.3, 0.0, 0.2
KAPPA_HIGH = 0.9  # above Δsim of some tokens written at the step: only "∨ P_i" keeps those
TOL = 1e-5


def perturb(model, scale, generator, names=lambda n: True):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if names(name):
                p.add_(scale * torch.randn(p.shape, generator=generator, dtype=p.dtype))


def gcfg(kl="gaussian", kappa=KAPPA, **kw):
    return settings(beta=BETA, kl=kl, mte_trajectories=S, top_k=TOP_K, mte_positions="unknown",
                    consistency_threshold=kappa, train_cfg="rollout", **kw).validate()


def build_case():
    """The shapes world's small MAR (pixel tokens, prompt conditioning, x̂0 clamped) at 16 px, patch
    4, width 32, 1 block, 6 diffusion steps, with random weights, every zero-initialised tensor
    given weight; its rollout and MTE draws; and a reference policy whose transformer is perturbed
    (the head is frozen in MAR-GRPO, so it stays shared)."""
    torch.manual_seed(0)
    model = mar.build_mar(dict(
        img_size=16, vae_stride=1, patch_size=4, vae_embed_dim=3, encoder_embed_dim=32, encoder_depth=1,
        encoder_num_heads=2, decoder_embed_dim=32, decoder_depth=1, decoder_num_heads=2, mlp_ratio=4.0, norm_eps=1e-6,
        class_num=1, buffer_size=shapes.MAX_PROMPT_TOKENS, diffloss_d=1, diffloss_w=32, num_sampling_steps="6",
        attn_dropout=0.0, proj_dropout=0.0, text_vocab_size=len(shapes.VOCAB), clip_denoised=True)).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():  # adaLN modulations, the head's output layer, biases
                p.normal_(0, 0.05, generator=g)
    condition = dict(prompt_ids=PROMPTS)
    record, view = record_rollout(model, condition, AR_STEPS, DIFF_STEPS, NUM_ITER, CFG, TEMPERATURE,
                                  torch.Generator().manual_seed(1))
    mte_in, traj = draw_mte(model, record, S, TOP_K, TEMPERATURE, torch.Generator().manual_seed(2))

    ref = copy.deepcopy(model)
    perturb(ref, 0.05, torch.Generator().manual_seed(3), names=lambda n: not n.startswith("diffloss."))
    return Namespace(model=model, ref=ref, record=record, view=view, mte_in=mte_in, traj=traj, condition=condition)


@pytest.fixture(scope="module")
def case():
    return build_case()


def params_of(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def grads(loss, named):
    g = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True, retain_graph=True)
    return [torch.zeros_like(p) if gi is None else gi for (_, p), gi in zip(named, g)]


def assert_grads_match(g_code, g_hand, named, what):
    """Every parameter's gradient within TOL of the hand gradient (relative to its largest entry)."""
    flat_h = torch.cat([g.flatten() for g in g_hand])
    scale = flat_h.abs().max()
    assert scale > 0, f"{what}: the hand gradient is zero, the test would be blind"
    bad = [(n, ((gc - gh).abs().max() / scale).item()) for (n, _), gc, gh in zip(named, g_code, g_hand)
           if (gc - gh).abs().max() > TOL * scale]
    assert not bad, (f"{what}: the code's gradient differs from the hand computation's in {len(bad)} of "
                     f"{len(named)} parameters (max |Δ| / max |∇L|): {bad[:6]}")


def code_objective(case, policy_model, gc, old_logp=None):
    """−mean_i of the code's per-step losses (the mean is pinned by the backward_rollout tests) and
    each step's ℓ_old for later epochs."""
    losses, kept_old_logp = [], []
    for j in range(len(case.view["steps"])):
        loss, old = step_loss(policy_model, case.ref, case.record, j, case.condition, ADV, gc, case.mte_in,
                              None if old_logp is None else old_logp[j])
        losses.append(loss)
        kept_old_logp.append(old)
    return torch.stack(losses), kept_old_logp


def step_table(code_losses, parts):
    rows = [f"  step {j}: code {c.item():+.8f}  hand −(P − βKL) {-(p['P'] - BETA * p['KL']).item():+.8f}  "
            f"(P {p['P'].item():+.6f}, βKL {BETA * p['KL'].item():.6f})" for j, (c, p) in enumerate(zip(code_losses, parts))]
    return "\n".join(rows)


# -----------------------------------------------------------------------------
# Tests

def test_the_tiny_case_exercises_every_term(case):
    """Every term of the objective is active, so a wrong one moves the value or the gradient."""
    view, traj = case.view, case.traj
    B, L = view["final"].shape[:2]
    assert len(view["steps"]) >= 2 and len(DIFF_STEPS) >= 2
    assert len(set(ADV.tolist())) == B and ADV[:2].sum() != ADV[2:].sum()  # per image and per group
    assert all(st["w"] != 1.0 for st in view["steps"])  # CFG on at every trained step
    assert (traj["x_prev"][0] - traj["x_prev"][1]).abs().min() > 0  # the MTE trajectories differ
    assert S >= 2
    # the recorded transitions recompute (docs/method.md §2 parity): the hand μ reads the record right
    for st in view["steps"]:
        with torch.no_grad():
            logp = hand_logp(st["x_prev"], hand_mu(case.model, st, case.condition, st["x_t"]), st["std"])
        U = st["unknown"][None, :, :, None].expand_as(logp)
        assert (logp - st["logp"])[U].abs().max() < 1e-4
    for kl in grpo.KL_KINDS:
        L_, parts = hand_objective(case.model, case.ref, view, traj, case.condition, ADV, BETA, kl, KAPPA, TOP_K)
        for p in parts:
            # the KL is a visible part of every step's value (the reference differs): flipping its
            # sign or zeroing it moves the step's loss by ≥ 100 × TOL relative
            assert BETA * p["KL"] > 100 * TOL * (p["P"] - BETA * p["KL"]).abs(), (kl, p["KL"], p["P"])
    n_kept_not_written = n_dropped = 0
    for st, p in zip(view["steps"], parts):
        U, W, M = p["U"], p["W"], p["M"]
        assert (W & ~U).sum() == 0 and (M & ~U).sum() == 0
        if st["preview_prev"] is not None:  # consistency active: keeps some tokens, drops others
            n_kept_not_written += (W & ~st["written"]).sum().item()
            n_dropped += (U & ~W).sum().item()
        # MTE at some unknown positions of more than one image, the single trajectory at others
        assert M.any(1).sum() >= 2 and (U & ~M).any()
        assert (W & M).any() and (W & ~M).any()
    assert n_kept_not_written > 0 and n_dropped > 0, (n_kept_not_written, n_dropped)
    # with κ = KAPPA_HIGH some tokens written at their step fail Δsim > κ: "∨ P_i" alone keeps them
    # (with κ = 0 it never matters: a written token's preview is its final value, so Δsim > 0)
    assert any(((hand_delta_sim(st, view["final"]) <= KAPPA_HIGH) & st["written"]).any()
               for st in view["steps"] if st["preview_prev"] is not None)
    assert view["steps"][0]["preview_prev"] is None  # the first AR step keeps all of U_0
    # the MTE terms carry gradient (in the first epoch their value is A, their gradient is not)
    L_, parts = hand_objective(case.model, case.ref, view, traj, case.condition, ADV, BETA, "gaussian", KAPPA, TOP_K)
    g = grads(torch.stack([p["P_unc"] for p in parts]).sum(), params_of(case.model))
    assert torch.cat([x.flatten() for x in g]).abs().max() > 0


@pytest.mark.parametrize("kl,kappa", [(kl, KAPPA) for kl in grpo.KL_KINDS] + [("gaussian", KAPPA_HIGH)])
def test_objective_value_and_gradient_match_hand_computation(case, kl, kappa):
    """First inner epoch (ρ ≡ 1 in value): L and ∇_θ L over every parameter of the policy (the
    transformer and the head) equal the hand computation, with MTE, both masks, CFG and the KL."""
    named = params_of(case.model)
    code_losses, _ = code_objective(case, case.model, gcfg(kl, kappa))
    L_hand, parts = hand_objective(case.model, case.ref, case.view, case.traj, case.condition, ADV, BETA, kl,
                                   kappa, TOP_K)
    hand_losses = torch.stack([-(p["P"] - BETA * p["KL"]) for p in parts])
    table = step_table(code_losses, parts)
    assert torch.allclose(code_losses, hand_losses, rtol=TOL, atol=0), \
        f"per-step loss −(P_i − β KL_i) differs from the hand computation (kl={kl}, κ={kappa}):\n{table}"
    L_code = code_losses.mean()
    assert torch.allclose(L_code, L_hand, rtol=TOL, atol=0)
    assert_grads_match(grads(L_code, named), grads(L_hand, named), named, f"∇L, first epoch, kl={kl}, κ={kappa}")


def test_later_ppo_epoch_value_and_gradient_match_hand_computation(case):
    """A second inner epoch after the policy moved: ρ ≠ 1 on the rollout and on the MTE
    trajectories, ℓ_old from the first epoch, PPO clipping binding on some kept elements."""
    eps, kl = 0.2, "k3"
    gc = gcfg(kl, inner_epochs=2, clip_eps=eps)
    _, old_logp = code_objective(case, case.model, gc)  # first epoch, θ_old = the rollout policy
    moved = copy.deepcopy(case.model)
    perturb(moved, 0.02, torch.Generator().manual_seed(4))
    named = params_of(moved)
    code_losses, _ = code_objective(case, moved, gc, old_logp)
    L_hand, parts = hand_objective(moved, case.ref, case.view, case.traj, case.condition, ADV, BETA, kl, KAPPA,
                                   TOP_K, old_pol=case.model, clip_eps=eps)
    # the case is informative: ratios leave 1, and clipping binds on some kept elements, not all
    A = ADV[None, :, None, None]
    clipped = unclipped = 0
    for p in parts:
        W = p["W"][None, :, :, None].expand_as(p["ratio"])
        binds = ((p["ratio"] > 1 + eps) & (A > 0)) | ((p["ratio"] < 1 - eps) & (A < 0))
        clipped += (binds & W).sum().item()
        unclipped += (~binds & W).sum().item()
        assert (p["ratio"][W] - 1).abs().max() > eps
    assert clipped > 0 and unclipped > clipped / 10, (clipped, unclipped)

    hand_losses = torch.stack([-(p["P"] - BETA * p["KL"]) for p in parts])
    table = step_table(code_losses, parts)
    assert torch.allclose(code_losses, hand_losses, rtol=TOL, atol=0), \
        f"per-step loss of the second PPO epoch differs from the hand computation:\n{table}"
    L_code = code_losses.mean()
    assert torch.allclose(L_code, L_hand, rtol=TOL, atol=0)
    assert_grads_match(grads(L_code, named), grads(L_hand, named), named, "∇L, second PPO epoch")
