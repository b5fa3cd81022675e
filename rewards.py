"""Rewards for GRPO: one call signature, built by name, combined with weights.

Every reward is a callable

    fn(images, prompts, metadata) -> (scores, info)

    images:   (B, 3, H, W) float in [0, 1], any device (numpy, and uint8 in 0..255, accepted too)
    prompts:  list of B strings
    metadata: list of B dicts (or None); only `shapes` reads it (the prompt's parsed meta)
    scores:   (B,) float32 tensor on the CPU
    info:     dict of per-image extras (e.g. "details" for shapes) and JSON-able scalars

run under `torch.no_grad()`, one batched pass per call. `build_reward("hpsv2:1.0,pickscore:0.5",
weights={...})` parses the `--reward` spec and returns the weighted sum of its rewards,

    r_b = sum_k w_k r_k,b          info["components"][k] = r_k (B,), info["means"][k] = mean_b r_k,b

(the means are unweighted, one per component, for logging). SPEC section 8 uses HPS v2.1.

Rewards, the weight files they need, and where those files are published
(the `weights` key is what `build_reward(..., weights={key: path})` and `--reward-ckpt key=PATH` take):

| `--reward` name | score | `weights` key -> file | where the official file is published |
|---|---|---|---|
| `shapes` | verifier score of the shapes world (`shapes.verify_batch`) | none | - (rendered world in shapes.py) |
| `jpeg_compressibility` | -(JPEG size in kB at quality 95), as in DDPO | none | - |
| `jpeg_incompressibility` | +(JPEG size in kB at quality 95), as in DDPO | none | - |
| `clip_score` | 100 * cos(image, prompt) | `clip_score` -> `ViT-L-14.pt` for the default `model_name="ViT-L-14-quickgelu"`; any open_clip checkpoint of the `model_name` you choose | OpenAI CLIP release (`https://openaipublic.azureedge.net/clip/models/b8cca3fd41ae0c99ba7e8951adf17d267cdb84cd88be6f7c2e0eca1737a03836/ViT-L-14.pt`, the file `clip.load("ViT-L/14")` fetches) or HF `openai/clip-vit-large-patch14` `model.safetensors`; other archs: the `open_clip_pytorch_model.bin` of their HF repo (e.g. `laion/CLIP-ViT-H-14-laion2B-s32B-b79K` with `model_name="ViT-H-14"`) |
| `hpsv2` | cos(image, prompt) under HPS v2 / v2.1 (papers print it x100: 0.2676 -> "26.76") | `hpsv2` -> `HPS_v2.1_compressed.pt` (v2.1) or `HPS_v2_compressed.pt` (v2.0) | HF `xswu/HPSv2` (linked from GitHub `tgxs002/HPSv2`) |
| `pickscore` | exp(logit_scale) * cos(image, prompt) (about 100 * cos) | `pickscore` -> `model.safetensors` | HF `yuvalkirstain/PickScore_v1`; its processor `laion/CLIP-ViT-H-14-laion2B-s32B-b79K` is open_clip's built-in tokenizer, so no file is needed for it |
| `aesthetic` | LAION aesthetic MLP on the L2-normalised CLIP ViT-L/14 image embedding (about 1..10) | `aesthetic` -> `sac+logos+ava1-l14-linearMSE.pth`; `aesthetic_clip` -> `ViT-L-14.pt` | GitHub `christophschuhmann/improved-aesthetic-predictor`; CLIP as for `clip_score` (OpenAI `ViT-L-14.pt` or HF `openai/clip-vit-large-patch14`) |

Weight files are read locally, never downloaded. Accepted formats for every CLIP tower: a plain
state dict (`.pt`/`.bin`), `{'state_dict': ...}` (the HPS files), `.safetensors`, an OpenAI
TorchScript archive (`ViT-L-14.pt`), and Hugging Face `CLIPModel` checkpoints (PickScore,
`openai/clip-vit-large-patch14`), which are renamed to open_clip keys by
`convert_pickscore_hf_to_open_clip`. The model is built with `open_clip.create_model(name,
pretrained=None)` and loaded with `strict=True`; a missing file raises a one-line
FileNotFoundError naming `--reward-ckpt` and the expected file, a file that does not fit raises a
one-line ValueError naming the file and the first mismatched keys, both at construction.

Where this file departs from the official scorers (all of which read 8-bit PIL images):
1. Preprocessing runs in torch, batched, on the images' device. Images are first rounded to 8 bits
   (what the official pipelines see after saving a PNG); the bicubic resize uses torch's
   antialiased kernel, which follows PIL's to within a few 1/255 steps (mean well under 1/255).
   For odd crop margins the centre crop rounds like torchvision's CenterCrop (OpenAI CLIP), not
   like HF's CLIPImageProcessor (floor); square images, the case here, are not cropped at all.
2. HPS: HPSv2's `ResizeMaxSize` skips both resize and padding when the longest side already equals
   the model size, which leaves a non-square input for non-square images; here the pad always
   happens, so the input is always square. For square images (all images in this project) the two
   agree exactly.
3. clip_score is not clamped at 0 (torchmetrics' CLIPScore returns max(100 cos, 0)); a reward for
   RL keeps the ordering of low scores.
4. Text features are computed once per distinct prompt in the batch (GRPO repeats each prompt G
   times); this changes no score.
"""

