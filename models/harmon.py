"""Harmon (Wu et al. 2025, GitHub wusize/Harmon) as a MAR-family policy (the second system of
MAR-GRPO; fixtures/README_adapters.md, "Harmon").

Harmon is a MAR encoder/decoder with the LTH14 diffusion head (the project's `mar.MAR` and
`DiffLoss`, built with Harmon's sizes so the `mar.*` keys are the official ones) whose encoder
output is refined by a Qwen2.5 LLM that reads the prompt. z for a canvas (`predict_z`):
  1. MAR encoder on [buffer slots, all `fake_latent`; known tokens] -> x_enc_mar; the text enters
     only through the LLM;
  2. `proj_in`, buffer slots moved behind the image tokens, appended to the prompt embeddings;
  3. the LLM (causal attention, padded prompt positions masked, position ids cumsum(mask) − 1);
  4. its outputs at the image positions, buffers moved back in front, through `proj_out`, added
     to x_enc_mar -> x_enc;
  5. MAR decoder -> z (B, L, D_dec), the head's condition at every position.
Tokens: a token is the 16 VAE-latent channels of one position, layout (C, p, p) with p = 1,
positions row-major. The latent × `vae_scale` (0.2325) happens in the codec, not in this file:
`vae.vae_encode` multiplies by `vae.VAE_SCALE` (the same number), `vae.vae_decode` divides.

Where this file departs from the official code:
1. No KV cache. The official sampler prefills the prompt into a `DynamicCache` once and, at every
   AR step, runs the image part against it and cuts the cache back (`curtail_cache`). This file's
   LLM runs [prompt; image] in one uncached pass per call: the same z (|Δ| ≤ 2e-6 against the
   official cached run, float32) from a pure function of (canvas, condition, weights) that
   autograd sees whole, which RL needs: the cache is a mutable object, built without gradients
   in the released trainer and trimmed through `.data`, so the prompt path is invisible to
   autograd and a call order mistake silently corrupts later calls. The prompt (~30 tokens) is
   small next to the 64 buffer + known image tokens, so the extra cost is a few percent. (The
   cache API the official code uses, `DynamicCache.from_legacy_cache`, is also gone from
   transformers 5.)
2. The padded prompt positions are masked in that one pass. The official prefill runs the
   prompt unmasked, which is the same for right padding (Harmon's tokenizer pads right) and
   wrong for left padding; in this file either padding gives the same z.
3. The condition is the prompt's token ids and mask; the LLM embeds them inside `predict_z`.
   `condition` pads right to at least the null prompt's length, so that cond and
   `null_condition_like(cond)` share one length and concatenate along the batch.
4. Generation orders come from a `torch.Generator` (official: global numpy state).
5. The MAR encoder never drops the condition in training mode (Harmon's MAR has no condition to
   drop; its label drop is commented out); dropout in the blocks acts in train mode as official.
"""

import os
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from infra import checkpoints
import mar as mar_lib

# Harmon's chat template (configs/models/*.py, prompt_template['INSTRUCTION']); no system prompt,
# so the tokenizer's own chat template (which adds Qwen's default system prompt) is not used
PROMPT_TEMPLATE = "<|im_start|>user\n{input}<|im_end|>\n<|im_start|>assistant\n"
GENERATION_TEMPLATE = "Generate an image: {text}"  # scripts/text2image.py; MAR-GRPO's text2image_hf.py
NULL_PROMPT = "Generate an image."  # the CFG prompt (`cfg_prompt`)

_QWEN25 = dict(vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
               tie_word_embeddings=True, hidden_act="silu")
_MAR_KL16 = dict(img_size=256, vae_stride=16, patch_size=1, vae_embed_dim=16, mlp_ratio=4.0, mask_ratio_min=0.7,
                 label_drop_prob=0.1, class_num=1000, attn_dropout=0.1, proj_dropout=0.1, buffer_size=64,
                 num_sampling_steps="100", diffusion_batch_mul=4, grad_checkpointing=False, layernorm_eps=1e-6)
