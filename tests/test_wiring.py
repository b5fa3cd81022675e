"""How train.py wires the objective's pieces together in a GRPO step, pinned against a
re-computation of whole steps from their captured inputs.

test_objective.py pins one trained AR step's loss −(P_i − β KL_i) against a dense hand computation;
this file pins what train.py does around it. `train.cli` runs two GRPO steps in this process at
smoke size: 2 prompts × G = 2 images, 2 trained AR steps (1 and 2, then 1 and 3: the consistency
mask acts), 3 diffusion steps each, guidance w = 3 on the linear schedule, MAR-GRPO's MTE (S = 3,
top 30%) and consistency mask (τ = 0), the Gaussian KL to the base (β = 0.01), weight decay, and a
--max-grad-norm that binds at both steps. Wrapping the module-level functions train.py calls
captures each step's inputs: the rollouts (`rollout.record_rollout`: condition, tokens, record),
the MTE trajectories (`mte.sample_trajectories`), the code's uncertainty mask (`masks.top_k_mask`)
and the rewards (of the reward `registry.build_reward` builds). From those inputs and the base's
parameters alone, this file recomputes each step:

    groups   images gG … gG + G − 1 share prompt g (asserted on the captured prompts)
    A_b      (r_b − mean_g r) / (std_g r + 1e-4), Bessel-corrected std, within each group
    P_i, KL_i  test_objective.hand_objective (dense over all positions, plain tensor ops), with this
             file's copy of the policy and the base, unchanged since the run started, as reference
    L        −mean_i (P_i − β KL_i) over the trained AR steps
    ∇L       autograd of L w.r.t. the trained parameters (all but `class_emb` and the head
             `diffloss.*`); ‖∇L‖ the global 2-norm; ∇L · min(1, M / (‖∇L‖ + 1e-6)), M = --max-grad-norm
             (the 1e-6 is torch.nn.utils.clip_grad_norm_'s)
    update   torch.optim.AdamW(lr, betas (0.9, 0.999), eps 1e-8, weight_decay) on that copy

and compares with what train.py wrote: the trained parameters in ckpt/step_000001.pt and
ckpt/latest.pt (after steps 1 and 2) and metrics.jsonl's adv_abs_mean, loss, policy_term, kl and
pre-clip grad_norm of both steps. It also checks that each step's rollouts were sampled by the
policy of that step (their recorded log-probabilities recompute under this file's policy).

Two steps, because at the first the policy is the reference: the KL and its gradient are exactly 0
and β is invisible. At the second the policy has moved: there β KL ≈ 2e-5 of a logged loss of ≈ 5e-5,
and dropping it moves parameters by up to 2.5e-4 (a quarter of lr). The second step also pins that
the reference stays the base (not the updated policy), that AdamW's state carries over, and that
the step's rollouts come from the updated policy (under the base their ℓ is off by ~1 nat).

The base is the smoke base (conftest.smoke_base, 20 pretraining steps) with weight given to its
head's adaLN modulations and final layer (zero-initialised, still ≤ 8e-4 after pretraining, so μ
hardly depended on z): without that the policy gradient is ~3e-6 and the KL after a step ~1e-10,
and neither clipping nor β shows in anything train.py writes. The reward is the JPEG size
(deterministic, continuous); the shapes verifier often ties within a group at this size (A = 0).

What the parameters cannot show: with the clip binding, summing the per-step losses instead of
averaging them clips to the very same vector; only the logged pre-clip grad_norm shows it.

Tolerances. Parameters: PARAM_TOL = 1e-6 absolute, 1/1000 of lr = 1e-3. AdamW's first step moves
an element by lr · g / (|g| + 1e-8): the clipped gradient's entries are ~1e-8, so Adam's eps
matters (a gradient off by a factor moves the update) and the movement is 0.2 lr at the median, up
to lr. The code and this file agree to 1.2e-7, one float32 ulp of a parameter near 1 (the same
arithmetic summed in different orders). grad_norm: 1e-4 relative (agrees to 3e-6). Advantages:
1e-6 (agree to 6e-8). Loss and policy term: 1e-6 absolute (agree to 2e-8; β KL is 2e-5). KL:
1e-4 relative (agrees to 1e-6). Recorded vs recomputed ℓ: 1e-3 nats (3.6e-6 measured).
"""

import copy
import inspect
import json
import os

import torch

import masks
from models import loading
import mte
import rollout
from scorers import registry
from tests import test_objective as hand
import train

torch.set_num_threads(1)

