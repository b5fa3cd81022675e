"""The controlled study of the README ("The study") and the context probe of its "Findings":
experiments that run train.py many times or look inside a base model, not performance figures
(those are bench.py's).

    python study.py --study [--study-seeds 3] [--study-arms main] [--study-out runs/study] \
        [--study-train-flags "--lr 1e-4"] [train.py flags for every run]
    python study.py --context-probe runs/demo/base.pt    # does a base model use its canvas?

The study: one base model (pretrained into --study-out unless a base.pt is already there), then
for every arm of STUDY_MAIN (--study-seeds seeds each) and STUDY_ABLATIONS (one seed) a GRPO run
of --study-steps steps on the four STUDY_PROMPTS, each evaluated on the stratified held-out
prompts and on the study prompts × 24 images with fixed seeds. Runs go two at a time with one
thread each; finished ones are skipped, so an interrupted study continues where it stopped.
It ends by writing study.json, study.md and study.png into --study-out.
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

import mar
import models
import shapes
import train
from prompts import Prompts

STUDY_MAIN = {  # arm -> train.py flags; --study-seeds seeds each
    "grpo": ["--method", "grpo"],
    "grpo-fixed-head": ["--method", "grpo-fixed-head"],
    "mar-grpo": ["--method", "mar-grpo", "--mte-positions", "unknown"],
    "mar-grpo, MTE on P_i": ["--method", "mar-grpo", "--mte-positions", "predicted"],
}
STUDY_ABLATIONS = {  # one seed each; S = 1 is the fixed head with the masks alone
    "MTE alone": ["--method", "grpo-fixed-head", "--mte-seeds", "3", "--mte-positions", "unknown"],
    "MTE on P_i alone": ["--method", "grpo-fixed-head", "--mte-seeds", "3", "--mte-positions", "predicted"],
    "masks alone (S=1, tau 0)": ["--method", "grpo-fixed-head", "--tau", "0"],
    "mar-grpo S=5": ["--method", "mar-grpo", "--mte-seeds", "5", "--mte-positions", "unknown"],
    "mar-grpo k=10%": ["--method", "mar-grpo", "--top-k", "0.1", "--mte-positions", "unknown"],
    "mar-grpo k=60%": ["--method", "mar-grpo", "--top-k", "0.6", "--mte-positions", "unknown"],
    "mar-grpo tau off": ["--method", "mar-grpo", "--tau", "off", "--mte-positions", "unknown"],
}


# the study trains on four fixed training-split prompts, one per category, so that 25 GRPO steps
# on 2 CPU cores separate the arms; held-out evaluation uses the usual stratified held-out set
STUDY_PROMPTS = ["a red square", "a green circle and a yellow square", "three red circles",
                 "a blue square left of a green circle"]


def _coloured(tokens):
    """(..., C) pixel tokens in [-1, 1] -> (...) 1.0 where some pixel is not black (black is -1)."""
    return (tokens > -0.5).any(-1).float()


@torch.no_grad()
def context_probe(model, codec, n_images=128, known_fracs=(0.0, 0.5, 0.9), temperature=0.5, seed=0):
    """Does a pixel-token base model use the canvas? Rendered training-split images with a random
    fraction of their tokens known: the diffusion loss on the unknown tokens (split into tokens
    with some colour and all-black ones), and how often a token sampled there (no CFG) is coloured
    where the image is black or the reverse. A model that reads its neighbours gets better as more
    of the canvas is known; one that has learnt only the prompt's marginal does not.

    Returns {known_frac: {"loss_coloured", "loss_black", "colour_error"}}, "coloured_frac" and "n_images"."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    imgs, metas = shapes.make_dataset(n_images, model.img_size, np.random.default_rng(seed), split="train")
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


def linear_probe(model, codec, known_frac=0.9, n_images=256, seed=0):
    """Does z at a hidden position know whether that token is coloured? A logistic regression from
    z (standardised) to "this token has colour", fitted on the hidden tokens of n_images rendered
    training-split images with `known_frac` of their tokens known, tested on the hidden tokens of
    n_images others. Returns (test accuracy, the majority-class base rate of the test tokens)."""
    sets = []
    for part in (seed, seed + 1):  # fit, test
        imgs, metas = shapes.make_dataset(n_images, model.img_size, np.random.default_rng([part, 13]), split="train")
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


