"""The paper's comparison on a base that half-follows spatial relations (experiments/study.md,
"Spatial relations"): every arm trains on the 312 training-split spatial prompts with a reward that
copies cannot pay (`--reward shapes_relation`: 1 only where both objects are drawn once, nothing
else is, and the relation holds), from the preset's base, then each run's last checkpoint and the
base are evaluated on every spatial prompt of both splits at each τ of TAUS (`spatial.evaluate_spatial`,
the same seeds for every model).

    python -m experiments.relation_study [--out runs/relation] [--seeds 3] [--steps 60] [--arms a,b]
        [--report-only] [train.py flags for every run]

Runs go two at a time with one thread each; finished runs and evaluations are skipped, an
interrupted run resumes. The report (relation.json, relation.md, relation.png in --out) gives per arm
and seed relation | both and strict accuracy at τ 1 and at the arm's best τ (chosen on the training
split), with binomial standard errors, the gradient norm's mean and std/mean, and the KL at the end.
"""

import argparse
import json
import os
import sys

import numpy as np

from experiments import lab, spatial
from experiments.study import run_jobs, shell_chain, slug
from infra import checkpoints, flags, processes

PRESET = "relation"  # lab.py: the half-following base experiments/bases/relation.pt, the demo's sampling
RAFT_LR = "1e-4"
ARMS = {  # arm -> flags
    "mar-grpo": ["--method", "mar-grpo"],
    "grpo": ["--method", "grpo"],
    "grpo-fixed-head": ["--method", "grpo-fixed-head"],
    "raft": ["--method", "grpo-fixed-head", "--loss", "raft", "--lr", RAFT_LR],  # the supervised control
}
RUN = ["--reward", "shapes_relation", "--eval-prompts", "0", "--keep-last", "1", "--save-every", "25"]
TAUS = ("1", "0.6")
TARGET = dict(heldout=0.85, gain=0.20)  # relation | both held out at τ 1, and its gain over the base in every seed


def evals(ckpt, out):
    """The commands that evaluate `ckpt` at every τ of TAUS into out/eval_tau<τ>.json (those not done)."""
    py = [sys.executable, "-m", spatial.__name__]
    return [py + ["--eval", ckpt, "--temperature", t, "--json", os.path.join(out, f"eval_tau{t}.json"), "--threads", "1",
                  "--preset", PRESET]
            for t in TAUS if not os.path.exists(os.path.join(out, f"eval_tau{t}.json"))]


def run(opts, extra):
    """Every arm × seed, then the evaluations; returns `report`."""
    root = opts.out
    arms = {a: f for a, f in ARMS.items() if not opts.arms or slug(a) in opts.arms.split(",")}
    for arm_flags in arms.values():  # every run's flags parse before the first run starts
        flags.parse_args(["--preset", PRESET] + RUN + extra + arm_flags)
    checkpoints.check_writable(root, "--out")
    os.makedirs(root, exist_ok=True)
    prompts = os.path.join(root, "train_spatial.txt")
    with open(prompts, "w") as f:
        f.writelines(m["prompt"] + "\n" for m in spatial.spatial_prompts("train"))
    jobs = []
    base_evals = evals(flags.PRESETS[PRESET]["init"], os.path.join(root, "base"))
    if base_evals:
        os.makedirs(os.path.join(root, "base"), exist_ok=True)
        jobs.append(("base", os.path.join(root, "log_base.txt"), shell_chain(base_evals)))
    for arm, arm_flags in arms.items():
        for seed in range(opts.seeds):
            out = os.path.join(root, slug(arm), f"seed{seed}")
            cmds = []
            if not os.path.exists(os.path.join(out, "ckpt", f"step_{opts.steps:06d}.pt")):
                cmds.append([sys.executable, "-m", lab.__name__, "--preset", PRESET, "--prompts", prompts, "--steps",
                             str(opts.steps), "--seed", str(seed), "--out", out, "--threads", "1", "--resume", "auto"]
                            + RUN + extra + arm_flags)
            cmds += evals(os.path.join(out, "ckpt", f"step_{opts.steps:06d}.pt"), out)
            if cmds:
                jobs.append((f"{arm} seed {seed}", os.path.join(root, f"log_{slug(arm)}_{seed}.txt"), shell_chain(cmds)))
    run_jobs(jobs, "relation study")
    return report(opts, arms)


def figures(folder):
    """One model's evaluations: {τ: {split: (relation | both, its n, accuracy, its n)}}, or None if not all done."""
    res = {}
    for t in TAUS:
        try:
            with open(os.path.join(folder, f"eval_tau{t}.json")) as f:
                ev = json.load(f)
        except (OSError, ValueError):
            return None
        res[t] = {s: (ev[s]["relation_rate_given_both"], ev[s]["both"], ev[s]["accuracy"], ev[s]["images"])
                  for s in ("train", "heldout")}
    return res


