"""The controlled study of docs/study.md and the probes of docs/demo.md and docs/research_log.md:
experiments that run train.py many times or look inside a base model, not performance figures
(those are bench.py's).

    python experiments/study.py --study sweep         # the learning rate: grpo-fixed-head at SWEEP_LRS
    python experiments/study.py --study main          # MAIN_ARMS × 3 seeds, 150 steps, evaluated at 50/100/150
    python experiments/study.py --study hack          # 3 arms trained on a hackable proxy (HACK_REWARD), 100 steps
    python experiments/study.py --study components    # COMPONENT_ARMS, one seed, 50 steps (against main's step 50)
        [--study-out runs/study] [--study-lr 1e-4] [--study-seeds N] [--study-steps N] [--report-only]
        [--study-train-flags "..."] [train.py flags for every run]
    python experiments/study.py --context-probe bases/demo.pt    # does a base model use its canvas? (in the preset's world)
    python experiments/study.py --noise-probe bases/demo.pt      # where does a rollout's randomness decide the image?

docs/study.md ran with `--preset free16` (its base: experiments/bases/free16.pt).
A table: GRPO runs from the preset's base (the demo's shipped bases/demo.pt; a preset without one
pretrains a base into --study-out) on the four STUDY_PROMPTS, each run's checkpoints at the table's
steps evaluated with fixed seeds on the stratified held-out prompts and on the study prompts × 24
images (the base once, the same way). Runs go two at a time with one thread each; finished runs and
evaluations are skipped and an interrupted run resumes from its last checkpoint, so an interrupted
table continues where it stopped. It ends by writing
<table>.json, <table>.md and <table>.png into --study-out.
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # a plain script beside the reference: import its top-level modules

import evaluate  # noqa: E402
import flags  # noqa: E402
import mar  # noqa: E402
import models  # noqa: E402
import processes  # noqa: E402
import rewards  # noqa: E402
import rollout  # noqa: E402
import shapes  # noqa: E402
import train  # noqa: E402
import verifier  # noqa: E402
from diffloss import reverse_sample  # noqa: E402
from prompts import Prompts  # noqa: E402

# The previous demo's base, the base of docs/study.md (preset free16): free object sizes and
# positions, clean captions; 8000 steps, then 8000 more at half the learning rate on new data draws
# (43 and 66 minutes on 2 CPU cores, torch 2.14):
#     python experiments/study.py --train --preset free16 --stage pretrain --out runs/free_base --threads 2
#     python experiments/study.py --train --preset free16 --stage pretrain --out runs/free_base2 \
#         --pretrain-from runs/free_base/base.pt --pretrain-lr 5e-4 --seed 1
#     python checkpoints.py half runs/free_base2/base.pt experiments/bases/free16.pt
FREE16_BASE = os.path.join(REPO, "experiments", "bases", "free16.pt")
FREE16_BASE_SHA256 = "a60207e9f2a68321a025568539d959753f182ded1fbbd46c7c83627d96cd36ee"
# train.py's presets for the study's runs (`--train` runs train.py with them registered): the previous
# demo, free object sizes and positions, clean captions, CFG 6, τ 0.5, lr 1e-5
PRESETS = {"free16": dict(init=FREE16_BASE, img_size=16, patch_size=2, local_conv=3, pretrain_steps=8000, num_iter=16,
                          min_diff_step=2, lr=1e-5, cfg=6.0)}
flags.PRESETS.update(PRESETS)


class ShapesCoverageReward(rewards.ShapesReward):
    """A deliberately hackable proxy of the shapes world, for the reward-hacking study (docs/study.md):
    the mean, over the colours the prompt asks for, of the fraction of pixels of that colour,

        r = 1/|C| sum_{c in C} #{pixels nearest to colour c} / (H W),   C = the prompt's colours,

    pixels assigned to the nearest of black and the palette as the verifier does. It rises with
    the right colours on the canvas, so it correlates with the verifier's score, but it pays more
    for more paint: large blobs score higher than the asked shapes, counts and sizes."""

    name = "shapes_coverage"

    def score(self, images, prompts, metadata):
        classes = self.verifier.nearest_colour(images.cpu().permute(0, 2, 3, 1).numpy())  # (B, H, W), 0 = black
        names = list(self.shapes.COLORS)  # colour k is class k + 1
        scores = []
        for b, meta in enumerate(self.metas(prompts, metadata)):
            asked = sorted({names.index(o["color"]) + 1 for o in meta["objects"]})
            scores.append(float(np.mean([(classes[b] == k).mean() for k in asked])))
        return torch.tensor(scores, dtype=torch.float32), {}


rewards.REWARDS["shapes_coverage"] = (ShapesCoverageReward, (), set())  # --reward shapes_coverage in the study's runs

# The study (docs/study.md): GRPO from the demo's shipped base on four fixed training prompts, one
# per category, 4 prompts × G = 4 images a step, one thread per run, two runs at a time; every
# arm's seed s draws the same prompts and noise. Four tables, one command each:
#     python experiments/study.py --study sweep|main|hack|components
STUDY_PROMPTS = ["a red square", "a green circle and a yellow square", "three red circles",
                 "a blue square left of a green circle"]
STUDY_RUN = ["--prompts-per-step", "4", "--group-size", "4", "--keep-last", "0", "--save-every", "50"]
SWEEP_LRS = ["3e-5", "1e-4", "3e-4"]
STUDY_LR = "3e-5"  # the sweep's choice: the fixed head's training reward rises at 3e-5, falls at 1e-4 (docs/study.md)
HACK_LR = "1e-4"   # the proxy runs: fast enough that the policy moves (KL ~1e-2 after 60 steps in the sweep)
HACK_REWARD = "shapes_coverage:1,shapes:0"  # train on the proxy; the verifier (weight 0) is only logged

MAIN_ARMS = {  # arm -> train.py flags
    "grpo": ["--method", "grpo"],
    "grpo-fixed-head": ["--method", "grpo-fixed-head"],
    "mar-grpo": ["--method", "mar-grpo", "--mte-positions", "unknown"],
    "mar-grpo, MTE on P_i": ["--method", "mar-grpo", "--mte-positions", "predicted"],
}
COMPONENT_ARMS = {  # against mar-grpo (S = 3, k = 30%, τ = 0, MTE on U_i); S = 1 is the masks without MTE
    "MTE alone (S=3 on all tokens, no mask)": ["--method", "grpo-fixed-head", "--mte-seeds", "3", "--top-k", "1",
                                               "--mte-positions", "unknown"],
    "mar-grpo S=1 (consistency mask alone)": ["--method", "grpo-fixed-head", "--tau", "0"],
    "mar-grpo S=5": ["--method", "mar-grpo", "--mte-seeds", "5", "--mte-positions", "unknown"],
    "mar-grpo k=10%": ["--method", "mar-grpo", "--top-k", "0.1", "--mte-positions", "unknown"],
    "mar-grpo k=60%": ["--method", "mar-grpo", "--top-k", "0.6", "--mte-positions", "unknown"],
    "mar-grpo tau off": ["--method", "mar-grpo", "--tau", "off", "--mte-positions", "unknown"],
}
# table -> its arms, seeds per arm, GRPO steps, checkpoints evaluated, learning rate (None: the
# arm's own), training reward (None: the preset's verifier)
TABLES = {
    "sweep": dict(arms={f"grpo-fixed-head lr{lr}": ["--method", "grpo-fixed-head", "--lr", lr] for lr in SWEEP_LRS},
                  seeds=1, steps=60, evals=(), lr=None, reward=None),
    "main": dict(arms=MAIN_ARMS, seeds=3, steps=150, evals=(50, 100, 150), lr=STUDY_LR, reward=None),
    "hack": dict(arms={k: MAIN_ARMS[k] for k in ("grpo", "grpo-fixed-head", "mar-grpo")}, seeds=1, steps=100,
                 evals=(50, 100), lr=HACK_LR, reward=HACK_REWARD),
    "components": dict(arms=COMPONENT_ARMS, seeds=1, steps=50, evals=(50,), lr=STUDY_LR, reward=None),
}


def _coloured(tokens):
    """(..., C) pixel tokens in [-1, 1] -> (...) 1.0 where some pixel is not black (black is -1)."""
    return (tokens > -0.5).any(-1).float()


@torch.no_grad()
def context_probe(model, codec, n_images=128, known_fracs=(0.0, 0.5, 0.9), temperature=0.5, seed=0, cell=0):
    """Does a pixel-token base model use the canvas? Rendered training-split images with a random
    fraction of their tokens known: the diffusion loss on the unknown tokens (split into tokens
    with some colour and all-black ones), and how often a token sampled there (no CFG) is coloured
    where the image is black or the reverse. A model that reads its neighbours gets better as more
    of the canvas is known; one that has learnt only the prompt's marginal does not. cell: the
    base's world (shapes.render: 0 free objects, or objects aligned to cells of this many pixels).

    Returns {known_frac: {"loss_coloured", "loss_black", "colour_error"}}, "coloured_frac" and "n_images"."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    imgs, metas = shapes.make_dataset(n_images, model.img_size, np.random.default_rng(seed), split="train", cell=cell)
    tokens = model.patchify(codec.encode(torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 255))  # (B, L, C)
    B, L, C = tokens.shape
    flat = tokens.reshape(B * L, C)
    coloured = _coloured(tokens)  # (B, L)
    cond = model.condition(**Prompts("shapes").condition(metas, tokens.device))
    order = torch.argsort(torch.rand(B, L, generator=g), dim=1)  # the same known positions for every fraction

    def loss(z, sel):  # the training loss on the selected positions (B, L), averaged over 10 noise draws
        return float(np.mean([model.diffloss(z=z, target=flat, mask=sel.reshape(B * L), generator=g).item()
                              for _ in range(10)]))

    res = {"coloured_frac": coloured.mean().item(), "n_images": n_images}
    for frac in known_fracs:
        unknown = torch.ones(B, L).scatter_(1, order[:, :int(L * frac)], 0.0)  # (B, L), 1 = unknown
        z = model.predict_z(tokens, unknown, cond).reshape(B * L, -1)  # (B·L, D)
        sampled = model.diffloss.sample(z, temperature=temperature, generator=g).reshape(B, L, C)
        wrong = (_coloured(sampled) != coloured).float()  # (B, L)
        res[frac] = dict(loss_coloured=loss(z, unknown * coloured), loss_black=loss(z, unknown * (1 - coloured)),
                         colour_error=((wrong * unknown).sum() / unknown.sum()).item())
    return res


