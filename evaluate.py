"""Evaluation: images for prompts at fixed seeds, scored, and each model at its best sampling
temperature (train.py's before/after report, --eval-only, the lab's sweeps, the paper's tables).

One loop, `generate_and_score`, makes and scores every evaluation image (train.py's before/after
evaluation, --eval-only, the table of tables/paper.py), through rollout.record_rollout with nothing
recorded: the same loop and noise for MAR, Harmon and NOVA. Batch b of the (prompt, image) list is
drawn from a generator seeded by (--seed, the evaluation's seed stage, b) on rank b mod world: an
image depends on the seed, the batch size and the device type, never on the checkpoint, the
temperature or the number of processes, so every model and temperature is scored on the same noise.

A lower sampling temperature τ sharpens a model, dropping low-probability modes, which is much of
what a short RL run does (experiments/study.md). So models are compared each at its best τ:
`temperature_sweep` scores a model at every τ of --eval-temperatures (× --eval-cfgs) on a choice
split and on the reported one, `best_setting` picks the τ whose choice split scores highest, and
a gain is the tuned model's reported split at its best τ minus its base's at the base's best
(`gain_at_best`). In the shapes world: chosen on the training split (fresh seeds), reported held
out, by the strict accuracy (every check passes), a share of all images, with how images fail
beside it (`summarize`).
"""

import json
import math
import os

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from tqdm import tqdm

import rewards
import rollout
from demo import verifier
from infra import figures, processes

SEED_STAGE = processes.SEED_STAGES["evaluation"]  # seeded(device, --seed, SEED_STAGE, batch)
SHAPES_CATEGORIES = ("single", "two_objects", "counting", "spatial")  # demo/shapes.py's


@torch.no_grad()
def generate(model, codec, inputs, args, generator, temperature=None, cfg=None):
    """Images (B, 3, H, W) in [0, 1] for condition inputs of batch B, at the run's sampling flags,
    or at `temperature` and guidance `cfg` where given."""
    cfg = args.cfg if cfg is None else cfg
    temperature = args.temperature if temperature is None else temperature
    tokens, _ = rollout.record_rollout(model, inputs, args.num_iter, cfg, args.cfg_schedule,
                                       temperature, generator=generator)
    return codec.decode(model.unpatchify(tokens).float())


