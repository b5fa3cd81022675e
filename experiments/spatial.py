"""Spatial relations in the demo world (experiments/study.md, "Spatial relations"): is there a learning
signal for RL on spatial prompts, and where in a rollout is the placement decided?

    python -m experiments.spatial --probe demo/base.pt --threads 1          # the measurements, at the demo's τ
    python -m experiments.spatial --probe demo/base.pt --temperature 0.5    # ... at another τ
    python -m experiments.spatial --eval CKPT [--temperature T] [--split train|heldout]   # spatial accuracy only
    python -m experiments.spatial --sweep CKPT --json FILE [--eval-temperatures ...] [--eval-cfgs ...]
        # every spatial prompt of both splits at each τ (evaluate.temperature_sweep), its best on the training split
    python -m experiments.spatial --write-prompts FILE   # the 312 training-split spatial prompts, one a line (--prompts)
    python -m experiments.spatial --report RUN [RUN ...] [--block N] [--plot PNG]   # reward blocks, gradient norm, KL

In the demo's world (`--cell 8`: each object fills one 8-px cell of a 2 × 2 grid) a spatial prompt
"A REL B" is right when A and B are drawn and their cells stand in the relation, e.g. "left of": the
same row, A's cell left of B's (demo/verifier.py; the centroid rule reduces to that on a cell grid). Two
objects placed in distinct random cells satisfy a given relation in 2 of 12 ordered placements, 1 in 6.

Measurements (`probe`), each on a stated set of spatial prompts and seeds:
1. The learning signal (`group_signal`): G images per prompt, as a GRPO group sees them. The share
   of groups with at least one correct image and with at least one image whose relation holds; the
   share of groups whose reward varies (a group with equal rewards has zero advantage); the mean
   within-group variance of the reward and of the relation indicator; best-of-N accuracy (pass@N,
   the unbiased estimator 1 − C(n−c, N) / C(n, N) from the n = G images); and the relation's rate
   among images whose two objects are both drawn ("relation | both"), against chance 1/6.
2. Where placement is decided (`decision_probe`): for each image, its rollout's canvas at the start
   of AR step s is kept (the generation order too) and the rollout is completed K times with fresh
   head noise from there. Per s: how often a completion has the same layout (which cell holds which
   colour and shape) as the original image, and how often its relation outcome agrees. Placement is
   decided by the first s at which completions reproduce the original's layout.
3. Which diffusion steps decide (`diffusion_flips`): for the tokens written at the first AR steps,
   the head is run again from the z they were drawn from, with the same noise except at one
   diffusion step k: how often the token turns from black to coloured or back (the draw that puts
   an object in a cell or not).
"""

import argparse
import json
import math
import os
import sys

import numpy as np
import torch
from matplotlib.figure import Figure

import evaluate
import train
from demo import shapes, verifier
from diffloss import reverse_sample
from experiments import lab  # noqa: F401  (registers the reward shapes_relation, the flag --train-ar-below)
from infra import checkpoints, flags, processes
from infra.figures import save_grid
from models.prompts import Prompts
from models import loading, vae

def spatial_prompts(split):
    """Every spatial prompt of a split ("train": 312, "heldout": 216), as shapes metas, in a fixed order."""
    return [m for m in shapes.all_prompts(split) if m["category"] == "spatial"]


def outcome(details):
    """(correct, both objects drawn, relation holds) of one verifier result (verifier.verify)."""
    return bool(details["correct"]), bool(details["present"]), details["relation"] is True