def run_context_probe(path, args, out):
    model = models.load_policy(args, path)
    if model.config["vae_stride"] != 1 or model.config.get("text_vocab_size", 0) == 0:
        raise SystemExit(f"--context-probe {path}: needs a prompt-conditioned pixel-token base (train.py's small model)")
    res = context_probe(model, mar.PixelCodec(), temperature=args.temperature)
    out(f"context probe of {path}: {res['n_images']} training-split images, {res['coloured_frac']:.1%} of tokens coloured")
    out("  known fraction | diffusion loss, coloured / black unknown tokens | colour error of sampled unknown tokens")
    for frac, r in res.items():
        if isinstance(frac, float):
            out(f"  {frac:14.1f} | {r['loss_coloured']:.4f} / {r['loss_black']:.4f} | {r['colour_error']:.3f}")
    for frac in (0.5, 0.9):
        res[f"linear_probe_{frac}"] = accuracy, base_rate = linear_probe(model, mar.PixelCodec(), frac)
        out(f"linear probe z -> coloured at the hidden tokens, {frac:.0%} known: accuracy {accuracy:.3f} "
            f"(base rate {base_rate:.3f})")
    return res


def _slug(arm):
    """A folder name for an arm: 'mar-grpo, MTE on P_i' -> 'mar-grpo_MTE_on_P_i'."""
    return re.sub(r"[^A-Za-z0-9.=-]+", "_", arm).strip("_")


def _study_runs(opts):
    runs = [(arm, seed, flags) for arm, flags in STUDY_MAIN.items() for seed in range(opts.study_seeds)]
    if opts.study_arms == "main":
        return runs
    return runs + [(arm, 0, flags) for arm, flags in STUDY_ABLATIONS.items()]


def study(opts, extra):
    """Run every arm (GRPO from one base, then two evaluations: the stratified held-out prompts, and
    the study's four training prompts × 24 images with fixed seeds), two processes at a time with
    one thread each, skipping what is already finished; then write the table, JSON and plot.
    `extra` flags go to every train.py call; --study-train-flags only to the GRPO runs."""
    root = opts.study_out
    extra = ["--preset", opts.preset] + extra
    os.makedirs(root, exist_ok=True)
    prompt_file = os.path.join(root, "prompts.txt")
    with open(prompt_file, "w") as f:
        f.write("\n".join(STUDY_PROMPTS) + "\n")
    train_extra = ["--prompts", prompt_file, "--steps", str(opts.study_steps)] + opts.study_train_flags.split()
    base = os.path.join(root, "base.pt")
    py = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")]
    if not os.path.exists(base):
        subprocess.run(py + ["--stage", "pretrain", "--out", root] + extra, check=True)

    def evals(ckpt, out):  # held-out prompts (stratified), then the study's training prompts, 24 images each
        cmds = []
        if not os.path.exists(os.path.join(out, "eval", "summary.json")):
            cmds.append(py + ["--eval-only", "--init", ckpt, "--out", os.path.join(out, "eval"), "--threads", "1"] + extra)
        if not os.path.exists(os.path.join(out, "eval_train", "summary.json")):
            cmds.append(py + ["--eval-only", "--init", ckpt, "--out", os.path.join(out, "eval_train"), "--threads", "1",
                              "--prompts", prompt_file, "--eval-images-per-prompt", "24"] + extra)
        return cmds

    def shell(cmds):
        return " && ".join(" ".join(shlex.quote(str(c)) for c in cmd) for cmd in cmds)

    jobs = []
    base_cmds = evals(base, os.path.join(root, "base"))
    if base_cmds:
        jobs.append(("base", 0, shell(base_cmds)))
    for arm, seed, flags in _study_runs(opts):
        out = os.path.join(root, _slug(arm), f"seed{seed}")
        cmds = []
        if not os.path.exists(os.path.join(out, "eval", "summary.json")):  # evaluation follows a finished run
            cmds.append(py + ["--stage", "grpo", "--init", base, "--out", out, "--seed", str(seed), "--threads", "1"]
                        + flags + extra + train_extra)
        cmds += evals(os.path.join(out, "ckpt", "latest.pt"), out)
        if cmds:
            jobs.append((arm, seed, shell(cmds)))
    running = []
    while jobs or running:
        while jobs and len(running) < 2:
            arm, seed, cmd = jobs.pop(0)
            print(f"study: {arm} seed {seed}", flush=True)
            log = open(os.path.join(root, f"log_{_slug(arm)}_{seed}.txt"), "w")
            running.append(subprocess.Popen(cmd, shell=True, stdout=log, stderr=subprocess.STDOUT,
                                            env=dict(os.environ, OMP_NUM_THREADS="1")))
        time.sleep(2)
        for p in [p for p in running if p.poll() is not None]:
            if p.returncode:
                print(f"study: a run failed ({p.args[:120]}...)", flush=True)
            running.remove(p)
    return study_report(opts)