@torch.no_grad()
def generate_and_score(args, ctx, model, codec, prompts, items, reward_fns, out_dir,
                       temperature=None, cfg=None):
    """args.eval_images_per_prompt images for each of `items`, each scored by every reward of
    `reward_fns` ({name: Reward}) through rewards.score, at `temperature` and `cfg` (default: the
    run's). Batches of args.eval_batch_size; batch b on rank b mod world (module docstring). Every
    rank writes its images to out_dir/images/; rank 0 writes out_dir/scores.jsonl. Returns the
    rows of scores.jsonl, sorted (every rank gets all of them): prompt, prompt_index, image_index,
    file, one column per reward, and for shapes prompts the verifier's `details`,
    `shapes_accuracy` (1 where every check passes) and `category`."""
    model.eval()
    jobs = [(i, j) for i in range(len(items)) for j in range(args.eval_images_per_prompt)]
    size = args.eval_batch_size
    batches = [jobs[b0:b0 + size] for b0 in range(0, len(jobs), size)]
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    rows = []
    for b in tqdm(range(ctx.rank, len(batches), ctx.world), disable=not ctx.master,
                  desc=os.path.relpath(out_dir, args.out) if args.out else out_dir, leave=False):
        its = [items[i] for i, _ in batches[b]]
        texts, metas = prompts.texts(its), prompts.metas(its)
        generator = processes.seeded(ctx.device, args.seed, SEED_STAGE, b)
        with ctx.autocast():
            images = generate(model, codec, prompts.condition(its, ctx.device), args, generator,
                              temperature, cfg)  # (B, 3, H, W) in [0, 1]
        columns, details = {}, None
        for name, reward_fn in reward_fns.items():
            scores, info = rewards.score(reward_fn, name, images, texts, metas)  # (B,)
            columns[name] = scores.tolist()
            details = details or info.get("details")  # the shapes verifier's checks, per image
        for k, (i, j) in enumerate(batches[b]):
            file = f"images/{i:05d}_{j:03d}.png"
            px = images[k].float().clamp(0, 1).mul(255).round().byte().permute(1, 2, 0)  # (H, W, 3)
            Image.fromarray(px.cpu().numpy()).save(os.path.join(out_dir, file))
            row = dict(prompt=texts[k], prompt_index=i, image_index=j, file=file,
                       **{key: values[k] for key, values in columns.items()})
            task = its[k].get("task_type") if isinstance(its[k], dict) else None  # a record's
            if task:
                row["task_type"] = task
            if details is not None:
                row.update(shapes_accuracy=float(details[k]["correct"]),
                           category=its[k]["category"], details=details[k])
            rows.append(row)
    if ctx.ddp:  # the rows (no images) to every rank
        gathered = [None] * ctx.world
        dist.all_gather_object(gathered, rows)
        rows = [r for part in gathered for r in part]
    rows.sort(key=lambda r: (r["prompt_index"], r["image_index"]))
    if ctx.master:
        with open(os.path.join(out_dir, "scores.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    ctx.barrier()
    return rows


# -----------------------------------------------------------------------------
# What the rows say: strict accuracy and how images fail, a share of all images

def summarize(rows, reward_names=()):
    """A split's figures from generate_and_score's rows: n, the mean ± SEM of every reward of
    `reward_names`; for shapes prompts the strict accuracy (a share of all images), the share of
    each failure mode and the accuracy per category. (The spatial study's figures, relation and
    pass@k, extend it: experiments/spatial.spatial_summary.)"""
    out = {"n": len(rows)}
    for name in reward_names:
        figure = mean_sem([r[name] for r in rows])
        out.update({name: figure["mean"], f"{name}_sem": figure["sem"]})
    checked = [r for r in rows if "details" in r]
    if not checked:
        return out
    modes = [verifier.failure(r["details"]) for r in checked]
    out["accuracy"] = float(np.mean([r["details"]["correct"] for r in checked]))
    out["failures"] = {mode: modes.count(mode) / len(checked) for mode in verifier.FAILURES}
    for cat in SHAPES_CATEGORIES:
        sel = [r for r in checked if r["category"] == cat]
        if sel:
            out[f"accuracy/{cat}"] = float(np.mean([r["details"]["correct"] for r in sel]))
    return out


def mean_sem(values):
    """{"mean", "sem", "n"}: the mean and its standard error std(ddof=1) / sqrt(n) (None for
    n = 1)."""
    x = np.asarray(values, dtype=np.float64)  # (n,)
    sem = float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else None
    return {"mean": float(x.mean()), "sem": sem, "n": len(x)}


def binomial_sem(p, n):
    """The binomial standard error of a rate p over n images, sqrt(p (1 − p) / n)."""
    return math.sqrt(max(p * (1 - p), 0.0) / max(n, 1))


# -----------------------------------------------------------------------------
# Each model at its best sampling temperature

def temperature_sweep(score, temperatures, cfgs=(None,), choose_on="train", keys=("accuracy",)):
    """A model scored at every sampling setting (τ of `temperatures` × guidance of `cfgs`, None:
    the run's), its best chosen on one split by the first of `keys` its summaries hold.

    score(temperature, cfg) -> {split: summary dict holding a key and "n"}. Returns {"cells":
    [{"temperature", "cfg", "split", **summary}, ...], "best": the chosen {"temperature", "cfg"},
    "choose_on", "key"}."""
    cells = [dict(temperature=t, cfg=w, split=split, **summary)
             for t in temperatures for w in cfgs for split, summary in score(t, w).items()]
    key = next((k for k in keys if k in cells[0]), None)
    if key is None:
        raise ValueError(f"the sweep's summaries hold none of {list(keys)}")
    sweep = dict(cells=cells, choose_on=choose_on, key=key)
    sweep["best"] = best_setting(sweep)
    return sweep


def best_setting(sweep):
    """The setting whose choice split scores highest on the sweep's key; among equal ones the
    highest τ (the least sharpening), then the lowest guidance. Returns {"temperature", "cfg"}."""
    pool = [c for c in sweep["cells"] if c["split"] == sweep["choose_on"]]
    if not pool:
        raise ValueError(f"the sweep has no cell of the choice split {sweep['choose_on']!r}")
    best = max(pool, key=lambda c: (c[sweep["key"]], c["temperature"], -(c["cfg"] or 0)))
    return {"temperature": best["temperature"], "cfg": best["cfg"]}


def cell(sweep, split, setting=None):
    """The sweep's summary of `split` at `setting` ({"temperature", "cfg"}; default: its best)."""
    setting = setting or sweep["best"]
    for c in sweep["cells"]:
        same = c["temperature"] == setting["temperature"] and c["cfg"] == setting["cfg"]
        if c["split"] == split and same:
            return c
    raise KeyError(f"no cell of split {split!r} at {setting}")


def gain_at_best(base, tuned, split, key="accuracy"):
    """A tuned model's `key` on `split` at its best setting minus its base's at the base's best."""
    return cell(tuned, split)[key] - cell(base, split)[key]


def sweep_splits(args, ctx, model, codec, prompts, splits, reward_fns, out_dir, temperatures,
                 cfgs=(None,), choose_on="train", summary=summarize):
    """temperature_sweep of `model` over `splits` ({name: items}), each setting's images and scores
    in out_dir/tau<τ>[_cfg<w>]/<split>/, summarised by `summary(rows, reward names)` (a study's
    may add figures), the best chosen by the strict accuracy (shapes prompts) or else the first
    reward's mean. Returns the sweep (every rank)."""
    def score(temperature, cfg):
        folder = os.path.join(out_dir, setting_folder(temperature, cfg))
        return {split: summary(generate_and_score(args, ctx, model, codec, prompts, items,
                                                  reward_fns, os.path.join(folder, split),
                                                  temperature, cfg), list(reward_fns))
                for split, items in splits.items()}
    return temperature_sweep(score, temperatures, cfgs, choose_on, ("accuracy", *reward_fns))


def setting_folder(temperature, cfg=None):
    """The folder of a sampling setting's images: tau0.3, or tau0.3_cfg3."""
    return f"tau{temperature:g}" + ("" if cfg is None else f"_cfg{cfg:g}")


def setting_name(setting):
    """'τ 0.3' or 'τ 0.3, w 3' of a {"temperature", "cfg"} setting."""
    return f"τ {setting['temperature']:g}" + ("" if setting["cfg"] is None
                                              else f", w {setting['cfg']:g}")


def describe(summary, key):
    """'30.2% ± 3.3 (n 192)' of a rate (strict accuracy), '0.476 ± 0.012 (n 192)' of a mean."""
    if key == "accuracy":
        p = summary[key]
        return f"{p:.1%} ± {100 * binomial_sem(p, summary['n']):.1f} (n {summary['n']})"
    sem = summary.get(f"{key}_sem")
    spread = "" if sem is None else f" ± {sem:.2g}"
    return f"{summary[key]:.4g}{spread} (n {summary['n']})"


def print_report(out, report, at_run):
    """The before/after report of `python train.py`: per split, base and tuned at the run's setting
    `at_run` ({"temperature", "cfg"}: a cell of the sweep) and each at its best (chosen on the
    training split), the gain over the base at its best, and how the images at the best fail."""
    base, tuned = report["base"], report["tuned"]
    key = base["key"]
    scale, unit = (100, " points") if key == "accuracy" else (1, "")
    titles = {"heldout": "held-out prompts (never seen in pretraining or RL)",
              "train": "training-split prompts, fresh seeds"}
    for split in [s for s in titles if any(c["split"] == s for c in base["cells"])]:
        what = key if key != "accuracy" else "strict accuracy (every check passes), of all images"
        print(f"\n{titles[split]}: {what}")
        run_tau = setting_name(at_run)
        for name, sweep in (("base", base), ("tuned", tuned)):
            best = setting_name(sweep["best"])
            print(f"  {name:<6} at {run_tau:<7} {describe(cell(sweep, split, at_run), key):<26}"
                  f"at its best, {best:<7} {describe(cell(sweep, split), key)}")
        at_run_gain = cell(tuned, split, at_run)[key] - cell(base, split, at_run)[key]
        gain = gain_at_best(base, tuned, split, key)
        print(f"  tuned − base: {scale * gain:+.1f}{unit} each at its best τ, "
              f"{scale * at_run_gain:+.1f}{unit} at {run_tau}")
        for name, sweep in (("base", base), ("tuned", tuned)):
            fails = cell(sweep, split).get("failures")
            if fails:
                shares = ", ".join(f"{m} {fails[m]:.0%}" for m in verifier.FAILURES)
                print(f"  {name} at its best, images: {shares}")
    print(f"\nfiles: {out}/ (metrics.jsonl, curves.png, samples/, ckpt/, eval/)")


def base_and_tuned(args, ctx, base, tuned, codec, prompts, reward_fn):
    """`python train.py`'s last stage: base and tuned model on the same prompts and seeds, each at
    every τ of --eval-temperatures (and --temperature) and at its best τ, chosen on the training
    split: for shapes prompts the held-out compositions and the training split (prompts of the
    split RL draws from, fresh seeds); with --prompts, those prompts with fresh seeds. Writes
    eval/base/, eval/tuned/, eval/summary.json and eval/base_vs_tuned.png (the same prompts and
    seeds at the run's τ, then each at its best) and prints the report; returns {"base": sweep,
    "tuned": sweep}."""
    splits = {"train": prompts.eval_items(args.eval_prompts, args.seed, "train")}
    if args.prompts is None and prompts.is_shapes:
        splits = {"heldout": prompts.eval_items(args.eval_prompts, args.seed, "heldout"), **splits}
    temperatures = sorted({*args.eval_temperatures, args.temperature})
    at_run = {"temperature": args.temperature, "cfg": args.cfg if args.eval_cfgs else None}
    cfgs = sorted({*args.eval_cfgs, args.cfg}) if args.eval_cfgs else (None,)  # the run's w is one
    report = {tag: sweep_splits(args, ctx, model, codec, prompts, splits, {args.reward: reward_fn},
                                os.path.join(args.out, "eval", tag), temperatures, cfgs)
              for tag, model in (("base", base), ("tuned", tuned))}
    if ctx.master:
        with open(os.path.join(args.out, "eval", "summary.json"), "w") as f:
            json.dump(report, f, indent=1)
        print_report(args.out, report, at_run)
        split, key = next(iter(splits)), report["base"]["key"]
        settings = [("base", at_run), ("tuned", at_run), *((t, report[t]["best"]) for t in report)]
        rows = [(f"{tag} t{s['temperature']:g}", os.path.join(args.out, "eval", tag,
                 setting_folder(s["temperature"], s["cfg"]), split)) for tag, s in settings]
        def what(r):  # how an image fails (shapes prompts), or its score
            return verifier.failure(r["details"]) if "details" in r else f"{r[key]:.3f}"
        figures.image_rows(rows, os.path.join(args.out, "eval", "base_vs_tuned.png"), what)
        if args.preset == "smoke":
            print("(a toy model trained for seconds: its numbers test the pipeline only)")
    return report


def eval_only(args, ctx, model, codec, prompts, reward_fn):
    """`python train.py --eval-only`: the prompts (a file's, or held-out shapes ones) at
    --temperature, scored; scores.jsonl and summary.json in --out. Returns the summary."""
    items = prompts.eval_items(args.eval_prompts, args.seed)
    rows = generate_and_score(args, ctx, model, codec, prompts, items, {args.reward: reward_fn},
                              args.out)
    summary = summarize(rows, [args.reward])
    if ctx.master:
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    scores = os.path.join(args.out, "scores.jsonl")
    ctx.print0(json.dumps(summary, indent=1) + f"\nscores: {scores}")
    return summary