from __future__ import annotations

import io
import logging
import re
import warnings
import zipfile
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# OpenAI CLIP normalisation, used by HPS, PickScore's processor and the aesthetic predictor.
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)

REWARD_FLAG = "--reward"      # the spec flag, named in errors
CKPT_FLAG = "--reward-ckpt"   # the weights flag, `--reward-ckpt key=PATH`, named in errors

# weights key -> (expected file, where it is published); the table of the module docstring.
WEIGHT_FILES = {
    "hpsv2": ("HPS_v2.1_compressed.pt or HPS_v2_compressed.pt", "HF xswu/HPSv2"),
    "pickscore": ("model.safetensors", "HF yuvalkirstain/PickScore_v1"),
    "clip_score": ("ViT-L-14.pt (or the open_clip checkpoint of model_name)",
                   "OpenAI CLIP release / HF openai/clip-vit-large-patch14"),
    "aesthetic": ("sac+logos+ava1-l14-linearMSE.pth",
                  "GitHub christophschuhmann/improved-aesthetic-predictor"),
    "aesthetic_clip": ("ViT-L-14.pt", "OpenAI CLIP release / HF openai/clip-vit-large-patch14"),
}

# Keys some checkpoints carry that are no parameters of an open_clip model: non-persistent
# buffers saved by TorchScript/older code, and OpenAI's integer hyper-parameters.
_IGNORED_KEYS = {"attn_mask", "input_resolution", "context_length", "vocab_size"}


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
            raise ValueError(f"{self.name} reward: images must be (B, 3, H, W), got {tuple(images.shape)}")
        B = images.shape[0]
        if len(prompts) != B:
            raise ValueError(f"{self.name} reward: {B} images but {len(prompts)} prompts")
        metadata = [{} for _ in range(B)] if metadata is None else list(metadata)
        if len(metadata) != B:
            raise ValueError(f"{self.name} reward: {B} images but {len(metadata)} metadata dicts")
        images = images.float().div(255) if images.dtype == torch.uint8 else images.float().clamp(0, 1)
        scores, info = self.score(images, list(prompts), metadata)
        return scores.detach().float().cpu().reshape(B), info

    def score(self, images, prompts, metadata):
        raise NotImplementedError


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
        total = torch.zeros(images.shape[0])                                  # (B,)
        info = {"means": {}, "components": {}, "weights": {}}
        for name, weight, reward in self.components:
            r, extra = reward(images, prompts, metadata)                      # (B,)
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
            raise ValueError(f"unknown reward '{name}' ({REWARD_FLAG}); choose from {', '.join(REWARDS)}")
        try:
            w = float(weight) if weight.strip() else 1.0
        except ValueError:
            raise ValueError(f"bad weight '{weight}' for reward '{name}' ({REWARD_FLAG} name:weight)") from None
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
                raise ValueError(f"{CKPT_FLAG} '{item}': write key=PATH with key in {', '.join(WEIGHT_FILES)}")
    return weights


