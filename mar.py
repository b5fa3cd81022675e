"""MAR: masked autoregressive image generation with a diffusion head (docs/method.md §1, §3, §10).

The model is the official one (Li et al. 2024, GitHub LTH14/mar), with the same module names,
so official checkpoints load with `strict=True`:
- tokens x (B, L, C_tok) are patches of a latent image (KL-16 VAE latents, or raw pixels);
- an MAE encoder reads the *known* tokens plus `buffer_size` condition slots, an MAE decoder
  fills every position with a mask token where unknown and outputs z (B, L, D) per position;
- the diffusion head (diffloss.py) turns z into tokens.
Generation (`sample_tokens`) runs N steps over a random order; after step i, floor(L cos(π/2 (i+1)/N))
tokens are unknown, at least one fewer each step (`ar_schedule`).

What this file adds or changes, in order of importance:
1. The policy interface of rollout.py (`condition`, `null_condition_like`, `predict_z`, `ar_schedule`,
   `sample_orders`, the head `diffloss`), so the model-agnostic recorder and loss drive this MAR as
   they drive Harmon and NOVA. `sample_tokens` stays the plain official loop.
2. Prompt conditioning beside the class path: `prompt_ids` (B, S) are embedded and placed in the
   first S buffer slots; padding and the free slots hold `fake_latent`, which is also the null
   condition of classifier-free guidance. The class path is unchanged.
3. All randomness goes through a `torch.Generator`, the device comes from the model's tensors
   (the official code uses global numpy state and `.cuda()`). With the same orders and noise,
   `sample_tokens` computes what the official code computes in eval mode (tested).
4. `local_conv=k` (small models only; 0 by default, as official): a zero-initialised k×k
   convolution over the decoder's token grid after the position embedding. The small MAR trained
   for minutes on a CPU does not learn which tokens are neighbours from learned position
   embeddings; this prior gives it that locality (docs/research_log.md).
The pixel codec ends the file; the KL-16 VAE is vae.py; loading `.pth` files, models.load_checkpoint.
"""

import math
from functools import partial

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint
from timm.models.vision_transformer import Block
from tqdm import tqdm

from diffloss import DiffLoss
from rollout import guidance_weight


def unknown_after_step(step, num_iter, seq_len, num_unknown):
    """Number of tokens still unknown after AR step `step` (MaskGIT cosine schedule, at least one
    token generated per step, all generated at the last step)."""
    if step >= num_iter - 1:
        return 0
    target = math.floor(seq_len * math.cos(math.pi / 2.0 * (step + 1) / num_iter))
    return max(1, min(num_unknown - 1, target))


def random_orders(bsz, seq_len, device, generator=None):
    """(B, L) generation orders, one random permutation of 0 … L−1 per row: the argsort of uniform
    noise, as the official MAR and NOVA draw them (MAR, Harmon and NOVA all draw theirs with it)."""
    return torch.argsort(torch.rand(bsz, seq_len, device=device, generator=generator), dim=1)