def linear_probe(model, codec, known_frac=0.9, n_images=256, seed=0, cell=0):
    """Does z at a hidden position know whether that token is coloured? A logistic regression from
    z (standardised) to "this token has colour", fitted on the hidden tokens of n_images rendered
    training-split images with `known_frac` of their tokens known, tested on the hidden tokens of
    n_images others (rendered in the world of `cell`, as context_probe). Returns (test accuracy, the
    majority-class base rate of the test tokens)."""
    sets = []
    for part in (seed, seed + 1):  # fit, test
        imgs, metas = shapes.make_dataset(n_images, model.img_size, np.random.default_rng([part, 13]), split="train",
                                          cell=cell)
        tokens = model.patchify(codec.encode(torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 255))  # (B, L, C)
        B, L, _ = tokens.shape
        order = torch.argsort(torch.rand(B, L, generator=torch.Generator().manual_seed(part)), dim=1)
        unknown = torch.ones(B, L).scatter_(1, order[:, :round(L * known_frac)], 0.0)  # (B, L), 1 = hidden
        with torch.no_grad():
            z = model.predict_z(tokens, unknown, model.condition(**Prompts("shapes").condition(metas, tokens.device)))
        hidden = unknown.bool()
        sets.append((z[hidden], _coloured(tokens)[hidden]))  # (N, D), (N,)
    (x_fit, y_fit), (x_test, y_test) = sets
    mu, sd = x_fit.mean(0), x_fit.std(0) + 1e-6
    w = torch.zeros(x_fit.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=200)

    def closure():
        opt.zero_grad()
        logits = (x_fit - mu) / sd @ w + b
        loss = F.binary_cross_entropy_with_logits(logits, y_fit) + 1e-3 * (w ** 2).sum()
        loss.backward()
        return loss
    opt.step(closure)
    with torch.no_grad():
        accuracy = ((((x_test - mu) / sd @ w + b) > 0).float() == y_test).float().mean().item()
    return accuracy, max(y_test.mean().item(), 1 - y_test.mean().item())


