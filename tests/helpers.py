"""What several test files build: a tiny MAR, a recorded rollout of it, a policy of the MAR family
that is not a MAR; train.py's entry point run in the test's process with its output captured, and
what a run writes read back; where the fixtures are."""

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import torch

import grpo
import mar
import masks
import rollout
import train
from diffloss import DiffLoss

FIXTURES = Path(__file__).resolve().parent / "fixtures"
ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "train.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # for train.py in a subprocess
ADAPTER_PROMPTS = ["a red cube", "a blue ball", "the red ball"]  # in the words of the tiny Harmon's tokenizer


def settings(method="mar-grpo", **changes):
    """The GRPO settings train.py gives --method `method` (its defaults and the method's changes to
    them), with `changes` on top."""
    return dataclasses.replace(train.grpo_settings(train.parse_args(["--method", method])), **changes)


def tiny_mar(**kw):
    """A MAR on 16×16 RGB pixels: 4×4 patches -> 16 tokens of 48 channels."""
    cfg = dict(img_size=16, vae_stride=1, patch_size=4, vae_embed_dim=3, encoder_embed_dim=32, encoder_depth=2,
               encoder_num_heads=4, decoder_embed_dim=32, decoder_depth=2, decoder_num_heads=4, class_num=5,
               buffer_size=4, diffloss_d=2, diffloss_w=32, num_sampling_steps="10", attn_dropout=0.0,
               proj_dropout=0.0, text_vocab_size=9)
    cfg.update(kw)
    torch.manual_seed(0)
    model = mar.build_mar(dict(cfg, norm_eps=1e-6))
    # give the zero-initialised parts of the head some weight so that tests see real functions
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adaLN_modulation" in name or "final_layer.linear" in name:
                p.normal_(0, 0.05)
    return model.eval()


def loss_and_grads(model, record, cond, adv, cfg, trajectories=None):
    """L = −mean_i(P_i − β KL_i) over a record's trained steps, its value and the gradients it leaves."""
    model.zero_grad()
    total = 0.0
    for j in range(len(record.steps)):
        loss, _, _ = grpo.ar_step_loss(model, model, record, j, cond, adv, cfg, trajectories)
        (loss / len(record.steps)).backward()
        total += loss.item() / len(record.steps)
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def step_grad_with_uncertain(model, record, j, cond, adv, cfg, trajectories, uncertain):
    """The loss of AR step j with its M_unc replaced by `uncertain` (B, L): the gradient it leaves,
    flattened over the trained parameters, and the step's stats."""
    model.zero_grad()
    built = masks.uncertainty_mask
    masks.uncertainty_mask = lambda x0, frac: uncertain  # noqa: E731  (the loss's M_unc, replaced)
    try:
        loss, stats, _ = grpo.ar_step_loss(model, model, record, j, cond, adv, cfg, trajectories)
    finally:
        masks.uncertainty_mask = built
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), stats


def make_rollout(model, cfg=2.5, temperature=0.9, ar_steps=(0, 2, 3), diff_steps=(8, 5, 2), seed=0, bsz=4):
    """A recorded rollout of 4 images (2 prompts × G = 2) with CFG."""
    labels = torch.tensor([1, 1, 3, 3][:bsz])
    plan = rollout.RolloutPlan(ar_steps=list(ar_steps), diff_steps=torch.tensor(diff_steps))
    _, record = rollout.record_rollout(model, dict(labels=labels), 5, cfg, "linear", temperature, plan,
                                       torch.Generator().manual_seed(seed))
    return record, dict(labels=labels)


class ToyPolicy(mar.MaskedAR, torch.nn.Module):
    """A model of the MAR family that is not a MAR: a bag-of-tokens encoder with positions and a
    class embedding, and the project's head. It implements the policy interface (and inherits the
    shared generation loop, mar.MaskedAR) and nothing else, to show that the recorder, MTE and the
    loss need nothing more."""

    def __init__(self, L=12, C=6, D=16, classes=4, T=8):
        super().__init__()
        self.seq_len, self.token_embed_dim = L, C
        self.embed = torch.nn.Linear(C, D)
        self.pos = torch.nn.Parameter(torch.randn(L, D) * 0.5)
        self.classes = torch.nn.Embedding(classes, D)
        self.null = torch.nn.Parameter(torch.randn(D) * 0.5)
        self.mix = torch.nn.Linear(2 * D, D)
        self.diffloss = DiffLoss(C, D, depth=1, width=16, num_sampling_steps=T, clip_denoised=True)
        with torch.no_grad():  # the zero-initialised layers of the head get weights, as in tiny_mar
            for name, p in self.diffloss.named_parameters():
                if "adaLN_modulation" in name or "final_layer.linear" in name:
                    p.normal_(0, 0.05)

    def condition(self, labels):
        return self.classes(labels)  # (B, D)

    def null_condition_like(self, cond):
        return self.null.expand(cond.shape)

    def predict_z(self, tokens, mask, cond):
        known = tokens * (1 - mask)[..., None]  # (B, L, C)
        context = self.embed(known).mean(1, keepdim=True) + cond[:, None]  # (B, 1, D)
        return self.mix(torch.cat([self.pos.expand(len(tokens), -1, -1), context.expand(-1, self.seq_len, -1)], -1))

    def ar_schedule(self, num_iter, seq_len):
        return [len(chunk) for chunk in torch.arange(seq_len).chunk(num_iter)]

    def sample_orders(self, bsz, generator=None):
        return torch.argsort(torch.rand(bsz, self.seq_len, generator=generator), dim=1)

    def patchify(self, latents):
        return latents.flatten(2).transpose(1, 2)  # (B, C, 3, 4) -> (B, 12, C)

    def unpatchify(self, tokens):
        return tokens.transpose(1, 2).reshape(len(tokens), self.token_embed_dim, 3, 4)


def cli(capsys, *flags):
    """Run train.py's entry point in-process. Returns (exit status, stdout, stderr)."""
    capsys.readouterr()
    code = train.cli([str(f) for f in flags])
    out, err = capsys.readouterr()
    return code, out, err


def grpo_flags(base, out, *more):
    return ["--preset", "smoke", "--eval-prompts", "0", "--init", base, "--out", out, *more]


def snapshot(folder):
    """path -> (sha1 of the bytes, mtime) of every file under folder."""
    return {str(p.relative_to(folder)): (hashlib.sha1(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
