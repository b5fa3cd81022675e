"""The paper's tables: every checkpoint's images for a prompt file at fixed seeds, scored by each
reward on its own, as the papers print them (rows: checkpoints; cells: mean ± SEM over images).

    python -m tables.paper --ckpt base=PATH --ckpt tuned=PATH --prompts FILE --images-per-prompt 4 \\
        --seed 0 --reward hpsv2,imagereward,pickscore --reward-ckpt hpsv2=... --out DIR [flags]
        [--sweep --eval-temperatures 0.1,0.2,0.3,0.5,0.7,1 --choose-prompts TRAIN_FILE]

writes DIR/NAME/images/*.png and DIR/NAME/scores.jsonl (a line per image: prompt, indices, file, a
raw score per reward, the verifier's checks for shapes prompts), DIR/table.md and table.json (rows:
checkpoints; columns: rewards as the papers print them, "mean ± SEM"). With --sweep the rows are
each checkpoint at --temperature and at its best τ (chosen on --choose-prompts), with the gain over
the first at its own best; DIR/sweep.md holds every cell. The images and the sweep are evaluate.py's
(`generate_and_score`, `sweep_splits`: the same seeds for every checkpoint and τ). The sampling,
model, processes, evaluation and reward-service flags are train.py's (infra/flags.py). With
--compbench (and the released prompt records of AMAP-ML/mar-grpo@fcb7969 as --prompts:
infra/prompt_records.py) the columns are T2I-CompBench's categories (scorers/compbench.py).

Where the table departs from what the papers state (besides seeds per batch: evaluate.py):
1. The SEM is over images (n = prompts × images per prompt), std(ddof=1) / sqrt(n); images of one
   prompt are not independent, so it understates the spread over prompt sets.
2. Under torchrun each rank writes its own PNGs (DIR must be one shared folder, as in DiT's
   sample_ddp.py); the scores are gathered and rank 0 writes the rest.
"""

import json
import os
import re
import sys

import evaluate
from infra import flags, processes, prompt_records
from models import loading
from scorers import compbench, registry

# -----------------------------------------------------------------------------
# The table's flags

DESCRIPTION = """The paper's table: N images per prompt for every checkpoint with the same seeds,
each scored by each --reward on its own (tables/paper.py's docstring)."""
TABLE_DEFAULTS = dict(eval_images_per_prompt=1, eval_batch_size=16)  # whatever a preset's evaluation


def table_flags(p):
    """The table's own flags."""
    a = p.add_argument
    a("--ckpt", action="append", default=[], metavar="NAME=PATH", help="a checkpoint and its row "
      "name (repeatable; NOVA: the first is the pipeline folder whose vae/ decodes, unless --vae)")
    a("--out", required=True, help="output folder: NAME/images/, NAME/scores.jsonl, table.md, "
                                   "table.json")
    a("--reward", default=None, help="the columns: reward names, comma-separated, each scored on "
                                     "its own (scorers/registry.py; the shapes world's: shapes)")
    a("--sweep", action="store_true", help="score every checkpoint at each τ of "
      "--eval-temperatures (× --eval-cfgs), choose each one's best on --choose-prompts, and report "
      "--prompts at --temperature and at that best, with the gain over the first checkpoint at its "
      "own best")
    a("--choose-prompts", default=None, metavar="FILE", help="with --sweep: the prompts each "
      "checkpoint's best τ is chosen on (training prompts; the shapes world's: its training split)")
    a("--compbench", action="store_true", help="the T2I-CompBench table (scorers/compbench.py) "
      "instead of the --reward columns: --prompts is the released records (.jsonl), each image "
      "scored by its task type's evaluator")
    a("--compbench-ckpt", action="append", default=[], metavar="KEY=PATH",
      help="T2I-CompBench weights: blip_vqa=FOLDER, gdino=FOLDER, clip=ViT-B-32.pt (repeatable)")