# The released models (configs/models/qwen2_5_{0_5b_kl16_mar_b,1_5b_kl16_mar_h}.py): Qwen2.5-Instruct
# + MAR-B / MAR-H (LayerNorm eps 1e-6) at the native 16×16 grid, sampled at 32×32 (512 px).


def _release(llm_width, llm_mlp, llm_layers, llm_heads, mar_width, mar_depth, mar_heads, head_depth, head_width):
    """A released Harmon's config from its sizes (Qwen2.5 with 2 key-value heads, a KL-16 MAR)."""
    return dict(llm=dict(_QWEN25, hidden_size=llm_width, intermediate_size=llm_mlp, num_hidden_layers=llm_layers,
                         num_attention_heads=llm_heads, num_key_value_heads=2),
                mar=dict(_MAR_KL16, encoder_embed_dim=mar_width, encoder_depth=mar_depth, encoder_num_heads=mar_heads,
                         decoder_embed_dim=mar_width, decoder_depth=mar_depth, decoder_num_heads=mar_heads,
                         diffloss_d=head_depth, diffloss_w=head_width),
                vae_scale=0.2325, image_shape=[32, 32])


CONFIGS = {
    "harmon_0.5b": _release(896, 4864, 24, 14, 768, 12, 12, 6, 1024),  # Qwen2.5-0.5B + MAR-B
    "harmon_1.5b": _release(1536, 8960, 28, 12, 1280, 20, 16, 12, 1536),  # Qwen2.5-1.5B + MAR-H
}


def build_mlp(in_dim, hidden_dim, out_dim):
    """Harmon's projector: Linear -> SiLU -> Linear (keys `.0.*`, `.2.*`)."""
    return nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.SiLU(), nn.Linear(hidden_dim, out_dim))