# The run's settings (passed as flags); the recomputation reads these constants, not train.py's.
SEED = 2            # its trained AR steps: (1, 2) at step 0, (1, 3) at step 1
STEPS, PROMPTS, G = 2, 2, 2
LR, WD, BETA, MAX_NORM = 1e-3, 0.05, 0.01, 1e-5
S, TOP_K, KAPPA = 3, 0.3, 0.0
ADV_EPS, CLIP_EPS = 1e-4, 1e-6  # std + 1e-4 (grpo.py, item 1); ‖∇L‖ + 1e-6 (torch.nn.utils.clip_grad_norm_)
HEAD_INIT = 0.05                # std of the weight given to the head's zero-initialised tensors
PARAM_TOL, LOSS_TOL, ADV_TOL, NORM_RTOL, KL_RTOL = 1e-6, 1e-6, 1e-6, 1e-4, 1e-4
PARITY_TOL = 1e-3               # nats: recorded vs recomputed ℓ of a rollout (~1e-5 when they match)


def flags(base, out):
    return [str(f) for f in (
        "--preset", "smoke", "--eval-prompts", "0", "--init", base, "--out", out, "--device", "cpu", "--seed", SEED,
        "--steps", STEPS, "--save-every", 1, "--keep-last", 0, "--method", "mar-grpo",
        "--prompts-per-step", PROMPTS, "--group-size", G, "--grad-accum", 1, "--train-ar-steps", 2,
        "--train-diff-steps", 3, "--cfg", 3.0, "--cfg-schedule", "linear", "--mte-trajectories", S, "--top-k", TOP_K,
        "--consistency-threshold", KAPPA, "--beta", BETA, "--kl", "gaussian", "--inner-epochs", 1, "--train-cfg", "rollout",
        "--lr", LR, "--weight-decay", WD, "--max-grad-norm", MAX_NORM, "--reward", "jpeg_incompressibility")]


def lively_base(smoke_base, path):
    """The smoke base with N(0, HEAD_INIT²) added to its head's adaLN modulations and final layer
    (seeded), saved as a base of ours at `path`."""
    model = loading.load_checkpoint(str(smoke_base))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("diffloss.") and ("adaLN_modulation" in name or "final_layer" in name):
                p.add_(HEAD_INIT * torch.randn(p.shape, generator=g))
    torch.save({"model": model.state_dict(), "config": model.config, "stage": "pretrain"}, path)
    return path


# -----------------------------------------------------------------------------
# Capturing each step's inputs

def capture(monkeypatch):
    """Wrap what train.py calls; returns the dict the wrappers fill, one entry per call."""
    cap = dict(rollouts=[], trajectories=[], uncertain=[], rewards=[])
    real_record, real_traj, real_topk, real_build = (rollout.record_rollout, mte.sample_trajectories,
                                                      masks.top_k_mask, registry.build_reward)
    signature = inspect.signature(real_record)

    def record_rollout(*a, **k):
        tokens, record = real_record(*a, **k)
        cap["rollouts"].append(dict(inputs=signature.bind(*a, **k).arguments["inputs"], tokens=tokens, record=record))
        return tokens, record

    def sample_trajectories(*a, **k):
        cap["trajectories"].append(real_traj(*a, **k))
        return cap["trajectories"][-1]

    def top_k_mask(*a, **k):
        cap["uncertain"].append(real_topk(*a, **k))
        return cap["uncertain"][-1]

    class Recorded:
        """The reward train.py builds, recording each call's scores and prompts."""

        def __init__(self, inner):
            self.inner = inner

        def __call__(self, images, texts, metas=None):
            scores, info = self.inner(images, texts, metas)
            cap["rewards"].append(dict(scores=scores.clone(), texts=list(texts)))
            return scores, info

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(rollout, "record_rollout", record_rollout)
    monkeypatch.setattr(mte, "sample_trajectories", sample_trajectories)
    monkeypatch.setattr(masks, "top_k_mask", top_k_mask)
    monkeypatch.setattr(registry, "build_reward", lambda *a, **k: Recorded(real_build(*a, **k)))
    return cap


# -----------------------------------------------------------------------------
# The recomputation

def dense_view(record, tokens):
    """A captured Rollout in test_objective's dense layout: final (B, L, C) and one dict per trained
    AR step, the recorded transitions of U_i scattered to their positions (0 / 0 / 1 elsewhere)."""
    L = tokens.shape[1]
    steps = []
    for s in record.steps:
        K, B, n, C = s.x_t.shape
        idx = s.unk_idx[None, :, :, None].expand(K, B, n, C)  # (K, B, n, C)

        def scatter(packed, fill):  # (K, B, n, C) packed on U_i -> (K, B, L, C)
            return torch.full((K, B, L, C), fill, dtype=packed.dtype).scatter(2, idx, packed)
        steps.append(dict(i=s.i, canvas=s.tokens, unknown=s.unknown.bool(), written=s.written.bool(), w=float(s.cfg),
                          k=[int(k) for k in s.diff_steps], x_t=scatter(s.x_t, 0.0), x_prev=scatter(s.x_prev, 0.0),
                          std=scatter(s.std, 1.0), logp=scatter(s.logp, 0.0), preview=s.preview,
                          preview_prev=s.preview_prev))
    return dict(final=tokens, steps=steps)


