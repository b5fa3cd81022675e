"""NOVA (Deng et al. 2024, GitHub baaivision/NOVA, package `diffnext`) as a MAR-family policy:
the text-to-image `NOVATransformer3DModel` with its official parameter names, so a released
`transformer/diffusion_pytorch_model.safetensors` loads key for key, behind the project's policy
interface (condition, null_condition_like, predict_z, patchify/unpatchify, ar_schedule,
sample_orders, seq_len, token_embed_dim, diffloss).

The model, for one image:
- text: precomputed Phi-2 prompt embeddings (n, 2560), padded to `text_token_len` T with the
  model's buffer `text_embed.weight[n:T]`, then Linear + LayerNorm (`text_embed`);
- condition c = video encoder on [text; one frame of `bos_token` + time embedding + 2-D sin-cos],
  its frame outputs (B, L_v, D); computed once per prompt, reused at every AR step;
- z = image encoder on the canvas: patch embedding, unknown positions replaced by `mask_token`,
  + 2-D sin-cos; the first half of its blocks runs on [c; known tokens], the known tokens are put
  back, the second half runs on [c; all tokens]; final LayerNorm. Blocks are post-norm;
- the head (nova_heads.py: `DiffusionMLP`, DDPM or flow-matching SDE) turns z into tokens.

Where this file departs from the official code and the released MAR-GRPO NOVA trainer:
1. Stateless, token-level API: `predict_z(tokens, mask, cond)` takes (p, p, C) tokens and a mask
   (1 = unknown), not a canvas plus the stateful `mask_embed`; the patch conv acts as a linear map.
2. Known tokens enter the first half of the image encoder in position order, not generation
   order; attention is permutation-equivariant in this model (absolute sin-cos, no RoPE), so z is the same
   up to rounding. Every row must know the same number of tokens, as in the official loop.
3. The released trainer recomputes z with the video encoder run on two frames [bos frame;
   canvas frame] (`single_forward_without_head`) where the sampler used the bos frame alone;
   this file recomputes z exactly as it was sampled (the same `condition`).
4. The released trainer recomputes the head's mean unguided (conditional z only) although it
   sampled with CFG 5, so its log-probabilities are not those of the sampled transitions; in this file
   [cond; null] rows and the rollout's w are used and the two agree (tests/test_nova.py).
5. Only NOVA's text-to-image configuration is built (one frame, absolute position embeddings,
   no motion embedding, no video mixer); anything else is refused with a clear error.
6. The null condition is the pipeline's: `text_embed.weight[:T]` through the same video encoder,
   recomputed at every call (it depends on trainable weights).
7. `nova_embed.embed_prompts` runs Phi-2 as transformers' `PhiModel` (NOVA's `PhiEncoderModel` has the same
   layers) in fp32, one unpadded prompt at a time; the pipeline pads ids to T without an attention
   mask, which leaves the first n outputs unchanged (causal attention, right padding).
8. All randomness through a `torch.Generator`; nothing calls `.cuda()`.
"""

import json
import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from infra import checkpoints
from mar import MaskedAR, random_orders
from models.nova_heads import DiffusionMLP, PatchEmbed, make_head

# The official architecture registry (transformer_nova.py): name -> kind and sizes
ARCHS = {
    **{f"vit_d16w{w}": dict(kind="video_encoder", depth=16, embed_dim=w, num_heads=h)
       for w, h in ((768, 12), (1024, 16), (1536, 16))},
    **{f"vit_d32w{w}": dict(kind="image_encoder", depth=32, embed_dim=w, num_heads=h)
       for w, h in ((768, 12), (1024, 16), (1536, 16))},
    **{f"mlp_d{d}w{w}": dict(kind="image_decoder", depth=d, embed_dim=w)
       for d, w in ((3, 1280), (6, 768), (6, 1024), (6, 1536))},
}


# -----------------------------------------------------------------------------
# Transformer pieces (official names: blocks.i.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1/fc2})