def parse_ckpts(values):
    """['base=a.pt', 'tuned=b.pt'] -> [('base', 'a.pt'), ('tuned', 'b.pt')]; one-line errors."""
    if not values:
        raise ValueError("--ckpt: give at least one checkpoint as NAME=PATH")
    out = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not path or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise ValueError(f"--ckpt {value!r}: write NAME=PATH, NAME of letters, digits, '.', "
                             "'_', '-' (a folder name)")
        if name in [n for n, _ in out]:
            raise ValueError(f"--ckpt {name}: the name is given twice")
        if not os.path.exists(path):
            raise FileNotFoundError(f"--ckpt {name}={path}: no such file or folder")
        out.append((name, path))
    return out


def reward_names(spec):
    """The --reward names; a weight is refused (the table scores every reward on its own)."""
    if ":" in (spec or ""):
        raise ValueError(f"--reward {spec}: the table scores each reward on its own; list names "
                         "without weights")
    return [name for name, _ in registry.parse_spec(spec)]  # an unknown name fails now


def parse_table_args(argv=None):
    """The table's flags (`table_flags`) and the sampling, model, processes, evaluation and
    reward-service flags it shares with train.py (infra/flags.py), over the --preset; checks the
    inputs (`check_table_inputs`). Returns (the Namespace, the dests given on the command line)."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    groups = [("the table", table_flags), flags.SAMPLING, flags.MODEL, flags.PROCESSES,
              flags.EVALUATION, flags.REWARD_SERVICE]
    p = flags.build_parser(groups, description=DESCRIPTION, prog="python -m tables.paper")
    preset = p.parse_known_args(argv)[0].preset  # the table's own defaults win over the preset's
    own = TABLE_DEFAULTS
    p.set_defaults(**{k: v for k, v in flags.PRESETS[preset].items() if k not in own}, **own)
    args = p.parse_args(argv)
    if not args.out.strip():
        raise ValueError("--out '': give the table's folder")
    args.compbench_weights = compbench.parse_weights(args.compbench_ckpt, args.compbench)
    args.ckpts = parse_ckpts(args.ckpt)
    args.init = args.ckpts[0][1]  # where loading.load_codec looks for NOVA's vae/ folder
    check_table_inputs(args)
    return args, flags.given(argv, p)


def check_table_inputs(args):
    """Files and cross-flag rules, before anything is loaded or written: one-line errors naming
    the flag."""
    if args.compbench and not (args.prompts and prompt_records.is_record_file(args.prompts)):
        raise ValueError("--compbench: give --prompts FILE.jsonl, the released prompt records "
                         "(infra/prompt_records.py)")
    if args.choose_prompts is not None and not args.sweep:
        raise ValueError("--choose-prompts: belongs to a sweep; give --sweep too")
    if args.sweep:
        if args.compbench:
            raise ValueError("--sweep: the T2I-CompBench table is scored at --temperature alone")
        if args.choose_prompts is None and (args.model != "small" or args.prompts is not None):
            raise ValueError("--sweep: give --choose-prompts FILE, the training prompts each "
                             "checkpoint's best τ is chosen on")
        if args.choose_prompts is not None and not os.path.isfile(args.choose_prompts):
            raise FileNotFoundError(f"--choose-prompts: no such file: {args.choose_prompts}")
    if not args.compbench and not args.reward:
        raise ValueError("--reward: name the rewards the table scores (e.g. shapes, or "
                         "hpsv2,pickscore)")
    if not args.compbench:
        reward_names(args.reward)  # an unknown name or a weight fails now
    flags.check_model_inputs(args, scores_reward=not args.compbench)
    if not args.compbench:
        registry.check_reward_flags(args)
    loading.check_prompt_files(args)


# -----------------------------------------------------------------------------
# The columns and cells

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


def table_columns(names):
    """The table's columns for reward names, in order: dicts of key, reward, label, scale, decimals."""
    return [dict(key=key, reward=name, label=label, scale=scale, decimals=decimals)
            for name in names for key, label, scale, decimals in COLUMNS.get(name, [(name, name, 1.0, 2)])]


def table_row(name, path, rows, columns):
    """One checkpoint's row: each column's mean ± SEM over images (of its category, for a column with
    a `task`), in the column's printed scale."""
    pick = lambda c: [r for r in rows if c.get("task") in (None, r.get("task_type"))]  # noqa: E731
    return {"name": name, "ckpt": path, "n": len(rows),
            "cells": {c.get("id", c["key"]): evaluate.mean_sem([c["scale"] * r[c["key"]] for r in pick(c)])
                      for c in columns}}


