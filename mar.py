"""MAR, masked autoregressive image generation with a diffusion head (docs/method.md §1; §10, the
official interfaces), and the generation loop MAR, Harmon and NOVA share: at AR step i of N, over a
random order, with U_i the unknown positions and P_i ⊆ U_i those the step writes,

    z_i       = f_θ(known canvas, condition)                  (B, L, D), at every position
    x_p       ~ head(z_i,p) for p ∈ P_i                       T-step DDPM of diffloss.py, τ, w_i
    |U_{i+1}| = max(1, min(|U_i| − 1, ⌊L cos(π/2 (i+1)/N)⌋))  0 after the last step (`ar_schedule`)
    w_i       = 1 + (w − 1)(L − max(|U_{i+1}|, 1)) / L         linear guidance, or w constant
"""

import math
from functools import partial
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint
from timm.models.vision_transformer import Block
from tqdm import tqdm

from diffloss import DiffLoss


def unknown_after_step(step, num_iter, seq_len, num_unknown):
    """Number of tokens still unknown after AR step `step` (MaskGIT cosine schedule, at least one
    token generated per step, all generated at the last step)."""
    if step >= num_iter - 1:
        return 0
    target = math.floor(seq_len * math.cos(math.pi / 2.0 * (step + 1) / num_iter))
    return max(1, min(num_unknown - 1, target))


def random_orders(bsz, seq_len, device, generator=None):
    """(B, L) generation orders, one random permutation of 0 … L−1 per row: the argsort of
    uniform noise, as NOVA draws them (the official MAR and the released Harmon shuffle each row
    with np.random.shuffle: the same distribution of orders). MAR, Harmon and NOVA here all draw
    theirs with it, from the caller's generator."""
    return torch.argsort(torch.rand(bsz, seq_len, device=device, generator=generator), dim=1)


def guidance_weight(cfg, cfg_schedule, num_unknown_next, seq_len):
    """w of one AR step: constant, or "linear" (MAR, after Muse): rising with the fraction of
    tokens generated, 1 + (w − 1)(L − max(n_next, 1)) / L (the official code's max(…, 1))."""
    if cfg_schedule == "constant":
        return cfg
    if cfg_schedule == "linear":
        return 1 + (cfg - 1) * (seq_len - max(num_unknown_next, 1)) / seq_len
    raise ValueError(f"cfg_schedule {cfg_schedule!r}: choose 'linear' or 'constant'")


def cat_rows(a, b):
    """Concatenate two batches of a condition (a tensor or a dict of tensors) along dim 0."""
    if isinstance(a, dict):
        return {key: torch.cat([a[key], b[key]]) for key in a}
    return torch.cat([a, b])


class StepView(NamedTuple):
    """What AR step i of `MaskedAR.generate` shows its observer after the head's call (`saw(view)`;
    rollout.py records from it, docs/method.md §3): B images, L positions, C token channels, m
    positions the head sampled."""
    i: int
    tokens: torch.Tensor      # (B, L, C) the canvas the step started from (zeros where unknown)
    unknown: torch.Tensor     # (B, L) bool U_i
    written: torch.Tensor     # (B, L) bool P_i ⊆ U_i, the positions written at this step
    pos: torch.Tensor         # (B, m) the positions the head sampled, ascending
    z: torch.Tensor           # (B, L, D), or (2B, L, D) [cond; null] rows with guidance
    w: float                  # the step's guidance
    canvas: torch.Tensor      # (B, L, C) the canvas with the head's result at `pos`
    traj: dict | None         # the head's recorded transitions ((K, B·m, C) each), or None


