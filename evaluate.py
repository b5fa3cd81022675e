"""Evaluation: generate images for prompts with fixed seeds, score them, write them; and the paper's
metric table.

`evaluate` is what `python train.py` runs on the base and the tuned model (the same prompts and
seeds for both) and what `python train.py --eval-only` runs on a checkpoint. Generation goes
through rollout.record_rollout with nothing recorded, so it is the same loop, and the same noise,
for MAR, Harmon and NOVA. Under torchrun every rank generates a slice and sends it to rank 0,
which alone holds all the images and writes them.

The paper's table (`python evaluate.py --help`):

    python evaluate.py --ckpt base=PATH --ckpt tuned=PATH --prompts FILE --images-per-prompt 4 \\
        --seed 0 --reward hpsv2,imagereward,pickscore --reward-ckpt hpsv2=... --out DIR [train.py flags]

generates N images per prompt for every checkpoint with the same seeds, scores each image with
each named reward on its own, and writes DIR/NAME/images/*.png, DIR/NAME/scores.jsonl (one line
per image: prompt, prompt and image index, file, one raw score per reward) and DIR/table.md and
DIR/table.json (rows: checkpoints; columns: rewards as the papers print them, "mean ± SEM").
Every flag it does not define itself (--model, --preset, --prompts, --seed, --reward,
--reward-ckpt, the sampling flags, ...) is train.py's, with train.py's defaults and checks.

With --compbench (and --prompts FILE.jsonl, the released records) the columns are T2I-CompBench's
categories instead: each image is scored by its record's category evaluator (scorers/compbench.py), each
cell is the mean ± SEM over that category's images, and the departures from the benchmark are
printed under the table.

Where the table departs from what the papers state:
1. Seeds are per batch: batch b of the fixed (prompt, image) list is drawn from a generator seeded
   by (--seed, b) on the run's device, so an image depends on the seed, --batch-size and the device
   type, never on the checkpoint or the number of processes (batch b runs on rank b mod world).
2. The SEM is over images (n = prompts × images per prompt), std(ddof=1) / sqrt(n); images of one
   prompt are not independent, so it understates the spread over prompt sets.
3. Under torchrun each rank writes its own PNGs (DIR must be one shared folder, as in DiT's
   sample_ddp.py); the scores are gathered and rank 0 writes the rest.
"""

import json
import math
import os
import re
import sys

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from tqdm import tqdm

import rewards
import rollout
from demo import shapes
from infra import flags, processes, prompt_records
from models import loading
from scorers import compbench, remote


@torch.no_grad()
def generate(model, codec, inputs, args, generator):
    """Images (B, 3, H, W) in [0, 1] for condition inputs of batch B, at the run's sampling flags."""
    tokens, _ = rollout.record_rollout(model, inputs, args.num_iter, args.cfg, args.cfg_schedule,
                                       args.temperature if args.eval_temperature is None else args.eval_temperature,
                                       generator=generator)
    return codec.decode(model.unpatchify(tokens).float())