def _token_colours(tokens, patch_size):
    """(N, 3·p²) pixel tokens in [-1, 1] (channel-major, as MAR.patchify) -> (N, p²) palette index
    of each pixel (verifier.nearest_colour: 0 = black)."""
    pixels = ((tokens.reshape(len(tokens), 3, patch_size ** 2).transpose(1, 2) + 1) / 2).clamp(0, 1)  # (N, p², 3)
    return torch.as_tensor(verifier.nearest_colour(pixels.numpy()))


@torch.no_grad()
def noise_probe(model, codec, reward_fn, num_iter=16, cfg=6.0, temperature=0.5, n_prompts=16, group=12, seed=0):
    """Where does a rollout's randomness decide the image? A rollout has two sources: the random
    generation order (not an action of the policy: no log-probability is taken of it) and the
    head's noise (the actions whose log-probabilities the policy gradient uses). For `n_prompts`
    training-split prompts × `group` images (a GRPO group each):
      - reward variance within a group with every image's order drawn afresh, and with one order
        shared by the group (then only the head's noise differs): their ratio is the share of the
        reward's variance that the policy's actions carry;
      - for each token, z as the rollout generated it; the head is run again from z with the
        same noise except at one diffusion step k (or all of it, x^T too): how often the token's
        colour (any pixel's nearest palette colour) changes, per k, and per AR step of the token.
    Returns {"reward_var_free_order", "reward_var_fixed_order", "share_of_head_noise",
    "flip_at_step": {k: fraction}, "flip_all": fraction, "flip_by_ar_step": [fraction per AR step]}."""
    model.eval()
    items = [m for m in shapes.sample_prompts(n_prompts, np.random.default_rng([seed, 21])) for _ in range(group)]
    prompts = Prompts("shapes")
    inputs, texts = prompts.condition(items, "cpu"), prompts.texts(items)
    B, L = len(items), model.seq_len
    free = model.sample_orders(B, torch.Generator().manual_seed(seed))  # (B, L)
    fixed = free[::group].repeat_interleave(group, 0)  # (B, L): one order per group

    def group_rewards(orders):  # (n_prompts, group) rewards of one rollout with these orders
        tokens, record = rollout.record_rollout(model, inputs, num_iter, cfg, "linear", temperature,
                                                generator=torch.Generator().manual_seed(seed + 1), orders=orders)
        images = codec.decode(model.unpatchify(tokens).float())
        return reward_fn(images, texts, items)[0].reshape(n_prompts, group), record

    r_fixed, _ = group_rewards(fixed)
    r_free, record = group_rewards(free)
    var_free, var_fixed = r_free.var(1).mean().item(), r_fixed.var(1).mean().item()
    res = dict(reward_var_free_order=var_free, reward_var_fixed_order=var_fixed,
               share_of_head_noise=var_fixed / max(var_free, 1e-12))

    # the head's decisions: replay each token's sampling from the z it was generated from
    head, p = model.diffloss, model.patch_size
    D, C = record.z_final.shape[-1], model.token_embed_dim
    z = record.z_final.reshape(B * L, D)  # (BL, D)
    if record.z_final_null is not None:  # with guidance: (2BL, D) = [cond; null]
        z = torch.cat([z, record.z_final_null.reshape(B * L, D)])
    w = record.cfg_final.reshape(B * L)  # (BL,)
    g = torch.Generator().manual_seed(seed + 2)
    draw = lambda: torch.randn(B * L, C, generator=g)  # noqa: E731
    x_T, noise = draw(), {k: draw() for k in range(1, head.num_sampling_steps)}
    ref = _token_colours(reverse_sample(head, z, C, temperature, w, x_T=x_T, noise=noise), p)  # (BL, p²)
    res["flip_at_step"] = {}
    for k in sorted(noise, reverse=True):
        changed = _token_colours(reverse_sample(head, z, C, temperature, w, x_T=x_T, noise={**noise, k: draw()}), p)
        res["flip_at_step"][k] = (changed != ref).any(1).float().mean().item()
    flips = (_token_colours(reverse_sample(head, z, C, temperature, w, x_T=draw(), noise={k: draw() for k in noise}), p)
             != ref).any(1).float().reshape(B, L)  # (B, L)
    res["flip_all"] = flips.mean().item()
    counts = model.ar_schedule(num_iter, L)
    ar_step = torch.repeat_interleave(torch.arange(len(counts)), torch.as_tensor(counts))  # (L,) step of the j-th generated
    step_of = torch.empty(B, L, dtype=torch.long).scatter_(1, record.orders, ar_step.expand(B, L))  # (B, L)
    res["flip_by_ar_step"] = [flips[step_of == i].mean().item() for i in range(len(counts))]
    return res


