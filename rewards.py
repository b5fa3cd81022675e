"""Rewards for GRPO: one call signature, built by name, combined with weights.

"Released" is the MAR-GRPO code, GitHub `AMAP-ML/mar-grpo@fcb7969`: its runs
scripts/debug_entry_{nova,harmon,nova_mix}.py (`--reward_funcs hps` with HPS_v2.1_compressed.pt;
nova_mix adds `git` and `gdino`), the prompt records they train on (read in
src/grpo/src/open_r1/grpo_v1.py) and its scorers src/grpo/src/utils/reward_hps.py,
reward_git.py and reward_gdino.py.

Every reward is a callable

    fn(images, prompts, metadata) -> (scores, info)

    images:   (B, 3, H, W) float in [0, 1], any device (numpy, and uint8 in 0..255, accepted too);
              every reward scores the 8-bit image, round(255 x) / 255 (what a PNG of it holds, and
              what the reward server receives: both paths score the same pixels)
    prompts:  list of B strings
    metadata: list of B dicts (or None): the prompt's parsed meta (`shapes`), or its released record
              (infra/prompt_records.py; `gdino`, `git_vqa`)
    scores:   (B,) float32 tensor on the CPU
    info:     dict of per-image extras (e.g. "details" for shapes) and JSON-able scalars

run under `torch.no_grad()`, one batched pass per call. `build_reward("hpsv2:1.0,pickscore:0.5",
weights={...})` parses the `--reward` spec and returns the weighted sum of its rewards,

    r_b = sum_k w_k r_k,b          info["components"][k] = r_k (B,), info["means"][k] = mean_b r_k,b

(the means are unweighted, one per component, for logging). The released runs use HPS v2.1
(docs/method.md §8, the released hyperparameters: reward HPS v2.1, β = 0.01, G = 4 images per
prompt, 12 AR × 10 diffusion steps trained per rollout). `build_reward(spec, server={"url": ...})`
returns the same reward scored by a reward server (`python -m scorers.server`; the client is
scorers/remote.py, docs/reward_server.md).

This file holds the interface, the spec parser, `build_reward`, the table of weight files
(`WEIGHT_FILES`), and the rewards that need no model (JPEG). The others live in folders and are
imported when first built, so `import rewards` pulls in none of their libraries: the shapes
verifier in demo/verifier.py, the model-based rewards in scorers/ (clip.py: open_clip;
scorers/imagereward.py: BLIP; composition.py: GroundingDINO, GIT; weights.py reads their weight
files).

The rewards: `shapes` and `shapes_partial` (the demo's verifier), `jpeg_compressibility` and
`jpeg_incompressibility` (DDPO's JPEG size) need no weights; `clip_score`, `hpsv2`, `pickscore`
and `aesthetic` (CLIP models), `imagereward` (BLIP), and `gdino`, `gdino_released` and `git_vqa`
(GroundingDINO, GIT; these also need `--prompts FILE.jsonl`) read local weight files, given by
`weights` key as `build_reward(..., weights={key: path})` or `--reward-ckpt key=PATH`. What each
scores, its keys and files, and where each file is published:
docs/real_models.md, "Rewards and their weight files".

Weight files are read locally, never downloaded, and loaded strictly at construction: a missing
file raises a one-line FileNotFoundError naming `--reward-ckpt` and the expected file, a file that
does not fit raises a one-line ValueError naming the file and the first mismatched keys. The
accepted file formats and where each reward departs from its official scorer are listed at the top
of scorers/clip.py and scorers/imagereward.py.
"""

from __future__ import annotations

import importlib
import io
import math

import torch
from PIL import Image

REWARD_FLAG = "--reward"      # the spec flag, named in errors
CKPT_FLAG = "--reward-ckpt"   # the weights flag, `--reward-ckpt key=PATH`, named in errors

# weights key -> (expected file, where it is published); the table of docs/real_models.md,
# "Rewards and their weight files".
WEIGHT_FILES = {
    "hpsv2": ("HPS_v2.1_compressed.pt or HPS_v2_compressed.pt", "HF xswu/HPSv2"),
    "pickscore": ("model.safetensors", "HF yuvalkirstain/PickScore_v1"),
    "clip_score": ("ViT-L-14.pt (or the open_clip checkpoint of model_name)",
                   "OpenAI CLIP release / HF openai/clip-vit-large-patch14"),
    "aesthetic": ("sac+logos+ava1-l14-linearMSE.pth",
                  "GitHub christophschuhmann/improved-aesthetic-predictor"),
    "aesthetic_clip": ("ViT-L-14.pt", "OpenAI CLIP release / HF openai/clip-vit-large-patch14"),
    "imagereward": ("ImageReward.pt", "HF THUDM/ImageReward"),
    "imagereward_tokenizer": ("a folder with the bert-base-uncased vocab.txt",
                              "HF google-bert/bert-base-uncased"),
    "gdino": ("a GroundingDINO folder in the HF layout", "HF IDEA-Research/grounding-dino-tiny"),
    "git_vqa": ("a GIT folder in the HF layout", "HF microsoft/git-large-vqav2"),
}
# weights keys that name a folder, not a file
FOLDER_KEYS = {"imagereward_tokenizer", "gdino", "git_vqa"}
# rewards that read the released prompt records
METADATA_REWARDS = ("gdino", "gdino_released", "git_vqa")


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