class Harmon(mar_lib.MaskedAR, nn.Module):
    """The Harmon generator: `llm` (Qwen2ForCausalLM), `mar` (mar.MAR with its DiffLoss head),
    `proj_in`, `proj_out`; the KL-16 VAE is loaded separately (vae.load_vae).

    llm: Qwen2Config kwargs; mar: MAR kwargs plus `layernorm_eps` (the blocks' LayerNorm eps);
    vae_scale: the latent scale (used by the codec); image_shape: the sampling grid (h, w) of
    tokens, default the MAR's native grid img_size / vae_stride / patch_size.
    """
    # the trained transformer's blocks (infra/fsdp.py shards each) and the projections in them that take
    # LoRA adapters with --lora (infra/lora.py): the MAR's, as in mar.MAR; the LLM stays frozen, as the
    # released trainer keeps it (loading.trainable_names)
    BLOCKS = r"mar\.(encoder|decoder)_blocks\.\d+"
    LORA_TARGETS = BLOCKS + r"\.(attn\.(qkv|proj)|mlp\.(fc1|fc2))"

    def __init__(self, llm, mar, vae_scale=0.2325, image_shape=None):
        super().__init__()
        mar_kwargs = dict(mar)
        eps = mar_kwargs.pop("layernorm_eps", 1e-6)
        self.config = dict(llm=dict(llm), mar=dict(mar), vae_scale=vae_scale,
                           image_shape=None if image_shape is None else list(image_shape))
        self.llm = Qwen2ForCausalLM(Qwen2Config(**llm))
        self.mar = mar_lib.MAR(norm_layer=partial(nn.LayerNorm, eps=eps), **mar_kwargs)
        if getattr(self.mar, "local_conv", 0) or hasattr(self.mar, "text_emb"):
            raise ValueError("Harmon's MAR takes the official MAR arguments only (no local_conv, text_vocab_size)")
        hidden, enc_dim = self.llm.config.hidden_size, self.mar.z_proj.out_features
        self.proj_in = build_mlp(enc_dim, hidden, hidden)
        self.proj_out = build_mlp(hidden, hidden, enc_dim)
        self.vae_scale = vae_scale
        self.image_shape = tuple(image_shape) if image_shape is not None else (self.mar.seq_h, self.mar.seq_w)
        # the CFG null prompt's ids (no padding), set by `set_null_prompt` or `set_null_prompt_from_tokenizer`
        self.register_buffer("null_input_ids", torch.zeros(0, dtype=torch.long), persistent=False)
        self.pad_token_id = 0

    # -------------------------------------------------------------------------
    # tokens

    @property
    def diffloss(self):
        return self.mar.diffloss

    @property
    def seq_len(self):
        """L: tokens on the sampling grid `image_shape`."""
        return self.image_shape[0] * self.image_shape[1]

    @property
    def token_embed_dim(self):
        return self.mar.token_embed_dim  # C = vae_embed_dim · p²

    def set_image_shape(self, image_shape):
        """Set the sampling grid (h, w) of tokens used when `image_shape` is not passed."""
        self.image_shape = (int(image_shape[0]), int(image_shape[1]))
        self.config["image_shape"] = list(self.image_shape)

    def patchify(self, latents):
        """(B, C, H, W) latent image (already × vae_scale) -> (B, L, C·p²) tokens, (C, p, p) layout."""
        bsz, c, h, w = latents.shape
        p = self.mar.patch_size
        x = latents.reshape(bsz, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)  # (B, h, w, C, p, p)
        return x.reshape(bsz, (h // p) * (w // p), c * p * p)  # (B, L, C·p²)

    def unpatchify(self, tokens, image_shape=None):
        """(B, L, C·p²) tokens on the grid `image_shape` (default the sampling grid) -> (B, C, H, W)."""
        h, w = image_shape or self.image_shape
        bsz, p, c = tokens.shape[0], self.mar.patch_size, self.mar.vae_embed_dim
        x = tokens.reshape(bsz, h, w, c, p, p).permute(0, 3, 1, 4, 2, 5)  # (B, C, h, p, w, p)
        return x.reshape(bsz, c, h * p, w * p)

    def sample_orders(self, bsz, generator=None):
        """(B, L) random generation orders on the sampling grid (mar.random_orders)."""
        return mar_lib.random_orders(bsz, self.seq_len, self.mar.fake_latent.device, generator)

    # -------------------------------------------------------------------------
    # conditioning

    def set_null_prompt(self, input_ids, pad_token_id=None):
        """Store the CFG null prompt: input_ids (S0,) its token ids without padding (the chat-templated
        "Generate an image."); pad_token_id fills padding (masked, so its value does not matter)."""
        self.null_input_ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1).to(self.null_input_ids.device)
        if pad_token_id is not None:
            self.pad_token_id = int(pad_token_id)

    def condition(self, input_ids, attention_mask=None):
        """The condition of a batch of prompts.

        input_ids: (B, S) token ids of the chat-templated prompts; attention_mask: (B, S), 1 = token,
        0 = padding (None: no padding). Returns dict(input_ids (B, S'), attention_mask (B, S') bool),
        right-padded to S' = max(S, null prompt length).
        """
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be (B, S), got {tuple(input_ids.shape)}")
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        extra = len(self.null_input_ids) - input_ids.shape[1]
        if extra > 0:
            input_ids = F.pad(input_ids, (0, extra), value=self.pad_token_id)
            mask = F.pad(mask, (0, extra), value=False)
        return dict(input_ids=input_ids, attention_mask=mask)

    def null_condition_like(self, cond):
        """The null prompt as a condition of the same batch size and length as `cond`, right-padded."""
        bsz, length = cond["input_ids"].shape
        null = self.null_input_ids.to(cond["input_ids"].device)
        if len(null) == 0:
            raise ValueError("no null prompt: call set_null_prompt(...) or set_null_prompt_from_tokenizer(...) first")
        if length < len(null):
            raise ValueError(f"condition of length {length} is shorter than the null prompt ({len(null)}); "
                             "build it with condition()")
        ids = torch.full_like(cond["input_ids"], self.pad_token_id)
        ids[:, :len(null)] = null
        mask = torch.zeros_like(cond["attention_mask"], dtype=torch.bool)
        mask[:, :len(null)] = True
        return dict(input_ids=ids, attention_mask=mask)

    # -------------------------------------------------------------------------
    # activation checkpointing (train.py --grad-checkpointing)

    @property
    def grad_checkpointing(self):
        """Whether a pass with gradients keeps only each block's input and recomputes the block in the
        backward pass: the MAR's encoder and decoder blocks (mar.MAR.run_blocks) and the LLM's Qwen2
        layers (frozen, but between the trained blocks, so their activations are held for the backward)."""
        return self.mar.grad_checkpointing

    @grad_checkpointing.setter
    def grad_checkpointing(self, on):
        if on and self.llm.config.attention_dropout:
            raise ValueError(f"--grad-checkpointing runs the LLM's layers in training mode, where its attention_dropout "
                             f"{self.llm.config.attention_dropout} drops what the rollout kept (Harmon's is 0)")
        self.mar.grad_checkpointing = bool(on)
        # transformers' own activation checkpointing of the decoder layers, non-reentrant (its newer name first)
        if on and hasattr(self.llm, "activation_checkpointing_enable"):
            self.llm.activation_checkpointing_enable({"use_reentrant": False})
        elif on:
            self.llm.gradient_checkpointing_enable({"use_reentrant": False})
        else:
            disable = getattr(self.llm, "activation_checkpointing_disable", None) or self.llm.gradient_checkpointing_disable
            disable()

    # -------------------------------------------------------------------------
    # z: MAR encoder -> LLM residual -> MAR decoder

    def grid_pos_embed(self, table, num_buffer, image_shape):
        """A learned position table (1, num_buffer + h0·w0, D) for the grid (h, w): the image part is
        resized bilinearly (align_corners=False) when (h, w) is not the native (h0, w0); buffer
        entries are kept. Returns (1, num_buffer + h·w, D)."""
        h0, w0 = self.mar.seq_h, self.mar.seq_w
        if tuple(image_shape) == (h0, w0):
            return table
        dim = table.shape[-1]
        image = table[:, num_buffer:].reshape(1, h0, w0, dim).permute(0, 3, 1, 2)  # (1, D, h0, w0)
        image = F.interpolate(image, size=tuple(image_shape), mode="bilinear", align_corners=False)
        image = image.flatten(2).transpose(1, 2)  # (1, h·w, D)
        return torch.cat([table[:, :num_buffer], image], dim=1)

    def mar_encoder(self, tokens, mask, image_shape=None):
        """MAR encoder with `fake_latent` in every buffer slot.

        tokens: (B, L, C) canvas; mask: (B, L), 1 = unknown (every row the same number of known
        tokens); image_shape: (h, w) with h·w = L. Returns x_enc_mar (B, buffer + #known, D_enc).
        """
        m = self.mar
        x = m.z_proj(tokens.to(m.z_proj.weight.dtype))  # (B, L, D)
        bsz, seq_len, dim = x.shape
        buffer = m.fake_latent[None].expand(bsz, m.buffer_size, dim).to(x.dtype)  # (B, buffer, D)
        x = torch.cat([buffer, x], dim=1) + self.grid_pos_embed(m.encoder_pos_embed_learned, m.buffer_size,
                                                                 image_shape or self.image_shape)
        x = m.z_proj_ln(x)  # (B, buffer+L, D)
        known = torch.cat([mask.new_zeros(bsz, m.buffer_size), mask], dim=1) == 0  # (B, buffer+L)
        x = x[known].reshape(bsz, -1, dim)  # (B, buffer+#known, D)
        return m.encoder_norm(m.run_blocks(m.encoder_blocks, x))

    def llm_residual(self, x_enc_mar, cond):
        """x_enc = x_enc_mar + proj_out(LLM([prompt; proj_in(known tokens); proj_in(buffers)]) at the
        image positions, buffers back in front). One uncached causal pass (module docstring, item 1).

        x_enc_mar: (B, buffer + K, D_enc); cond: dict(input_ids (B, S), attention_mask (B, S)).
        Returns x_enc (B, buffer + K, D_enc).
        """
        buf, n_img = self.mar.buffer_size, x_enc_mar.shape[1]
        z_enc = self.proj_in(x_enc_mar)  # (B, buffer+K, H)
        z_enc = torch.cat([z_enc[:, buf:], z_enc[:, :buf]], dim=1)  # (B, K+buffer, H): buffers last
        prompt = self.llm.get_input_embeddings()(cond["input_ids"])  # (B, S, H)
        prompt_mask = cond["attention_mask"].bool()
        attn = torch.cat([prompt_mask, prompt_mask.new_ones(prompt_mask.shape[0], n_img)], dim=1)  # (B, S+K+buffer)
        position_ids = (attn.long().cumsum(dim=1) - 1).clamp(min=0)
        # transformers checkpoints a Qwen2 layer only in training mode; without attention dropout (the
        # grad_checkpointing setter checks) it computes the same in both modes, so a checkpointed pass with
        # gradients runs the LLM in training mode and puts it back
        train_mode = self.grad_checkpointing and torch.is_grad_enabled() and not self.llm.training
        if train_mode:
            self.llm.train()
        try:
            hidden = self.llm.model(inputs_embeds=torch.cat([prompt, z_enc.to(prompt.dtype)], dim=1),
                                    attention_mask=attn, position_ids=position_ids, use_cache=False).last_hidden_state
        finally:
            if train_mode:
                self.llm.eval()
        z_llm = hidden[:, -n_img:]  # (B, K+buffer, H) the image positions
        z_llm = torch.cat([z_llm[:, n_img - buf:], z_llm[:, :n_img - buf]], dim=1)  # (B, buffer+K, H)
        return x_enc_mar + self.proj_out(z_llm).to(x_enc_mar.dtype)

    def mar_decoder(self, x_enc, mask, image_shape=None):
        """MAR decoder: x_enc (B, buffer + #known, D_enc); mask (B, L), 1 = unknown.
        Returns z (B, L, D_dec), plus the diffusion position embedding."""
        m = self.mar
        image_shape = image_shape or self.image_shape
        x = m.decoder_embed(x_enc)  # (B, buffer+#known, D)
        bsz, dim = x.shape[0], x.shape[-1]
        known = torch.cat([mask.new_zeros(bsz, m.buffer_size), mask], dim=1) == 0  # (B, buffer+L)
        full = m.mask_token.repeat(bsz, known.shape[1], 1).to(x.dtype)  # (B, buffer+L, D)
        full[known] = x.reshape(-1, dim)  # the encoded known tokens back in place
        x = full + self.grid_pos_embed(m.decoder_pos_embed_learned, m.buffer_size, image_shape)
        x = m.decoder_norm(m.run_blocks(m.decoder_blocks, x))[:, m.buffer_size:]  # (B, L, D)
        return x + self.grid_pos_embed(m.diffusion_pos_embed_learned, 0, image_shape)

    def predict_z(self, tokens, mask, cond, image_shape=None):
        """z (B, L, D_dec) for a canvas.

        tokens: (B, L, C) (values at unknown positions are ignored); mask: (B, L) float, 1 = unknown;
        cond: from `condition` / `null_condition_like` (or their concatenation), batch B;
        image_shape: the token grid (h, w), h·w = L (default the sampling grid `image_shape`).
        """
        image_shape = tuple(image_shape or self.image_shape)
        if tokens.shape[1] != image_shape[0] * image_shape[1]:
            raise ValueError(f"tokens hold {tokens.shape[1]} positions, image_shape {image_shape} needs "
                             f"{image_shape[0] * image_shape[1]}")
        x_enc = self.llm_residual(self.mar_encoder(tokens, mask, image_shape), cond)
        return self.mar_decoder(x_enc, mask, image_shape)

    # -------------------------------------------------------------------------
    # checkpoints

    def load_state_dict(self, state_dict, strict=True, assign=False, path="state_dict", flag="harmon checkpoint"):
        """Load official weights (`harmon_*.pth`: a plain state dict of llm.*, mar.*, proj_in.*,
        proj_out.*). `vae.*` keys are ignored (the VAE loads through vae.load_vae); a missing tied
        `llm.lm_head.weight` is taken from the embedding. strict: every other key must match;
        wrong shapes always fail. Errors are one line naming `flag` and `path`."""
        sd = {k: v for k, v in state_dict.items() if not k.startswith("vae.")}
        tied = self.llm.config.tie_word_embeddings
        if tied and "llm.lm_head.weight" not in sd and "llm.model.embed_tokens.weight" in sd:
            sd["llm.lm_head.weight"] = sd["llm.model.embed_tokens.weight"]
        if strict:
            checkpoints.check_state_dict(self, sd, path, flag=flag)
        else:
            own = self.state_dict()
            wrong = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in sd.items()
                     if k in own and tuple(v.shape) != tuple(own[k].shape)]
            if wrong:
                raise ValueError(f"{flag} {path}: wrong shape (file vs model) {wrong[:3]}")
        return super().load_state_dict(sd, strict=strict, assign=assign)