class Attention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        B, N, D = x.shape  # batch, tokens, width
        q, k, v = self.qkv(x).view(B, N, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)  # (B, nh, N, hd)
        o = F.scaled_dot_product_attention(q, k, v)  # (B, nh, N, hd)
        return self.proj(o.transpose(1, 2).reshape(B, N, D))


class MLP(nn.Module):
    def __init__(self, dim, mlp_ratio=4):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, int(dim * mlp_ratio)), nn.Linear(int(dim * mlp_ratio), dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Post-norm transformer block: x + LN(attn(x)), then x + LN(mlp(x))."""

    def __init__(self, dim, num_heads):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, num_heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), MLP(dim)

    def forward(self, x):
        x = x + self.norm1(self.attn(x))
        return x + self.norm2(self.mlp(x))


class VisionTransformer(nn.Module):
    """NOVA's ViT (used as video and as image encoder), on already embedded tokens. With
    `grad_checkpointing`, a pass with gradients keeps each block's input only and recomputes the block
    in the backward pass."""

    def __init__(self, depth, embed_dim, num_heads, patch_size, image_dim):
        super().__init__()
        self.patch_embed = PatchEmbed(image_dim, embed_dim, patch_size)
        self.blocks = nn.ModuleList(Block(embed_dim, num_heads) for _ in range(depth))
        self.norm = nn.LayerNorm(embed_dim)
        self.encoder_depth = depth // 2
        self.grad_checkpointing = False

    def run(self, blocks, h):
        """h (B, N, D) through `blocks`, each checkpointed when grad_checkpointing and gradients are on."""
        for block in blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.grad_checkpointing and torch.is_grad_enabled() else block(h)
        return h

    def forward(self, x, c, known=None):
        """x: (B, L, D) embedded tokens; c: (B, Lc, D) prefix (text or condition);
        known: optional (B, K) positions that alone enter the first half of the blocks.
        returns (B, L, D): the normalised outputs at the L token positions."""
        Lc, half = c.shape[1], self.encoder_depth
        if known is None:
            h = torch.cat([c, x], 1)  # (B, Lc+L, D)
        else:
            idx = known[..., None].expand(-1, -1, x.shape[-1])  # (B, K, D)
            h = self.run(self.blocks[:half], torch.cat([c, x.gather(1, idx)], 1))  # (B, Lc+K, D)
            h = torch.cat([h[:, :Lc], x.to(h.dtype).scatter(1, idx, h[:, Lc:])], 1)  # known tokens back in place
        h = self.run(self.blocks[half if known is not None else 0:], h)
        return self.norm(h[:, Lc:])


def sincos_2d(dim, h, w):
    """NOVA's 2-D sin-cos position embedding (h·w, dim), positions row-major over (h, w):
    [sin(j f), cos(j f), sin(i f), cos(i f)] for column j, row i, f = 10000^(−m/(dim/4))."""
    freq = 1 / (10000 ** (torch.arange(dim // 4, dtype=torch.float32) / (dim // 4)))  # (dim/4,)
    rows, cols = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32),
                                indexing="ij")  # (h, w) each
    fw, fh = cols.reshape(-1, 1) * freq, rows.reshape(-1, 1) * freq  # (h·w, dim/4) each
    return torch.cat([fw.sin(), fw.cos(), fh.sin(), fh.cos()], dim=-1)


class VideoPosEmbed(nn.Module):
    """The frame-time embedding LN(MLP([sin | cos](t · 10000^(−m/128)))) (official names)."""

    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.time_proj = nn.Sequential(nn.Linear(256, dim), nn.SiLU(), nn.Linear(dim, dim))

    def time_embed(self):
        """(1, D): the embedding of frame 0 of a one-frame video (sin 0 = 0, cos 0 = 1)."""
        w = self.time_proj[0].weight
        sincos = torch.cat([torch.zeros(1, 128), torch.ones(1, 128)], dim=-1).to(w)  # (1, 256)
        return self.norm(self.time_proj(sincos))


class TextEmbed(nn.Module):
    """Prompt embeddings -> LN(Linear(.)); `weight` (512, D_text) holds the padding / null rows."""

    def __init__(self, token_dim, embed_dim, num_tokens):
        super().__init__()
        self.num_tokens = num_tokens
        self.proj, self.norm = nn.Linear(token_dim, embed_dim), nn.LayerNorm(embed_dim)
        self.register_buffer("weight", torch.randn(512, token_dim) * 0.02)

    def pad(self, prompt_embeds):
        """(B, n, D_text) tensor or list of (n_i, D_text) -> (B, T, D_text), row i padded with
        weight[n_i:T] (the pipeline's `encode_prompts`)."""
        T = self.num_tokens
        if torch.is_tensor(prompt_embeds) and prompt_embeds.shape[1] == T:
            return prompt_embeds.to(self.weight)
        rows = []
        for e in prompt_embeds:
            if e.shape[0] > T:
                raise ValueError(f"prompt_embeds: a prompt of {e.shape[0]} tokens exceeds text_token_len {T}")
            rows.append(torch.cat([e.to(self.weight), self.weight[e.shape[0]:T]]))
        return torch.stack(rows)

    def forward(self, prompt_embeds):
        return self.norm(self.proj(self.pad(prompt_embeds)))  # (B, T, D)


class MaskEmbed(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.bos_token = nn.Parameter(torch.randn(1, dim) * 0.02)
        self.mask_token = nn.Parameter(torch.randn(1, dim) * 0.02)


# -----------------------------------------------------------------------------
# The model

class NOVA(MaskedAR, nn.Module):
    """NOVA's text-to-image transformer. Arguments are `NOVATransformer3DModel`'s config
    (image_dim, image_size, image_stride, text_token_dim, text_token_len, image_base_size,
    video_base_size, arch = [video encoder, image encoder, image decoder] registry names) plus
    arch_defs: extra registry entries {name: {kind, depth, embed_dim[, num_heads]}};
    scheduler: a diffusers scheduler config dict (selects the head, nova_heads.py);
    num_sampling_steps: T of the head (NOVA's `num_diffusion_steps`, 25 by default)."""
    # the trained transformer's blocks (infra/fsdp.py shards each) and the projections in them that take
    # LoRA adapters with --lora (infra/lora.py): the video and image encoders' attention qkv / proj and
    # MLP fc1 / fc2; the diffusion MLP `image_decoder` is the head and stays frozen
    BLOCKS = r"(video|image)_encoder\.blocks\.\d+"
    LORA_TARGETS = BLOCKS + r"\.(attn\.(qkv|proj)|mlp\.(fc1|fc2))"

    def __init__(self, image_dim, image_size, image_stride, text_token_dim, text_token_len, image_base_size,
                 video_base_size, arch, scheduler, num_sampling_steps=25, arch_defs=None, rotary_pos_embed=False,
                 video_mixer_rank=None):
        super().__init__()
        if rotary_pos_embed or video_mixer_rank or not text_token_dim or video_base_size[0] != 1:
            raise ValueError("config: only NOVA's text-to-image configuration is supported (rotary_pos_embed false, "
                             "no video_mixer_rank, text_token_dim set, video_base_size[0] == 1)")
        registry = {**ARCHS, **(arch_defs or {})}
        sizes = []
        for name, kind in zip(arch, ("video_encoder", "image_encoder", "image_decoder")):
            if name not in registry or registry[name]["kind"] != kind:
                raise ValueError(f"config: arch {name!r} is not a known {kind} (add it to arch_defs)")
            sizes.append(registry[name])
        v, e, d = sizes
        if v["embed_dim"] != e["embed_dim"]:
            raise ValueError(f"config: the video and image encoders must have one width, got {arch[0]} and {arch[1]}")
        self.patch_size = 15 // image_stride + 1  # 2 for the KL-8 VAE (image_stride 8)
        self.grid, self.image_dim = tuple(image_base_size), image_dim  # (h, w) token grid, latent channels
        self.video_encoder = VisionTransformer(v["depth"], v["embed_dim"], v["num_heads"], 2 * self.patch_size, image_dim)
        self.image_encoder = VisionTransformer(e["depth"], e["embed_dim"], e["num_heads"], self.patch_size, image_dim)
        self.image_decoder = DiffusionMLP(d["depth"], d["embed_dim"], e["embed_dim"], self.patch_size, image_dim)
        self.mask_embed = MaskEmbed(e["embed_dim"])
        self.text_embed = TextEmbed(text_token_dim, e["embed_dim"], text_token_len)
        self.video_pos_embed = VideoPosEmbed(v["embed_dim"])
        self.register_buffer("image_pos", sincos_2d(e["embed_dim"], *self.grid), persistent=False)  # (L, D)
        self.register_buffer("video_pos", sincos_2d(v["embed_dim"], *video_base_size[1:]), persistent=False)  # (L_v, D)
        self.set_scheduler(scheduler, num_sampling_steps)

    def set_scheduler(self, scheduler, num_sampling_steps):
        """(Re)build `diffloss`, the head for a diffusers scheduler config, around `image_decoder`.
        It is a plain attribute, not a submodule: its net *is* image_decoder, whose parameters
        keep their official names (and are listed once) in the state dict."""
        object.__setattr__(self, "diffloss", make_head(self.image_decoder, scheduler, num_sampling_steps))

    @property
    def grad_checkpointing(self):
        """Whether a pass with gradients recomputes each block of the video and image encoders in the
        backward pass instead of keeping its activations (train.py --grad-checkpointing)."""
        return self.image_encoder.grad_checkpointing

    @grad_checkpointing.setter
    def grad_checkpointing(self, on):
        self.video_encoder.grad_checkpointing = self.image_encoder.grad_checkpointing = bool(on)

    @property
    def seq_len(self):
        return self.grid[0] * self.grid[1]

    @property
    def token_embed_dim(self):
        return self.patch_size ** 2 * self.image_dim

    # -------------------------------------------------------------------------
    # tokens

    def patchify(self, latents):
        """(B, C, H, W) latent image -> (B, L, p·p·C) tokens in NOVA's (p, p, C) layout."""
        B, C, H, W = latents.shape
        p, (h, w) = self.patch_size, self.grid
        if (H, W) != (h * p, w * p) or C != self.image_dim:
            raise ValueError(f"latents: expected (B, {self.image_dim}, {h * p}, {w * p}), got {tuple(latents.shape)}")
        x = latents.reshape(B, C, h, p, w, p).permute(0, 2, 4, 3, 5, 1)  # (B, h, w, p, p, C)
        return x.reshape(B, h * w, p * p * C)

    def unpatchify(self, tokens):
        """(B, L, p·p·C) tokens -> (B, C, H, W) latent image."""
        B = tokens.shape[0]
        p, (h, w), C = self.patch_size, self.grid, self.image_dim
        x = tokens.reshape(B, h, w, p, p, C).permute(0, 5, 1, 3, 2, 4)  # (B, C, h, p, w, p)
        return x.reshape(B, C, h * p, w * p)

    def ar_schedule(self, num_iter, seq_len):
        """Tokens written at each executed AR step: differences of round(L cos(π/2 · k/N)),
        k = 0 … N, with the zero-count steps dropped (so possibly fewer than N entries)."""
        lengths = [round(math.cos(0.5 * math.pi * k / num_iter) * seq_len) for k in range(num_iter + 1)]
        return [a - b for a, b in zip(lengths, lengths[1:]) if a > b]

    def sample_orders(self, bsz, generator=None):
        """(B, L) generation orders: the argsort of uniform noise per row, the official draw (mar.random_orders)."""
        return random_orders(bsz, self.seq_len, self.mask_embed.mask_token.device, generator)

    # -------------------------------------------------------------------------
    # condition and z

    def condition(self, prompt_embeds):
        """c (B, L_v, D): the video encoder's output for a batch of prompts.

        prompt_embeds: (B, n, D_text) Phi-2 embeddings, or a list of (n_i, D_text); rows shorter
        than text_token_len are padded with text_embed.weight[n_i:T] (see models/nova_embed.py).
        """
        text = self.text_embed(prompt_embeds)  # (B, T, D)
        frame = self.mask_embed.bos_token + self.video_pos_embed.time_embed() + self.video_pos  # (L_v, D)
        return self.video_encoder(frame.expand(text.shape[0], -1, -1), text)

    def null_condition_like(self, cond):
        """The null condition (the pipeline's null prompt, text_embed.weight[:T]), shaped like cond."""
        null_prompt = self.text_embed.weight[None, :self.text_embed.num_tokens]  # (1, T, D_text)
        return self.condition(null_prompt).expand(cond.shape[0], -1, -1)

    def predict_z(self, tokens, mask, cond):
        """z (B, L, D) for a canvas.

        tokens: (B, L, p·p·C) in (p, p, C) layout (values at unknown positions are ignored);
        mask: (B, L), 1 = unknown, the same number of known tokens in every row; cond: (B, L_v, D).
        """
        m = mask.to(tokens.dtype)[..., None]  # (B, L, 1)
        x = self.image_encoder.patch_embed(tokens) * (1 - m) + self.mask_embed.mask_token * m + self.image_pos
        num_known = (mask == 0).sum(1)  # (B,)
        if bool((num_known != num_known[0]).any()):  # syncs with the GPU, as does int() below
            raise ValueError("mask: every row must have the same number of known tokens")
        known = torch.argsort(m[..., 0], dim=1, stable=True)[:, :int(num_known[0])]  # (B, K) known, in position order
        return self.image_encoder(x, cond, known)


# -----------------------------------------------------------------------------
# Building and loading

def build(config):
    """A NOVA from a plain config dict: {"transformer": NOVATransformer3DModel kwargs,
    "scheduler": diffusers scheduler config, optional "arch_defs", "num_diffusion_steps"}."""
    if "scheduler" not in config:
        raise ValueError("config: a 'scheduler' (diffusers scheduler config dict) is required")
    kwargs = {k: v for k, v in config["transformer"].items() if not k.startswith("_") and k != "arch_defs"}
    arch_defs = {**(config["transformer"].get("arch_defs") or {}), **(config.get("arch_defs") or {})}  # custom archs
    model = NOVA(**kwargs, scheduler=config["scheduler"], num_sampling_steps=config.get("num_diffusion_steps", 25),
                 arch_defs=arch_defs or None)
    model.config = dict(config)  # a plain dict, saved with the weights by train.py
    return model


def _read_json(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read JSON ({type(e).__name__}: {e})") from None


def load_nova(path, scheduler=None, num_sampling_steps=25, arch_defs=None):
    """Load a released NOVA transformer in eval mode.

    path: a NOVA pipeline folder (with transformer/ and scheduler/), its transformer/ folder, or
        a .safetensors file; the model config is the `config.json` beside the weights (sharded
        weights via `diffusion_pytorch_model.safetensors.index.json` are read too).
    scheduler: a diffusers scheduler config dict; default: the pipeline's
        scheduler/scheduler_config.json. num_sampling_steps: T of the head.
    arch_defs: registry entries for architecture names the official registry lacks.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"load_nova: no such file or folder: {path}")
    folder = path.parent if path.is_file() else (path / "transformer" if (path / "transformer").is_dir() else path)
    if path.is_file():
        files = [path]
    elif (folder / "diffusion_pytorch_model.safetensors.index.json").is_file():
        index = _read_json(folder / "diffusion_pytorch_model.safetensors.index.json")
        files = [folder / name for name in sorted(set(index["weight_map"].values()))]
    else:
        files = [folder / "diffusion_pytorch_model.safetensors"]
    if scheduler is None:
        scheduler_file = folder.parent / "scheduler" / "scheduler_config.json"
        if not scheduler_file.is_file():
            raise FileNotFoundError(f"load_nova: no scheduler given and no {scheduler_file}")
        scheduler = _read_json(scheduler_file)
    model = build(dict(transformer=_read_json(folder / "config.json"), scheduler=scheduler,
                       num_diffusion_steps=num_sampling_steps, arch_defs=arch_defs))
    sd = {}
    for file in files:
        sd.update(checkpoints.read_state_dict(file))
    checkpoints.check_state_dict(model, sd, files[0] if len(files) == 1 else folder)
    model.load_state_dict(sd, strict=True)
    return model.eval()
