"""A run's curve: each checkpoint at its best sampling temperature, against training steps, beside
the run's own statistics (reward, KL, gradient norm, diversity, skipped steps, the ratio, the MTE
gap).

    python -m experiments.curve RUN [RUN ...] --out DIR [--steps 0,100,200,400,800,1200]
        [--eval-temperatures 0.1,0.3,1] [--eval-prompts 96] [--eval-images-per-prompt 2]

RUN is a train.py --out folder (config.json, metrics.jsonl, ckpt/step_XXXXXX.pt; keep every
checkpoint with --save-every 100 --keep-last 0). Step 0 is the run's --init, the base. Every
checkpoint of every run is swept by evaluate.sweep_splits on the same prompts and seeds (--seed,
whatever seed a run trained with): the held-out compositions and the training split's prompts
with fresh seeds, at every τ of
--eval-temperatures; its best τ is chosen on the training split and both splits are read there.
A checkpoint's sweep is kept in DIR/points/ (keyed by the file, its size and time, and the sweep's
settings), so a second call, or a call after the run has gone on, sweeps only what is new.

Writes DIR/curve.json (per run: the points, the statistics in windows of --window steps, and the
stability figures of `stability`), DIR/curve.md (the table) and DIR/curve.png (accuracy at the
best τ against steps with the base's as a line, and the statistics' panels).

Cost: one checkpoint is (#τ) × 2 splits × eval-prompts × images-per-prompt images; with the
defaults 3 × 2 × 192 = 1152 images of the demo's 16-step sampler, about 1.5 minutes on one CPU
thread, so six checkpoints of a run add about 9 minutes to its hour.
"""

import argparse
import hashlib
import json
import os
import statistics
import sys

from matplotlib.figure import Figure

import evaluate
from demo import verifier
from infra import checkpoints, flags, processes
from models import loading

# the statistics of metrics.jsonl a curve shows, as (key, label); a window's value is their mean
# (the skipped share: the fraction of its steps whose update was skipped); a run that does not log
# one (mte_gap without MTE) has no line for it
STATS = (("reward_mean", "training reward"), ("kl", "KL to the base"),
         ("grad_norm", "gradient norm (before clipping)"), ("diversity", "group diversity"),
         ("skipped", "share of skipped steps"), ("ratio_max_dev", "max |ρ − 1|"),
         ("mte_gap", "MTE gap outside P_i (nats / element)"))


def run_checkpoints(run):
    """{step: path} of a run folder: 0 → its --init (config.json), n → ckpt/step_n.pt."""
    with open(os.path.join(run, "config.json")) as f:
        config = json.load(f)
    found = {0: config["init"]}
    for name in checkpoints.checkpoint_names(os.path.join(run, "ckpt")):
        found[int(name[len("step_"):-len(".pt")])] = os.path.join(run, "ckpt", name)
    return found


def curve_point(step, sweep):
    """A checkpoint's point from its sweep (evaluate.temperature_sweep's dict): the best τ (chosen
    on the training split) and each split's strict accuracy and n there, and every cell's."""
    best = sweep["best"]
    point = {"step": step, "temperature": best["temperature"]}
    for split in sorted({c["split"] for c in sweep["cells"]}):
        at_best = evaluate.cell(sweep, split)
        point[split] = at_best[sweep["key"]]
        point[f"{split}_n"] = at_best["n"]
        point[f"{split}_by_tau"] = {f"{c['temperature']:g}": c[sweep["key"]]
                                    for c in sweep["cells"] if c["split"] == split}
    return point


def windows(rows, width):
    """The statistics of STATS that the rows hold, in windows of `width` steps:
    [{"first", "last", key: mean}]."""
    out = []
    for a in range(0, len(rows), width):
        w = rows[a:a + width]
        out.append({"first": w[0]["step"], "last": w[-1]["step"],
                    **{key: statistics.fmean(r[key] for r in w) for key, _ in STATS
                       if key in w[0]}})
    return out


