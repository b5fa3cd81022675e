"""Evaluation: generate images for prompts with fixed seeds, score them, write them; and the
pictures of a run (sample grids, reward and gradient-norm curves).

`evaluate` is what `python train.py` runs on the base and the tuned model (the same prompts and
seeds for both) and what `python train.py --eval-only` runs on a checkpoint. Generation goes
through rollout.record_rollout with nothing recorded, so it is the same loop, and the same noise,
for MAR, Harmon and NOVA. Under torchrun every rank generates a slice; rank 0 writes.
"""

import json
import math
import os

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import rollout
import shapes


@torch.no_grad()
def generate(model, codec, inputs, args, generator):
    """Images (B, 3, H, W) in [0, 1] for condition inputs of batch B, at the run's sampling flags."""
    tokens, _ = rollout.record_rollout(model, inputs, args.num_iter, args.cfg, args.cfg_schedule,
                                       args.temperature if args.eval_temperature is None else args.eval_temperature,
                                       generator=generator)
    return codec.decode(model.unpatchify(tokens).float())


@torch.no_grad()
def evaluate(args, ctx, model, codec, items, prompts, reward_fn, out_dir, tag, score):
    """Generate args.eval_images_per_prompt images for each item, score them with reward_fn (via
    `score`, train.py's guarded call), and write images/, results.jsonl (one line per image:
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
        scores, info = score(reward_fn, args.reward, images, prompts.texts(its), prompts.metas(its))
        details = info.get("details", [{}] * len(its))
        for k, ((i, it), img) in enumerate(zip(chunk, images)):
            rows.append(dict(index=i, prompt=prompts.texts([it])[0], reward=float(scores[k]),
                             category=it.get("category") if isinstance(it, dict) else None,
                             details=details[k], image=img.cpu()))
    if ctx.ddp:
        gathered = [None] * ctx.world
        dist.all_gather_object(gathered, rows)
        rows = [r for part in gathered for r in part]
    summary = {}
    if ctx.master:
        from PIL import Image
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
    titles = {"": "held-out prompts (never seen in pretraining or RL)", "_train": "training prompts, fresh seeds"}
    for suffix, title in titles.items():
        before, after = report.get("base" + suffix), report.get("tuned" + suffix)
        if before is None:
            continue
        print(f"\n{title}, {before['n']} images:")
        print(f"  {'metric':<26}{'base':>8}{'tuned':>8}")
        for k in [k for k in before if k.startswith("accuracy") or k.startswith("reward")]:
            print(f"  {k:<26}{before[k]:>8.3f}{after.get(k, float('nan')):>8.3f}")
    print(f"\nfiles: {out}/ (metrics.jsonl, curves.png, samples/, ckpt/, eval/)")


def save_grid(images, captions, path, scale=4):
    """A grid of images (B, 3, H, W) in [0, 1] with a caption under each."""
    from PIL import Image, ImageDraw
    b, _, h, w = images.shape
    cols = min(8, b)
    rows = math.ceil(b / cols)
    cw, ch = max(w * scale, 160), h * scale + 28
    grid = Image.new("RGB", (cols * cw, rows * ch), "white")
    draw = ImageDraw.Draw(grid)
    arr = (images.clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).cpu().numpy()
    for i in range(b):
        x, y = (i % cols) * cw, (i // cols) * ch
        grid.paste(Image.fromarray(arr[i]).resize((w * scale, h * scale), Image.NEAREST), (x, y))
        draw.text((x + 2, y + h * scale + 2), captions[i][:26], fill="black")
        draw.text((x + 2, y + h * scale + 14), captions[i][26:52], fill="black")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    grid.save(path)


def plot_curves(metrics_path, out_path):
    """Reward and gradient norm over steps, from metrics.jsonl."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(metrics_path)]
    if not rows:
        return
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
    steps = [r["step"] for r in rows]
    ax[0].plot(steps, [r["reward_mean"] for r in rows])
    ax[0].set(xlabel="step", ylabel="reward (mean)")
    ax[1].plot(steps, [r["grad_norm"] for r in rows])
    ax[1].set(xlabel="step", ylabel="grad norm (before clipping)")
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