class MAR(nn.Module):
    """Masked autoregressive model with a diffusion head (official arguments and defaults).

    Extra arguments beyond the official ones:
        text_vocab_size: if > 0, a word-embedding table for prompt conditioning (`text_emb`);
        clip_denoised: the head clamps x̂0 to [-1, 1] when sampling (pixel tokens; diffloss.py).
    """
    # the trained blocks (fsdp.py shards each) and their projections that take --lora adapters (lora.py)
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
        norm_eps = norm_layer.keywords.get("eps", 1e-5) if isinstance(norm_layer, partial) else 1e-5
        # plain-dict snapshot of the constructor, saved in checkpoints (no pickled objects)
        self.config = dict(
            img_size=img_size, vae_stride=vae_stride, patch_size=patch_size,
            encoder_embed_dim=encoder_embed_dim, encoder_depth=encoder_depth, encoder_num_heads=encoder_num_heads,
            decoder_embed_dim=decoder_embed_dim, decoder_depth=decoder_depth, decoder_num_heads=decoder_num_heads,
            mlp_ratio=mlp_ratio, norm_eps=norm_eps, vae_embed_dim=vae_embed_dim, mask_ratio_min=mask_ratio_min,
            label_drop_prob=label_drop_prob, class_num=class_num, attn_dropout=attn_dropout,
            proj_dropout=proj_dropout, buffer_size=buffer_size, diffloss_d=diffloss_d, diffloss_w=diffloss_w,
            num_sampling_steps=str(num_sampling_steps), diffusion_batch_mul=diffusion_batch_mul,
            grad_checkpointing=grad_checkpointing, text_vocab_size=text_vocab_size, clip_denoised=clip_denoised,
            local_conv=local_conv)

        # tokens
        self.vae_embed_dim = vae_embed_dim
        self.img_size = img_size
        self.vae_stride = vae_stride
        self.patch_size = patch_size
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
        self.encoder_pos_embed_learned = nn.Parameter(torch.zeros(1, self.seq_len + buffer_size, encoder_embed_dim))
        self.encoder_blocks = nn.ModuleList([
            Block(encoder_embed_dim, encoder_num_heads, mlp_ratio, qkv_bias=True, norm_layer=norm_layer,
                  proj_drop=proj_dropout, attn_drop=attn_dropout) for _ in range(encoder_depth)])
        self.encoder_norm = norm_layer(encoder_embed_dim)

        # MAE decoder
        self.decoder_embed = nn.Linear(encoder_embed_dim, decoder_embed_dim, bias=True)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        self.decoder_pos_embed_learned = nn.Parameter(torch.zeros(1, self.seq_len + buffer_size, decoder_embed_dim))
        self.decoder_blocks = nn.ModuleList([
            Block(decoder_embed_dim, decoder_num_heads, mlp_ratio, qkv_bias=True, norm_layer=norm_layer,
                  proj_drop=proj_dropout, attn_drop=attn_dropout) for _ in range(decoder_depth)])
        self.decoder_norm = norm_layer(decoder_embed_dim)
        self.diffusion_pos_embed_learned = nn.Parameter(torch.zeros(1, self.seq_len, decoder_embed_dim))
        self.local_conv = local_conv
        if local_conv:  # not in the official MAR: see the module docstring, item 4
            self.decoder_local_conv = nn.Conv2d(decoder_embed_dim, decoder_embed_dim, local_conv, padding=local_conv // 2)

        self.initialize_weights()
        for p in self.decoder_local_conv.parameters() if local_conv else ():  # zero: it starts as the official model
            nn.init.zeros_(p)

        # diffusion head
        self.diffloss = DiffLoss(target_channels=self.token_embed_dim, z_channels=decoder_embed_dim,
                                 width=diffloss_w, depth=diffloss_d, num_sampling_steps=num_sampling_steps,
                                 grad_checkpointing=grad_checkpointing, clip_denoised=clip_denoised)
        self.diffusion_batch_mul = diffusion_batch_mul

    def initialize_weights(self):
        for p in (self.class_emb.weight, self.fake_latent, self.mask_token, self.encoder_pos_embed_learned,
                  self.decoder_pos_embed_learned, self.diffusion_pos_embed_learned):
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

    def random_masking(self, x, orders, generator=None):
        """MAE training mask (B, L), 1 = masked: the first ⌈L·ratio⌉ positions of each order, the
        ratio a normal(1, 0.25) truncated to [mask_ratio_min, 1] (inverse-CDF sampling), one per
        batch (the encoder keeps the same number of tokens in every row)."""
        bsz, seq_len, _ = x.shape
        u = torch.rand((), generator=generator, dtype=torch.float64, device=orders.device).cpu()
        a = torch.special.ndtr(torch.tensor((self.mask_ratio_min - 1.0) / 0.25, dtype=torch.float64))
        mask_rate = 1.0 + 0.25 * torch.special.ndtri(a + u * (0.5 - a)).item()  # 0.5 = Φ(0)
        num_masked = int(math.ceil(seq_len * mask_rate))
        mask = torch.zeros(bsz, seq_len, device=x.device)
        return torch.scatter(mask, -1, orders[:, :num_masked], 1.0)

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
                raise ValueError(f"prompt of {prompt_ids.shape[1]} tokens exceeds buffer_size {self.buffer_size}")
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
        x = torch.cat([torch.zeros(bsz, self.buffer_size, embed_dim, device=x.device, dtype=x.dtype), x], dim=1)
        mask_with_buffer = torch.cat([torch.zeros(bsz, self.buffer_size, device=x.device), mask], dim=1)
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
        x = x[(1 - mask_with_buffer).nonzero(as_tuple=True)].reshape(bsz, -1, embed_dim)  # (B, buffer+#known, D)
        for block in self.encoder_blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.grad_checkpointing and torch.is_grad_enabled() else block(x)
        return self.encoder_norm(x)

    def forward_mae_decoder(self, x, mask):
        """x: (B, buffer + #known, D_enc) encoder output; mask: (B, L), 1 = unknown.
        Returns z: (B, L, D_dec), the diffusion head's condition for every position."""
        x = self.decoder_embed(x)
        mask_with_buffer = torch.cat([torch.zeros(x.size(0), self.buffer_size, device=x.device), mask], dim=1)
        # put the known tokens back in place, mask tokens elsewhere
        x_after_pad = self.mask_token.repeat(mask_with_buffer.shape[0], mask_with_buffer.shape[1], 1).to(x.dtype)
        x_after_pad[(1 - mask_with_buffer).nonzero(as_tuple=True)] = x.reshape(x.shape[0] * x.shape[1], x.shape[2])
        x = x_after_pad + self.decoder_pos_embed_learned  # (B, buffer+L, D)
        if self.local_conv:  # a local prior on the token grid (small models only)
            x = torch.cat([x[:, :self.buffer_size], x[:, self.buffer_size:] + self.grid_conv(x[:, self.buffer_size:])], dim=1)
        for block in self.decoder_blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.grad_checkpointing and torch.is_grad_enabled() else block(x)
        x = self.decoder_norm(x)
        x = x[:, self.buffer_size:]  # (B, L, D)
        return x + self.diffusion_pos_embed_learned

    def grid_conv(self, x):
        """The decoder's local prior: x (B, L, D) image positions -> (B, L, D), a k×k convolution
        over the (h, w) token grid (mask tokens and encoded known tokens alike)."""
        bsz, seq_len, dim = x.shape
        grid = x.transpose(1, 2).reshape(bsz, dim, self.seq_h, self.seq_w)  # (B, D, h, w)
        return self.decoder_local_conv(grid).flatten(2).transpose(1, 2)  # (B, L, D)

    def predict_z(self, tokens, mask, cond):
        """z (B, L, D) for a canvas: tokens (B, L, C_tok), mask (B, L) 1 = unknown, cond (B, [S,] D)."""
        return self.forward_mae_decoder(self.forward_mae_encoder(tokens, mask, cond), mask)

    # -------------------------------------------------------------------------
    # training

    def forward_loss(self, z, target, mask, generator=None):
        """Diffusion loss on masked positions, each repeated `diffusion_batch_mul` times."""
        bsz, seq_len, _ = target.shape
        target = target.reshape(bsz * seq_len, -1).repeat(self.diffusion_batch_mul, 1)  # (B·L·m, C)
        z = z.reshape(bsz * seq_len, -1).repeat(self.diffusion_batch_mul, 1)  # (B·L·m, D)
        mask = mask.reshape(bsz * seq_len).repeat(self.diffusion_batch_mul)  # (B·L·m,)
        return self.diffloss(z=z, target=target, mask=mask, generator=generator)

    def forward(self, imgs, labels=None, prompt_ids=None, generator=None):
        """The official MAE-style training loss.

        imgs: (B, C, H, W) latent images; labels: (B,) classes, or prompt_ids: (B, S).
        """
        cond = self.condition(labels, prompt_ids, bsz=imgs.shape[0])
        x = self.patchify(imgs)  # (B, L, C_tok)
        gt_latents = x.clone().detach()
        orders = self.sample_orders(x.size(0), generator)
        mask = self.random_masking(x, orders, generator)
        x = self.forward_mae_encoder(x, mask, cond, generator)
        z = self.forward_mae_decoder(x, mask)
        return self.forward_loss(z=z, target=gt_latents, mask=mask, generator=generator)

    # -------------------------------------------------------------------------
    # generation

    def ar_schedule(self, num_iter, seq_len):
        """Tokens written at each of the N AR steps (the cosine schedule of `unknown_after_step`)."""
        counts, num_unknown = [], seq_len
        for step in range(num_iter):
            n_next = unknown_after_step(step, num_iter, seq_len, num_unknown)
            counts.append(num_unknown - n_next)
            num_unknown = n_next
        return counts

    @torch.no_grad()
    def sample_tokens(self, bsz, num_iter=64, cfg=1.0, cfg_schedule="linear", labels=None, temperature=1.0,
                      progress=False, generator=None, prompt_ids=None, orders=None):
        """Generate latent images (docs/method.md §1): the official loop, without RL recording (rollout.py).

        bsz: images; num_iter: AR steps N; cfg: guidance w (the batch is doubled internally when
        w != 1); cfg_schedule: "linear" (w rises with the fraction generated, as Muse) or
        "constant"; labels: (B,) classes or prompt_ids: (B, S) (neither = unconditional);
        temperature: τ of the head's noise; orders: optional (B, L) generation orders.
        returns (B, C, H, W) latent images.
        """
        device = self.fake_latent.device
        L, C = self.seq_len, self.token_embed_dim
        mask = torch.ones(bsz, L, device=device)
        tokens = torch.zeros(bsz, L, C, device=device)
        orders = self.sample_orders(bsz, generator) if orders is None else orders.to(device)
        cond = self.condition(labels, prompt_ids, bsz)
        if cfg != 1.0:
            cond = torch.cat([cond, self.null_condition_like(cond)], dim=0)  # (2B, [S,] D)

        num_unknown = L
        for step, count in enumerate(tqdm(self.ar_schedule(num_iter, L), disable=not progress)):
            x = torch.cat([tokens, tokens], dim=0) if cfg != 1.0 else tokens
            m = torch.cat([mask, mask], dim=0) if cfg != 1.0 else mask
            z = self.forward_mae_decoder(self.forward_mae_encoder(x, m, cond), m)  # (B or 2B, L, D)

            # the positions that stay unknown after this step: the first n_next of each order
            n_next = num_unknown - count
            mask_next = torch.zeros(bsz, L, device=device).scatter(1, orders[:, :n_next], 1.0)
            mask_to_pred = mask.bool() & ~mask_next.bool()  # (B, L) P_i
            cfg_iter = guidance_weight(cfg, cfg_schedule, n_next, L)  # constant, or linear as the official code

            idx = mask_to_pred.nonzero(as_tuple=True)
            z_head = z[:bsz][idx]  # (M, D)
            if cfg != 1.0:
                z_head = torch.cat([z_head, z[bsz:][idx]], dim=0)  # (2M, D) = [cond; null]
            tokens = tokens.clone()
            tokens[idx] = self.diffloss.sample(z_head, temperature, cfg_iter, generator).to(tokens.dtype)  # (M, C)
            mask, num_unknown = mask_next, n_next
        return self.unpatchify(tokens)


def mar_base(**kwargs):
    return MAR(encoder_embed_dim=768, encoder_depth=12, encoder_num_heads=12, decoder_embed_dim=768, decoder_depth=12,
               decoder_num_heads=12, mlp_ratio=4, norm_layer=partial(nn.LayerNorm, eps=1e-6), **kwargs)


def mar_large(**kwargs):
    return MAR(encoder_embed_dim=1024, encoder_depth=16, encoder_num_heads=16, decoder_embed_dim=1024, decoder_depth=16,
               decoder_num_heads=16, mlp_ratio=4, norm_layer=partial(nn.LayerNorm, eps=1e-6), **kwargs)


def mar_huge(**kwargs):
    return MAR(encoder_embed_dim=1280, encoder_depth=20, encoder_num_heads=16, decoder_embed_dim=1280, decoder_depth=20,
               decoder_num_heads=16, mlp_ratio=4, norm_layer=partial(nn.LayerNorm, eps=1e-6), **kwargs)


# the official training scripts pass these head sizes with each model (main_mar.py flags)
OFFICIAL_HEADS = {"mar_base": dict(diffloss_d=6, diffloss_w=1024),
                  "mar_large": dict(diffloss_d=8, diffloss_w=1280),
                  "mar_huge": dict(diffloss_d=12, diffloss_w=1536)}


def build_mar(config):
    """A MAR from a plain config dict (as saved in `MAR.config`)."""
    config = dict(config)
    norm_eps = config.pop("norm_eps", 1e-6)
    if config.pop("mask_schedule", "official") != "official":  # a small base's config may record the official one
        raise ValueError("config: only the official mask schedule (a truncated normal ratio) is built")
    return MAR(norm_layer=partial(nn.LayerNorm, eps=norm_eps), **config)


# -----------------------------------------------------------------------------
# Image <-> latent-image codecs. MAR works on latent images (B, C, h, w) and patchifies them.

class PixelCodec:
    """Raw pixels as the latent image: images (B, 3, H, W) in [0, 1] <-> values in [-1, 1].
    With MAR(vae_stride=1, vae_embed_dim=3, patch_size=p) a token is one p×p×3 patch."""

    def encode(self, images, generator=None):
        return images * 2 - 1

    def decode(self, latents):
        return ((latents + 1) / 2).clamp(0, 1)
