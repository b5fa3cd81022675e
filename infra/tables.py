"""The paper's tables as evaluate.py writes them: columns per reward as the papers print them,
cells "mean ± SEM" over images, rows per checkpoint (at a sampling setting after a sweep), and the
cells of a temperature sweep."""

import math
import os
import re

import numpy as np

import rewards

DESCRIPTION = """The paper's table: N images per prompt for every checkpoint with the same seeds,
each scored by each --reward on its own (evaluate.py's docstring)."""
TABLE_DEFAULTS = dict(eval_images_per_prompt=1, eval_batch_size=16)  # whatever a preset's evaluation


def table_flags(p):
    """evaluate.py's own flags."""
    a = p.add_argument
    a("--ckpt", action="append", default=[], metavar="NAME=PATH", help="a checkpoint and its row "
      "name (repeatable; NOVA: the first is the pipeline folder whose vae/ decodes, unless --vae)")
    a("--out", required=True, help="output folder: NAME/images/, NAME/scores.jsonl, table.md, "
                                   "table.json")
    a("--reward", default=None, help="the columns: reward names, comma-separated, each scored on "
                                     "its own (rewards.py; the shapes world's: shapes)")
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
    return [name for name, _ in rewards.parse_reward_spec(spec)]  # an unknown name fails now


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
    """One checkpoint's row: each column's mean ± SEM over images (of its category, for a column with
    a `task`), in the column's printed scale."""
    pick = lambda c: [r for r in rows if c.get("task") in (None, r.get("task_type"))]  # noqa: E731
    return {"name": name, "ckpt": path, "n": len(rows),
            "cells": {c.get("id", c["key"]): mean_sem([c["scale"] * r[c["key"]] for r in pick(c)])
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


def setting_name(setting):
    """'τ 0.3' or 'τ 0.3, w 3' of a {"temperature", "cfg"} setting."""
    return f"τ {setting['temperature']:g}" + ("" if setting["cfg"] is None else f", w {setting['cfg']:g}")


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
            lines.append(f"| {name} | {setting_name({'temperature': t, 'cfg': w})}{star} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"
