"""ImageReward v1.0 (Xu et al., 2023) as a reward: BLIP reads the prompt against the image, a small
MLP turns the first token's feature into a score, and the score is standardised with the
published constants:

    v = ViT(x)                                  (B, 1 + P, Wv)  image tokens, P = (224 / 16)^2
    h = BERT(tokens(y), cross-attending to v)   (B, L, Wt)      L = 35 prompt tokens
    s = (MLP(h[:, 0]) - mu) / sigma             (B,)            mu = 0.16717362830052426, sigma = 1.0333394966054072

The weights are the released `ImageReward.pt` (HF THUDM/ImageReward); the tokenizer is BERT
`bert-base-uncased` read from a local folder, with BLIP's two added tokens [DEC] and [ENC] (so the
vocabulary is 30522 + 2 = 30524 rows, the size of the checkpoint's word embedding). Facts taken
from the official code (GitHub THUDM/ImageReward: ImageReward/ImageReward.py, models/BLIP/vit.py,
med.py, blip.py, blip_pretrain.py) and its `med_config.json`:

- image: resize the shortest side to 224 (bicubic), centre crop 224, OpenAI CLIP mean/std;
- vision: BLIP's ViT-L/16 (width 1024, 24 blocks, 16 heads, MLP 4096, qkv with bias, pre-norm
  blocks, LayerNorm eps 1e-6, exact GELU, a final LayerNorm on every token, no pre-LayerNorm);
- text: BERT-base (width 768, 12 layers, 12 heads, FFN 3072, LayerNorm eps 1e-12, exact GELU,
  word + position embeddings only), post-norm layers of self-attention (bidirectional, padding
  masked), then cross-attention to all image tokens (key/value from width 1024), then the FFN, in
  every layer (BLIP's `mode='multimodal'`); no pooler, the feature is the first token's state;
- prompt: padded and truncated to 35 tokens; `mu`, `sigma` as above (`ImageReward.__init__`).

The two towers are transformers' `BlipVisionModel` and `BlipTextModel`, which port the same BLIP
code; `convert_imagereward_checkpoint` renames the released keys. Settings that would change the
numbers if left at transformers' defaults, set in `ImageRewardModel`: the vision LayerNorm eps
(transformers 1e-5, BLIP 1e-6), `is_decoder=True` in the text config (transformers builds the
cross-attention modules only for a decoder) with `is_decoder=False` at the call (the default:
bidirectional self-attention as BLIP's encoder), and `add_pooling_layer=False`. The masking value
differs (BLIP adds -10000 to padded keys, transformers the dtype's minimum); either gives those
keys weight 0 after the softmax in float32.

Position 0 holds [CLS]: the official `score`, `inference_rank`, `score_gard` and the training data
code all pass the tokenizer's ids unchanged. [ENC] is in the vocabulary (BLIP's image-text matching
head puts it at position 0) but ImageReward never places it, and neither does this file.

Where this file departs from the official scorer (`ImageReward.load("ImageReward-v1.0").score`):
1. Preprocessing runs in torch, batched, on 8-bit-rounded images, with torch's antialiased bicubic
   resize, as the CLIP rewards (clip_rewards.py, departure 1: within a few 1/255 steps of PIL's).
2. The checkpoint is loaded strictly (the official loader uses `strict=False`); only the five keys
   the score never reads are skipped: `blip.vision_proj.*`, `blip.text_proj.*` (the contrastive
   projections) and the `blip.text_encoder.embeddings.position_ids` buffer.
3. Many (image, prompt) pairs per forward, in chunks of `batch_size`; the official `score` takes one
   image. Padding to 35 is kept, so each pair's numbers are those of a single-pair call.
4. No `med_config.json` is read: its values are fixed for v1.0 and are the defaults of
   `ImageRewardArch` (the official code also overrides its `encoder_width` with the ViT's 1024).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn as nn
from transformers import BertTokenizer, BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

from scorers.clip import (OPENAI_MEAN, OPENAI_STD, AestheticMLP, normalize, quantize_8bit,
                          resize_shortest_side_and_center_crop)
from infra import checkpoints
from rewards import Reward
from scorers.weights import CKPT_FLAG, WEIGHT_FILES, check_file, load_strict

# The published standardisation of the MLP output (ImageReward.py, `ImageReward.__init__`).
IMAGEREWARD_MEAN = 0.16717362830052426
IMAGEREWARD_STD = 1.0333394966054072


@dataclass(frozen=True)
class ImageRewardArch:
    """Hyper-parameters of ImageReward's BLIP; the defaults are v1.0 (`vit='large'`, med_config.json).
    Tests pass a tiny one through `build_reward(..., options={"imagereward": {"arch": {...}}})`."""

    image_size: int = 224          # input side in pixels (the centre crop)
    patch_size: int = 16
    vision_width: int = 1024       # ViT-L (its MLP hidden layer is 4x this)
    vision_layers: int = 24
    vision_heads: int = 16
    text_width: int = 768          # BERT-base
    text_layers: int = 12
    text_heads: int = 12
    text_ffn: int = 3072
    vocab_size: int = 30524        # bert-base-uncased 30522 + [DEC] + [ENC]
    max_positions: int = 512
    max_length: int = 35           # prompt tokens, [CLS] and [SEP] included

    def describe(self):
        return (f"ImageReward BLIP: ViT {self.vision_width}x{self.vision_layers} patch {self.patch_size} "
                f"at {self.image_size} px, BERT {self.text_width}x{self.text_layers}, vocab {self.vocab_size}")


class ImageRewardModel(nn.Module):
    """BLIP's ViT, BLIP's BERT with cross-attention, and the MLP head; forward returns the standardised
    score. Module names: `visual_encoder`, `text_encoder` (transformers), `mlp` (`AestheticMLP`)."""

    def __init__(self, arch=ImageRewardArch()):
        super().__init__()
        self.arch = arch
        vision = BlipVisionConfig(
            hidden_size=arch.vision_width, intermediate_size=4 * arch.vision_width,
            num_hidden_layers=arch.vision_layers, num_attention_heads=arch.vision_heads,
            image_size=arch.image_size, patch_size=arch.patch_size, hidden_act="gelu",
            layer_norm_eps=1e-6)                       # BLIP's ViT: partial(nn.LayerNorm, eps=1e-6)
        text = BlipTextConfig(
            vocab_size=arch.vocab_size, hidden_size=arch.text_width, encoder_hidden_size=arch.vision_width,
            intermediate_size=arch.text_ffn, num_hidden_layers=arch.text_layers,
            num_attention_heads=arch.text_heads, max_position_embeddings=arch.max_positions,
            hidden_act="gelu", layer_norm_eps=1e-12,   # med_config.json
            is_decoder=True,                           # builds `crossattention` in every layer
            pad_token_id=0, bos_token_id=None, eos_token_id=None, sep_token_id=None)
        self.visual_encoder = BlipVisionModel(vision)
        self.text_encoder = BlipTextModel(text, add_pooling_layer=False)
        self.mlp = AestheticMLP(arch.text_width)

    def forward(self, pixels, input_ids, attention_mask):
        """pixels: (B, 3, S, S) normalised; input_ids, attention_mask: (B, L) from the BERT tokenizer.
        Returns (B,) standardised scores."""
        image_embeds = self.visual_encoder(pixel_values=pixels).last_hidden_state        # (B, 1 + P, Wv)
        # no encoder_attention_mask: every image token is attended (the official code passes ones)
        text = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask,
                                 encoder_hidden_states=image_embeds).last_hidden_state   # (B, L, Wt)
        raw = self.mlp(text[:, 0]).float()                                               # (B,)
        return (raw - IMAGEREWARD_MEAN) / IMAGEREWARD_STD


# -----------------------------------------------------------------------------
# The released checkpoint

# Keys of ImageReward.pt that the score does not use.
_UNUSED_PREFIXES = ("blip.vision_proj.", "blip.text_proj.")
_UNUSED_KEYS = {"blip.text_encoder.embeddings.position_ids"}

# BLIP ViT (timm names, under blip.visual_encoder.) -> transformers BlipVisionModel.
_VISION_FIXED = {
    "cls_token": "embeddings.class_embedding",            # (1, 1, Wv) both
    "pos_embed": "embeddings.position_embedding",         # (1, 1 + P, Wv) both
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}
_VISION_BLOCK = {  # blocks.i.<x> -> encoder.layers.i.<y>; qkv rows are q, k, v in both
    "norm1": "layer_norm1", "attn.qkv": "self_attn.qkv", "attn.proj": "self_attn.projection",
    "norm2": "layer_norm2", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2",
}


def _vision_key(key):
    """A key under blip.visual_encoder. -> its BlipVisionModel name (unknown keys unchanged)."""
    if key in _VISION_FIXED:
        return _VISION_FIXED[key]
    block, _, rest = key.partition(".")
    index, _, rest = rest.partition(".")
    module, _, param = rest.rpartition(".")
    if block == "blocks" and index.isdigit() and module in _VISION_BLOCK:
        return f"encoder.layers.{index}.{_VISION_BLOCK[module]}.{param}"
    return key


def convert_imagereward_checkpoint(state_dict):
    """Rename the released ImageReward.pt state dict to `ImageRewardModel` keys.

    blip.visual_encoder.* -> visual_encoder.* (timm ViT names -> BlipVisionModel names);
    blip.text_encoder.*   -> text_encoder.*   (BLIP's med.py BertModel and transformers'
                                               BlipTextModel use the same names);
    mlp.*                 -> mlp.*;
    the five unused keys are dropped, anything else passes unchanged so a strict load names it.
    """
    out = {}
    for key, value in state_dict.items():
        if key in _UNUSED_KEYS or key.startswith(_UNUSED_PREFIXES):
            continue
        if key.startswith("blip.visual_encoder."):
            key = "visual_encoder." + _vision_key(key[len("blip.visual_encoder."):])
        elif key.startswith("blip.text_encoder."):
            key = key[len("blip."):]
        out[key] = value
    return out


def load_imagereward(path, arch=ImageRewardArch(), device="cpu", dtype=torch.float32):
    """ImageReward.pt (checked by `check_file` beforehand) -> `ImageRewardModel`, strictly loaded,
    in eval mode, frozen, on `device` in `dtype`. A file that does not fit is a one-line ValueError."""
    state_dict = convert_imagereward_checkpoint(checkpoints.read_state_dict(path, where=f"{CKPT_FLAG} imagereward={path}"))
    model = ImageRewardModel(arch)
    load_strict(model, state_dict, path, f"{arch.describe()} (expected {WEIGHT_FILES['imagereward'][0]})")
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_tokenizer(folder, vocab_size):
    """BERT's uncased WordPiece tokenizer from a local folder (vocab.txt, or the HF bert-base-uncased
    snapshot), with BLIP's [DEC] (bos) and [ENC] added as `init_tokenizer` does. Its size must equal
    the checkpoint's vocabulary. A folder without vocab.txt / tokenizer.json (FileNotFoundError) or
    of another size (ValueError) is a one-line error naming the folder."""
    folder = Path(folder)
    flag = f"{CKPT_FLAG} imagereward_tokenizer={folder}"
    if not any((folder / name).is_file() for name in ("vocab.txt", "tokenizer.json")):
        raise FileNotFoundError(f"{flag}: no vocab.txt or tokenizer.json in the folder; "
                                f"expected {WEIGHT_FILES['imagereward_tokenizer'][0]}")
    try:
        tokenizer = BertTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{flag}: cannot read a BERT tokenizer ({first_line})") from None
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    if len(tokenizer) != vocab_size:
        raise ValueError(f"{flag}: {len(tokenizer)} tokens with [DEC] and [ENC], but ImageReward's word "
                         f"embedding has {vocab_size} rows; expected {WEIGHT_FILES['imagereward_tokenizer'][0]}")
    return tokenizer


# -----------------------------------------------------------------------------
# The reward

class ImageRewardReward(Reward):
    """ImageReward v1.0 of each (image, prompt) pair; see the module docstring for the score.

    imagereward:           path of ImageReward.pt.
    imagereward_tokenizer: folder of the bert-base-uncased tokenizer.
    arch:                  an `ImageRewardArch` or a dict of its fields (default: v1.0).
    """

    name = "imagereward"

    def __init__(self, device="cpu", imagereward=None, imagereward_tokenizer=None, arch=None,
                 dtype=torch.float32, batch_size=32):
        path = check_file(imagereward, "imagereward")
        folder = check_file(imagereward_tokenizer, "imagereward_tokenizer")
        if not isinstance(arch, ImageRewardArch):
            unknown = set(arch or {}) - {f.name for f in fields(ImageRewardArch)}
            if unknown:
                raise ValueError(f"imagereward arch: unknown fields {sorted(unknown)}")
            arch = ImageRewardArch(**(arch or {}))
        self.arch, self.device, self.dtype, self.batch_size = arch, torch.device(device), dtype, batch_size
        self.tokenizer = load_tokenizer(folder, arch.vocab_size)
        self.model = load_imagereward(path, arch, device, dtype)

    def preprocess(self, images):
        """(B, 3, H, W) in [0, 1] -> (B, 3, S, S): shortest side to S (bicubic), centre crop, CLIP mean/std."""
        x = resize_shortest_side_and_center_crop(quantize_8bit(images), self.arch.image_size)
        return normalize(x, OPENAI_MEAN, OPENAI_STD)

    def score(self, images, prompts, metadata):
        pixels = self.preprocess(images)                                                 # (B, 3, S, S)
        tokens = self.tokenizer(prompts, padding="max_length", truncation=True,
                                max_length=self.arch.max_length, return_tensors="pt")    # (B, L) each
        scores = [self.model(px.to(self.device, self.dtype), ids.to(self.device), mask.to(self.device))
                  for px, ids, mask in zip(pixels.split(self.batch_size),
                                           tokens["input_ids"].split(self.batch_size),
                                           tokens["attention_mask"].split(self.batch_size))]
        return torch.cat(scores), {}