class MaskedAR:
    """The generation loop of the MAR family (MAR, Harmon and NOVA inherit it), over the policy
    interface each of them implements:

        condition(**inputs) -> cond              batch-first tensor or dict of tensors; `inputs`
                                                 are a batch's raw condition inputs (MAR:
                                                 prompt_ids or labels; Harmon: input_ids,
                                                 attention_mask; NOVA: prompt_embeds)
        null_condition_like(cond) -> cond_null   the classifier-free-guidance null, same structure
        predict_z(tokens, mask, cond) -> z       tokens (B, L, C), mask (B, L) float 1 = unknown,
                                                 z (B, L, D)
        diffloss                                 the head: p_mean_variance, sample,
                                                 trainable_steps()
        sample_orders(bsz, generator), seq_len, token_embed_dim, patchify, unpatchify
        grad_checkpointing                       settable: the transformer's blocks recomputed in
                                                 the backward pass
    """

    def ar_schedule(self, num_iter, seq_len):
        """Tokens written at each AR step (the cosine schedule of `unknown_after_step`). Steps that
        would write nothing (N > L) are left out: the official loop runs them without effect."""
        counts, num_unknown = [], seq_len
        for step in range(num_iter):
            n_next = unknown_after_step(step, num_iter, seq_len, num_unknown)
            counts.append(num_unknown - n_next)
            num_unknown = n_next
        return [n for n in counts if n > 0]

    def with_null(self, cond):
        """The rows [cond; null] of classifier-free guidance, batch 2B."""
        return cat_rows(cond, self.null_condition_like(cond))

    def guided_z(self, tokens, mask, cond, guided):
        """z of a canvas for the head: (B, L, D), or with guidance (2B, L, D) = the canvas under
        [cond; null] (cond from `with_null`) in one batched pass. tokens (B, L, C); mask (B, L)
        float."""
        if guided:
            # (2B, L, C), (2B, L)
            tokens, mask = torch.cat([tokens, tokens]), torch.cat([mask, mask])
        return self.predict_z(tokens, mask, cond).float()

    @torch.no_grad()
    def generate(self, cond, orders, num_iter, cfg=1.0, cfg_schedule="linear", temperature=1.0,
                 generator=None, observer=None, progress=False):
        """Generate tokens: at AR step i, z of the canvas, then the head writes the next
        `ar_schedule` tokens of each order (from its end, as MAR): P_i ⊆ U_i.

        cond: a batch's condition; orders: (B, L); num_iter: N; cfg: guidance w (rows doubled with
        the null condition when w != 1); cfg_schedule: "linear" | "constant"; temperature: τ;
        observer: None, or one with `wants(i)` -> None (the head samples P_i alone) or a request
          with `all_unknown` (it samples all of U_i) and `record_steps` (its diffusion steps to
          record, or None): rollout.StepRequest; and `saw(view)`, view a `StepView` of the step
          (rollout.Recorder).
        returns tokens (B, L, C)
        """
        guided = cfg != 1.0
        if guided:
            cond = self.with_null(cond)  # (2B, ...) = [cond; null]
        (B, L), C = orders.shape, self.token_embed_dim
        tokens = torch.zeros(B, L, C, device=orders.device)
        unknown = torch.ones(B, L, dtype=torch.bool, device=orders.device)
        # Every image has the same number of unknown tokens at every step, so the positions the head
        # samples are a gather from the orders, not a boolean mask: no host sync in this loop beyond
        # what predict_z itself does.
        num_unknown = L
        for i, count in enumerate(tqdm(self.ar_schedule(num_iter, L), disable=not progress)):
            z = self.guided_z(tokens, unknown.to(tokens.dtype), cond, guided)  # (B or 2B, L, D)
            D = z.shape[-1]
            n_next = num_unknown - count  # orders[:, :n_next] stay unknown
            # (B, L) P_i
            written = torch.zeros_like(unknown).scatter_(1, orders[:, n_next:num_unknown], True)
            w = guidance_weight(cfg, cfg_schedule, n_next, L) if guided else 1.0
            request = observer.wants(i) if observer is not None else None
            all_unknown = request is not None and request.all_unknown
            record_steps = request.record_steps if request is not None else None
            pos = (orders[:, :num_unknown] if all_unknown
                   else orders[:, n_next:num_unknown]).sort(dim=1).values  # (B, m)
            # the head's rows are image-major, positions ascending
            idx = pos[..., None].expand(-1, -1, D)  # (B, m, D)
            z_head = z[:B].gather(1, idx).reshape(-1, D)  # (B·m, D)
            if guided:
                # (2·B·m, D) = [cond; null]
                z_head = torch.cat([z_head, z[B:].gather(1, idx).reshape(-1, D)])
            out = self.diffloss.sample(z_head, temperature, w, generator, record_steps=record_steps)
            sampled, traj = out if record_steps is not None else (out, None)  # (B·m, C)
            # the canvas with the head's result on the sampled positions: x̂0 on U_i when
            # all_unknown
            canvas = tokens.scatter(1, pos[..., None].expand(-1, -1, C),
                                    sampled.reshape(B, -1, C).to(tokens.dtype))
            if observer is not None:
                observer.saw(StepView(i, tokens=tokens, unknown=unknown, written=written, pos=pos,
                                      z=z, w=w, canvas=canvas, traj=traj))
            tokens = torch.where(written[..., None], canvas, tokens)  # only P_i is written
            unknown, num_unknown = unknown & ~written, n_next
        return tokens