def stability(rows, n=100):
    """How steady a run is: gradient-norm growth (mean of the last n steps over the first n; n at
    most half the run), variability (std / mean over the run) of the gradient norm and of the KL,
    and the KL's mean over the last n steps."""
    g, kl = [r["grad_norm"] for r in rows], [r["kl"] for r in rows]
    n = max(1, min(n, len(rows) // 2))
    cv = lambda v: statistics.pstdev(v) / max(statistics.fmean(v), 1e-12)  # noqa: E731
    return {"steps": len(rows), "grad_growth": statistics.fmean(g[-n:]) / statistics.fmean(g[:n]),
            "grad_cv": cv(g), "kl_cv": cv(kl), "kl_last": statistics.fmean(kl[-n:])}


def point_key(path, opts):
    """The cache key of a checkpoint's sweep: the file (its real path, size, time) and the
    sweep's settings."""
    st = os.stat(path)
    what = [os.path.realpath(path), st.st_size, st.st_mtime_ns, opts.eval_temperatures,
            opts.eval_prompts, opts.eval_images_per_prompt, opts.eval_batch_size, opts.seed]
    return hashlib.sha1(json.dumps(what).encode()).hexdigest()[:16]


def run_args(run, opts):
    """The run's flags (the newest checkpoint's; config.json's "model" is the model's config, not
    the flag) with the curve's evaluation settings and seed over them."""
    names = checkpoints.checkpoint_names(os.path.join(run, "ckpt"))
    if not names:
        raise FileNotFoundError(f"{run}: no checkpoint in {run}/ckpt")
    saved = checkpoints.read_checkpoint(os.path.join(run, "ckpt", names[-1]), run)["args"]
    args = argparse.Namespace(**saved)
    for key in ("eval_temperatures", "eval_prompts", "eval_images_per_prompt", "eval_batch_size",
                "threads", "seed"):
        setattr(args, key, getattr(opts, key))
    args.device, args.eval_cfgs = "cpu" if opts.device == "cpu" else args.device, []
    return args


def sweep_run(run, opts, steps=None, sweep=evaluate.sweep_splits):
    """The curve points of a run's checkpoints (all, or those of `steps`), each swept once (the
    cache in opts.out/points/). sweep: evaluate.sweep_splits's signature (tests pass a fake)."""
    args = run_args(run, opts)
    ctx = processes.Ctx(args)
    found = run_checkpoints(run)
    chosen = sorted(s for s in found if steps is None or s in steps)
    missing = sorted(set(steps or ()) - set(found))
    if missing:
        raise FileNotFoundError(f"--steps: {run} has no checkpoint of step {missing} (it has "
                                f"{sorted(found)}; keep them with --save-every and --keep-last 0)")
    cache = os.path.join(opts.out, "points")
    os.makedirs(cache, exist_ok=True)
    args.out = os.path.join(opts.out, "images", os.path.basename(os.path.normpath(run)))
    points, codec, prompts, splits = [], None, None, None
    for step in chosen:
        path = os.path.join(cache, point_key(found[step], opts) + ".json")
        if not os.path.exists(path):
            model = loading.load_policy(args, found[step], f"{run} step {step}").to(ctx.device)
            if codec is None:  # the first checkpoint swept: what every checkpoint shares
                codec = loading.load_codec(args, model, ctx.device)
                prompts = loading.load_prompts(args, model)
                splits = {name: prompts.eval_items(args.eval_prompts, args.seed, name)
                          for name in ("heldout", "train")}
            s = sweep(args, ctx, model.requires_grad_(False), codec, prompts, splits,
                      {"shapes": verifier.ShapesReward()},
                      os.path.join(args.out, f"step_{step:06d}"), sorted(args.eval_temperatures))
            with checkpoints.writing(path), open(path, "w") as f:
                json.dump(curve_point(step, s), f)
        with open(path) as f:
            points.append(json.load(f))
    return points


def table(curves):
    """curve.md: per run and step, the best τ and both splits' strict accuracy there."""
    lines = ["| run | step | best τ | held out at best τ | training split at best τ |",
             "|---|---|---|---|---|"]
    for name, c in curves.items():
        for p in c["points"]:
            se = {s: 100 * evaluate.binomial_sem(p[s], p[f"{s}_n"]) for s in ("heldout", "train")}
            lines.append(f"| {name} | {p['step']} | {p['temperature']:g} | "
                         f"{p['heldout']:.1%} ± {se['heldout']:.1f} | "
                         f"{p['train']:.1%} ± {se['train']:.1f} |")
        s = c["stability"]
        lines.append(f"| {name} | stability | | grad-norm growth {s['grad_growth']:.1f}× | "
                     f"grad-norm cv {s['grad_cv']:.2f}, KL cv {s['kl_cv']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(curves, path):
    """curve.png: accuracy at each checkpoint's best τ (held out, training split; the base's as
    dotted lines), then each statistic of STATS, every run a colour."""
    fig = Figure(figsize=(13, 10))
    axes = fig.subplots(3, 3).ravel()
    colours = [f"C{i}" for i in range(10)]
    for (name, c), colour in zip(curves.items(), colours):
        steps = [p["step"] for p in c["points"]]
        for ax, split in zip(axes[:2], ("heldout", "train")):
            ax.plot(steps, [100 * p[split] for p in c["points"]], "o-", color=colour, label=name)
            base = next((p for p in c["points"] if p["step"] == 0), None)
            if base is not None:
                ax.axhline(100 * base[split], color=colour, ls=":", lw=1)
        mid = [(w["first"] + w["last"]) / 2 for w in c["windows"]]
        for ax, (key, _) in zip(axes[2:], STATS):
            if key in c["windows"][0]:
                ax.plot(mid, [w[key] for w in c["windows"]], color=colour, label=name)
    for ax, title in zip(axes, ("held out, strict accuracy at best τ (%)",
                                "training split, strict accuracy at best τ (%)",
                                *(label for _, label in STATS))):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
    axes[4].set_yscale("log")  # gradient norm
    axes[0].legend(fontsize=7)
    fig.text(0.01, 0.005, "dotted: the base (step 0) at its best τ", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def steps_list(text):
    """'0,100,200' -> [0, 100, 200] (an argparse type)."""
    return [flags.NONNEG_INT(t) for t in text.split(",")]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="train.py --out folders")
    p.add_argument("--out", required=True, help="the curve's folder")
    p.add_argument("--steps", type=steps_list, default=None,
                   help="the checkpoints' steps to sweep (default: all; 0 is the base)")
    p.add_argument("--eval-temperatures", type=flags.POS_FLOATS, default=[0.1, 0.3, 1.0])
    p.add_argument("--eval-prompts", type=flags.POS_INT, default=96, help="prompts per split")
    p.add_argument("--eval-images-per-prompt", type=flags.POS_INT, default=2)
    p.add_argument("--eval-batch-size", type=flags.POS_INT, default=64)
    p.add_argument("--seed", type=flags.NONNEG_INT, default=0,
                   help="the evaluation's prompts and noise, the same for every run")
    p.add_argument("--window", type=flags.POS_INT, default=20, help="steps a statistic averages")
    p.add_argument("--threads", type=flags.NONNEG_INT, default=0)
    p.add_argument("--device", default="auto", choices=["auto", "cpu"])
    return p.parse_args(argv)


def main(argv=None):
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    for run in opts.runs:
        for name in ("config.json", "metrics.jsonl"):
            if not os.path.exists(os.path.join(run, name)):
                raise FileNotFoundError(f"{run}: no {name} (not a train.py --out folder)")
    curves = {}
    for run in opts.runs:
        with open(os.path.join(run, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        name = os.path.basename(os.path.normpath(run))
        curves[name] = {"points": sweep_run(run, opts, opts.steps),
                        "windows": windows(rows, opts.window), "stability": stability(rows)}
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, "curve.json"), "w") as f:
        json.dump(curves, f, indent=1)
    with open(os.path.join(opts.out, "curve.md"), "w") as f:
        f.write(table(curves))
    plot(curves, os.path.join(opts.out, "curve.png"))
    print(table(curves) + f"\nfiles: {opts.out}/curve.png, curve.md, curve.json")
    return curves


if __name__ == "__main__":
    sys.exit(processes.cli(main))