@torch.no_grad()
def evaluate(args, ctx, model, codec, items, prompts, reward_fn, out_dir, tag):
    """Generate args.eval_images_per_prompt images for each item, score them with reward_fn (via
    rewards.score, the guarded call), and write images/, results.jsonl (one line per image:
    prompt, file, reward, category, per-check details) and summary.json. Returns the summary."""
    model.eval()
    jobs = [(i, it) for i, it in enumerate(items) for _ in range(args.eval_images_per_prompt)]
    mine = jobs[ctx.rank::ctx.world]
    rows, batch = [], 64
    if ctx.master:
        os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    for b0 in tqdm(range(0, len(mine), batch), disable=not ctx.master, desc=f"eval {tag}"):
        chunk = mine[b0:b0 + batch]
        its = [it for _, it in chunk]
        with ctx.autocast():
            images = generate(model, codec, prompts.condition(its, ctx.device), args, ctx.generator(6, b0))
        scores, info = rewards.score(reward_fn, args.reward, images, prompts.texts(its), prompts.metas(its))
        details = info.get("details", [{}] * len(its))
        for k, ((i, it), img) in enumerate(zip(chunk, images)):
            rows.append(dict(index=i, prompt=prompts.texts([it])[0], reward=float(scores[k]),
                             category=it.get("category") if isinstance(it, dict) else None,
                             details=details[k], image=img.cpu()))
    if ctx.ddp:  # rank 0 alone receives the images and writes them
        gathered = [None] * ctx.world if ctx.master else None
        dist.gather_object(rows, gathered, dst=0)
        rows = [r for part in gathered for r in part] if ctx.master else []
    summary = {}
    if ctx.master:
        rows.sort(key=lambda r: r["index"])
        with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
            for k, r in enumerate(rows):
                name = f"images/{k:05d}.png"
                arr = (r.pop("image").clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
                Image.fromarray(arr).save(os.path.join(out_dir, name))
                f.write(json.dumps({"prompt": r["prompt"], "file": name, "reward": r["reward"],
                                    "category": r["category"], "details": r["details"]}) + "\n")
        summary = summarize(rows)
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    ctx.barrier()
    return summary


def group_diversity(images, G):
    """Mean pairwise RMS pixel distance between the images of a group (a collapse detector)."""
    x = images.flatten(1).reshape(-1, G, images[0].numel()).float()  # (#prompts, G, 3·H·W)
    d = torch.cdist(x, x) / math.sqrt(x.shape[-1])  # (#prompts, G, G)
    return d.sum() / (d.shape[0] * G * (G - 1))


def summarize(rows):
    """Mean reward, and for shapes prompts the accuracy (all checks pass) by category."""
    out = {"n": len(rows), "reward_mean": float(np.mean([r["reward"] for r in rows]))}
    checked = [r for r in rows if "correct" in (r["details"] or {})]
    if checked:
        out["accuracy"] = float(np.mean([r["details"]["correct"] for r in checked]))
        for cat in shapes.CATEGORIES:
            sel = [r for r in checked if r["category"] == cat]
            if sel:
                out[f"accuracy/{cat}"] = float(np.mean([r["details"]["correct"] for r in sel]))
                out[f"reward/{cat}"] = float(np.mean([r["reward"] for r in sel]))
    return out


def print_report(out, report):
    """The before/after table of `python train.py`'s last stage."""
    titles = {"": "held-out prompts (never seen in pretraining or RL)", "_train": "training-split prompts, fresh seeds"}
    for suffix, title in titles.items():
        before, after = report.get("base" + suffix), report.get("tuned" + suffix)
        if before is None:
            continue
        print(f"\n{title}, {before['n']} images:")
        print(f"  {'metric':<26}{'base':>8}{'tuned':>8}")
        for k in [k for k in before if k.startswith("accuracy") or k.startswith("reward")]:
            print(f"  {k:<26}{before[k]:>8.3f}{after.get(k, float('nan')):>8.3f}")
    print(f"\nfiles: {out}/ (metrics.jsonl, curves.png, samples/, ckpt/, eval/)")


# -----------------------------------------------------------------------------
# The paper's table: `python evaluate.py --ckpt NAME=PATH ... --reward hpsv2,imagereward,pickscore`

# reward name -> its columns: (key in scores.jsonl, label as the papers print it, scale, decimals);
# HPS is a cosine that papers print ×100 (0.2676 -> 26.76); CLIP score and PickScore are already ×100
COLUMNS = {
    "hpsv2": [("hpsv2", "HPS v2 (×100)", 100.0, 2)],
    "imagereward": [("imagereward", "ImageReward", 1.0, 3)],
    "pickscore": [("pickscore", "PickScore", 1.0, 2)],
    "clip_score": [("clip_score", "CLIP score", 1.0, 2)],
    "aesthetic": [("aesthetic", "Aesthetic", 1.0, 2)],
    "shapes": [("shapes_accuracy", "Shapes accuracy", 1.0, 3), ("shapes", "Shapes reward", 1.0, 3)],
}  # any other reward: one column of its name, as is (e.g. jpeg_incompressibility, kB)
SEED_STAGE = 10  # the table's generators: seeded(device, seed, SEED_STAGE, batch); train.py uses 1..8


def table_parser():
    p = processes.Parser(prog="evaluate.py", allow_abbrev=False, description="The paper's table: N images per prompt "
                     "for every checkpoint with the same seeds, each scored by each --reward on its own.",
                     epilog="Every other flag is train.py's (python train.py --help): --model, --preset, --prompts, "
                            "--seed, --reward (names, comma-separated), --reward-ckpt, the sampling flags.")
    a = p.add_argument
    a("--ckpt", action="append", default=[], metavar="NAME=PATH", help="a checkpoint and its row name (repeatable; "
      "NOVA: the first is the pipeline folder whose vae/ decodes, unless --vae)")
    a("--images-per-prompt", type=flags.POS_INT, default=1, help="images generated per prompt and checkpoint")
    a("--batch-size", type=flags.POS_INT, default=16, help="images per generated batch (each batch has its own seed)")
    a("--out", required=True, help="output folder: NAME/images/, NAME/scores.jsonl, table.md, table.json")
    a("--compbench", action="store_true", help="the T2I-CompBench table (scorers/compbench.py) instead of the --reward columns: "
      "--prompts is the released records (.jsonl), each image scored by its task type's evaluator")
    a("--compbench-ckpt", action="append", default=[], metavar="KEY=PATH",
      help="T2I-CompBench weights: blip_vqa=FOLDER, gdino=FOLDER, clip=ViT-B-32.pt (repeatable)")
    return p


def parse_table_args(argv=None):
    """This file's flags, then train.py's for the rest; checks the inputs (`check_table_inputs`)."""
    own, rest = table_parser().parse_known_args(argv)
    if not own.out.strip():
        raise ValueError("--out '': give the table's folder")
    args = flags.parse_args(rest)
    args.out, args.images_per_prompt, args.batch_size = own.out, own.images_per_prompt, own.batch_size
    args.compbench = own.compbench
    args.compbench_weights = compbench.parse_weights(own.compbench_ckpt, own.compbench)
    args.ckpts = parse_ckpts(own.ckpt)
    args.init = args.ckpts[0][1]  # where loading.load_codec looks for NOVA's vae/ folder
    check_table_inputs(args)
    return args


def parse_ckpts(values):
    """['base=a.pt', 'tuned=b.pt'] -> [('base', 'a.pt'), ('tuned', 'b.pt')]; one-line errors."""
    if not values:
        raise ValueError("--ckpt: give at least one checkpoint as NAME=PATH")
    out = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not path or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise ValueError(f"--ckpt {value!r}: write NAME=PATH, NAME of letters, digits, '.', '_', '-' (a folder name)")
        if name in [n for n, _ in out]:
            raise ValueError(f"--ckpt {name}: the name is given twice")
        if not os.path.exists(path):
            raise FileNotFoundError(f"--ckpt {name}={path}: no such file or folder")
        out.append((name, path))
    return out


def reward_names(spec):
    """The --reward names; a weight is refused (the table scores every reward on its own)."""
    if ":" in (spec or ""):
        raise ValueError(f"--reward {spec}: the table scores each reward on its own; list names without weights")
    return [name for name, _ in rewards.parse_reward_spec(spec)]  # an unknown name fails now


def check_table_inputs(args):
    """Files and cross-flag rules, before anything is loaded or written: one-line errors naming the flag."""
    if args.compbench and not (args.prompts and prompt_records.is_record_file(args.prompts)):
        raise ValueError("--compbench: give --prompts FILE.jsonl, the released prompt records (infra/prompt_records.py)")
    flags.check_model_inputs(args, None if args.compbench else reward_names(args.reward))


@torch.no_grad()
def generate_and_score(args, ctx, model, codec, prompts, items, reward_fns, out_dir):
    """args.images_per_prompt images for each of `items`, each scored by every reward of
    `reward_fns` ({name: Reward}) through rewards.score. Batch b of the (prompt, image)
    list runs on rank b mod world with the generator seeded by (args.seed, SEED_STAGE, b). Every
    rank writes its images to out_dir/images/; rank 0 writes out_dir/scores.jsonl. Returns the
    rows of scores.jsonl, sorted (every rank gets all of them)."""
    jobs = [(i, j) for i in range(len(items)) for j in range(args.images_per_prompt)]
    batches = [jobs[b0:b0 + args.batch_size] for b0 in range(0, len(jobs), args.batch_size)]
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    rows = []
    for b in tqdm(range(ctx.rank, len(batches), ctx.world), disable=not ctx.master, desc=os.path.basename(out_dir)):
        its = [items[i] for i, _ in batches[b]]
        texts, metas = prompts.texts(its), prompts.metas(its)
        with ctx.autocast():
            images = generate(model, codec, prompts.condition(its, ctx.device), args,
                              processes.seeded(ctx.device, args.seed, SEED_STAGE, b))  # (B, 3, H, W) in [0, 1]
        columns = {}
        for name, reward_fn in reward_fns.items():
            scores, info = rewards.score(reward_fn, name, images, texts, metas)  # (B,)
            columns[name] = scores.tolist()
            if name == "shapes":  # accuracy: every check of the verifier passes
                columns["shapes_accuracy"] = [float(d["correct"]) for d in info["details"]]
        for k, (i, j) in enumerate(batches[b]):
            file = f"images/{i:05d}_{j:03d}.png"
            pixels = (images[k].float().clamp(0, 1) * 255).round().byte().permute(1, 2, 0)  # (H, W, 3) uint8
            Image.fromarray(pixels.cpu().numpy()).save(os.path.join(out_dir, file))
            task = its[k].get("task_type") if isinstance(its[k], dict) else None  # a released record's
            rows.append(dict(prompt=texts[k], prompt_index=i, image_index=j, file=file,
                             **({"task_type": task} if task else {}), **{key: values[k] for key, values in columns.items()}))
    if ctx.ddp:
        gathered = [None] * ctx.world
        dist.all_gather_object(gathered, rows)
        rows = [r for part in gathered for r in part]
    rows.sort(key=lambda r: (r["prompt_index"], r["image_index"]))
    if ctx.master:
        with open(os.path.join(out_dir, "scores.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    ctx.barrier()
    return rows


def mean_sem(values):
    """{"mean", "sem", "n"}: the mean and its standard error std(ddof=1) / sqrt(n) (None for n = 1)."""
    x = np.asarray(values, dtype=np.float64)  # (n,)
    sem = float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else None
    return {"mean": float(x.mean()), "sem": sem, "n": len(x)}


def table_columns(names):
    """The table's columns for reward names, in order: dicts of key, reward, label, scale, decimals."""
    return [dict(key=key, reward=name, label=label, scale=scale, decimals=decimals)
            for name in names for key, label, scale, decimals in COLUMNS.get(name, [(name, name, 1.0, 2)])]


def table_row(name, path, rows, columns):
    """One checkpoint's row: each column's mean ± SEM over images (of its category, for a column with a
    `task`), in the column's printed scale."""
    pick = lambda c: [r for r in rows if c.get("task") in (None, r.get("task_type"))]
    return {"name": name, "ckpt": path, "n": len(rows),
            "cells": {c.get("id", c["key"]): mean_sem([c["scale"] * r[c["key"]] for r in pick(c)]) for c in columns}}


def table_markdown(table):
    """The table as markdown: a caption line, then rows = checkpoints, cells "mean ± SEM"."""
    cols = table["columns"]
    fmt = lambda cell, d: f"{cell['mean']:.{d}f}" + ("" if cell["sem"] is None else f" ± {cell['sem']:.{d}f}")
    lines = [f"{table['num_prompts']} prompts × {table['images_per_prompt']} images per checkpoint, seed "
             f"{table['seed']}; mean ± standard error of the mean over images", "",
             "| checkpoint | " + " | ".join(c["label"] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += ["| " + " | ".join([row["name"]] + [fmt(row["cells"][c.get("id", c["key"])], c["decimals"]) for c in cols]) + " |"
              for row in table["rows"]]
    lines += [""] + [f"{k}. {note}" for k, note in enumerate(table.get("notes", []), 1)] if table.get("notes") else []
    return "\n".join(lines) + "\n"


def load_checkpoint(args, name, path):
    """The policy of `--ckpt name=path` on the CPU, frozen (loading.load_policy: a base, a GRPO
    checkpoint over its base, or LoRA adapters on theirs); a bad file is one line naming --ckpt."""
    try:
        return loading.load_policy(args, path, f"--ckpt {name}").requires_grad_(False)
    except (ValueError, FileNotFoundError) as e:  # "--ckpt NAME PATH: why" -> "--ckpt NAME=PATH: why", as it was given
        raise type(e)(str(e).replace(f"--ckpt {name} {path}", f"--ckpt {name}={path}")) from None


def main(argv=None):
    """`python evaluate.py ...`: check the inputs, build the rewards, read and check every checkpoint,
    then for each in turn load, generate, score and write; rank 0 writes and prints the table.
    Returns the table dict (also DIR/table.json); an empty dict on ranks > 0."""
    args = parse_table_args(argv)
    ctx = processes.Ctx(args)
    if args.compbench:  # one score per image, its category's (scorers/compbench.py)
        reward_fns = {"compbench": compbench.CompBench(args.compbench_weights, ctx.device)}
        columns, notes = None, compbench.DEPARTURES
    else:
        weights = rewards.parse_reward_ckpt(args.reward_ckpt, args.reward)
        names = reward_names(args.reward)
        reward_fns = {name: rewards.build_reward(name, device=ctx.device, weights=weights, server=remote.settings(args))
                      for name in names}
        columns, notes = table_columns(names), []
    # --- every checkpoint (and the prompts and codec it needs) read and checked before the first image:
    #     each loaded on the CPU in turn and freed; the images below load it again
    for k, (name, path) in enumerate(args.ckpts):
        model = load_checkpoint(args, name, path)
        loading.load_prompts(args, model)
        if k == 0:  # the flags that describe the model say what the first checkpoint is (table.json's args)
            loading.describe(args, model, flags.given(sys.argv[1:] if argv is None else [str(a) for a in argv]))
    codec = loading.load_codec(args, None, ctx.device)
    table = None
    for name, path in args.ckpts:
        model = load_checkpoint(args, name, path).to(ctx.device)
        prompts = loading.load_prompts(args, model)  # per model: Harmon's null prompt is set on it
        items = prompts.eval_items(args.eval_prompts, args.seed)  # the file's prompts, or held-out shapes ones
        if args.compbench:  # GenEval's `object` records have no T2I-CompBench category
            items = [it for it in items if it["task_type"] != "object"]
            columns = columns or compbench.table_columns(items)
        if table is None:
            table = dict(columns=columns, notes=notes, rows=[], num_prompts=len(items), images_per_prompt=args.images_per_prompt,
                         seed=args.seed, batch_size=args.batch_size, model=args.model, prompts=args.prompts,
                         args={k: v for k, v in vars(args).items() if k != "ckpts"})
        # --- generate and score; the row's mean ± SEM per column
        rows = generate_and_score(args, ctx, model, codec, prompts, items, reward_fns, os.path.join(args.out, name))
        table["rows"].append({**table_row(name, path, rows, columns), "model": model.config})
        del model  # before the next one is loaded
    if not ctx.master:
        return {}
    with open(os.path.join(args.out, "table.json"), "w") as f:
        json.dump(table, f, indent=1)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table_markdown(table))
    print("\n" + table_markdown(table) + f"\nfiles: {args.out}/ (table.md, table.json, NAME/images/, NAME/scores.jsonl)")
    return table


def cli(argv=None):
    """main() with failures said in one line on stderr, as train.py's (processes.cli)."""
    return processes.cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