def parse_reward_spec(spec):
    """'hpsv2:1.0,pickscore:0.5' -> [('hpsv2', 1.0), ('pickscore', 0.5)]; a bare name weighs 1."""
    items = []
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        name, _, weight = part.partition(":")
        name = name.strip()
        if name not in REWARDS:
            raise ValueError(f"unknown reward '{name}' ({REWARD_FLAG}); "
                             f"choose from {', '.join(REWARDS)}")
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
        raise ValueError(f"empty reward spec ({REWARD_FLAG}); choose from {', '.join(REWARDS)}")
    return items


def parse_reward_ckpt(values, spec):
    """Turn `--reward-ckpt` values into the `weights` dict of `build_reward`.

    values: list of strings (or one string), each 'key=PATH' (comma-separated lists allowed), or a
            single bare PATH when the spec needs exactly one weight file.
    spec:   the `--reward` spec, to know which keys are needed.
    """
    if values is None:
        return {}
    values = [values] if isinstance(values, str) else list(values)
    needed = [key for name, _ in parse_reward_spec(spec) for key in REWARDS[name][1]]
    weights = {}
    for value in values:
        for item in value.split(","):
            item = item.strip()
            key, sep, path = item.partition("=")
            if sep and key in WEIGHT_FILES:
                weights[key] = path
            elif len(values) == 1 and "," not in value and len(needed) == 1:
                weights[needed[0]] = item
            elif item:
                raise ValueError(f"{CKPT_FLAG} '{item}': write key=PATH with key in "
                                 f"{', '.join(WEIGHT_FILES)}")
    unused = [key for key in weights if key not in needed]
    if unused:  # a file given for a reward that is not in use would be silently ignored
        raise ValueError(f"{CKPT_FLAG} {unused[0]}={weights[unused[0]]}: {REWARD_FLAG} '{spec}' "
                         f"uses no {unused[0]} weights"
                         + (f" (it takes {', '.join(needed)})" if needed else ""))
    return weights


def build_reward(spec, *, device="cpu", weights=None, options=None, server=None, **kwargs):
    """Build the weighted reward of a `--reward` spec.

    spec:    'name' or 'name:weight' items, comma-separated (e.g. 'hpsv2:1.0,pickscore:0.5').
    device:  where the reward models run (images are moved there after preprocessing).
    weights: weights key -> local file, e.g. {"hpsv2": ".../HPS_v2.1_compressed.pt",
             "pickscore": ".../model.safetensors", "clip_score": ".../ViT-L-14.pt",
             "aesthetic": ".../sac+logos+ava1-l14-linearMSE.pth",
             "aesthetic_clip": ".../ViT-L-14.pt", "imagereward": ".../ImageReward.pt",
             "imagereward_tokenizer": ".../bert-base-uncased"} (the tokenizer key names a
             folder). Keys of rewards not in the spec are ignored.
    options: per-reward keyword arguments, {name: {kwarg: value}}, over `kwargs`.
    kwargs:  keyword arguments given to every reward of the spec that takes them (e.g.
             `model_name` for the CLIP-based rewards, `arch` for imagereward, `dtype`,
             `batch_size`).
    server:  None (the reward models run in this process), or {"url", "token", "timeout",
             "retries"}: a reward server (`python -m scorers.server`) that serves every name of
             the spec scores the images and this process sums them (scorers/remote.py
             `RemoteReward`); the weight files and options are then the server's.
    Returns a `WeightedSum` (also for a single reward, so info always has means and components), or
    with `server` a RemoteReward whose info has the same keys.
    """
    items = parse_reward_spec(spec)
    if server is not None:
        if weights or options or kwargs:
            raise ValueError(f"{CKPT_FLAG} and reward options "
                             f"{sorted({**(weights or {}), **(options or {}), **kwargs})}: "
                             "the reward server loads the models "
                             "(python -m scorers.server --reward-ckpt KEY=PATH)")
        return _built_from("scorers.remote", "RemoteReward")(items=items, **server)
    weights = dict(weights or {})
    for key in weights:
        if key not in WEIGHT_FILES:
            raise ValueError(f"{CKPT_FLAG}: unknown weights key '{key}'; "
                             f"choose from {', '.join(WEIGHT_FILES)}")
    options = dict(options or {})
    for name in options:
        if name not in REWARDS:
            raise ValueError(f"unknown reward '{name}' in options; "
                             f"choose from {', '.join(REWARDS)}")
    components = []
    for name, w in items:
        factory, keys, accepted = REWARDS[name]
        opts = {k: v for k, v in kwargs.items() if k in accepted}
        opts.update(options.get(name, {}))
        paths = {key: weights.get(key) for key in keys}
        components.append((name, w, factory(device=device, **paths, **opts)))
    used = set().union(*(REWARDS[n][2] for n, _ in items))
    unused = [k for k in kwargs if k not in used]
    if unused:
        raise ValueError(f"reward options {unused} are taken by none of the rewards in '{spec}'")
    return WeightedSum(components)