def _load_pixel_base(path, args, flag):
    """The base a probe looks into: train.py's small model (pixel tokens, prompt-conditioned), or exit
    naming the flag."""
    model = models.load_policy(args, path, flag)
    if model.config["vae_stride"] != 1 or model.config.get("text_vocab_size", 0) == 0:
        raise ValueError(f"{flag} {path}: needs a prompt-conditioned pixel-token base (train.py's small model)")
    return model


def run_noise_probe(path, args, out):
    model = _load_pixel_base(path, args, "--noise-probe")
    res = noise_probe(model, mar.PixelCodec(), rewards.build_reward("shapes"),
                      args.num_iter, args.cfg, args.temperature)
    out(f"noise probe of {path} (CFG {args.cfg:g}, τ {args.temperature:g}, {args.num_iter} AR steps)")
    out(f"  reward variance within a group: orders drawn per image {res['reward_var_free_order']:.4f}, one order per "
        f"group {res['reward_var_fixed_order']:.4f}: the head's noise carries {res['share_of_head_noise']:.0%} of it")
    out("  a token's colour changes when the head's noise is redrawn at one diffusion step k (other noise kept):")
    out("    " + "  ".join(f"k={k}: {v:.1%}" for k, v in res["flip_at_step"].items()))
    out(f"  ... at every step: {res['flip_all']:.1%}; by the token's AR step: "
        + " ".join(f"{v:.0%}" for v in res["flip_by_ar_step"]))
    return res