def hand_advantages(r, group_size):
    """(r − mean) / (std + 1e-4) within each group of `group_size` adjacent images, Bessel std,
    in the rewards' float32."""
    groups = r.float().reshape(-1, group_size)  # (#prompts, G)
    mean = groups.sum(1, keepdim=True) / group_size  # (#prompts, 1)
    std = (((groups - mean) ** 2).sum(1, keepdim=True) / (group_size - 1)).sqrt()  # (#prompts, 1)
    return ((groups - mean) / (std + ADV_EPS)).reshape(-1)  # (B,)


def trained_names(model):
    """MAR-GRPO on the small model trains all but the unused class table and the frozen head."""
    return [n for n, _ in model.named_parameters() if not n.startswith(("class_emb.", "diffloss."))]


def recorded_parity(pol, view, inputs):
    """max |ℓ recomputed under `pol` − ℓ recorded| over the recorded transitions of U_i (nats)."""
    worst = 0.0
    with torch.no_grad():
        for st in view["steps"]:
            logp = hand.hand_logp(st["x_prev"], hand.hand_mu(pol, st, inputs, st["x_t"]), st["std"])  # (K, B, L, C)
            U = st["unknown"][None, :, :, None].expand_as(logp)  # (K, B, L, C)
            worst = max(worst, (logp - st["logp"])[U].abs().max().item())
    return worst


