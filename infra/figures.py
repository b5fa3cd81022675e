"""The pictures of a run: sample grids with their prompts, and the reward and gradient-norm curves."""

import json
import math
import os

import numpy as np
import torch
from matplotlib.figure import Figure
from PIL import Image, ImageDraw


def save_grid(images, captions, path, scale=4, cols=8):
    """A grid of images (B, 3, H, W) in [0, 1], `cols` a row, with a caption under each."""
    b, _, h, w = images.shape
    cols = min(cols, b)
    rows = math.ceil(b / cols)
    cw, ch = max(w * scale, 160), h * scale + 28
    grid = Image.new("RGB", (cols * cw, rows * ch), "white")
    draw = ImageDraw.Draw(grid)
    arr = (images.clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).cpu().numpy()  # (B, H, W, 3)
    for i in range(b):
        x, y = (i % cols) * cw, (i // cols) * ch
        grid.paste(Image.fromarray(arr[i]).resize((w * scale, h * scale), Image.NEAREST), (x, y))
        draw.text((x + 2, y + h * scale + 2), captions[i][:26], fill="black")
        draw.text((x + 2, y + h * scale + 14), captions[i][26:52], fill="black")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    grid.save(path)


def image_rows(rows, path, caption, k=8):
    """A grid of saved evaluation images, one row per (label, folder) of `rows` (a folder that
    evaluate.generate_and_score wrote: scores.jsonl and images/): k of its images, evenly spaced in
    scores.jsonl's order (so across the prompt categories), each captioned "label: caption(its row)"
    above its prompt. Returns path."""
    images, captions, per_row = [], [], set()
    for label, folder in rows:
        with open(os.path.join(folder, "scores.jsonl")) as f:
            lines = [json.loads(line) for line in f]
        lines = lines[::max(1, len(lines) // k)][:k]
        per_row.add(len(lines))  # every folder holds the same prompts and seeds
        for r in lines:
            pixels = np.array(Image.open(os.path.join(folder, r["file"])).convert("RGB"))  # (H, W, 3)
            images.append(torch.from_numpy(pixels).permute(2, 0, 1).float() / 255)  # (3, H, W)
            captions.append(f"{label}: {caption(r)}".ljust(26)[:26] + r["prompt"])
    if len(per_row) != 1:
        raise ValueError(f"image_rows: the folders hold different numbers of images ({sorted(per_row)})")
    save_grid(torch.stack(images), captions, path, cols=per_row.pop())  # (rows · k, 3, H, W)
    return path


def plot_curves(metrics_path, out_path):
    """Reward and gradient norm over steps, from metrics.jsonl (matplotlib's Figure: no GUI backend)."""
    rows = [json.loads(line) for line in open(metrics_path)]
    if not rows:
        return
    fig = Figure(figsize=(9, 3.2))
    ax = fig.subplots(1, 2)
    steps = [r["step"] for r in rows]
    ax[0].plot(steps, [r["reward_mean"] for r in rows])
    ax[0].set(xlabel="step", ylabel="reward (mean)")
    ax[1].plot(steps, [r["grad_norm"] for r in rows])
    ax[1].set(xlabel="step", ylabel="grad norm (before clipping)")
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