def group_signal(scores, details, G):
    """The learning signal GRPO sees in groups of G consecutive images.

    scores: (n·G,) rewards; details: n·G verifier results (verifier.verify_batch). Returns a dict of
    shares over the n groups and rates over the images (module docstring, item 1)."""
    scores = np.asarray(scores, dtype=np.float64).reshape(-1, G)  # (n, G)
    out = np.array([outcome(d) for d in details], dtype=bool).reshape(-1, G, 3)  # (n, G, correct/both/relation)
    correct, both, relation = out[..., 0], out[..., 1], out[..., 2]
    n = len(scores)
    res = dict(groups=n, images=n * G, accuracy=float(correct.mean()), reward_mean=float(scores.mean()),
               groups_any_correct=float(correct.any(1).mean()), groups_any_relation=float(relation.any(1).mean()),
               groups_reward_varies=float((scores.std(1) > 0).mean()),
               reward_var_within=float(scores.var(1, ddof=1).mean()),
               relation_var_within=float(relation.astype(float).var(1, ddof=1).mean()),
               extra=float(np.mean([d["extra_objects"] > 0 for d in details])),
               counts_off=float(np.mean([not d["count"] for d in details])),
               both=int(both.sum()), relation_given_both=int((relation & both).sum()),
               relation_rate_given_both=float((relation & both).sum() / max(both.sum(), 1)))
    c = correct.sum(1)
    res["pass_at"] = {k: float(np.mean([pass_at(G, int(ci), k) for ci in c])) for k in range(1, G + 1)}
    return res