def study_report(opts):
    """Aggregate metrics.jsonl and eval summaries into study.json, study.md and study.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    root, table, curves = opts.study_out, {}, {}
    for arm, seed, _ in _study_runs(opts):
        out = os.path.join(root, _slug(arm), f"seed{seed}")
        try:
            rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
            ev = json.load(open(os.path.join(out, "eval", "summary.json")))
            ev_train = json.load(open(os.path.join(out, "eval_train", "summary.json")))
        except (OSError, ValueError):
            continue
        grad = [r["grad_norm"] for r in rows]
        tail, head = rows[-max(1, len(rows) // 5):], rows[:max(1, len(rows) // 5)]
        rec = dict(heldout_acc=ev.get("accuracy", float("nan")), heldout_reward=ev.get("reward_mean", float("nan")),
                   train_acc=ev_train["accuracy"], train_reward=ev_train["reward_mean"],
                   train_reward_first=float(np.mean([r["reward_mean"] for r in head])),
                   train_reward_last=float(np.mean([r["reward_mean"] for r in tail])),
                   grad_norm_mean=float(np.mean(grad)), grad_norm_std=float(np.std(grad)),
                   grad_norm_cv=float(np.std(grad) / np.mean(grad)), kl_last=float(np.mean([r["kl"] for r in tail])),
                   diversity_last=float(np.mean([r["diversity"] for r in tail])),
                   step_s=float(np.mean([r["t_rollout"] + r["t_reward"] + r["t_update"] for r in rows])),
                   **{k: v for k, v in ev.items() if k.startswith("accuracy/")})
        table.setdefault(arm, []).append(rec)
        curves.setdefault(arm, []).append(([r["reward_mean"] for r in rows], grad))
    try:  # the base model without RL, for reference
        ev = json.load(open(os.path.join(root, "base", "eval", "summary.json")))
        ev_train = json.load(open(os.path.join(root, "base", "eval_train", "summary.json")))
        table["base (no RL)"] = [dict(heldout_acc=ev["accuracy"], heldout_reward=ev["reward_mean"],
                                      train_acc=ev_train["accuracy"], train_reward=ev_train["reward_mean"],
                                      **{k: v for k, v in ev.items() if k.startswith("accuracy/")})]
    except (OSError, ValueError):
        pass
    summary = {arm: {k: (float(np.mean([r[k] for r in recs])), float(np.std([r[k] for r in recs])), len(recs))
                     for k in recs[0]} for arm, recs in table.items()}
    with open(os.path.join(root, "study.json"), "w") as f:
        json.dump(summary, f, indent=1)
    cols = ["train_reward_first", "train_reward_last", "train_reward", "train_acc", "heldout_reward", "heldout_acc", "accuracy/single",
            "accuracy/two_objects", "accuracy/counting", "accuracy/spatial", "grad_norm_mean", "grad_norm_std", "grad_norm_cv",
            "kl_last", "diversity_last", "step_s"]
    lines = ["| arm | seeds | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for arm, stats in summary.items():
        cells = [f"{stats[c][0]:.3f} ± {stats[c][1]:.3f}" if c in stats else "–" for c in cols]
        lines.append(f"| {arm} | {next(iter(stats.values()))[2]} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    with open(os.path.join(root, "study.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.6))
    for arm in STUDY_MAIN:
        if arm not in curves:
            continue
        r = np.mean([c[0] for c in curves[arm]], axis=0)
        g = np.mean([c[1] for c in curves[arm]], axis=0)
        ax[0].plot(r, label=arm)
        ax[1].plot(g, label=arm)
    ax[0].set(xlabel="GRPO step", ylabel="train reward (mean over seeds)")
    ax[1].set(xlabel="GRPO step", ylabel="grad norm before clipping", yscale="log")
    ax[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(root, "study.png"), dpi=110)
    return summary


def main(argv=None):
    """`python study.py ...`: the study (returns its summary) or the context probe (its figures)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", action="store_true", help="run the controlled study (see study())")
    p.add_argument("--context-probe", default=None, metavar="BASE",
                   help="does this pixel-token base model (base.pt) use the canvas? (see context_probe)")
    p.add_argument("--preset", default="demo", help="train.py preset of every run (and of the probe's flags)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads for the probe (0: default)")
    p.add_argument("--study-seeds", type=int, default=3, help="seeds per main arm")
    p.add_argument("--study-out", default="runs/study", help="the study's folder")
    p.add_argument("--study-train-flags", default="", help="extra train.py flags for the GRPO runs only")
    p.add_argument("--study-steps", type=int, default=25, help="GRPO steps per study run")
    p.add_argument("--study-arms", default="all", choices=["all", "main"], help="main: the four main arms only")
    opts, rest = p.parse_known_args(argv)
    if opts.study == (opts.context_probe is not None):
        p.error("give exactly one of --study and --context-probe BASE")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    if opts.study:
        return study(opts, rest)
    args = train.parse_args(["--preset", opts.preset] + rest)
    return run_context_probe(opts.context_probe, args, lambda s: print(s, flush=True))


if __name__ == "__main__":
    main()