def best_tau(fig):
    """The τ of TAUS whose training-split accuracy is highest (the first of equal ones)."""
    return max(TAUS, key=lambda t: fig[t]["train"][2])


def describe(fig, t):
    """'relation | both train / held out, accuracy train / held out' at τ t, with binomial SEMs."""
    (rt, nt, at, it), (rh, nh, ah, ih) = fig[t]["train"], fig[t]["heldout"]
    return (f"{rt:.1%} ± {spatial.sem(rt, nt):.1%} / {rh:.1%} ± {spatial.sem(rh, nh):.1%}",
            f"{at:.1%} ± {spatial.sem(at, it):.1%} / {ah:.1%} ± {spatial.sem(ah, ih):.1%}")


def report(opts, arms=None):
    """relation.json / relation.md / relation.png in --out from the finished runs; returns the figures."""
    root, arms = opts.out, arms or ARMS
    base = figures(os.path.join(root, "base"))
    res = {"base": base, "arms": {}}
    header = ("| model | seed | τ | relation \\| both, train / held out | accuracy, train / held out | "
              "gain held out (τ 1) | gradient norm mean, std/mean | KL, last 10 steps |")
    lines = [header, "|" + "---|" * 8]
    if base:
        for t in ("1", best_tau(base)):
            lines.append(f"| base | | {t} | " + " | ".join(describe(base, t)) + " | | | |")
    curves = {}
    for arm in arms:
        for seed in range(opts.seeds):
            out = os.path.join(root, slug(arm), f"seed{seed}")
            fig = figures(out)
            if fig is None or not os.path.exists(os.path.join(out, "metrics.jsonl")):
                continue
            metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
            grad = np.array([r["grad_norm"] for r in metrics])
            rec = dict(fig=fig, best_tau=best_tau(fig), grad_norm_mean=float(grad.mean()),
                       grad_norm_cv=float(grad.std() / grad.mean()), kl_last=float(np.mean([r["kl"] for r in metrics[-10:]])),
                       gain=fig["1"]["heldout"][0] - base["1"]["heldout"][0] if base else None)
            res["arms"].setdefault(arm, []).append(rec)
            curves.setdefault(arm, []).append(metrics)
            for t in ("1",) + ((rec["best_tau"],) if rec["best_tau"] != "1" else ()):
                gain = f"{rec['gain']:+.1%}" if t == "1" and rec["gain"] is not None else ""
                lines.append(f"| {arm} | {seed} | {t} | " + " | ".join(describe(fig, t)) + f" | {gain} | "
                             f"{rec['grad_norm_mean']:.3g}, {rec['grad_norm_cv']:.2f} | {rec['kl_last']:.2e} |")
    base_best = max(base[t]["heldout"][0] for t in TAUS) if base else float("inf")  # the base at its best τ
    for arm, recs in res["arms"].items():
        held = [r["fig"]["1"]["heldout"][0] for r in recs]
        met = len(recs) == opts.seeds and all(h >= TARGET["heldout"] and h > base_best for h in held) and all(
            r["gain"] is not None and r["gain"] >= TARGET["gain"] for r in recs)
        res["arms"][arm] = dict(runs=recs, heldout_relation_mean=float(np.mean(held)),
                                heldout_relation_std=float(np.std(held)), target_met=bool(met))
    text = "\n".join(lines + [""] + [
        f"{arm}: relation | both held out at τ 1 {r['heldout_relation_mean']:.1%} ± {r['heldout_relation_std']:.1%} "
        f"over {len(r['runs'])} seeds; target (≥ {TARGET['heldout']:.0%}, a gain ≥ {TARGET['gain'] * 100:.0f} points and "
        "above the base's best τ, in every seed) "
        + ("met" if r["target_met"] else "not met") for arm, r in res["arms"].items()])
    with open(os.path.join(root, "relation.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(root, "relation.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(text)
    if curves:
        spatial.plot_groups(curves, os.path.join(root, "relation.png"), w=5)
    return res


def main(argv=None):
    """`python -m experiments.relation_study ...`: the comparison (or its report); returns the figures."""
    p = processes.Parser(prog="python -m experiments.relation_study", description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/relation", help="the comparison's folder")
    p.add_argument("--seeds", type=flags.POS_INT, default=3, help="seeds per arm")
    p.add_argument("--steps", type=flags.POS_INT, default=60, help="GRPO steps per run")
    p.add_argument("--arms", default="", help=f"only these arms (of {', '.join(ARMS)})")
    p.add_argument("--report-only", action="store_true", help="only aggregate the finished runs")
    opts, rest = p.parse_known_args(argv)
    return report(opts) if opts.report_only else run(opts, rest)


if __name__ == "__main__":
    sys.exit(processes.cli(main))