def pass_at(n, c, k):
    """The unbiased pass@k of n images of a prompt, c of them correct: 1 − C(n−c, k) / C(n, k),
    the chance that k images drawn from the n hold a correct one (what sampling reaches at all)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def spatial_summary(rows, reward_names=()):
    """evaluate.summarize of a split's rows, with this study's figures beside it: pass@k of the
    images of each prompt (k = 1 … n, when every prompt has the same n > 1 images) and, for spatial
    prompts, the share of all spatial images whose two objects are each drawn once with the relation
    right ("relation_right"), the images with both objects drawn ("both") and the relation's rate
    among them ("relation_given_both", the conditional rate, never a headline alone)."""
    out = evaluate.summarize(rows, reward_names)
    checked = [r for r in rows if "details" in r]
    per_prompt = {}
    for r in checked:
        per_prompt.setdefault(r["prompt_index"], []).append(bool(r["details"]["correct"]))
    if len({len(v) for v in per_prompt.values()}) == 1 and len(next(iter(per_prompt.values()))) > 1:
        n = len(next(iter(per_prompt.values())))  # images per prompt: pass@k for k = 1 … n
        out["pass_at"] = {k: float(np.mean([pass_at(n, sum(v), k) for v in per_prompt.values()]))
                          for k in range(1, n + 1)}
    spatial = [r["details"] for r in checked if r["category"] == "spatial"]
    if spatial:
        both = [d for d in spatial if d["present"]]
        right = [d["relation"] is True for d in both]
        right_once = [d["count"] and d["relation"] is True for d in spatial]
        out.update(spatial_n=len(spatial), both=len(both), relation_right=float(np.mean(right_once)),
                   relation_given_both=float(np.mean(right)) if both else 0.0)
    return out


def cell_layout(found, cell=8):
    """The layout of detected objects (verifier.detect_objects): a sorted tuple of (row, column,
    colour, shape), one per object, its cell from its centroid."""
    return tuple(sorted((int(d["y"] // cell), int(d["x"] // cell), d["color"], d["shape"]) for d in found))


@torch.no_grad()
def continue_rollout(model, cond, tokens, unknown, orders, start, num_iter, temperature, generator, keep=None,
                     counts=None):
    """The AR loop of MAR (CFG 1, as the demo samples) from AR step `start`, canvas `tokens` (B, L, C)
    with `unknown` (B, L) bool positions still to write, generation `orders` (B, L): step i writes the
    last counts[i] of the orders' first (still unknown) entries. keep: a list that receives (tokens,
    unknown) at the start of every step from `start` on; counts: tokens per step (default
    `model.ar_schedule(num_iter, L)`, a whole canvas). Returns the final tokens."""
    counts = model.ar_schedule(num_iter, model.seq_len) if counts is None else counts
    num_unknown = int(unknown[0].sum())
    for i in range(start, len(counts)):
        if keep is not None:
            keep.append((tokens, unknown))
        z = model.predict_z(tokens, unknown.float(), cond).float()  # (B, L, D)
        n_next = num_unknown - counts[i]
        pos = orders[:, n_next:num_unknown]  # (B, m) P_i, the positions written at step i
        B, m = pos.shape
        z_head = z.gather(1, pos[..., None].expand(B, m, z.shape[-1])).reshape(B * m, -1)  # (B·m, D)
        sampled = model.diffloss.sample(z_head, temperature, 1.0, generator).reshape(B, m, -1)  # (B, m, C)
        tokens = tokens.scatter(1, pos[..., None].expand(B, m, tokens.shape[-1]), sampled.to(tokens.dtype))
        unknown = unknown.scatter(1, pos, False)
        num_unknown = n_next
    return tokens


def verify_tokens(model, tokens, metas):
    """Verifier results of token grids (B, L, C) against metas: (scores (B,), details)."""
    images = vae.PixelCodec().decode(model.unpatchify(tokens).float())  # (B, 3, H, W) in [0, 1]
    return verifier.verify_batch(images, metas)


@torch.no_grad()
def sample_groups(model, metas, G, num_iter, temperature, seed, batch=96, grid=None):
    """G images for each meta (consecutive), at CFG 1. Returns (scores (n·G,), details); grid: a PNG
    path for the first 32 images with their prompts ([ok] = correct)."""
    items = [m for m in metas for _ in range(G)]
    prompts = Prompts("shapes")
    scores, details = [], []
    for b0 in range(0, len(items), batch):
        its = items[b0:b0 + batch]
        g = torch.Generator().manual_seed(seed * 100003 + b0)
        cond = model.condition(**prompts.condition(its, "cpu"))
        B, L = len(its), model.seq_len
        tokens = continue_rollout(model, cond, torch.zeros(B, L, model.token_embed_dim), torch.ones(B, L, dtype=torch.bool),
                                  model.sample_orders(B, g), 0, num_iter, temperature, g)
        s, d = verify_tokens(model, tokens, its)
        if grid and b0 == 0:
            images = vae.PixelCodec().decode(model.unpatchify(tokens[:32]).float())
            save_grid(images, [("[ok] " if x["correct"] else "") + m["prompt"] for x, m in zip(d, its)], grid)
        scores += s.tolist()
        details += d
    return np.array(scores), details


@torch.no_grad()
def decision_probe(model, metas, num_iter, temperature, seed, branches=6, starts=None):
    """Module docstring, item 2. metas: the images' prompts (one image each). Returns
    {"tokens_known": [...], "steps": {s: {"same_layout", "same_relation", "relation_var"}}, "original": {...}}."""
    prompts = Prompts("shapes")
    cond = model.condition(**prompts.condition(metas, "cpu"))
    B, L, C = len(metas), model.seq_len, model.token_embed_dim
    g = torch.Generator().manual_seed(seed)
    orders = model.sample_orders(B, g)  # (B, L)
    states = []
    final = continue_rollout(model, cond, torch.zeros(B, L, C), torch.ones(B, L, dtype=torch.bool), orders, 0,
                             num_iter, temperature, g, keep=states)
    _, det = verify_tokens(model, final, metas)
    layout0 = [cell_layout(d["detected"]) for d in det]
    rel0 = np.array([outcome(d)[2] for d in det])
    counts = model.ar_schedule(num_iter, L)
    res = {"tokens_known": [int(sum(counts[:s])) for s in range(num_iter + 1)], "steps": {},
           "original": {"relation": float(rel0.mean()), "both": float(np.mean([outcome(d)[1] for d in det]))}}
    for s in (starts or range(num_iter)):
        tokens, unknown = states[s]
        same_layout, same_rel, rel = [], [], []
        for _ in range(branches):
            out = continue_rollout(model, cond, tokens, unknown, orders, s, num_iter, temperature, g)
            _, d = verify_tokens(model, out, metas)
            same_layout.append([cell_layout(x["detected"]) == l0 for x, l0 in zip(d, layout0)])
            r = np.array([outcome(x)[2] for x in d])
            same_rel.append(r == rel0)
            rel.append(r)
        rel = np.array(rel, dtype=float)  # (branches, B)
        res["steps"][s] = dict(same_layout=float(np.mean(same_layout)), same_relation=float(np.mean(same_rel)),
                               relation_var=float(rel.var(0, ddof=1).mean()))
    return res


def _coloured(tokens):
    """(N, C) pixel tokens in [-1, 1] -> (N,) True where some pixel is not black (black is -1)."""
    return (tokens > -0.5).any(-1)


@torch.no_grad()
def diffusion_flips(model, metas, num_iter, temperature, seed, ar_steps=(0, 1, 2, 3, 4, 5)):
    """Module docstring, item 3: {k: share of the tokens written at `ar_steps` whose coloured/black
    state changes when diffusion step k's noise is redrawn}, and "all": when every draw is redrawn."""
    prompts = Prompts("shapes")
    cond = model.condition(**prompts.condition(metas, "cpu"))
    B, L, C = len(metas), model.seq_len, model.token_embed_dim
    g = torch.Generator().manual_seed(seed)
    orders = model.sample_orders(B, g)
    states = []
    continue_rollout(model, cond, torch.zeros(B, L, C), torch.ones(B, L, dtype=torch.bool), orders, 0,
                     num_iter, temperature, g, keep=states)
    counts = model.ar_schedule(num_iter, L)
    zs = []
    for i in ar_steps:  # the z each written token was drawn from
        tokens, unknown = states[i]
        z = model.predict_z(tokens, unknown.float(), cond).float()  # (B, L, D)
        n_before = L - sum(counts[:i])
        pos = orders[:, n_before - counts[i]:n_before]  # (B, m)
        zs.append(z.gather(1, pos[..., None].expand(*pos.shape, z.shape[-1])).reshape(-1, z.shape[-1]))
    z = torch.cat(zs)  # (N, D)
    head, N = model.diffloss, len(z)
    draw = lambda: torch.randn(N, C, generator=g)  # noqa: E731
    x_T, noise = draw(), {k: draw() for k in range(1, head.num_sampling_steps)}
    ref = _coloured(reverse_sample(head, z, C, temperature, 1.0, x_T=x_T, noise=noise))
    res = {"tokens": N, "coloured": float(ref.float().mean())}
    for k in sorted(noise, reverse=True):
        res[k] = float((_coloured(reverse_sample(head, z, C, temperature, 1.0, x_T=x_T, noise={**noise, k: draw()}))
                        != ref).float().mean())
    res["x_T"] = float((_coloured(reverse_sample(head, z, C, temperature, 1.0, x_T=draw(), noise=noise)) != ref)
                       .float().mean())
    res["all"] = float((_coloured(reverse_sample(head, z, C, temperature, 1.0, x_T=draw(),
                                                 noise={k: draw() for k in noise})) != ref).float().mean())
    return res


def probe(model, args, out, G=6, seed=0):
    """The measurements of the module docstring on `model` at args.temperature; prints and returns them."""
    T, N = args.temperature, args.num_iter
    res = {"temperature": T}
    for split in ("train", "heldout"):
        r = group_signal(*sample_groups(model, spatial_prompts(split), G, N, T, seed), G)
        res[split] = r
        out(f"{split}: {r['groups']} spatial prompts × G = {G} at τ {T:g}: accuracy {r['accuracy']:.3f} "
            f"± {evaluate.binomial_sem(r['accuracy'], r['images']):.3f}, reward {r['reward_mean']:.3f}")
        out(f"  groups with a correct image {r['groups_any_correct']:.3f}, with a right relation "
            f"{r['groups_any_relation']:.3f}, whose reward varies {r['groups_reward_varies']:.3f}; within-group "
            f"variance: reward {r['reward_var_within']:.4f}, relation {r['relation_var_within']:.4f}")
        out(f"  relation | both objects drawn: {r['relation_given_both']}/{r['both']} = {r['relation_rate_given_both']:.3f} "
            f"± {evaluate.binomial_sem(r['relation_rate_given_both'], r['both']):.3f} (chance {verifier.relation_chance(spatial_prompts(split)):.3f}); best-of-N: "
            + ", ".join(f"N={k} {v:.3f}" for k, v in r["pass_at"].items()))
    metas = spatial_prompts("train")[::3]  # 104 training-split spatial prompts, one image each
    d = decision_probe(model, metas, N, T, seed + 1, branches=4, starts=(0, 1, 2, 3, 4, 5, 6, 8, 12))
    res["decision"] = d
    out(f"where placement is decided ({len(metas)} training-split spatial images, 4 completions from the canvas at "
        f"the start of AR step s; originals: both objects {d['original']['both']:.3f}, relation {d['original']['relation']:.3f}):")
    for s, r in d["steps"].items():
        out(f"  s={s:2d} ({d['tokens_known'][s]:2d} of 64 tokens known): same layout {r['same_layout']:.3f}, same relation "
            f"outcome {r['same_relation']:.3f}, relation variance over completions {r['relation_var']:.3f}")
    f = diffusion_flips(model, metas, N, T, seed + 2)
    res["flips"] = f
    out(f"tokens of AR steps 0-5 ({f['tokens']}; {f['coloured']:.2f} coloured) turning coloured <-> black when one "
        "diffusion step's noise is redrawn: " + " ".join(f"k={k}: {f[k]:.3f}" for k in range(15, 0, -1))
        + f"; x_T {f['x_T']:.3f}; all {f['all']:.3f}")
    return res


def run_summary(run, block=20):
    """A GRPO run's figures from its metrics.jsonl: the training reward in blocks of `block` steps (and,
    trained on the proxy `shapes_coverage`, the verifier score logged beside it), the gradient norm's
    mean and std/mean over steps, the KL to the base over the last 10 steps, and train.py's own
    evaluation of the tuned model if it ran (eval/summary.json: at its best τ, accuracy held out and
    on the training split)."""
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    blocks = lambda key: [float(np.mean([r[key] for r in rows[i:i + block]])) for i in range(0, len(rows), block)]  # noqa: E731
    grad = np.array([r["grad_norm"] for r in rows])
    res = dict(steps=len(rows), reward_blocks=blocks("reward_mean"), grad_norm_mean=float(grad.mean()),
               grad_norm_cv=float(grad.std() / grad.mean()), kl_last=float(np.mean([r["kl"] for r in rows[-10:]])),
               step_s=float(np.mean([r["t_rollout"] + r["t_reward"] + r.get("t_mte", 0.0) + r["t_update"]
                                     for r in rows])))
    if "reward/shapes_coverage" in rows[0]:
        res["verifier_blocks"] = blocks("reward/shapes")
    if os.path.exists(os.path.join(run, "eval", "summary.json")):
        with open(os.path.join(run, "eval", "summary.json")) as f:
            ev = json.load(f)
        tuned = ev["tuned"]  # its sweep (evaluate.temperature_sweep): the tuned model at its best τ
        res["accuracy"] = {"best_tau": tuned["best"]["temperature"],
                           **{split: evaluate.cell(tuned, split)["accuracy"] for split in ("heldout", "train")}}
    return res


def plot_runs(runs, path, w=10):
    """Training reward and gradient norm (trailing means over w steps) of run folders; runs whose
    folder names differ only in a trailing `_seedN` share a colour and a mean ± std band (`plot_groups`)."""
    groups = {}
    for run in runs:
        rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
        groups.setdefault(os.path.basename(run.rstrip("/")).rsplit("_seed", 1)[0], []).append(rows)
    plot_groups(groups, path, w)


def plot_groups(groups, path, w=10):
    """Training reward and gradient norm (trailing means over w steps) of {name: [metrics rows of a
    run, ...]}: one line per name, the mean over its runs, with a ± std band."""
    fig = Figure(figsize=(10, 3.6))
    axes = fig.subplots(1, 2)
    for name, members in groups.items():
        for ax, key in zip(axes, ("reward_mean", "grad_norm")):
            n = min(len(m) for m in members)
            y = np.array([np.convolve([r[key] for r in m[:n]], np.ones(w) / w, mode="valid") for m in members])  # (seeds, n−w+1)
            x = np.arange(w - 1, n)
            line, = ax.plot(x, y.mean(0), label=f"{name} ({len(members)})")
            if len(members) > 1:
                ax.fill_between(x, y.mean(0) - y.std(0), y.mean(0) + y.std(0), color=line.get_color(), alpha=0.2)
    axes[0].set(xlabel="GRPO step", ylabel=f"training reward ({w}-step mean)")
    axes[1].set(xlabel="GRPO step", ylabel=f"gradient norm ({w}-step mean)", yscale="log")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    """`--probe`, `--eval`, `--report` (return the figures) or `--write-prompts`. Training runs go
    through `python -m experiments.lab FLAGS` (train.py with the reward shapes_relation)."""
    p = processes.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--probe", default=None, metavar="CKPT", help="the measurements of the module docstring")
    p.add_argument("--eval", default=None, metavar="CKPT", help="spatial accuracy of a base or GRPO checkpoint")
    p.add_argument("--sweep", default=None, metavar="CKPT", help="spatial figures of a checkpoint at each τ of "
                   "--eval-temperatures (× --eval-cfgs), its best τ chosen on the training split (sweep)")
    p.add_argument("--eval-cfgs", type=flags.POS_FLOATS, default=(None,), help="--sweep: guidance weights too")
    p.add_argument("--images-dir", default=None, help="--sweep: where the images go (default: beside --json)")
    p.add_argument("--report", nargs="+", default=None, metavar="RUN", help="run folders: run_summary of each")
    p.add_argument("--block", type=int, default=20, help="--report: steps per block of the reward")
    p.add_argument("--plot", default=None, metavar="PNG", help="--report: the runs' reward and gradient-norm curves")
    p.add_argument("--write-prompts", default=None, metavar="FILE", help="write the training-split spatial prompts")
    p.add_argument("--split", default="both", choices=["train", "heldout", "both"], help="--eval: which spatial prompts")
    p.add_argument("--images", type=int, default=2, help="--eval: images per prompt")
    p.add_argument("--grid", default=None, metavar="PREFIX", help="--eval: save the first 32 images as PREFIX_<split>.png")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--json", default=None, help="also write the result here")
    opts, rest = p.parse_known_args(argv)
    for flag, path in (("--write-prompts", opts.write_prompts), ("--json", opts.json), ("--plot", opts.plot),
                       ("--grid", opts.grid and opts.grid + "_x.png")):  # where this run will write: writable first
        if path is not None:
            checkpoints.check_writable(os.path.dirname(os.path.abspath(path)), flag)
    if opts.report:
        res = {}
        for run in opts.report:
            res[run] = r = run_summary(run, opts.block)
            fmt = lambda xs: " ".join(f"{x:.3f}" for x in xs)  # noqa: E731
            parts = [f"{r['steps']} steps", f"training reward in {opts.block}-step blocks {fmt(r['reward_blocks'])}"]
            parts += [f"verifier {fmt(r['verifier_blocks'])}"] if "verifier_blocks" in r else []
            parts += [f"gradient norm mean {r['grad_norm_mean']:.4f}, std/mean {r['grad_norm_cv']:.2f}",
                      f"KL (last 10 steps) {r['kl_last']:.2e}", f"{r['step_s']:.1f} s/step"]
            if "accuracy" in r:
                acc = r["accuracy"]
                parts.append(f"at its best τ {acc['best_tau']:g}: accuracy held out {acc['heldout']:.3f}, "
                             f"training split {acc['train']:.3f}")
            print(f"{run}: " + "; ".join(parts))
        if opts.plot:
            plot_runs(opts.report, opts.plot)
        return res
    if opts.write_prompts:
        with open(opts.write_prompts, "w") as f:
            f.writelines(m["prompt"] + "\n" for m in spatial_prompts("train"))
        return None
    if sum(x is not None for x in (opts.probe, opts.eval, opts.sweep)) != 1:
        p.error("give one of --probe CKPT, --eval CKPT, --sweep CKPT and --write-prompts FILE")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    args = train.parse_args(["--preset", "demo"] + rest)
    if opts.sweep:
        if opts.json is None:
            raise ValueError("--sweep: give --json FILE, where the sweep goes")
        out = opts.images_dir or os.path.splitext(opts.json)[0]
        res = sweep(args, opts.sweep, out, opts.images, opts.eval_cfgs)
        with open(opts.json, "w") as f:
            json.dump(res, f, indent=1)
        return res
    if args.cfg != 1.0:
        raise ValueError("--cfg: these probes sample without guidance (CFG 1), as the demo does")
    model = loading.load_policy(args, opts.probe or opts.eval, "--probe" if opts.probe else "--eval")
    say = lambda s: print(s, flush=True)  # noqa: E731
    if opts.probe:
        res = probe(model, args, say, seed=opts.seed)
    else:
        res = evaluate_spatial(model, args, opts.split, opts.images, opts.seed, say, opts.grid)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


def sweep(args, path, out_dir, images=2, cfgs=(None,)):
    """The checkpoint at `path` on every spatial prompt of both splits, `images` each, at every τ of
    args.eval_temperatures (× the guidance weights `cfgs`) through evaluate.py's one loop (the same
    seeds for every model and τ), its best chosen on the training split's strict accuracy. Images
    and scores in out_dir/tau<τ>/<split>/. Returns evaluate.temperature_sweep's dict."""
    args.out, args.eval_images_per_prompt = out_dir, images
    ctx = processes.Ctx(args)
    model = loading.load_policy(args, path, "--sweep").to(ctx.device).requires_grad_(False)
    codec, prompts = loading.load_codec(args, model, ctx.device), loading.load_prompts(args, model)
    splits = {split: spatial_prompts(split) for split in ("train", "heldout")}
    temperatures = sorted({*args.eval_temperatures, args.temperature})
    return evaluate.sweep_splits(args, ctx, model, codec, prompts, splits, {"shapes": verifier.ShapesReward()},
                                 out_dir, temperatures, cfgs, summary=spatial_summary)


def evaluate_spatial(model, args, split, images, seed, out, opts_grid=None):
    """Spatial accuracy of `model` on every spatial prompt of the split(s), `images` each, at
    args.temperature; the same seeds for every model. Returns {split: group_signal's dict}."""
    res = {}
    for s in (("train", "heldout") if split == "both" else (split,)):
        grid = f"{opts_grid}_{s}.png" if opts_grid else None
        r = group_signal(*sample_groups(model, spatial_prompts(s), images, args.num_iter, args.temperature, seed,
                                        grid=grid), images)
        res[s] = r
        out(f"{s}: accuracy {r['accuracy']:.3f} ± {evaluate.binomial_sem(r['accuracy'], r['images']):.3f} ({r['images']} images, τ "
            f"{args.temperature:g}), both objects {r['both']}, relation | both {r['relation_given_both']}/{r['both']} = "
            f"{r['relation_rate_given_both']:.3f}, reward {r['reward_mean']:.3f}; images with an extra object "
            f"{r['extra']:.3f}, with a wrong count {r['counts_off']:.3f}")
    return res


if __name__ == "__main__":
    sys.exit(processes.cli(main))
