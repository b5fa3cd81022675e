"""The paper's comparison on spatial relations (experiments/study.md, "Spatial relations"): every arm
trains on the 312 training-split spatial prompts from a preset's base, then the base and each run's
last checkpoint are scored on every spatial prompt of both splits at each τ of the sweep
(`python -m experiments.spatial --sweep`: evaluate.temperature_sweep, the same seeds for every model
and τ), each at its best τ chosen on the training split.

    python -m experiments.relation_study [--out runs/relation] [--preset relation]
        [--reward shapes_relation] [--seeds 3] [--steps 60] [--arms a,b] [--base-cfgs 1,3]
        [--report-only] [train.py flags for every run]

The base is also swept over guidance weights (--base-cfgs): what sampling the base alone can reach.
Runs go two at a time with one thread each; finished runs and sweeps are skipped, an interrupted run
resumes. The report (relation.json, relation.md, relation.png in --out) gives per arm and seed the
held-out strict accuracy (every check of the verifier passes, a share of all images) at τ 1 and at
the run's best τ with binomial standard errors, the share of images whose objects are each drawn once
with the relation right, relation | both beside it, how the images fail (missing object, wrong count,
extra object, wrong relation), the gain over the base at the base's best setting, the gradient norm's
mean and std/mean, and the KL at the end; per arm the mean ± the sample standard deviation over seeds.
"""

import argparse
import json
import os
import sys

import numpy as np

import evaluate
from demo import verifier
from experiments import lab, spatial
from experiments.study import run_jobs, shell_chain, slug
from infra import checkpoints, flags, processes

RAFT_LR = "1e-4"
ARMS = {  # arm -> flags
    "mar-grpo": ["--method", "mar-grpo"],
    "grpo": ["--method", "grpo"],
    "grpo-fixed-head": ["--method", "grpo-fixed-head"],
    "raft": ["--method", "grpo-fixed-head", "--loss", "raft", "--lr", RAFT_LR],  # the supervised control
}
RUN = ["--eval-prompts", "0", "--keep-last", "1", "--save-every", "25"]
# the bar of a result RL earns: held-out strict accuracy, each at its best τ, above the base at its best
# sampling setting (τ and guidance) by this much in every seed
TARGET_GAIN = 0.10


def sweep_command(ckpt, out, preset, cfgs=None):
    """The command that sweeps `ckpt` into out/sweep.json (images beside it), or None if done."""
    if os.path.exists(os.path.join(out, "sweep.json")):
        return None
    return ([sys.executable, "-m", spatial.__name__, "--sweep", ckpt, "--json", os.path.join(out, "sweep.json"),
             "--threads", "1", "--preset", preset] + (["--eval-cfgs", cfgs] if cfgs else []))


def run(opts, extra):
    """Every arm × seed, then the sweeps; returns `report`."""
    root = opts.out
    arms = {a: f for a, f in ARMS.items() if not opts.arms or slug(a) in opts.arms.split(",")}
    run_flags = ["--preset", opts.preset, "--reward", opts.reward] + RUN + extra
    for arm_flags in arms.values():  # every run's flags parse before the first run starts
        lab.parse_args(run_flags + arm_flags)
    checkpoints.check_writable(root, "--out")
    os.makedirs(root, exist_ok=True)
    prompts = os.path.join(root, "train_spatial.txt")
    with open(prompts, "w") as f:
        f.writelines(m["prompt"] + "\n" for m in spatial.spatial_prompts("train"))
    jobs = []
    base_sweep = sweep_command(flags.PRESETS[opts.preset]["init"], os.path.join(root, "base"), opts.preset,
                               opts.base_cfgs)
    if base_sweep:
        os.makedirs(os.path.join(root, "base"), exist_ok=True)
        jobs.append(("base", os.path.join(root, "log_base.txt"), shell_chain([base_sweep])))
    for arm, arm_flags in arms.items():
        for seed in range(opts.seeds):
            out = os.path.join(root, slug(arm), f"seed{seed}")
            last = os.path.join(out, "ckpt", f"step_{opts.steps:06d}.pt")
            cmds = []
            if not os.path.exists(last):
                cmds.append([sys.executable, "-m", lab.__name__, "--prompts", prompts, "--steps", str(opts.steps),
                             "--seed", str(seed), "--out", out, "--threads", "1", "--resume", "auto"]
                            + run_flags + arm_flags)
            cmds += [c for c in [sweep_command(last, out, opts.preset)] if c]
            if cmds:
                jobs.append((f"{arm} seed {seed}", os.path.join(root, f"log_{slug(arm)}_{seed}.txt"), shell_chain(cmds)))
    run_jobs(jobs, "relation study")
    return report(opts, arms)