class MAR(MaskedAR, nn.Module):
    """Masked autoregressive model with a diffusion head (official arguments and defaults).

    Extra arguments beyond the official ones:
        text_vocab_size: if > 0, a word-embedding table for prompt conditioning (`text_emb`);
        clip_denoised: the head clamps x̂0 to [-1, 1] when sampling (pixel tokens; diffloss.py).
    """
    # the trained blocks (infra/fsdp.py shards each) and their projections that take --lora
    # adapters (infra/lora.py)
    BLOCKS = r"(encoder|decoder)_blocks\.\d+"
    LORA_TARGETS = BLOCKS + r"\.(attn\.(qkv|proj)|mlp\.(fc1|fc2))"

    def __init__(self, img_size=256, vae_stride=16, patch_size=1,
                 encoder_embed_dim=1024, encoder_depth=16, encoder_num_heads=16,
                 decoder_embed_dim=1024, decoder_depth=16, decoder_num_heads=16,
                 mlp_ratio=4., norm_layer=nn.LayerNorm,
                 vae_embed_dim=16, mask_ratio_min=0.7, label_drop_prob=0.1, class_num=1000,
                 attn_dropout=0.1, proj_dropout=0.1, buffer_size=64,
                 diffloss_d=3, diffloss_w=1024, num_sampling_steps='100', diffusion_batch_mul=4,
                 grad_checkpointing=False, text_vocab_size=0, clip_denoised=False, local_conv=0):
        super().__init__()
        # plain-dict snapshot of the constructor, saved in checkpoints (no pickled objects)
        self.config = {k: v for k, v in locals().items()
                       if k not in ("self", "norm_layer", "__class__")}
        self.config.update(num_sampling_steps=str(num_sampling_steps),
                           norm_eps=(norm_layer.keywords.get("eps", 1e-5)
                                     if isinstance(norm_layer, partial) else 1e-5))

        # tokens
        self.vae_embed_dim, self.img_size, self.vae_stride, self.patch_size = (
            vae_embed_dim, img_size, vae_stride, patch_size)
        self.seq_h = self.seq_w = img_size // vae_stride // patch_size
        self.seq_len = self.seq_h * self.seq_w
        self.token_embed_dim = vae_embed_dim * patch_size ** 2
        self.grad_checkpointing = grad_checkpointing

        # conditioning
        self.num_classes = class_num
        self.class_emb = nn.Embedding(class_num, encoder_embed_dim)
        self.label_drop_prob = label_drop_prob
        self.fake_latent = nn.Parameter(torch.zeros(1, encoder_embed_dim))  # the null condition
        if text_vocab_size > 0:
            self.text_emb = nn.Embedding(text_vocab_size, encoder_embed_dim)
        self.mask_ratio_min = mask_ratio_min

        # MAE encoder
        self.z_proj = nn.Linear(self.token_embed_dim, encoder_embed_dim, bias=True)
        self.z_proj_ln = nn.LayerNorm(encoder_embed_dim, eps=1e-6)
        self.buffer_size = buffer_size
        self.encoder_pos_embed_learned = nn.Parameter(
            torch.zeros(1, self.seq_len + buffer_size, encoder_embed_dim))
        self.encoder_blocks = nn.ModuleList([
            Block(encoder_embed_dim, encoder_num_heads, mlp_ratio, qkv_bias=True,
                  norm_layer=norm_layer, proj_drop=proj_dropout, attn_drop=attn_dropout)
            for _ in range(encoder_depth)])
        self.encoder_norm = norm_layer(encoder_embed_dim)

        # MAE decoder
        self.decoder_embed = nn.Linear(encoder_embed_dim, decoder_embed_dim, bias=True)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        self.decoder_pos_embed_learned = nn.Parameter(
            torch.zeros(1, self.seq_len + buffer_size, decoder_embed_dim))
        self.decoder_blocks = nn.ModuleList([
            Block(decoder_embed_dim, decoder_num_heads, mlp_ratio, qkv_bias=True,
                  norm_layer=norm_layer, proj_drop=proj_dropout, attn_drop=attn_dropout)
            for _ in range(decoder_depth)])
        self.decoder_norm = norm_layer(decoder_embed_dim)
        self.diffusion_pos_embed_learned = nn.Parameter(
            torch.zeros(1, self.seq_len, decoder_embed_dim))
        self.local_conv = local_conv
        if local_conv:  # not in the official MAR: the notes at the end of this file, item 4
            self.decoder_local_conv = nn.Conv2d(decoder_embed_dim, decoder_embed_dim, local_conv,
                                                padding=local_conv // 2)

        self.initialize_weights()
        # zero: it starts as the official model
        for p in self.decoder_local_conv.parameters() if local_conv else ():
            nn.init.zeros_(p)

        # diffusion head
        self.diffloss = DiffLoss(target_channels=self.token_embed_dim, z_channels=decoder_embed_dim,
                                 width=diffloss_w, depth=diffloss_d,
                                 num_sampling_steps=num_sampling_steps,
                                 grad_checkpointing=grad_checkpointing, clip_denoised=clip_denoised)
        self.diffusion_batch_mul = diffusion_batch_mul

    def initialize_weights(self):
        for p in (self.class_emb.weight, self.fake_latent, self.mask_token,
                  self.encoder_pos_embed_learned, self.decoder_pos_embed_learned,
                  self.diffusion_pos_embed_learned):
            nn.init.normal_(p, std=.02)
        if hasattr(self, "text_emb"):
            nn.init.normal_(self.text_emb.weight, std=.02)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.constant_(m.bias, 0)
        elif isinstance(m, nn.LayerNorm):
            if m.bias is not None:
                nn.init.constant_(m.bias, 0)
            if m.weight is not None:
                nn.init.constant_(m.weight, 1.0)

    # -------------------------------------------------------------------------
    # tokens

    def patchify(self, x):
        """(B, C, H, W) latent image -> (B, L, C·p²) tokens."""
        bsz, c, h, w = x.shape
        p = self.patch_size
        h_, w_ = h // p, w // p
        x = x.reshape(bsz, c, h_, p, w_, p)
        x = torch.einsum('nchpwq->nhwcpq', x)
        return x.reshape(bsz, h_ * w_, c * p ** 2)  # (B, L, C·p²)

    def unpatchify(self, x):
        """(B, L, C·p²) tokens -> (B, C, H, W) latent image."""
        bsz = x.shape[0]
        p = self.patch_size
        c = self.vae_embed_dim
        x = x.reshape(bsz, self.seq_h, self.seq_w, c, p, p)
        x = torch.einsum('nhwcpq->nchpwq', x)
        return x.reshape(bsz, c, self.seq_h * p, self.seq_w * p)  # (B, C, H, W)

    def sample_orders(self, bsz, generator=None):
        """(B, L) random generation orders (`random_orders`)."""
        return random_orders(bsz, self.seq_len, self.fake_latent.device, generator)

    # -------------------------------------------------------------------------
    # conditioning

    def condition(self, labels=None, prompt_ids=None, bsz=None):
        """Condition embeddings for the buffer slots.

        labels: (B,) class indices -> (B, D), broadcast to every buffer slot (official path);
        prompt_ids: (B, S) word ids, 0 = padding -> (B, S, D) placed in the first S slots;
        neither: the null condition `fake_latent`, (B, D).
        """
        if labels is not None:
            return self.class_emb(labels)
        if prompt_ids is not None:
            if prompt_ids.shape[1] > self.buffer_size:
                raise ValueError(f"prompt of {prompt_ids.shape[1]} tokens exceeds buffer_size "
                                 f"{self.buffer_size}")
            emb = self.text_emb(prompt_ids)  # (B, S, D)
            return torch.where((prompt_ids == 0)[..., None], self.fake_latent, emb)
        return self.fake_latent.expand(bsz, -1)

    def null_condition_like(self, cond):
        """The CFG null condition with the shape of `cond` ((B, D) or (B, S, D))."""
        return self.fake_latent.expand(cond.shape)

    # -------------------------------------------------------------------------
    # MAE encoder / decoder

    def forward_mae_encoder(self, x, mask, class_embedding, generator=None):
        """x: (B, L, C_tok) tokens; mask: (B, L), 1 = unknown; class_embedding: (B, D) or
        (B, S, D) condition. Returns (B, buffer + #known, D): the encoded known tokens."""
        x = self.z_proj(x)
        bsz, seq_len, embed_dim = x.shape
        # buffer slots in front of the tokens, never masked
        x = torch.cat([torch.zeros(bsz, self.buffer_size, embed_dim, device=x.device,
                                   dtype=x.dtype), x], dim=1)
        mask_with_buffer = torch.cat([torch.zeros(bsz, self.buffer_size, device=x.device), mask],
                                     dim=1)
        # drop the condition for classifier-free guidance training
        if self.training:
            drop = torch.rand(bsz, generator=generator, device=x.device) < self.label_drop_prob
            drop = drop.to(x.dtype).reshape(bsz, *([1] * (class_embedding.dim() - 1)))
            class_embedding = drop * self.fake_latent + (1 - drop) * class_embedding
        if class_embedding.dim() == 2:  # a class: the same embedding in every slot
            x[:, :self.buffer_size] = class_embedding.unsqueeze(1)
        else:  # a prompt: one word per slot, the free slots hold the null embedding
            s = class_embedding.shape[1]
            x[:, :s] = class_embedding
            x[:, s:self.buffer_size] = self.fake_latent.to(x.dtype)
        x = x + self.encoder_pos_embed_learned
        x = self.z_proj_ln(x)
        # keep the buffer and the known tokens (every row has the same number of them)
        # (B, buffer+#known, D)
        x = x[(1 - mask_with_buffer).nonzero(as_tuple=True)].reshape(bsz, -1, embed_dim)
        return self.encoder_norm(self.run_blocks(self.encoder_blocks, x))

    def forward_mae_decoder(self, x, mask):
        """x: (B, buffer + #known, D_enc) encoder output; mask: (B, L), 1 = unknown.
        Returns z: (B, L, D_dec), the diffusion head's condition for every position."""
        x = self.decoder_embed(x)
        mask_with_buffer = torch.cat([torch.zeros(x.size(0), self.buffer_size, device=x.device),
                                      mask], dim=1)
        # put the known tokens back in place, mask tokens elsewhere
        x_after_pad = self.mask_token.repeat(
            mask_with_buffer.shape[0], mask_with_buffer.shape[1], 1).to(x.dtype)
        x_after_pad[(1 - mask_with_buffer).nonzero(as_tuple=True)] = x.reshape(
            x.shape[0] * x.shape[1], x.shape[2])
        x = x_after_pad + self.decoder_pos_embed_learned  # (B, buffer+L, D)
        if self.local_conv:  # a local prior on the token grid (small models only)
            x = torch.cat([x[:, :self.buffer_size],
                           x[:, self.buffer_size:] + self.grid_conv(x[:, self.buffer_size:])],
                          dim=1)
        x = self.decoder_norm(self.run_blocks(self.decoder_blocks, x))
        x = x[:, self.buffer_size:]  # (B, L, D)
        return x + self.diffusion_pos_embed_learned

    def run_blocks(self, blocks, x):
        """x (B, N, D) through `blocks`; with grad_checkpointing and gradients on, each is
        recomputed in the backward."""
        for block in blocks:
            x = (checkpoint(block, x, use_reentrant=False)
                 if self.grad_checkpointing and torch.is_grad_enabled() else block(x))
        return x

    def grid_conv(self, x):
        """The decoder's local prior: x (B, L, D) image positions -> (B, L, D), a k×k convolution
        over the (h, w) token grid (mask tokens and encoded known tokens alike)."""
        bsz, seq_len, dim = x.shape
        grid = x.transpose(1, 2).reshape(bsz, dim, self.seq_h, self.seq_w)  # (B, D, h, w)
        return self.decoder_local_conv(grid).flatten(2).transpose(1, 2)  # (B, L, D)

    def predict_z(self, tokens, mask, cond):
        """z (B, L, D) for a canvas: tokens (B, L, C_tok), mask (B, L) 1 = unknown,
        cond (B, [S,] D)."""
        return self.forward_mae_decoder(self.forward_mae_encoder(tokens, mask, cond), mask)

    # -------------------------------------------------------------------------
    # generation

    @torch.no_grad()
    def sample_tokens(self, bsz, num_iter=64, cfg=1.0, cfg_schedule="linear", labels=None,
                      temperature=1.0, progress=False, generator=None, prompt_ids=None,
                      orders=None):
        """(B, C, H, W) latent images (docs/method.md §1, MAR's loop: N AR steps, each writing
        P_i ⊆ U_i from z = f_θ(canvas) by the head's T-step DDPM): `generate` behind the official
        signature; labels: (B,) classes or prompt_ids: (B, S) (neither: unconditional); orders:
        optional (B, L)."""
        orders = (self.sample_orders(bsz, generator) if orders is None
                  else orders.to(self.fake_latent.device))
        cond = self.condition(labels, prompt_ids, bsz)
        tokens = self.generate(cond, orders, num_iter, cfg, cfg_schedule, temperature, generator,
                               progress=progress)
        return self.unpatchify(tokens)


# the official sizes: (width, depth, heads) of encoder and decoder each, and the head (depth, width)
# the official training scripts pass with each model (main_mar.py flags)
OFFICIAL_SIZES = {"mar_base": (768, 12, 12), "mar_large": (1024, 16, 16),
                  "mar_huge": (1280, 20, 16)}
OFFICIAL_HEADS = {"mar_base": dict(diffloss_d=6, diffloss_w=1024),
                  "mar_large": dict(diffloss_d=8, diffloss_w=1280),
                  "mar_huge": dict(diffloss_d=12, diffloss_w=1536)}


def official_mar(name, **kwargs):
    """mar_base / mar_large / mar_huge: the official sizes, LayerNorm eps 1e-6, other arguments as
    given."""
    width, depth, heads = OFFICIAL_SIZES[name]
    return MAR(encoder_embed_dim=width, encoder_depth=depth, encoder_num_heads=heads,
               decoder_embed_dim=width, decoder_depth=depth, decoder_num_heads=heads, mlp_ratio=4,
               norm_layer=partial(nn.LayerNorm, eps=1e-6), **kwargs)


def mar_base(**kwargs):
    return official_mar("mar_base", **kwargs)


def mar_large(**kwargs):
    return official_mar("mar_large", **kwargs)


def mar_huge(**kwargs):
    return official_mar("mar_huge", **kwargs)


def build_mar(config):
    """A MAR from a plain config dict (as saved in `MAR.config`)."""
    config = dict(config)
    norm_eps = config.pop("norm_eps", 1e-6)
    # a small base's config may record the official one
    if config.pop("mask_schedule", "official") != "official":
        raise ValueError("config: only the official mask schedule (a truncated normal ratio) is "
                         "built")
    return MAR(norm_layer=partial(nn.LayerNorm, eps=norm_eps), **config)


# -----------------------------------------------------------------------------
# Notes: the official MAR, and what this file adds or changes
#
# Sources: "official" is GitHub `LTH14/mar@fe470ac`, models/mar.py (the head sizes: the main_mar.py
# commands of its README.md). "Released" is the MAR-GRPO code, GitHub `AMAP-ML/mar-grpo@fcb7969`:
# Harmon's MAR in src/grpo/src/harmon/mar.py, NOVA in src/grpo/src/diffnext/ (orders:
# models/embeddings.py; generation loop: models/transformers/transformer_3d.py).
#
# The model is the official one (Li et al. 2024, GitHub LTH14/mar), with the same module names,
# so official checkpoints load with `strict=True`: tokens x (B, L, C_tok) are patches of a latent
# image (KL-16 VAE latents, or raw pixels); an MAE encoder reads the *known* tokens plus
# `buffer_size` condition slots; an MAE decoder fills every position with a mask token where unknown
# and outputs z (B, L, D) per position; the diffusion head (diffloss.py) turns z into tokens.
# Generation runs N steps over a random order; after step i, floor(L cos(π/2 (i+1)/N)) tokens are
# unknown, at least one fewer each step (`ar_schedule`).
#
# What this file adds or changes, in order of importance:
# 1. The generation loop is `MaskedAR.generate`, shared by MAR, Harmon and NOVA: it calls only the
#    policy interface, so rollout.py's recorder and grpo.py's loss drive every model alike.
#    `sample_tokens` keeps the official signature.
# 2. Prompt conditioning beside the class path: `prompt_ids` (B, S) are embedded and placed in the
#    first S buffer slots; padding and the free slots hold `fake_latent`, which is also the null
#    condition of classifier-free guidance. The class path is unchanged.
# 3. All randomness goes through a `torch.Generator`, the device comes from the model's tensors
#    (the official code uses global numpy state and `.cuda()`). With the same orders and noise,
#    `sample_tokens` computes what the official code computes in eval mode (tested).
# 4. `local_conv=k` (small models only; 0 by default, as official): a zero-initialised k×k
#    convolution over the decoder's token grid. A small MAR trained for minutes on a CPU does not
#    learn from learned position embeddings which tokens are neighbours; this prior gives it that.
# Codecs (raw pixels, the KL-16 VAE) are in models/vae.py; loading `.pth` files, models/loading.py.