def build_reward(spec, *, device="cpu", weights=None, options=None, **kwargs):
    """Build the weighted reward of a `--reward` spec.

    spec:    'name' or 'name:weight' items, comma-separated (e.g. 'hpsv2:1.0,pickscore:0.5').
    device:  where the reward models run (images are moved there after preprocessing).
    weights: weights key -> local file, e.g. {"hpsv2": ".../HPS_v2.1_compressed.pt",
             "pickscore": ".../model.safetensors", "clip_score": ".../ViT-L-14.pt",
             "aesthetic": ".../sac+logos+ava1-l14-linearMSE.pth", "aesthetic_clip": ".../ViT-L-14.pt"}.
             Keys of rewards not in the spec are ignored.
    options: per-reward keyword arguments, {name: {kwarg: value}}, over `kwargs`.
    kwargs:  keyword arguments given to every reward of the spec that takes them (e.g.
             `model_name` for the CLIP-based rewards, `dtype`, `batch_size`).
    Returns a `WeightedSum` (also for a single reward, so info always has means and components).
    """
    items = parse_reward_spec(spec)
    weights = dict(weights or {})
    for key in weights:
        if key not in WEIGHT_FILES:
            raise ValueError(f"{CKPT_FLAG}: unknown weights key '{key}'; choose from {', '.join(WEIGHT_FILES)}")
    options = dict(options or {})
    for name in options:
        if name not in REWARDS:
            raise ValueError(f"unknown reward '{name}' in options; choose from {', '.join(REWARDS)}")
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


# -----------------------------------------------------------------------------
# Weight files

def _check_file(path, key):
    """The path of weights key `key` as a Path, or a one-line FileNotFoundError naming the flag."""
    expected, where = WEIGHT_FILES[key]
    if not path:
        raise FileNotFoundError(f"{CKPT_FLAG} {key}=PATH is required: expected {expected} (from {where})")
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{CKPT_FLAG} {key}={path}: no such file; expected {expected} (from {where})")
    return path


def _is_safetensors(path):
    """A safetensors file starts with an 8-byte little-endian header length, then a JSON '{'."""
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < path.stat().st_size


def _is_torchscript(path):
    """A TorchScript archive is a zip holding a 'constants.pkl' (a torch.save zip holds none)."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as z:
        return any(name.endswith("constants.pkl") for name in z.namelist())


def read_state_dict(path):
    """Read a tensor dict from a safetensors file, a torch file (plain or {'state_dict': ...}),
    or a TorchScript archive (OpenAI CLIP). Strips a DDP 'module.' prefix. Torch files are read
    with `weights_only=True`: no pickled code runs."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors" or _is_safetensors(path):
            from safetensors.torch import load_file
            obj = load_file(str(path), device="cpu")
        elif _is_torchscript(path):
            with warnings.catch_warnings():  # torch.jit.load is deprecated, still the OpenAI format
                warnings.simplefilter("ignore")
                obj = torch.jit.load(str(path), map_location="cpu").state_dict()
        else:
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot read weights from {path}: {first_line}") from None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise ValueError(f"cannot read weights from {path}: not a state dict ({type(obj).__name__})")
    obj = {k: v for k, v in obj.items() if torch.is_tensor(v)}
    if obj and all(k.startswith("module.") for k in obj):
        obj = {k[len("module."):]: v for k, v in obj.items()}
    return obj