def hand_step(pol, ref, named, opt, captured, traj, r):
    """One GRPO step of `pol` (updated in place by `opt`) from its captured inputs. Returns what the
    step should log, and the pieces for the checks."""
    inputs, record, tokens = captured["inputs"], captured["record"], captured["tokens"]
    B = tokens.shape[0]
    ids = inputs["prompt_ids"]  # (B, words)
    for g in range(B // G):  # each prompt's G images are adjacent, and the groups' prompts differ
        assert (ids[g * G:(g + 1) * G] == ids[g * G]).all()
        assert all(not torch.equal(ids[g * G], ids[h * G]) for h in range(g))
    adv = hand_advantages(r, G)  # (B,)
    view = dense_view(record, tokens)
    traj_view = {key: traj[key] for key in ("x_t", "x_prev", "std", "x0")}  # (S, K, B, L, C); x0 (S, B, L, C)
    parity = recorded_parity(pol, view, inputs)

    _, parts = hand.hand_objective(pol, ref, view, traj_view, inputs, adv, BETA, "gaussian", KAPPA, TOP_K)
    per_step = torch.stack([-(p["P"] - BETA * p["KL"]) for p in parts])  # (#trained AR steps,)
    loss = per_step.mean()  # L = −mean_i (P_i − β KL_i)
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    assert all(g is not None for g in grads), "a trained parameter the loss does not read"
    norm = torch.cat([g.flatten() for g in grads]).norm().item()
    coef = min(1.0, MAX_NORM / (norm + CLIP_EPS))
    for (_, p), g in zip(named, grads):
        p.grad = g * coef
    opt.step()
    opt.zero_grad(set_to_none=True)
    return dict(adv=adv, parts=parts, view=view, parity=parity, coef=coef, loss=loss.item(), grad_norm=norm,
                policy_term=torch.stack([p["P"] for p in parts]).mean().item(),
                kl=torch.stack([p["KL"] for p in parts]).mean().item())


# -----------------------------------------------------------------------------

def test_grpo_steps_are_wired_as_the_objective_says(smoke_base, tmp_path, monkeypatch):
    """Two GRPO steps of train.py equal the steps this test recomputes from their captured inputs:
    advantages within prompt groups, the per-step losses averaged, the KL to the frozen base, the
    global gradient norm clipped, one AdamW step each; checkpoints and metrics.jsonl say so."""
    init, out = lively_base(smoke_base, tmp_path / "base.pt"), tmp_path / "run"
    argv = flags(init, out)
    base = loading.load_policy(train.parse_args(argv), str(init)).requires_grad_(False)  # the reference
    base_before = {n: p.detach().clone() for n, p in base.named_parameters()}
    pol = copy.deepcopy(base)  # this file's policy
    names = trained_names(pol)
    for n, p in pol.named_parameters():
        p.requires_grad_(n in names)
    named = [(n, p) for n, p in pol.named_parameters() if n in names]
    opt = torch.optim.AdamW([p for _, p in named], lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD)

    cap = capture(monkeypatch)
    assert train.cli(argv) == 0
    monkeypatch.undo()
    per = len(cap["uncertain"]) // STEPS  # the loss builds M_unc at every trained AR step of every inner epoch
    assert {k: len(v) for k, v in cap.items()} == dict(rollouts=STEPS, trajectories=STEPS, uncertain=STEPS * per,
                                                      rewards=STEPS) and per >= 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(STEPS))
    ckpts = [out / "ckpt" / f"step_{s + 1:06d}.pt" for s in range(STEPS - 1)] + [out / "ckpt" / "latest.pt"]

    for step in range(STEPS):
        before = {n: p.detach().clone() for n, p in named}
        mine = hand_step(pol, base, named, opt, cap["rollouts"][step], cap["trajectories"][step],
                         cap["rewards"][step]["scores"])
        row, view, parts = rows[step], mine["view"], mine["parts"]
        what = f"GRPO step {step}"

        # the step is as rich as intended: guidance, both masks and the clip act, the KL from step 1
        assert len(view["steps"]) == 2 and all(st["w"] != 1.0 for st in view["steps"])
        assert any((p["U"] & ~p["W"]).any() for p in parts), "the consistency mask drops nothing"
        assert all(p["M"].any() and (p["U"] & ~p["M"]).any() for p in parts), "MTE everywhere or nowhere"
        assert mine["adv"].abs().min() > 0.1, mine["adv"]
        assert mine["coef"] < 0.5, f"{what}: the clip hardly binds (‖∇L‖ = {mine['grad_norm']:.3g})"
        assert (mine["kl"] > 1e-4) == (step > 0), mine["kl"]
        # the inputs: the code's uncertainty mask is the hand one, the rollout came from this policy
        hand_mask = hand.hand_uncertain(cap["trajectories"][step]["x0"], TOP_K)
        assert all(torch.equal(m, hand_mask) for m in cap["uncertain"][step * per:(step + 1) * per])
        assert mine["parity"] < PARITY_TOL, f"{what}: the rollout was not sampled by the policy of this step"

        # metrics.jsonl
        for key, rtol, atol in (("adv_abs_mean", 0, ADV_TOL), ("grad_norm", NORM_RTOL, 0), ("loss", 0, LOSS_TOL),
                                ("policy_term", 0, LOSS_TOL), ("kl", KL_RTOL, 1e-12)):
            value = mine["adv"].abs().mean().item() if key == "adv_abs_mean" else mine[key]
            torch.testing.assert_close(row[key], value, rtol=rtol, atol=atol,
                                       msg=lambda m: f"{what}: metrics.jsonl's {key} is not the recomputed one\n{m}")

        # the checkpoint: the trained parameters only, over the base, equal to this file's
        ck = torch.load(ckpts[step], map_location="cpu", weights_only=True)
        assert sorted(ck["model"]) == sorted(names) and ck["base"] == os.path.abspath(init)
        moved = min((p.detach() - before[n]).abs().max().item() for n, p in named)
        assert moved > 100 * PARAM_TOL, f"{what}: some parameter tensor hardly moved ({moved:.3g})"
        diff = {n: (ck["model"][n].float() - p.detach()).abs().max().item() for n, p in named}
        worst = sorted(diff, key=diff.get, reverse=True)[:4]
        print(f"{what}: |Δθ| ≥ {moved:.3g} per tensor, train.py − test ≤ {diff[worst[0]]:.3g} ({worst[0]}); "
              f"‖∇L‖ {mine['grad_norm']:.4g} (clip × {mine['coef']:.3g}); loss {mine['loss']:.6g} "
              f"(β KL {BETA * mine['kl']:.3g}); parity {mine['parity']:.3g}; metrics − test: "
              + ", ".join(f"{k} {row[k] - (mine['adv'].abs().mean().item() if k == 'adv_abs_mean' else mine[k]):.2g}"
                          for k in ("adv_abs_mean", "grad_norm", "loss", "policy_term", "kl")))
        assert diff[worst[0]] <= PARAM_TOL, (f"{what}: train.py's parameters differ from the recomputed ones: "
                                             + ", ".join(f"{n} {diff[n]:.3g}" for n in worst))

    # the reference is untouched (the recomputation used it as the base of the whole run)
    assert all(torch.equal(p, base_before[n]) for n, p in base.named_parameters())