def build(config):
    """A Harmon from its config {"llm": Qwen2Config kwargs, "mar": MAR kwargs + layernorm_eps,
    "vae_scale"[, "image_shape"]} (the fixture's layout; `CONFIGS` holds the released ones)."""
    missing = [k for k in ("llm", "mar") if k not in config]
    if missing:
        raise ValueError(f"Harmon config lacks {missing}; expected keys llm, mar, vae_scale[, image_shape]")
    return Harmon(config["llm"], config["mar"], config.get("vae_scale", 0.2325), config.get("image_shape"))


def load_harmon(path, config, flag="--init"):
    """Build a Harmon from `config` (a dict, or a name in CONFIGS) and load the weights at `path`
    (strict except vae.*); returns it in eval mode, float32 on the CPU."""
    if isinstance(config, str):
        if config not in CONFIGS:
            raise ValueError(f"unknown Harmon config {config!r}; choose from {sorted(CONFIGS)}")
        config = CONFIGS[config]
    model = build(config)
    # a harmon_*.pth (a plain dict, or one under 'state_dict' / 'model' / 'module'), a .safetensors file or an HF folder
    sd = checkpoints.read_state_dict(path, flag, unwrap=("state_dict", "model", "module"))
    model.load_state_dict(sd, strict=True, path=path, flag=flag)
    return model.eval()