def run_context_probe(path, args, out):
    model = _load_pixel_base(path, args, "--context-probe")
    res = context_probe(model, mar.PixelCodec(), temperature=args.temperature, cell=args.cell)
    out(f"context probe of {path}: {res['n_images']} training-split images" + (f" in {args.cell}-px cells" if args.cell else "")
        + f", τ {args.temperature:g}, {res['coloured_frac']:.1%} of tokens coloured")
    out("  known fraction | diffusion loss, coloured / black unknown tokens | colour error of sampled unknown tokens")
    for frac, r in res.items():
        if isinstance(frac, float):
            out(f"  {frac:14.1f} | {r['loss_coloured']:.4f} / {r['loss_black']:.4f} | {r['colour_error']:.3f}")
    for frac in (0.5, 0.9):
        res[f"linear_probe_{frac}"] = accuracy, base_rate = linear_probe(model, mar.PixelCodec(), frac, cell=args.cell)
        out(f"linear probe z -> coloured at the hidden tokens, {frac:.0%} known: accuracy {accuracy:.3f} "
            f"(base rate {base_rate:.3f})")
    return res


def _slug(arm):
    """A folder name for an arm: 'mar-grpo, MTE on P_i' -> 'mar-grpo_MTE_on_P_i'."""
    return re.sub(r"[^A-Za-z0-9.=%-]+", "_", arm).strip("_")


def _tables(text):
    """'main,hack' -> ['main', 'hack'] (argparse type of --study)."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in TABLES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{bad or text!r}: choose tables from {', '.join(TABLES)}")
    return names


def _table(opts, name):
    """Table `name`'s spec, with --study-arms / --study-seeds / --study-steps / --study-lr (tables on STUDY_LR) applied."""
    spec = dict(TABLES[name])
    spec["seeds"] = opts.study_seeds or spec["seeds"]
    spec["steps"] = opts.study_steps or spec["steps"]
    if opts.study_arms:  # folder names (_slug) of the arms to keep
        keep = opts.study_arms.split(",")
        spec["arms"] = {arm: arm_flags for arm, arm_flags in spec["arms"].items() if _slug(arm) in keep}
    if spec["lr"] == STUDY_LR and opts.study_lr:
        spec["lr"] = opts.study_lr
    spec["evals"] = tuple(k for k in spec["evals"] if k <= spec["steps"]) or (() if not spec["evals"] else (spec["steps"],))
    return spec


def _run_dir(root, table, arm, seed):
    return os.path.join(root, table, _slug(arm), f"seed{seed}")


