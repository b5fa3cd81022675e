"""The controlled study of experiments/study.md: tables of GRPO runs from one base, arm against arm
(performance figures are benchmarks/bench.py's; probes of a base, experiments/probes.py).

    python -m experiments.study --study sweep         # the learning rate: grpo-fixed-head at SWEEP_LRS
    python -m experiments.study --study main          # MAIN_ARMS × 3 seeds, 150 steps, evaluated at 50/100/150
    python -m experiments.study --study hack          # 3 arms trained on a hackable proxy (HACK_REWARD), 100 steps
    python -m experiments.study --study components    # COMPONENT_ARMS, one seed, 50 steps (against main's step 50)
        [--study-out runs/study] [--study-lr 1e-4] [--study-seeds N] [--study-steps N] [--report-only]
        [--study-train-flags "..."] [train.py flags for every run]

study.md ran with `--preset free16` (its base: experiments/bases/free16.pt; experiments/lab.py).
A table: GRPO runs from the preset's base (demo/base.pt for the demo's preset) on the four
STUDY_PROMPTS, each run's checkpoints at the table's
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
from matplotlib.figure import Figure
from PIL import Image

from experiments import lab
from infra import checkpoints, flags, processes
from infra.figures import save_grid

# The study (experiments/study.md): GRPO from the demo's shipped base on four fixed training prompts, one
# per category, 4 prompts × G = 4 images a step, one thread per run, two runs at a time; every
# arm's seed s draws the same prompts and noise. Four tables, one command each:
#     python -m experiments.study --study sweep|main|hack|components
STUDY_PROMPTS = ["a red square", "a green circle and a yellow square", "three red circles",
                 "a blue square left of a green circle"]
# each arm's --lr as given, whatever its --steps (the demo preset's --lr-budget would lower it)
STUDY_RUN = ["--prompts-per-step", "4", "--group-size", "4", "--keep-last", "0", "--save-every", "50",
             "--lr-budget", "off"]
SWEEP_LRS = ["3e-5", "1e-4", "3e-4"]
STUDY_LR = "3e-5"  # the sweep's choice: the fixed head's training reward rises at 3e-5, falls at 1e-4 (experiments/study.md)
HACK_LR = "1e-4"   # the proxy runs: fast enough that the policy moves (KL ~1e-2 after 60 steps in the sweep)
HACK_REWARD = "shapes_coverage:1,shapes:0"  # train on the proxy; the verifier (weight 0) is only logged

MAIN_ARMS = {  # arm -> train.py flags
    "grpo": ["--method", "grpo"],
    "grpo-fixed-head": ["--method", "grpo-fixed-head"],
    "mar-grpo": ["--method", "mar-grpo", "--mte-positions", "unknown"],
    "mar-grpo, MTE on P_i": ["--method", "mar-grpo", "--mte-positions", "predicted"],
}
COMPONENT_ARMS = {  # against mar-grpo (S = 3, k = 30%, τ = 0, MTE on U_i); S = 1 is the masks without MTE
    "MTE alone (S=3 on all tokens, no mask)": ["--method", "grpo-fixed-head", "--mte-trajectories", "3", "--top-k", "1",
                                               "--mte-positions", "unknown"],
    "mar-grpo S=1 (consistency mask alone)": ["--method", "grpo-fixed-head", "--consistency-threshold", "0"],
    "mar-grpo S=5": ["--method", "mar-grpo", "--mte-trajectories", "5", "--mte-positions", "unknown"],
    "mar-grpo k=10%": ["--method", "mar-grpo", "--top-k", "0.1", "--mte-positions", "unknown"],
    "mar-grpo k=60%": ["--method", "mar-grpo", "--top-k", "0.6", "--mte-positions", "unknown"],
    "mar-grpo tau off": ["--method", "mar-grpo", "--consistency-threshold", "off", "--mte-positions", "unknown"],
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


def slug(arm):
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
    if opts.study_arms:  # folder names (slug) of the arms to keep
        keep = opts.study_arms.split(",")
        spec["arms"] = {arm: arm_flags for arm, arm_flags in spec["arms"].items() if slug(arm) in keep}
    if spec["lr"] == STUDY_LR and opts.study_lr:
        spec["lr"] = opts.study_lr
    spec["evals"] = tuple(k for k in spec["evals"] if k <= spec["steps"]) or (() if not spec["evals"] else (spec["steps"],))
    return spec


def _run_dir(root, table, arm, seed):
    return os.path.join(root, table, slug(arm), f"seed{seed}")


def study(opts, extra):
    """Run the tables of --study (TABLES), in one queue: every arm × seed a GRPO run from the base, then for each
    evaluated checkpoint two evaluations with fixed seeds (the stratified held-out prompts, and the
    four study prompts × 24 images); the base is evaluated the same way once. Two processes at a
    time with one thread each; finished runs and evaluations are skipped, so an interrupted table
    continues where it stopped. Ends with study_report of each table. `extra` flags go to every
    train.py call, --study-train-flags only to the GRPO runs."""
    root = opts.study_out
    extra = ["--preset", opts.preset] + extra
    py = [sys.executable, "-m", lab.__name__]  # train.py, with the lab's presets and rewards
    base = flags.PRESETS[opts.preset].get("init")
    if base is None or not os.path.exists(base):
        raise FileNotFoundError(f"--preset {opts.preset}: its base {base} is missing (the study starts from a preset's base)")
    for name in opts.study:  # every run's flags parse before the first run starts (a bad one: one line, nothing written)
        spec = _table(opts, name)
        for arm_flags in spec["arms"].values():
            lab.parse_args(extra + arm_flags + (["--lr", spec["lr"]] if spec["lr"] else [])
                             + (["--reward", spec["reward"]] if spec["reward"] else []) + opts.study_train_flags.split())
    checkpoints.check_writable(root, "--study-out")
    os.makedirs(root, exist_ok=True)
    prompt_file = os.path.join(root, "prompts.txt")
    with open(prompt_file, "w") as f:
        f.write("\n".join(STUDY_PROMPTS) + "\n")

    def evals(ckpt, out, k):  # held-out prompts (stratified), then the study's prompts × 24 images
        cmds = []
        for name, more in ((f"eval_{k}", []), (f"eval_train_{k}", ["--prompts", prompt_file, "--eval-images-per-prompt", "24"])):
            if not os.path.exists(os.path.join(out, name, "summary.json")):
                cmds.append(py + ["--eval-only", "--init", ckpt, "--out", os.path.join(out, name), "--threads", "1"]
                            + extra + more)
        return cmds

    jobs = []  # (table, arm, seed, shell command)
    base_cmds = evals(base, os.path.join(root, "base"), 0)
    if base_cmds and any(_table(opts, name)["evals"] for name in opts.study):
        jobs.append(("base", "base", 0, shell_chain(base_cmds)))
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
                    cmds.append(py + ["--eval-prompts", "0", "--init", base, "--out", out, "--seed", str(seed),
                                      "--threads", "1", "--resume", "auto"] + extra + train_flags + arm_flags + opts.study_train_flags.split())
                for k in spec["evals"]:
                    cmds += evals(os.path.join(out, "ckpt", f"step_{k:06d}.pt"), out, k)
                if cmds:
                    jobs.append((name, arm, seed, shell_chain(cmds)))
    run_jobs([(f"{name}: {arm} seed {seed}", os.path.join(root, f"log_{name}_{slug(arm)}_{seed}.txt"), cmd)
              for name, arm, seed, cmd in jobs], "study")
    return {name: study_report(opts, name) for name in opts.study}


def shell_chain(cmds):
    """One shell line that runs the commands (argument lists) in turn, stopping at the first that fails."""
    return " && ".join(" ".join(shlex.quote(str(c)) for c in cmd) for cmd in cmds)


def run_jobs(jobs, who, parallel=2):
    """Run shell commands `parallel` at a time, one thread each: jobs are (what it runs, log path,
    command). Raises processes.Stop naming the first failure and its one-line reason, once all ended."""
    jobs, running, failed = list(jobs), [], []  # running: (process, log, what it runs)
    while jobs or running:
        while jobs and len(running) < parallel:
            what, path, cmd = jobs.pop(0)
            print(f"{who}: {what}", flush=True)
            with open(path, "w") as log:
                running.append((subprocess.Popen(cmd, shell=True, stdout=log, stderr=subprocess.STDOUT,
                                                 env=dict(os.environ, OMP_NUM_THREADS="1")), path, what))
        time.sleep(2)
        for job in [job for job in running if job[0].poll() is not None]:
            if job[0].returncode:
                failed.append(job)
                print(f"{who}: {job[2]} failed: {_reason(open(job[1]).read())}", flush=True)
            running.remove(job)
    if failed:
        raise processes.Stop(f"{who}: {len(failed)} run(s) failed, the first ({failed[0][2]}): "
                             f"{_reason(open(failed[0][1]).read())} (log: {failed[0][1]})")


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
               step_s=float(np.mean([r["t_rollout"] + r["t_reward"] + r.get("t_mte", 0.0) + r["t_update"]
                                     for r in rows])))
    return rec, rows


def _smooth(x, w=10):
    """Trailing moving average over w steps (shorter at the start)."""
    c = np.cumsum(np.insert(np.asarray(x, dtype=float), 0, 0.0))
    i = np.arange(1, len(x) + 1)
    return (c[i] - c[np.maximum(i - w, 0)]) / np.minimum(i, w)


def sample_grid(root, name, spec, path, per_prompt=2):
    """Rows of `per_prompt` evaluation images of each study prompt (the same seeds in every row):
    the base, then every arm's seed 0 at the table's last evaluated checkpoint. Returns the row labels."""
    k = spec["evals"][-1]
    rows = [("base (no RL)", os.path.join(root, "base", "eval_train_0"))]
    rows += [(f"{arm}, step {k}", os.path.join(_run_dir(root, name, arm, 0), f"eval_train_{k}")) for arm in spec["arms"]]
    images, captions, labels = [], [], []
    for label, folder in rows:
        try:
            results = [json.loads(line) for line in open(os.path.join(folder, "scores.jsonl"))]
        except OSError:
            continue
        per = len(results) // len(STUDY_PROMPTS)  # the images of a prompt are consecutive
        for r in [results[i * per + j] for i in range(len(STUDY_PROMPTS)) for j in range(per_prompt)]:
            img = np.array(Image.open(os.path.join(folder, r["file"])).convert("RGB"))
            images.append(torch.from_numpy(img).permute(2, 0, 1).float() / 255)  # (3, H, W)
            captions.append(("[ok] " if r["details"]["correct"] else "") + r["prompt"])
        labels.append(label)
    if images:
        save_grid(torch.stack(images), captions, path)
    return labels


def study_report(opts, name):
    """Aggregate one table's finished runs into <table>.json, <table>.md and <table>.png in
    --study-out: per arm, mean ± std over seeds of run_record's figures; curves of the training
    reward (and the verifier under a proxy) and the gradient norm, mean over seeds with a ±std band,
    and accuracy at the evaluated checkpoints against the base's."""
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
    lines = [f"`python -m experiments.study --study {name}`: {spec['steps']} steps, lr {spec['lr'] or 'per arm'}, "
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
    fig = Figure(figsize=(4.2 * (len(panels) + 1), 3.6))
    axes = fig.subplots(1, len(panels) + bool(spec["evals"]))
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
    """`python -m experiments.study ...`: the study; returns its summary."""
    p = processes.Parser(prog="python -m experiments.study", description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", required=True, type=_tables, metavar="TABLE[,TABLE]",
                   help=f"run tables of the study in one queue: {', '.join(TABLES)} (see study())")
    p.add_argument("--preset", default="demo", help="train.py preset of every run (its base is the runs' --init)")
    p.add_argument("--study-out", default="runs/study", help="the study's folder (one per base and preset)")
    p.add_argument("--study-seeds", type=int, default=0, help="seeds per arm (0: the table's)")
    p.add_argument("--study-steps", type=int, default=0, help="GRPO steps per run (0: the table's)")
    p.add_argument("--study-lr", default=None, help=f"learning rate of the main and components tables (default {STUDY_LR})")
    p.add_argument("--study-arms", default="", help="only these arms, by folder name (e.g. grpo-fixed-head,mar-grpo)")
    p.add_argument("--study-train-flags", default="", help="extra train.py flags for the GRPO runs only")
    p.add_argument("--report-only", action="store_true", help="with --study: only aggregate the finished runs")
    opts, rest = p.parse_known_args(argv)
    return {name: study_report(opts, name) for name in opts.study} if opts.report_only else study(opts, rest)


if __name__ == "__main__":
    sys.exit(processes.cli(main))