# -----------------------------------------------------------------------------
# Prompts -> token ids (a local tokenizer folder, e.g. Qwen2.5-*-Instruct's)

def load_tokenizer(path):
    """The LLM's tokenizer from a local folder (never downloaded), padding on the right as Harmon's."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--tokenizer: no such folder: {path}")
    return AutoTokenizer.from_pretrained(path, local_files_only=True, padding_side="right")


def prompt_ids(tokenizer, prompts, generation_template=True):
    """Chat-templated prompt ids: each prompt p becomes PROMPT_TEMPLATE(GENERATION_TEMPLATE(p))
    (`generation_template=False`: PROMPT_TEMPLATE(p)), right-padded.
    Returns dict(input_ids (B, S) long, attention_mask (B, S) bool), ready for `condition`."""
    texts = [PROMPT_TEMPLATE.format(input=GENERATION_TEMPLATE.format(text=p) if generation_template else p)
             for p in prompts]
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # Harmon pads with eos; padding is masked anyway
    enc = tokenizer(texts, add_special_tokens=True, padding=True, return_tensors="pt")
    return dict(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"].bool())


def set_null_prompt_from_tokenizer(model, tokenizer, text=NULL_PROMPT):
    """Tokenize the chat-templated null prompt and store it in `model` (Harmon.set_null_prompt)."""
    ids = tokenizer(PROMPT_TEMPLATE.format(input=text), add_special_tokens=True)["input_ids"]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.set_null_prompt(torch.tensor(ids, dtype=torch.long), pad)