def study(opts, extra):
    """Run the tables of --study (TABLES), in one queue: every arm × seed a GRPO run from the base, then for each
    evaluated checkpoint two evaluations with fixed seeds (the stratified held-out prompts, and the
    four study prompts × 24 images); the base is evaluated the same way once. Two processes at a
    time with one thread each; finished runs and evaluations are skipped, so an interrupted table
    continues where it stopped. Ends with study_report of each table. `extra` flags go to every
    train.py call, --study-train-flags only to the GRPO runs."""
    root = opts.study_out
    extra = ["--preset", opts.preset] + extra
    os.makedirs(root, exist_ok=True)
    prompt_file = os.path.join(root, "prompts.txt")
    with open(prompt_file, "w") as f:
        f.write("\n".join(STUDY_PROMPTS) + "\n")
    py = [sys.executable, os.path.abspath(__file__), "--train"]  # train.py, with this file's presets
    base = flags.PRESETS[opts.preset].get("init") or os.path.join(root, "base.pt")
    if not os.path.exists(base):  # a preset without a shipped base: pretrain one into the study's folder
        res = subprocess.run(py + ["--stage", "pretrain", "--out", root] + extra, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        if res.returncode:
            raise processes.Stop(f"study: pretraining its base failed: {_reason(res.stderr)}")

    def evals(ckpt, out, k):  # held-out prompts (stratified), then the study's prompts × 24 images
        cmds = []
        for name, more in ((f"eval_{k}", []), (f"eval_train_{k}", ["--prompts", prompt_file, "--eval-images-per-prompt", "24"])):
            if not os.path.exists(os.path.join(out, name, "summary.json")):
                cmds.append(py + ["--eval-only", "--init", ckpt, "--out", os.path.join(out, name), "--threads", "1"]
                            + extra + more)
        return cmds

    def shell(cmds):
        return " && ".join(" ".join(shlex.quote(str(c)) for c in cmd) for cmd in cmds)

    jobs = []  # (table, arm, seed, shell command)
    base_cmds = evals(base, os.path.join(root, "base"), 0)
    if base_cmds and any(_table(opts, name)["evals"] for name in opts.study):
        jobs.append(("base", "base", 0, shell(base_cmds)))
    for name in opts.study:
        spec = _table(opts, name)
        train_flags = ["--prompts", prompt_file, "--steps", str(spec["steps"])] + STUDY_RUN
        train_flags += ["--lr", spec["lr"]] if spec["lr"] else []
        train_flags += ["--reward", spec["reward"]] if spec["reward"] else []
        for arm, arm_flags in spec["arms"].items():
            for seed in range(spec["seeds"]):
                out = _run_dir(root, name, arm, seed)
                cmds = []
                if not os.path.exists(os.path.join(out, "ckpt", f"step_{spec['steps']:06d}.pt")):
                    cmds.append(py + ["--stage", "grpo", "--init", base, "--out", out, "--seed", str(seed),
                                      "--threads", "1", "--resume", "auto"] + extra + train_flags + arm_flags + opts.study_train_flags.split())
                for k in spec["evals"]:
                    cmds += evals(os.path.join(out, "ckpt", f"step_{k:06d}.pt"), out, k)
                if cmds:
                    jobs.append((name, arm, seed, shell(cmds)))
    running, failed = [], []  # (process, its log, what it runs)
    while jobs or running:
        while jobs and len(running) < 2:
            name, arm, seed, cmd = jobs.pop(0)
            print(f"study {name}: {arm} seed {seed}", flush=True)
            path = os.path.join(root, f"log_{name}_{_slug(arm)}_{seed}.txt")
            with open(path, "w") as log:
                running.append((subprocess.Popen(cmd, shell=True, stdout=log, stderr=subprocess.STDOUT,
                                                 env=dict(os.environ, OMP_NUM_THREADS="1")), path, f"{name}: {arm} seed {seed}"))
        time.sleep(2)
        for job in [job for job in running if job[0].poll() is not None]:
            if job[0].returncode:
                failed.append(job)
                print(f"study: {job[2]} failed: {_reason(open(job[1]).read())}", flush=True)
            running.remove(job)
    if failed:
        raise processes.Stop(f"study: {len(failed)} run(s) failed, the first ({failed[0][2]}): "
                             f"{_reason(open(failed[0][1]).read())} (log: {failed[0][1]})")
    return {name: study_report(opts, name) for name in opts.study}


def _reason(output):
    """The one-line reason a train.py run gave (its last `error...` line), or its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error")]
    return (errors or lines or ["no output"])[-1]


def _ends(values, n=10):
    """Mean of the first and of the last n values (n at most a fifth of them)."""
    n = max(1, min(n, len(values) // 5))
    return float(np.mean(values[:n])), float(np.mean(values[-n:]))


def run_record(out, steps, evals):
    """One finished run's figures: training reward (and, under a proxy, the logged verifier score)
    at the start and the end, accuracies at the evaluated checkpoints, the gradient norm's mean,
    std/mean and max over steps, KL and within-group diversity at the end, seconds per step.
    Returns (record, per-step rows), or None if the run or an evaluation has not finished."""
    if not os.path.exists(os.path.join(out, "ckpt", f"step_{steps:06d}.pt")):
        return None
    try:
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        ev = {k: (json.load(open(os.path.join(out, f"eval_{k}", "summary.json"))),
                  json.load(open(os.path.join(out, f"eval_train_{k}", "summary.json")))) for k in evals}
    except (OSError, ValueError):
        return None
    grad = np.array([r["grad_norm"] for r in rows])
    rec = dict(zip(("reward_first", "reward_last"), _ends([r["reward_mean"] for r in rows])))
    if "reward/shapes_coverage" in rows[0]:
        rec.update(zip(("verifier_first", "verifier_last"), _ends([r["reward/shapes"] for r in rows])))
    for k, (held, trn) in ev.items():
        rec[f"train_acc@{k}"], rec[f"heldout_acc@{k}"] = trn["accuracy"], held["accuracy"]
    rec.update(grad_norm_mean=float(grad.mean()), grad_norm_cv=float(grad.std() / grad.mean()),
               grad_norm_max=float(grad.max()), kl_last=_ends([r["kl"] for r in rows])[1],
               diversity_last=_ends([r["diversity"] for r in rows])[1],
               step_s=float(np.mean([r["t_rollout"] + r["t_reward"] + r["t_update"] for r in rows])))
    return rec, rows


def _smooth(x, w=10):
    """Trailing moving average over w steps (shorter at the start)."""
    c = np.cumsum(np.insert(np.asarray(x, dtype=float), 0, 0.0))
    i = np.arange(1, len(x) + 1)
    return (c[i] - c[np.maximum(i - w, 0)]) / np.minimum(i, w)


def sample_grid(root, name, spec, path, per_prompt=2):
    """Rows of `per_prompt` evaluation images of each study prompt (the same seeds in every row):
    the base, then every arm's seed 0 at the table's last evaluated checkpoint. Returns the row labels."""
    from PIL import Image
    k = spec["evals"][-1]
    rows = [("base (no RL)", os.path.join(root, "base", "eval_train_0"))]
    rows += [(f"{arm}, step {k}", os.path.join(_run_dir(root, name, arm, 0), f"eval_train_{k}")) for arm in spec["arms"]]
    images, captions, labels = [], [], []
    for label, folder in rows:
        try:
            results = [json.loads(line) for line in open(os.path.join(folder, "results.jsonl"))]
        except OSError:
            continue
        per = len(results) // len(STUDY_PROMPTS)  # the images of a prompt are consecutive
        for r in [results[i * per + j] for i in range(len(STUDY_PROMPTS)) for j in range(per_prompt)]:
            img = np.array(Image.open(os.path.join(folder, r["file"])).convert("RGB"))
            images.append(torch.from_numpy(img).permute(2, 0, 1).float() / 255)  # (3, H, W)
            captions.append(("[ok] " if r["details"]["correct"] else "") + r["prompt"])
        labels.append(label)
    if images:
        evaluate.save_grid(torch.stack(images), captions, path)
    return labels


def study_report(opts, name):
    """Aggregate one table's finished runs into <table>.json, <table>.md and <table>.png in
    --study-out: per arm, mean ± std over seeds of run_record's figures; curves of the training
    reward (and the verifier under a proxy) and the gradient norm, mean over seeds with a ±std band,
    and accuracy at the evaluated checkpoints against the base's."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    root, spec = opts.study_out, _table(opts, name)
    records, curves = {}, {}
    for arm in spec["arms"]:
        for seed in range(spec["seeds"]):
            got = run_record(_run_dir(root, name, arm, seed), spec["steps"], spec["evals"])
            if got:
                records.setdefault(arm, []).append(got[0])
                curves.setdefault(arm, []).append(got[1])
    base = {}
    try:
        held, trn = (json.load(open(os.path.join(root, "base", n, "summary.json"))) for n in ("eval_0", "eval_train_0"))
        base = {"train_acc": trn["accuracy"], "heldout_acc": held["accuracy"]}
    except (OSError, ValueError):
        pass
    summary = {arm: {k: (float(np.mean([r[k] for r in recs])), float(np.std([r[k] for r in recs])), len(recs))
                     for k in recs[0]} for arm, recs in records.items()}
    with open(os.path.join(root, f"{name}.json"), "w") as f:
        json.dump({"table": name, "spec": {k: v for k, v in spec.items() if k != "arms"}, "base": base,
                   "arms": summary}, f, indent=1)
    cols = list(next(iter(summary.values()), {}))
    lines = [f"`python experiments/study.py --study {name}`: {spec['steps']} steps, lr {spec['lr'] or 'per arm'}, "
             f"reward {spec['reward'] or 'shapes'}; mean ± std over seeds (n in the second column)."]
    if base:
        lines.append(f"Base (no RL): study prompts accuracy {base['train_acc']:.3f}, held out {base['heldout_acc']:.3f}.")
    lines.append("Columns: training reward (of the rollouts; under a proxy, the proxy) over the first and last 10 "
                 "steps; verifier score of the rollouts, same steps (proxy runs); verifier accuracy on the study "
                 "prompts × 24 images and on the held-out prompts at checkpoint @k; gradient norm before clipping: "
                 "mean, std/mean, max over steps; KL to the base and within-group diversity, last 10 steps; "
                 "seconds per step (two runs share the 2 cores).")
    lines += ["", "| arm | n | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for arm, stats in summary.items():
        cells = [f"{stats[c][0]:.3g} ± {stats[c][1]:.2g}" if stats[c][2] > 1 else f"{stats[c][0]:.3g}" for c in cols]
        lines.append(f"| {arm} | {stats[cols[0]][2]} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    with open(os.path.join(root, f"{name}.md"), "w") as f:
        f.write(text + "\n")
    print(text)

    panels = [("reward_mean", "training reward" if not spec["reward"] else "proxy reward (trained on)")]
    panels += [("reward/shapes", "verifier score of the rollouts")] if spec["reward"] else []
    panels += [("grad_norm", "gradient norm before clipping")]
    fig, axes = plt.subplots(1, len(panels) + bool(spec["evals"]), figsize=(4.2 * (len(panels) + 1), 3.6))
    for arm, runs in curves.items():
        for ax, (key, label) in zip(axes, panels):
            y = np.array([_smooth([r[key] for r in rows]) for rows in runs])  # (seeds, steps)
            line, = ax.plot(y.mean(0), label=f"{arm} ({len(runs)})")
            if len(runs) > 1:
                ax.fill_between(np.arange(y.shape[1]), y.mean(0) - y.std(0), y.mean(0) + y.std(0),
                                color=line.get_color(), alpha=0.2)
            ax.set(xlabel="GRPO step", ylabel=label + " (10-step mean)", yscale="log" if key == "grad_norm" else "linear")
        if spec["evals"]:
            ks = [0, *spec["evals"]]
            acc = np.array([[base.get("train_acc", np.nan), *[r[f"train_acc@{k}"] for k in spec["evals"]]]
                            for r in records[arm]])
            axes[-1].errorbar(ks, acc.mean(0), yerr=acc.std(0) if len(acc) > 1 else None, marker="o", capsize=3,
                              color=line.get_color())
    if spec["evals"]:
        axes[-1].set(xlabel="GRPO step (0 = base)", ylabel="verifier accuracy, study prompts × 24")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(root, f"{name}.png"), dpi=110)
    if spec["evals"]:
        labels = sample_grid(root, name, spec, os.path.join(root, f"{name}_samples.png"))
        print(f"{name}_samples.png, one row each: " + "; ".join(labels))
    return summary


def main(argv=None):
    """`python experiments/study.py ...`: the study (returns its summary) or a probe (its figures);
    `--train FLAGS` runs train.py with FLAGS and this file's presets (returns its exit status)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--train"]:
        return train.cli(argv[1:])
    p = processes.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", default=None, type=_tables, metavar="TABLE[,TABLE]",
                   help=f"run tables of the study in one queue: {', '.join(TABLES)} (see study())")
    p.add_argument("--context-probe", default=None, metavar="BASE",
                   help="does this pixel-token base model (base.pt) use the canvas? (see context_probe)")
    p.add_argument("--noise-probe", default=None, metavar="BASE",
                   help="which of a rollout's random draws decide its image and reward? (see noise_probe)")
    p.add_argument("--preset", default="demo", help="train.py preset of every run (and of the probe's flags)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads for the probe (0: default)")
    p.add_argument("--study-out", default="runs/study", help="the study's folder (one per base and preset)")
    p.add_argument("--study-seeds", type=int, default=0, help="seeds per arm (0: the table's)")
    p.add_argument("--study-steps", type=int, default=0, help="GRPO steps per run (0: the table's)")
    p.add_argument("--study-lr", default=None, help=f"learning rate of the main and components tables (default {STUDY_LR})")
    p.add_argument("--study-arms", default="", help="only these arms, by folder name (e.g. grpo-fixed-head,mar-grpo)")
    p.add_argument("--study-train-flags", default="", help="extra train.py flags for the GRPO runs only")
    p.add_argument("--report-only", action="store_true", help="with --study: only aggregate the finished runs")
    opts, rest = p.parse_known_args(argv)
    if sum(x is not None for x in (opts.study, opts.context_probe, opts.noise_probe)) != 1:
        p.error("give exactly one of --study TABLE, --context-probe BASE and --noise-probe BASE")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    if opts.study:
        return {name: study_report(opts, name) for name in opts.study} if opts.report_only else study(opts, rest)
    args = flags.parse_args(["--preset", opts.preset] + rest)
    if opts.noise_probe:
        return run_noise_probe(opts.noise_probe, args, lambda s: print(s, flush=True))
    return run_context_probe(opts.context_probe, args, lambda s: print(s, flush=True))


if __name__ == "__main__":  # `--train` returns train.py's exit status; the rest fail in one line (processes.cli)
    argv = sys.argv[1:]
    sys.exit(main(argv) if argv[:1] == ["--train"] else processes.cli(main, argv))
