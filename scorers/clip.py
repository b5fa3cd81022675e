"""The CLIP-based rewards: CLIP score, HPS v2 / v2.1, PickScore and the LAION aesthetic score.

Each is an open_clip model built with `open_clip.create_model(name, pretrained=None)` (never a
download) and loaded strictly from a local file, plus the eval transform of the official scorer.
They share one call signature with every reward (`rewards.Reward`) and are built by name through
`registry.build_reward` (scorers/registry.py); the table of weight files and where they are published is in
docs/real_models.md, "Rewards and their weight files".

Accepted formats for every CLIP tower: a plain state dict (`.pt`/`.bin`), `{'state_dict': ...}`
(the HPS files), `.safetensors`, an OpenAI TorchScript archive (`ViT-L-14.pt`), and Hugging Face
`CLIPModel` checkpoints (PickScore, `openai/clip-vit-large-patch14`), which are renamed to
open_clip keys by `convert_pickscore_hf_to_open_clip`. A missing file raises a one-line
FileNotFoundError naming `--reward-ckpt` and the expected file, a file that does not fit raises a
one-line ValueError naming the file and the first mismatched keys, both at construction.

The eval transforms (`quantize_8bit`, `resize_shortest_side_and_center_crop`, `normalize`) live
in this file because they are CLIP's; imagereward.py uses the same ones (ImageReward preprocesses as CLIP).

Where this file departs from the official scorers (all of which read 8-bit PIL images):
1. Preprocessing runs in torch, batched, on the images' device. Images are first rounded to 8 bits
   (what the official pipelines see after saving a PNG); the bicubic resize uses torch's
   antialiased kernel, which follows PIL's to within a few 1/255 steps (mean well under 1/255).
   For odd crop margins the centre crop rounds like torchvision's CenterCrop (OpenAI CLIP), not
   like HF's CLIPImageProcessor (floor); square images, the case of this project, are not cropped at all.
2. HPS: HPSv2's `ResizeMaxSize` skips both resize and padding when the longest side already equals
   the model size, which leaves a non-square input for non-square images; this file's pad always
   happens, so the input is always square. For square images (all images in this project) the two
   agree exactly.
3. clip_score is not clamped at 0 (torchmetrics' CLIPScore returns max(100 cos, 0)); a reward for
   RL keeps the ordering of low scores.
4. Text features are computed once per distinct prompt in the batch (GRPO repeats each prompt G
   times); this changes no score.
"""

from __future__ import annotations

import logging
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from infra import checkpoints
from rewards import Reward
from scorers.weights import CKPT_FLAG, WEIGHT_FILES, check_file, load_strict

# OpenAI CLIP normalisation, used by HPS, PickScore's processor, the aesthetic predictor and ImageReward.
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)

# Keys some checkpoints carry that are no parameters of an open_clip model: non-persistent
# buffers saved by TorchScript/older code, and OpenAI's integer hyper-parameters.
_IGNORED_KEYS = {"attn_mask", "input_resolution", "context_length", "vocab_size"}


# -----------------------------------------------------------------------------
# Loading: HF CLIPModel -> open_clip keys, then a strict load

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


def load_open_clip(model_name, path, key, device="cpu", dtype=torch.float32):
    """Build open_clip `model_name` with random weights (never downloads) and load `path` strictly.

    path: any format of `checkpoints.read_state_dict`; HF `CLIPModel` checkpoints are detected by their
          'vision_model.'/'text_model.' keys and converted.
    key:  the weights key, for error messages.
    Returns the model in eval mode, frozen, on `device` in `dtype`.
    """
    import open_clip

    path = check_file(path, key)
    state_dict = checkpoints.read_state_dict(path, where=f"{CKPT_FLAG} {key}={path}")
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

    ImageReward's `MLP` is this module (same layers, same keys under `mlp.`) on its 768-d BLIP
    feature; imagereward.py uses it from this file.
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
        """embeddings: (B, embed_dim) features (L2-normalised CLIP image features for the
        aesthetic score) -> (B,) scores."""
        return self.layers(embeddings).squeeze(-1)


class AestheticReward(_OpenClipReward):
    """LAION aesthetic score: `AestheticMLP` on the L2-normalised image embedding of CLIP ViT-L/14
    (OpenAI weights, QuickGELU). Preprocessing as `clip.load`: shortest side to 224 (bicubic),
    centre crop, OpenAI mean/std. Prompts are not used."""

    name = "aesthetic"

    def __init__(self, device="cpu", aesthetic=None, aesthetic_clip=None, model_name="ViT-L-14-quickgelu",
                 dtype=torch.float32, batch_size=32):
        head_path = check_file(aesthetic, "aesthetic")
        model = load_open_clip(model_name, aesthetic_clip, "aesthetic_clip", device, dtype)
        super().__init__(model, model_name, device, dtype, batch_size)
        self.head = AestheticMLP(model.visual.output_dim)
        load_strict(self.head, checkpoints.read_state_dict(head_path, where=f"{CKPT_FLAG} aesthetic={head_path}"), head_path,
                    f"the LAION aesthetic MLP on {model.visual.output_dim}-d features "
                    f"(expected {WEIGHT_FILES['aesthetic'][0]})")
        self.head = self.head.to(self.device).eval().requires_grad_(False)

    def score(self, images, prompts, metadata):
        return self.head(self.image_features(self.center_crop_pixels(images))), {}