def load_strict(module, state_dict, path, what):
    """module.load_state_dict(state_dict, strict=True), but a mismatch is one line naming the file.

    what: short description of the expected content, e.g. "open_clip 'ViT-H-14'".
    """
    own = module.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    shapes = [f"{k} {tuple(state_dict[k].shape)} vs {tuple(own[k].shape)}"
              for k in own if k in state_dict and state_dict[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        parts = [f"{label} {items[:3]}" + (f" (+{len(items) - 3} more)" if len(items) > 3 else "")
                 for label, items in (("missing", missing), ("unexpected", unexpected),
                                      ("shape file vs model", shapes)) if items]
        raise ValueError(f"weights in {path} do not fit {what}: " + "; ".join(parts))
    module.load_state_dict(state_dict, strict=True)


# HF CLIPModel <-> open_clip key names. Per transformer layer (prefix
# 'text_model.encoder.layers.i.' <-> 'transformer.resblocks.i.', and the vision_model/visual.
# versions); q/k/v are three Linear layers in HF and one stacked in_proj in open_clip.
_HF_LAYER = {
    "self_attn.out_proj": "attn.out_proj",
    "layer_norm1": "ln_1",
    "layer_norm2": "ln_2",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",
}
_HF_FIXED = {
    "logit_scale": "logit_scale",
    "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
    "text_model.embeddings.position_embedding.weight": "positional_embedding",
    "text_model.final_layer_norm.weight": "ln_final.weight",
    "text_model.final_layer_norm.bias": "ln_final.bias",
    "text_projection.weight": "text_projection",        # transposed: HF (D, W), open_clip (W, D)
    "vision_model.embeddings.class_embedding": "visual.class_embedding",
    "vision_model.embeddings.patch_embedding.weight": "visual.conv1.weight",
    "vision_model.embeddings.position_embedding.weight": "visual.positional_embedding",
    "vision_model.pre_layrnorm.weight": "visual.ln_pre.weight",   # sic: HF spells it 'layrnorm'
    "vision_model.pre_layrnorm.bias": "visual.ln_pre.bias",
    "vision_model.post_layernorm.weight": "visual.ln_post.weight",
    "vision_model.post_layernorm.bias": "visual.ln_post.bias",
    "visual_projection.weight": "visual.proj",          # transposed: HF (D, W), open_clip (W, D)
}
_TRANSPOSED = {"text_projection.weight", "visual_projection.weight"}
_TOWERS = {"text_model.encoder.layers.": "transformer.resblocks.",
           "vision_model.encoder.layers.": "visual.transformer.resblocks."}


def convert_pickscore_hf_to_open_clip(hf_state_dict):
    """Rename a Hugging Face `CLIPModel` state dict (PickScore_v1's `model.safetensors`, or any HF
    CLIP) to open_clip's CLIP keys. q/k/v projections are stacked into `in_proj_{weight,bias}`
    (rows q, then k, then v), projections are transposed, `position_ids` buffers are dropped, and
    keys it does not know are passed through unchanged (so a strict load reports them)."""
    out, qkv = {}, {}
    for key, value in hf_state_dict.items():
        if key.endswith("position_ids"):
            continue
        if key in _HF_FIXED:
            out[_HF_FIXED[key]] = value.t().contiguous() if key in _TRANSPOSED else value
            continue
        for hf_prefix, oc_prefix in _TOWERS.items():
            m = re.fullmatch(re.escape(hf_prefix) + r"(\d+)\.(.+)\.(weight|bias)", key)
            if m is None:
                continue
            layer, module, param = m.groups()
            if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                qkv.setdefault((oc_prefix, layer, param), {})[module[-6]] = value
            elif module in _HF_LAYER:
                out[f"{oc_prefix}{layer}.{_HF_LAYER[module]}.{param}"] = value
            else:
                out[key] = value
            break
        else:
            out[key] = value
    for (oc_prefix, layer, param), parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            for p, v in parts.items():  # incomplete: keep the HF names so the strict load names them
                out[f"{oc_prefix}{layer}.self_attn.{p}_proj.{param}"] = v
            continue
        out[f"{oc_prefix}{layer}.attn.in_proj_{param}"] = torch.cat([parts["q"], parts["k"], parts["v"]], 0)
    return out


def convert_open_clip_to_pickscore_hf(state_dict):
    """The inverse of `convert_pickscore_hf_to_open_clip`: open_clip CLIP keys -> HF `CLIPModel`
    keys (without `position_ids`). `in_proj` is split into q, k, v by rows. Used to test the
    converter without `transformers`."""
    fixed = {oc: hf for hf, oc in _HF_FIXED.items()}
    layer_map = {oc: hf for hf, oc in _HF_LAYER.items()}
    out = {}
    for key, value in state_dict.items():
        if key in _IGNORED_KEYS:
            continue
        if key in fixed:
            hf = fixed[key]
            out[hf] = value.t().contiguous() if hf in _TRANSPOSED else value
            continue
        for hf_prefix, oc_prefix in _TOWERS.items():
            m = re.fullmatch(re.escape(oc_prefix) + r"(\d+)\.attn\.in_proj_(weight|bias)", key)
            if m is not None:
                layer, param = m.groups()
                for name, part in zip("qkv", value.chunk(3, dim=0)):           # 3 x (W, W) or (W,)
                    out[f"{hf_prefix}{layer}.self_attn.{name}_proj.{param}"] = part
                break
            m = re.fullmatch(re.escape(oc_prefix) + r"(\d+)\.(.+)\.(weight|bias)", key)
            if m is not None and m.group(2) in layer_map:
                layer, module, param = m.groups()
                out[f"{hf_prefix}{layer}.{layer_map[module]}.{param}"] = value
                break
        else:
            out[key] = value
    return out


def load_open_clip(model_name, path, key, device="cpu", dtype=torch.float32):
    """Build open_clip `model_name` with random weights (never downloads) and load `path` strictly.

    path: any format of `read_state_dict`; HF `CLIPModel` checkpoints are detected by their
          'vision_model.'/'text_model.' keys and converted.
    key:  the weights key, for error messages.
    Returns the model in eval mode, frozen, on `device` in `dtype`.
    """
    import open_clip

    path = _check_file(path, key)
    state_dict = read_state_dict(path)
    if any(k.startswith(("vision_model.", "text_model.")) for k in state_dict):
        state_dict = convert_pickscore_hf_to_open_clip(state_dict)
    state_dict = {k: v for k, v in state_dict.items() if k not in _IGNORED_KEYS}
    logging.disable(logging.WARNING)  # open_clip warns "initialized randomly"; the weights come next
    try:
        model = open_clip.create_model(model_name, pretrained=None)
    finally:
        logging.disable(logging.NOTSET)
    if "logit_scale" in state_dict and state_dict["logit_scale"].ndim != model.logit_scale.ndim:
        state_dict["logit_scale"] = state_dict["logit_scale"].reshape(model.logit_scale.shape)
    load_strict(model, state_dict, path, f"open_clip '{model_name}' (expected {WEIGHT_FILES[key][0]})")
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


# -----------------------------------------------------------------------------
# Image preprocessing (torch, batched, on the images' device)

def quantize_8bit(images):
    """(B, 3, H, W) in [0, 1] -> the same values rounded to k/255, as an 8-bit image file holds."""
    return (images.clamp(0, 1) * 255).round() / 255


def _resize(images, size_hw):
    """Antialiased bicubic resize of (B, 3, H, W) to size_hw = (h, w), clamped to [0, 1]."""
    if tuple(images.shape[-2:]) == tuple(size_hw):
        return images
    return F.interpolate(images, size=size_hw, mode="bicubic", align_corners=False, antialias=True).clamp(0, 1)


def resize_longest_side_and_pad(images, size, fill=0.0):
    """HPSv2's eval transform: scale so the longest side is `size` (bicubic), then pad the short
    side to `size` with `fill` (0 = black, before normalisation), the image centred with the odd
    pixel on the bottom/right. (B, 3, H, W) -> (B, 3, size, size)."""
    B, C, H, W = images.shape  # batch, channels, height, width
    scale = size / max(H, W)
    h, w = round(H * scale), round(W * scale)
    images = _resize(images, (h, w))                                          # (B, 3, h, w)
    pad_h, pad_w = size - h, size - w
    return F.pad(images, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=fill)


def resize_shortest_side_and_center_crop(images, size):
    """CLIP's eval transform (OpenAI `clip.load`, HF `CLIPImageProcessor`): scale so the shortest
    side is `size` (bicubic), then take the central size x size crop. (B, 3, H, W) -> (B, 3, size, size)."""
    B, C, H, W = images.shape  # batch, channels, height, width
    h, w = (size, int(size * W / H)) if H <= W else (int(size * H / W), size)  # long side truncated
    images = _resize(images, (h, w))                                          # (B, 3, h, w)
    top, left = int(round((h - size) / 2)), int(round((w - size) / 2))        # as torchvision CenterCrop
    return images[:, :, top:top + size, left:left + size]                     # (B, 3, size, size)


def normalize(images, mean=OPENAI_MEAN, std=OPENAI_STD):
    """(x - mean) / std per channel. images: (B, 3, S, S)."""
    mean = torch.tensor(mean, device=images.device, dtype=images.dtype).view(1, 3, 1, 1)
    std = torch.tensor(std, device=images.device, dtype=images.dtype).view(1, 3, 1, 1)
    return (images - mean) / std


# -----------------------------------------------------------------------------
# The rewards

class ShapesReward(Reward):
    """The verifiable reward of the shapes world: `shapes.verify_batch` on the images and the
    prompts' metas (metadata[i] when it is a shapes meta, else `shapes.parse_prompt(prompts[i])`).
    info["details"]: the verifier's per-image check results."""

    name = "shapes"

    def __init__(self, device="cpu"):
        import shapes  # imported here so the other rewards work without the shapes world
        self.shapes = shapes

    def score(self, images, prompts, metadata):
        metas = []
        for prompt, meta in zip(prompts, metadata):
            if meta and "objects" in meta:  # a shapes meta dict (shapes.sample_prompts / parse_prompt)
                metas.append(meta)
                continue
            try:
                metas.append(self.shapes.parse_prompt(prompt))
            except ValueError as e:
                raise ValueError(f"shapes reward: '{prompt}' is not a shapes prompt ({e})") from None
        scores, details = self.shapes.verify_batch(images.cpu(), metas)
        return torch.as_tensor(np.asarray(scores, dtype=np.float32)), {"details": list(details)}


def jpeg_size_kb(images, quality=95):
    """JPEG file size in kB (1000 bytes) of each image at `quality`, DDPO's measure.
    images: (B, 3, H, W) in [0, 1]. Returns (B,) float32."""
    pixels = (images * 255).round().clamp(0, 255).to(torch.uint8).cpu().numpy()
    pixels = pixels.transpose(0, 2, 3, 1)                                     # (B, H, W, 3)
    from PIL import Image
    sizes = []
    for pixel in pixels:
        buffer = io.BytesIO()
        Image.fromarray(pixel).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32)


class JpegReward(Reward):
    """sign * JPEG size in kB at quality 95: sign -1 rewards compressible images, +1 incompressible."""

    def __init__(self, sign, device="cpu"):
        self.sign = sign
        self.name = "jpeg_compressibility" if sign < 0 else "jpeg_incompressibility"

    def score(self, images, prompts, metadata):
        return self.sign * jpeg_size_kb(images), {}


class _OpenClipReward(Reward):
    """Shared parts of the CLIP-based rewards: an open_clip model, its built-in tokenizer, text
    features once per distinct prompt, and image features in chunks of `batch_size`."""

    def __init__(self, model, model_name, device, dtype, batch_size):
        import open_clip
        self.model = model
        self.tokenizer = open_clip.get_tokenizer(model_name)  # SimpleTokenizer + bundled BPE: offline
        size = model.visual.image_size
        self.size = int(size[0] if isinstance(size, (tuple, list)) else size)
        self.mean = tuple(getattr(model.visual, "image_mean", None) or OPENAI_MEAN)
        self.std = tuple(getattr(model.visual, "image_std", None) or OPENAI_STD)
        self.device, self.dtype, self.batch_size = torch.device(device), dtype, batch_size

    def text_features(self, prompts):
        """L2-normalised text features (B, D), computed once per distinct prompt."""
        unique = list(dict.fromkeys(prompts))
        tokens = self.tokenizer(unique).to(self.device)                       # (U, context_length)
        feats = F.normalize(self.model.encode_text(tokens).float(), dim=-1)   # (U, D)
        index = torch.tensor([unique.index(p) for p in prompts], device=feats.device)
        return feats[index]                                                   # (B, D)

    def image_features(self, pixels):
        """L2-normalised image features (B, D) of preprocessed, normalised pixels (B, 3, S, S)."""
        feats = [self.model.encode_image(chunk.to(self.device, self.dtype)).float()
                 for chunk in pixels.split(self.batch_size)]
        return F.normalize(torch.cat(feats), dim=-1)                          # (B, D)

    def center_crop_pixels(self, images):
        """8-bit rounding, shortest-side resize + centre crop, model normalisation."""
        x = resize_shortest_side_and_center_crop(quantize_8bit(images), self.size)
        return normalize(x, self.mean, self.std)                              # (B, 3, S, S)


class ClipScoreReward(_OpenClipReward):
    """100 * cos(f_img, f_txt) for any open_clip model (`model_name`) loaded from a local file."""

    name = "clip_score"

    def __init__(self, device="cpu", clip_score=None, model_name="ViT-L-14-quickgelu",
                 dtype=torch.float32, batch_size=32):
        model = load_open_clip(model_name, clip_score, "clip_score", device, dtype)
        super().__init__(model, model_name, device, dtype, batch_size)

    def score(self, images, prompts, metadata):
        cos = (self.image_features(self.center_crop_pixels(images)) * self.text_features(prompts)).sum(-1)
        return 100 * cos, {}


class HPSv2Reward(_OpenClipReward):
    """Human Preference Score v2 / v2.1: an open_clip ViT-H-14 fine-tuned by HPS; the file decides
    the version. Score = cos(f_img, f_txt), features L2-normalised, as `hpsv2.score` returns it
    (papers print 100x). Preprocessing: resize longest side to S = visual.image_size (bicubic),
    pad to S x S with black centred, OpenAI mean/std."""

    name = "hpsv2"

    def __init__(self, device="cpu", hpsv2=None, model_name="ViT-H-14", dtype=torch.float32, batch_size=32):
        model = load_open_clip(model_name, hpsv2, "hpsv2", device, dtype)
        super().__init__(model, model_name, device, dtype, batch_size)

    def preprocess(self, images):
        """(B, 3, H, W) in [0, 1] -> HPS model input (B, 3, S, S)."""
        x = resize_longest_side_and_pad(quantize_8bit(images), self.size, fill=0.0)
        return normalize(x, self.mean, self.std)

    def score(self, images, prompts, metadata):
        return (self.image_features(self.preprocess(images)) * self.text_features(prompts)).sum(-1), {}


class PickScoreReward(_OpenClipReward):
    """PickScore v1: a CLIP ViT-H-14 fine-tuned on Pick-a-Pic, published as a Hugging Face
    `CLIPModel` and converted to open_clip on load. Score = exp(logit_scale) * cos(f_img, f_txt).
    Preprocessing as its processor (laion/CLIP-ViT-H-14-laion2B-s32B-b79K): shortest side to 224
    (bicubic), centre crop, OpenAI mean/std; tokens: the CLIP BPE, 77 long."""

    name = "pickscore"

    def __init__(self, device="cpu", pickscore=None, model_name="ViT-H-14", dtype=torch.float32, batch_size=32):
        model = load_open_clip(model_name, pickscore, "pickscore", device, dtype)
        super().__init__(model, model_name, device, dtype, batch_size)

    def score(self, images, prompts, metadata):
        cos = (self.image_features(self.center_crop_pixels(images)) * self.text_features(prompts)).sum(-1)
        return self.model.logit_scale.float().exp() * cos, {}


class AestheticMLP(nn.Module):
    """The LAION aesthetic predictor head (`sac+logos+ava1-l14-linearMSE.pth`): five linear layers
    and no nonlinearity, dropout between the first four (inactive at eval). Keys layers.{0,2,4,6,7}.

        score = W7 (W6 (W4 (W2 (W0 e + b0) + b2) + b4) + b6) + b7,   e = f_img / |f_img|
    """

    def __init__(self, embed_dim=768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(embed_dim, 1024), nn.Dropout(0.2),
            nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeddings):
        """embeddings: (B, embed_dim) L2-normalised CLIP image features -> (B,) scores."""
        return self.layers(embeddings).squeeze(-1)


class AestheticReward(_OpenClipReward):
    """LAION aesthetic score: `AestheticMLP` on the L2-normalised image embedding of CLIP ViT-L/14
    (OpenAI weights, QuickGELU). Preprocessing as `clip.load`: shortest side to 224 (bicubic),
    centre crop, OpenAI mean/std. Prompts are not used."""

    name = "aesthetic"

    def __init__(self, device="cpu", aesthetic=None, aesthetic_clip=None, model_name="ViT-L-14-quickgelu",
                 dtype=torch.float32, batch_size=32):
        head_path = _check_file(aesthetic, "aesthetic")
        model = load_open_clip(model_name, aesthetic_clip, "aesthetic_clip", device, dtype)
        super().__init__(model, model_name, device, dtype, batch_size)
        self.head = AestheticMLP(model.visual.output_dim)
        load_strict(self.head, read_state_dict(head_path), head_path,
                    f"the LAION aesthetic MLP on {model.visual.output_dim}-d features "
                    f"(expected {WEIGHT_FILES['aesthetic'][0]})")
        self.head = self.head.to(self.device).eval().requires_grad_(False)

    def score(self, images, prompts, metadata):
        return self.head(self.image_features(self.center_crop_pixels(images))), {}


# name -> (factory(device=..., **weight paths, **options), weights keys, accepted options)
_CLIP_OPTIONS = {"model_name", "dtype", "batch_size"}
REWARDS = {
    "shapes": (ShapesReward, (), set()),
    "jpeg_compressibility": (lambda device="cpu": JpegReward(-1.0, device), (), set()),
    "jpeg_incompressibility": (lambda device="cpu": JpegReward(+1.0, device), (), set()),
    "clip_score": (ClipScoreReward, ("clip_score",), _CLIP_OPTIONS),
    "hpsv2": (HPSv2Reward, ("hpsv2",), _CLIP_OPTIONS),
    "pickscore": (PickScoreReward, ("pickscore",), _CLIP_OPTIONS),
    "aesthetic": (AestheticReward, ("aesthetic", "aesthetic_clip"), _CLIP_OPTIONS),
}