def table_markdown(table):
    """The table as markdown: a caption line, then rows = checkpoints (with their sampling setting
    after a sweep), cells "mean ± SEM"."""
    cols = table["columns"]
    fmt = lambda cell, d: f"{cell['mean']:.{d}f}" + ("" if cell["sem"] is None else f" ± {cell['sem']:.{d}f}")  # noqa: E731
    sampling = any("sampling" in row for row in table["rows"])
    head = ["checkpoint"] + (["sampling"] if sampling else []) + [c["label"] for c in cols]
    lines = [f"{table['num_prompts']} prompts × {table['images_per_prompt']} images per checkpoint, seed "
             f"{table['seed']}; mean ± standard error of the mean over images", "",
             "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for row in table["rows"]:
        cells = [fmt(row["cells"][c.get("id", c["key"])], c["decimals"]) for c in cols]
        lines.append("| " + " | ".join([row["name"]] + ([row["sampling"]] if sampling else []) + cells) + " |")
    notes = table.get("notes") or []
    lines += ([""] + [f"{k}. {note}" for k, note in enumerate(notes, 1)]) if notes else []
    return "\n".join(lines) + "\n"


def sweep_markdown(sweeps):
    """Every cell of the checkpoints' sweeps: rows (checkpoint, setting), columns the splits' key
    metric ± SEM and n; * marks each checkpoint's best setting."""
    lines = ["| checkpoint | sampling | choice prompts | evaluated prompts |", "|---|---|---|---|"]
    for name, sweep in sweeps.items():
        key = sweep["key"]
        by_setting = {}
        for c in sweep["cells"]:
            by_setting.setdefault((c["temperature"], c["cfg"]), {})[c["split"]] = c
        for (t, w), splits in by_setting.items():
            star = " *" if {"temperature": t, "cfg": w} == sweep["best"] else ""
            vals = [f"{s[key]:.4g} (n {s['n']})" for s in (splits["train"], splits["eval"])]
            lines.append(f"| {name} | {evaluate.setting_name({'temperature': t, 'cfg': w})}{star} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


# -----------------------------------------------------------------------------
# The program

def load_checkpoint(args, name, path):
    """The policy of `--ckpt name=path` on the CPU, frozen (loading.load_policy: a base, a GRPO
    checkpoint over its base, or LoRA adapters on theirs); a bad file is one line naming --ckpt."""
    try:
        return loading.load_policy(args, path, f"--ckpt {name}").requires_grad_(False)
    except (ValueError, FileNotFoundError) as e:  # "--ckpt NAME PATH: why" -> "--ckpt NAME=PATH"
        raise type(e)(str(e).replace(f"--ckpt {name} {path}", f"--ckpt {name}={path}")) from None


def choice_items(args, model, prompts):
    """The prompts a sweep chooses each checkpoint's best τ on: --choose-prompts, or for the
    shapes world the training split's prompts (as many as the evaluated ones)."""
    if args.choose_prompts is not None:
        return loading.load_prompts(args, model, args.choose_prompts, "--choose-prompts").items
    return prompts.eval_items(args.eval_prompts, args.seed, "train")


def sweep_rows(args, ctx, name, path, model, codec, prompts, items, reward_fns, columns):
    """A checkpoint's table rows after a sweep: at --temperature and at its best τ (chosen on the
    choice prompts), and its sweep (sweep.json's entry)."""
    folder = os.path.join(args.out, name)
    splits = {"train": choice_items(args, model, prompts), "eval": items}
    sweep = evaluate.sweep_splits(args, ctx, model, codec, prompts, splits, reward_fns, folder,
                         args.eval_temperatures, args.eval_cfgs or (None,))
    rows = []
    for setting, label in (({"temperature": args.temperature, "cfg": None}, "at --temperature"),
                           (sweep["best"], "its best")):
        sub = os.path.join(folder, evaluate.setting_folder(setting["temperature"], setting["cfg"]), "eval")
        scored = [json.loads(line) for line in open(os.path.join(sub, "scores.jsonl"))]
        rows.append({**table_row(name, path, scored, columns),
                     "sampling": f"{evaluate.setting_name(setting)} ({label})", "setting": setting})
    return rows, sweep


def main(argv=None):
    """`python -m tables.paper ...`: check the inputs, build the rewards, read and check every
    checkpoint, then for each in turn load, generate, score and write; rank 0 writes and prints
    the table. Returns the table dict (also DIR/table.json); an empty dict on ranks > 0."""
    args, given = parse_table_args(argv)
    if args.sweep:  # with the row at --temperature
        args.eval_temperatures = sorted({*args.eval_temperatures, args.temperature})
    ctx = processes.Ctx(args)
    if args.compbench:  # one score per image, its category's (scorers/compbench.py)
        reward_fns = {"compbench": compbench.CompBench(args.compbench_weights, ctx.device)}
        columns, notes = None, compbench.DEPARTURES
    else:
        weights = registry.parse_reward_ckpt(args.reward_ckpt, args.reward)
        names = reward_names(args.reward)
        server = registry.server_settings(args)
        reward_fns = {name: registry.build_reward(name, device=ctx.device, weights=weights,
                                                  server=server) for name in names}
        columns, notes = table_columns(names), []
    # --- every checkpoint (and the prompts and codec it needs) read and checked before the first
    #     image: each loaded on the CPU in turn and freed; the images below load it again
    for k, (name, path) in enumerate(args.ckpts):
        model = load_checkpoint(args, name, path)
        loading.load_prompts(args, model)
        if args.choose_prompts is not None:
            loading.load_prompts(args, model, args.choose_prompts, "--choose-prompts")
        if k == 0:  # the flags that describe the model say what the first checkpoint is
            loading.describe(args, model, given)
    codec = loading.load_codec(args, None, ctx.device)
    table, sweeps = None, {}
    for name, path in args.ckpts:
        model = load_checkpoint(args, name, path).to(ctx.device)
        prompts = loading.load_prompts(args, model)  # per model: Harmon's null prompt is set on it
        items = prompts.eval_items(args.eval_prompts, args.seed)  # the file's, or held-out shapes
        if args.compbench:  # GenEval's `object` records have no T2I-CompBench category
            items = [it for it in items if it["task_type"] != "object"]
            columns = columns or compbench.table_columns(items)
        if table is None:
            table = dict(columns=columns, notes=notes, rows=[], num_prompts=len(items),
                         images_per_prompt=args.eval_images_per_prompt, seed=args.seed,
                         batch_size=args.eval_batch_size, model=args.model, prompts=args.prompts,
                         args={k: v for k, v in vars(args).items() if k != "ckpts"})
        # --- generate and score; the row's mean ± SEM per column
        if not args.sweep:
            rows = evaluate.generate_and_score(args, ctx, model, codec, prompts, items,
                                               reward_fns, os.path.join(args.out, name))
            row = table_row(name, path, rows, columns)
            table["rows"].append({**row, "model": model.config})
        else:
            rows, sweeps[name] = sweep_rows(args, ctx, name, path, model, codec, prompts, items,
                                            reward_fns, columns)
            table["rows"] += [{**row, "model": model.config} for row in rows]
        del model  # before the next one is loaded
    if sweeps:
        first = args.ckpts[0][0]
        table["notes"] = notes + [
            f"{name}: {100 * evaluate.gain_at_best(sweeps[first], s, 'eval', s['key']):+.1f} "
            f"({s['key']}, ×100) over {first}, each at its best τ"
            for name, s in sweeps.items() if name != first]
        table["sweeps"] = sweeps
    if not ctx.master:
        return {}
    with open(os.path.join(args.out, "table.json"), "w") as f:
        json.dump(table, f, indent=1)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table_markdown(table))
    if sweeps:
        with open(os.path.join(args.out, "sweep.md"), "w") as f:
            f.write(sweep_markdown(sweeps))
    print("\n" + table_markdown(table) + f"\nfiles: {args.out}/ (table.md, table.json, "
          "NAME/images/, NAME/scores.jsonl)")
    return table


def cli(argv=None):
    """main() with failures said in one line on stderr, as train.py's (processes.cli)."""
    return processes.cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