def read_sweep(folder):
    """A model's sweep (evaluate.temperature_sweep's dict), or None if it has not finished."""
    try:
        with open(os.path.join(folder, "sweep.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def at_w1(sweep):
    """The sweep restricted to unguided sampling (w None or 1), its best chosen again on it."""
    sub = dict(sweep, cells=[c for c in sweep["cells"] if c["cfg"] in (None, 1.0)])
    sub["best"] = evaluate.best_setting(sub)
    return sub


def figures(sweep, split, setting=None):
    """A split's figures at a setting (default: the sweep's best): strict accuracy, relation right
    (objects once each), relation | both, n, images with both objects, failure shares."""
    c = evaluate.cell(sweep, split, setting)
    return dict(accuracy=c["accuracy"], relation_right=c["relation_right"], relation_given_both=c["relation_given_both"],
                n=c["n"], both=c["both"], failures=c["failures"])


def describe(f):
    """'accuracy ± SEM | relation right | relation | both (n both) | failure shares' cells."""
    fails = f["failures"]
    return (f"{f['accuracy']:.1%} ± {evaluate.binomial_sem(f['accuracy'], f['n']):.1%} | {f['relation_right']:.1%} | "
            f"{f['relation_given_both']:.1%} ({f['both']}) | "
            + " / ".join(f"{fails[m]:.0%}" for m in verifier.FAILURES[1:]))


def sweep_table(name, sweep):
    """Markdown rows of every cell of a sweep: setting, split, strict accuracy ± SEM (n), relation
    right, relation | both (n both), failure shares; * marks the best setting."""
    lines = []
    for c in sweep["cells"]:
        setting = {"temperature": c["temperature"], "cfg": c["cfg"]}
        star = " *" if setting == sweep["best"] else ""
        lines.append(f"| {name} | {evaluate.setting_name(setting)}{star} | {c['split']} | {c['n']} | "
                     + describe(figures(sweep, c["split"], setting)) + " |")
    return lines


def report(opts, arms=None):
    """relation.json / relation.md / relation.png in --out from the finished runs; returns the figures."""
    root, arms = opts.out, arms or ARMS
    base = read_sweep(os.path.join(root, "base"))
    res = {"base": base, "arms": {}}
    cols = ("| model | setting | split | n | strict accuracy | relation right | relation \\| both (n both) | "
            "missing / wrong count / extra / wrong relation |")
    sweeps_md = [cols, "|" + "---|" * 8]
    runs_md = ["| arm | seed | best τ | held out at τ 1: strict accuracy | relation right | relation \\| both "
               "(n both) | failures | held out at its best τ: strict accuracy | relation right | relation \\| "
               "both (n both) | failures | gain over the base at its best (unguided) | gradient norm mean, "
               "std/mean | KL, last 10 steps |", "|" + "---|" * 15]
    base_best = base_unguided = None
    if base:
        sweeps_md += sweep_table("base", base)
        unguided = at_w1(base)  # the base at its best unguided setting, as the tuned runs sample
        res["base_best"] = dict(setting=base["best"], heldout=figures(base, "heldout"),
                                unguided=dict(setting=unguided["best"], heldout=figures(unguided, "heldout")))
        base_best = res["base_best"]["heldout"]["accuracy"]  # the base at its best τ and guidance
        base_unguided = res["base_best"]["unguided"]["heldout"]["accuracy"]
    curves = {}
    tau1 = {"temperature": 1.0, "cfg": None}
    for arm in arms:
        for seed in range(opts.seeds):
            out = os.path.join(root, slug(arm), f"seed{seed}")
            sweep = read_sweep(out)
            if sweep is None or not os.path.exists(os.path.join(out, "metrics.jsonl")):
                continue
            metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
            grad = np.array([r["grad_norm"] for r in metrics])
            at1, best = figures(sweep, "heldout", tau1), figures(sweep, "heldout")
            rec = dict(best=sweep["best"], heldout_tau1=at1, heldout_best=best, train_best=figures(sweep, "train"),
                       grad_norm_mean=float(grad.mean()), grad_norm_cv=float(grad.std() / grad.mean()),
                       kl_last=float(np.mean([r["kl"] for r in metrics[-10:]])),
                       gain=None if base_best is None else best["accuracy"] - base_best,
                       gain_unguided=None if base_best is None else best["accuracy"] - base_unguided)
            res["arms"].setdefault(arm, []).append(rec)
            curves.setdefault(arm, []).append(metrics)
            sweeps_md += sweep_table(f"{arm} {seed}", sweep)
            gain = "" if rec["gain"] is None else f"{100 * rec['gain']:+.1f} ({100 * rec['gain_unguided']:+.1f})"
            runs_md.append(f"| {arm} | {seed} | {sweep['best']['temperature']:g} | {describe(at1)} | {describe(best)} | "
                           f"{gain} | {rec['grad_norm_mean']:.3g}, {rec['grad_norm_cv']:.2f} | {rec['kl_last']:.2e} |")
    summary_md = []
    for arm, recs in res["arms"].items():
        held = [r["heldout_best"]["accuracy"] for r in recs]
        gains = [r["gain"] for r in recs if r["gain"] is not None]
        met = len(recs) == opts.seeds and len(gains) == len(recs) and all(g >= TARGET_GAIN for g in gains)
        std = lambda x: float(np.std(x, ddof=1)) if len(x) > 1 else None  # noqa: E731  (sample std over seeds)
        res["arms"][arm] = dict(runs=recs, heldout_best_mean=float(np.mean(held)), heldout_best_std=std(held),
                                gain_mean=float(np.mean(gains)) if gains else None, gain_std=std(gains),
                                target_met=bool(met))
        r = res["arms"][arm]
        spread = "" if r["heldout_best_std"] is None else f" ± {r['heldout_best_std']:.1%} (sample std)"
        summary_md.append(
            f"{arm}: held-out strict accuracy at its best τ {r['heldout_best_mean']:.1%}{spread} over {len(recs)} "
            f"seeds; gains over the base at its best: " + ", ".join(f"{100 * g:+.1f}" for g in gains)
            + f"; target (≥ +{100 * TARGET_GAIN:.0f} points in every seed) " + ("met" if met else "not met"))
    head = []
    if base:
        b, u = res["base_best"], res["base_best"]["unguided"]
        head = [f"base at its best setting ({evaluate.setting_name(b['setting'])}, chosen on the training split): "
                f"held out {describe(b['heldout'])}; unguided, at {evaluate.setting_name(u['setting'])}: "
                f"{describe(u['heldout'])}", ""]
    text = "\n".join(head + runs_md + [""] + summary_md + ["", "Every sweep's cells:", ""] + sweeps_md)
    with open(os.path.join(root, "relation.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(root, "relation.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("\n".join(head + runs_md + [""] + summary_md))
    if curves:
        spatial.plot_groups(curves, os.path.join(root, "relation.png"), w=5)
    return res


def main(argv=None):
    """`python -m experiments.relation_study ...`: the comparison (or its report); returns the figures."""
    p = processes.Parser(prog="python -m experiments.relation_study", description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/relation", help="the comparison's folder")
    p.add_argument("--preset", default="relation", choices=sorted(flags.PRESETS), help="the runs' preset (its base)")
    p.add_argument("--reward", default="shapes_relation", help="the runs' reward")
    p.add_argument("--seeds", type=flags.POS_INT, default=3, help="seeds per arm")
    p.add_argument("--steps", type=flags.POS_INT, default=60, help="GRPO steps per run")
    p.add_argument("--arms", default="", help=f"only these arms (of {', '.join(ARMS)})")
    p.add_argument("--base-cfgs", default=None, metavar="W,W,...", help="the base's sweep over guidance weights too")
    p.add_argument("--report-only", action="store_true", help="only aggregate the finished runs")
    opts, rest = p.parse_known_args(argv)
    if opts.base_cfgs:
        flags.POS_FLOATS(opts.base_cfgs)  # a bad list: one line, before any run
    return report(opts) if opts.report_only else run(opts, rest)


if __name__ == "__main__":
    sys.exit(processes.cli(main))