def server_settings(args):
    """build_reward's `server` for a run's flags: None without --reward-url, else what
    scorers/remote.py's `settings` reads (imported only by the runs that name a server)."""
    if getattr(args, "reward_url", None) is None:
        return None
    return importlib.import_module("scorers.remote").settings(args)


class RewardFailed(RuntimeError):
    """A reward raised while scoring a batch: the run stops (processes.cli prints the reward's own
    traceback, then this one line, and exits with status 1)."""


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


# -----------------------------------------------------------------------------
# The registry

def _built_from(module, cls_name):
    """A factory that imports `module` when the reward is first built: the scorers import `Reward`
    from this file and pull in open_clip / transformers, the shapes reward the demo's world."""
    def factory(**kwargs):
        return getattr(importlib.import_module(module), cls_name)(**kwargs)
    factory.__qualname__ = f"{module}.{cls_name}"
    return factory


# name -> (factory(device=..., **weight paths, **options), weights keys, accepted options)
_CLIP_OPTIONS = {"model_name", "dtype", "batch_size"}
REWARDS = {
    "shapes": (_built_from("demo.verifier", "ShapesReward"), (), set()),
    "shapes_partial": (_built_from("demo.verifier", "ShapesPartialReward"), (), set()),
    "jpeg_compressibility": (lambda device="cpu": JpegReward(-1.0, device), (), set()),
    "jpeg_incompressibility": (lambda device="cpu": JpegReward(+1.0, device), (), set()),
    "clip_score": (_built_from("scorers.clip", "ClipScoreReward"), ("clip_score",), _CLIP_OPTIONS),
    "hpsv2": (_built_from("scorers.clip", "HPSv2Reward"), ("hpsv2",), _CLIP_OPTIONS),
    "pickscore": (_built_from("scorers.clip", "PickScoreReward"), ("pickscore",), _CLIP_OPTIONS),
    "aesthetic": (_built_from("scorers.clip", "AestheticReward"), ("aesthetic", "aesthetic_clip"),
                  _CLIP_OPTIONS),
    "imagereward": (_built_from("scorers.imagereward", "ImageRewardReward"),
                    ("imagereward", "imagereward_tokenizer"), {"arch", "dtype", "batch_size"}),
    "gdino": (_built_from("scorers.composition", "GDinoReward"), ("gdino",), set()),
    "gdino_released": (_built_from("scorers.composition", "GDinoReleasedReward"), ("gdino",),
                       set()),
    "git_vqa": (_built_from("scorers.composition", "GitVqaReward"), ("git_vqa",), set()),
}

# The reward classes of other folders are also reachable from this module (`rewards.HPSv2Reward`),
# imported on first access (PEP 562) for the same reason as `_built_from`.
_ELSEWHERE = {"ShapesReward": "demo.verifier", "ShapesPartialReward": "demo.verifier",
              "ClipScoreReward": "scorers.clip", "HPSv2Reward": "scorers.clip",
              "PickScoreReward": "scorers.clip", "AestheticReward": "scorers.clip",
              "ImageRewardReward": "scorers.imagereward", "GDinoReward": "scorers.composition",
              "GDinoReleasedReward": "scorers.composition", "GitVqaReward": "scorers.composition"}


def __getattr__(name):
    if name in _ELSEWHERE:
        return getattr(importlib.import_module(_ELSEWHERE[name]), name)
    raise AttributeError(f"module 'rewards' has no attribute '{name}'")
