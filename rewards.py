"""Rewards for GRPO: one call signature, and the weighted sum of named rewards,

    r_b = sum_k w_k r_k,b          info["components"][k] = r_k (B,), info["means"][k] = mean_b r_k,b

(the means are unweighted, one per component, for logging), where every reward is a callable

    fn(images, prompts, metadata) -> (scores, info)

    images:   (B, 3, H, W) float in [0, 1], any device (numpy, and uint8 in 0..255, accepted too);
              every reward scores the 8-bit image, round(255 x) / 255 (what a PNG of it holds, and
              what the reward server receives: both paths score the same pixels)
    prompts:  list of B strings
    metadata: list of B dicts (or None): the prompt's parsed meta (`shapes`), or its released record
              (infra/prompt_records.py; `gdino`, `git_vqa`)
    scores:   (B,) float32 tensor on the CPU
    info:     dict of per-image extras (e.g. "details" for shapes) and JSON-able scalars

run under `torch.no_grad()`, one batched pass per call.

This file is the interface alone: `Reward`, `WeightedSum`, a `--reward` spec parsed into
(name, weight) items, `score` (a batch scored, a failing reward stopping the run in one line), and
the rewards that need no model (DDPO's JPEG size). It imports nothing of the project. Which reward
a name builds, its weight files, and whether it runs in this process or on a reward server are
decided in scorers/registry.py (`build_reward("hpsv2:1.0,pickscore:0.5", weights={...})`); the
rewards themselves live in demo/verifier.py (the shapes world's) and scorers/ (the model-based
ones). The released runs use HPS v2.1 (docs/method.md §8).
"""

from __future__ import annotations

import io
import math

import torch
from PIL import Image

REWARD_FLAG = "--reward"      # the spec flag, named in errors


# -----------------------------------------------------------------------------
# The interface

class Reward:
    """Base class: subclasses set `name` and implement `score(images, prompts, metadata)`.

    `__call__` checks the inputs, runs `score` without gradients and returns CPU float32 scores.
    """

    name = "reward"

    @torch.no_grad()
    def __call__(self, images, prompts, metadata=None):
        """images: (B, 3, H, W) in [0, 1]; prompts: B strings; metadata: B dicts or None.
        Returns (scores (B,) float32 CPU tensor, info dict)."""
        images = torch.as_tensor(images)
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"{self.name} reward: images must be (B, 3, H, W), "
                             f"got {tuple(images.shape)}")
        B = images.shape[0]
        if len(prompts) != B:
            raise ValueError(f"{self.name} reward: {B} images but {len(prompts)} prompts")
        metadata = [{} for _ in range(B)] if metadata is None else list(metadata)
        if len(metadata) != B:
            raise ValueError(f"{self.name} reward: {B} images but {len(metadata)} metadata dicts")
        images = images.float().div(255) if images.dtype == torch.uint8 else to_8bit(images.float())
        scores, info = self.score(images, list(prompts), metadata)
        return scores.detach().float().cpu().reshape(B), info

    def score(self, images, prompts, metadata):
        raise NotImplementedError


def to_8bit(images):
    """round(255 x) / 255 of x clamped to [0, 1]: the 8-bit image every reward scores (float,
    same shape)."""
    return images.clamp(0, 1).mul(255).round().div(255)


class WeightedSum(Reward):
    """r = sum_k w_k r_k over named component rewards.

    info["components"][name] is r_k (B,), info["means"][name] the mean of r_k (unweighted),
    info["weights"][name] = w_k. Each component's own info keys are copied to the top level
    ("details" of shapes); a key two components both set is stored as "name/key" for the later one.
    """

    name = "weighted_sum"

    def __init__(self, components):
        self.components = list(components)  # [(name, weight, Reward)]

    def score(self, images, prompts, metadata):
        return self.combine([(name, weight, *reward(images, prompts, metadata))
                             for name, weight, reward in self.components])

    @staticmethod
    def combine(parts):
        """parts: [(name, weight, r (B,) float32, extra info dict)] in the spec's order ->
        (sum_k w_k r_k (B,), info)."""
        total = torch.zeros(len(parts[0][2]))                                 # (B,)
        info = {"means": {}, "components": {}, "weights": {}}
        for name, weight, r, extra in parts:
            total += weight * r
            info["components"][name] = r
            info["means"][name] = float(r.mean())
            info["weights"][name] = weight
            for key, value in extra.items():
                info[key if key not in info else f"{name}/{key}"] = value
        return total, info


def parse_reward_spec(spec, names):
    """'hpsv2:1.0,pickscore:0.5' -> [('hpsv2', 1.0), ('pickscore', 0.5)]; a bare name weighs 1.
    names: the rewards a name may be (scorers/registry.py's); any other is a one-line error."""
    items = []
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        name, _, weight = part.partition(":")
        name = name.strip()
        if name not in names:
            raise ValueError(f"unknown reward '{name}' ({REWARD_FLAG}); "
                             f"choose from {', '.join(names)}")
        try:
            w = float(weight) if weight.strip() else 1.0
        except ValueError:
            raise ValueError(f"bad weight '{weight}' for reward '{name}' "
                             f"({REWARD_FLAG} name:weight)") from None
        if not math.isfinite(w):  # every reward would be non-finite: no update could happen
            raise ValueError(f"{REWARD_FLAG} {name}:{weight}: the weight must be a finite number")
        if name in [n for n, _ in items]:
            raise ValueError(f"reward '{name}' appears twice in {REWARD_FLAG} '{spec}'")
        items.append((name, w))
    if not items:
        raise ValueError(f"empty reward spec ({REWARD_FLAG}); choose from {', '.join(names)}")
    return items


class RewardFailed(RuntimeError):
    """A reward raised while scoring a batch: the run stops (processes.cli prints the reward's own
    traceback, then this one line, and exits with status 1: `stops_the_run`)."""

    stops_the_run = True


def score(reward_fn, spec, images, texts, metas):
    """reward_fn(images, texts, metas); a reward that raises stops the run (RewardFailed) with the
    reward's name and the batch's prompts, its own traceback kept as the cause."""
    try:
        return reward_fn(images, texts, metas)
    except RewardFailed:
        # already said in one line (a reward server that stopped answering: scorers/remote.py)
        raise
    except Exception as e:
        unique = list(dict.fromkeys(texts))
        shown = unique[:8] + ([f"... {len(unique)} prompts in all"] if len(unique) > 8 else [])
        reason = (str(e).strip().splitlines() or [""])[0]
        raise RewardFailed(f"--reward {spec!r} failed on the prompts {shown}: "
                           f"{type(e).__name__}: {reason}") from e


# -----------------------------------------------------------------------------
# The rewards that need no model

def jpeg_size_kb(images, quality=95):
    """JPEG file size in kB (1000 bytes) of each image at `quality`, DDPO's measure.
    images: (B, 3, H, W) in [0, 1]. Returns (B,) float32."""
    pixels = (images * 255).round().clamp(0, 255).to(torch.uint8).cpu().numpy()
    pixels = pixels.transpose(0, 2, 3, 1)                                     # (B, H, W, 3)
    sizes = []
    for pixel in pixels:
        buffer = io.BytesIO()
        Image.fromarray(pixel).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32)


class JpegReward(Reward):
    """sign * JPEG size in kB at quality 95: sign -1 rewards compressible images, +1
    incompressible."""

    def __init__(self, sign, device="cpu"):
        self.sign = sign
        self.name = "jpeg_compressibility" if sign < 0 else "jpeg_incompressibility"

    def score(self, images, prompts, metadata):
        return self.sign * jpeg_size_kb(images), {}
