"""The KL-16 VAE of MAR as a diffusers `AutoencoderKL` (docs/method.md §10).

Official MAR tokenises 256-px images with the KL-16 VAE of latent-diffusion (LDM): 16 latent
channels on a 16×16 grid, multiplied by the latent scale 0.2325. The released weights are an
LDM-format `.ckpt` whose state dict sits under `'model'`. This file loads them into diffusers'
`AutoencoderKL` (the same network under other names) and gives the codec MAR uses (`VAECodec`,
with the same interface as `PixelCodec`, raw pixels as the latent image). It is a file of its own, not a section of mar.py,
because the LDM <-> diffusers key mapping is a concept of its own that MAR readers can skip.

Why our own key converter: diffusers' LDM converter assumes the Stable-Diffusion VAE layout and
does not convert the attention inside the encoder's down levels, which the KL-16 VAE has. This file's
architecture is read off the tensor shapes instead, and the weights are loaded with `strict=True`,
so a wrong layout fails loudly rather than leaving layers at their random initialisation.
"""

import os
import re

import torch
from diffusers import AutoencoderKL

from infra import checkpoints

# ---------------------------------------------------------------------------------------------
# KL-16 VAE: LDM checkpoint -> diffusers AutoencoderKL, and the image <-> latent codec (docs/method.md §10)
# ---------------------------------------------------------------------------------------------

VAE_SCALE = 0.2325  # official MAR latent scale: tokens = VAE_SCALE * posterior sample

# Renames from LDM names to diffusers names, applied one after another to every key (each piece
# must start at a dot-separated component). {i} is a resolution level, {j} a block in a level.
# The reverse conversion applies the same steps backwards. LDM numbers decoder levels from the
# full-resolution one (`decoder.up.0` runs last) while diffusers numbers them in the order they
# run, so `_flip_up_level` turns `up_blocks.{i}` into `up_blocks.{L-1-i}` (L levels) afterwards.
_LDM_TO_DIFFUSERS_STEPS = (
    ("down.{i}.block.{j}.", "down_blocks.{i}.resnets.{j}."),
    ("down.{i}.attn.{j}.", "down_blocks.{i}.attentions.{j}."),
    ("down.{i}.downsample.", "down_blocks.{i}.downsamplers.0."),
    ("up.{i}.block.{j}.", "up_blocks.{i}.resnets.{j}."),
    ("up.{i}.attn.{j}.", "up_blocks.{i}.attentions.{j}."),
    ("up.{i}.upsample.", "up_blocks.{i}.upsamplers.0."),
    ("mid.block_1.", "mid_block.resnets.0."),
    ("mid.attn_1.", "mid_block.attentions.0."),
    ("mid.block_2.", "mid_block.resnets.1."),
    ("norm_out.", "conv_norm_out."),
    ("nin_shortcut.", "conv_shortcut."),  # the 1×1 conv on a residual path that changes width
    # inside an attention block: LDM's 1×1 convs become diffusers' Linear layers
    ("attentions.{j}.norm.", "attentions.{j}.group_norm."),
    ("attentions.{j}.q.", "attentions.{j}.to_q."),
    ("attentions.{j}.k.", "attentions.{j}.to_k."),
    ("attentions.{j}.v.", "attentions.{j}.to_v."),
    ("attentions.{j}.proj_out.", "attentions.{j}.to_out.0."),
)

# diffusers weights of attention projections: Linear (C, C) in diffusers, 1×1 Conv2d (C, C, 1, 1) in LDM
_ATTN_PROJ_WEIGHT = re.compile(r"\.attentions\.\d+\.(to_q|to_k|to_v|to_out\.0)\.weight$")


def _template_regex(template):
    """'down.{i}.block.{j}.' -> a regex that matches it at the start of a key component."""
    pattern = template.replace(".", r"\.").replace("{i}", r"(?P<i>\d+)").replace("{j}", r"(?P<j>\d+)")
    return re.compile(r"(?<![^.])" + pattern)


def _template_repl(template):
    """'down_blocks.{i}.resnets.{j}.' -> the replacement string for re.sub."""
    return template.replace("{i}", r"\g<i>").replace("{j}", r"\g<j>")


def _flip_up_level(key, num_levels):
    """decoder.up_blocks.{i}. <-> decoder.up_blocks.{num_levels-1-i}. (its own inverse)."""
    return re.sub(r"^decoder\.up_blocks\.(\d+)\.",
                  lambda m: f"decoder.up_blocks.{num_levels - 1 - int(m.group(1))}.", key)


def _count_indices(keys, pattern):
    """1 + the largest index that `pattern` captures in any key (0 if none matches)."""
    levels = [int(m.group(1)) for m in map(re.compile(pattern).match, keys) if m]
    return max(levels) + 1 if levels else 0


def _ldm_key_to_diffusers(key, num_up_levels):
    for ldm, diffusers in _LDM_TO_DIFFUSERS_STEPS:
        key = _template_regex(ldm).sub(_template_repl(diffusers), key)
    return _flip_up_level(key, num_up_levels)


def _diffusers_key_to_ldm(key, num_up_levels):
    key = _flip_up_level(key, num_up_levels)
    for ldm, diffusers in reversed(_LDM_TO_DIFFUSERS_STEPS):
        key = _template_regex(diffusers).sub(_template_repl(ldm), key)
    return key


def ldm_vae_to_diffusers(sd):
    """Rename an LDM AutoencoderKL state dict to diffusers' `AutoencoderKL` names.

    sd: {LDM key: tensor}, e.g. 'encoder.down.4.attn.0.q.weight' of shape (C, C, 1, 1).
    Returns {diffusers key: tensor}, e.g. 'encoder.down_blocks.4.attentions.0.to_q.weight' of
    shape (C, C): attention q/k/v/proj_out are 1×1 convs in LDM and Linear layers in diffusers,
    the same numbers. Keys this converter does not know pass through unchanged (a strict load
    then reports them). Tensors are shared with `sd`, not copied.
    """
    num_up_levels = _count_indices(sd, r"decoder\.up\.(\d+)\.")
    out = {}
    for key, value in sd.items():
        new_key = _ldm_key_to_diffusers(key, num_up_levels)
        if _ATTN_PROJ_WEIGHT.search(new_key) and value.ndim == 4:
            value = value[:, :, 0, 0]  # (C, C, 1, 1) -> (C, C)
        out[new_key] = value
    return out


def vae_config_from_ldm(sd):
    """Read the `AutoencoderKL(**config)` arguments off the shapes of an LDM VAE state dict.

    sd: {LDM key: tensor} (meta tensors are fine: only shapes are read).
    Returns a dict with
      block_out_channels  width of each encoder level, from `encoder.down.{i}.block.0.conv1`
      layers_per_block    res blocks per encoder level (LDM's num_res_blocks; the decoder has one
                          more per level, in LDM as in diffusers)
      latent_channels     z channels, from `post_quant_conv`
      in_channels / out_channels   from `encoder.conv_in` / `decoder.conv_out`
      down_block_types    'AttnDownEncoderBlock2D' for levels with `encoder.down.{i}.attn.*` keys,
                          else 'DownEncoderBlock2D'
      up_block_types      in diffusers order (lowest resolution first): 'AttnUpDecoderBlock2D' for
                          levels with `decoder.up.{i}.attn.*` keys, else 'UpDecoderBlock2D'
      mid_block_add_attention   whether the mid blocks have `mid.attn_1`
      norm_num_groups     32, fixed in LDM's Normalize
    Raises ValueError naming the first missing key if `sd` is not an LDM KL VAE.
    """
    def shape(key):
        if key not in sd:
            raise ValueError(f"not an LDM KL VAE checkpoint (missing {key})")
        return tuple(sd[key].shape)

    num_levels = _count_indices(sd, r"encoder\.down\.(\d+)\.")
    num_up_levels = _count_indices(sd, r"decoder\.up\.(\d+)\.")
    if num_levels == 0:
        raise ValueError("not an LDM KL VAE checkpoint (missing encoder.down.*)")
    if num_up_levels != num_levels:
        raise ValueError(f"not an LDM KL VAE checkpoint ({num_levels} encoder levels but "
                         f"{num_up_levels} decoder levels)")

    def has_attention(prefix):
        return any(key.startswith(prefix) for key in sd)

    return dict(
        in_channels=shape("encoder.conv_in.weight")[1],
        out_channels=shape("decoder.conv_out.weight")[0],
        down_block_types=tuple(
            "AttnDownEncoderBlock2D" if has_attention(f"encoder.down.{i}.attn.") else "DownEncoderBlock2D"
            for i in range(num_levels)),
        up_block_types=tuple(  # diffusers up_blocks.{k} is LDM decoder.up.{L-1-k}
            "AttnUpDecoderBlock2D" if has_attention(f"decoder.up.{i}.attn.") else "UpDecoderBlock2D"
            for i in reversed(range(num_levels))),
        block_out_channels=tuple(shape(f"encoder.down.{i}.block.0.conv1.weight")[0]
                                 for i in range(num_levels)),
        layers_per_block=_count_indices(sd, r"encoder\.down\.0\.block\.(\d+)\."),
        latent_channels=shape("post_quant_conv.weight")[0],
        norm_num_groups=32,
        mid_block_add_attention=has_attention("encoder.mid.attn_1."),
    )


def load_vae(path):
    """Load an LDM-format KL VAE `.ckpt` (the released MAR `kl16.ckpt`) as a diffusers model.

    path: file saved with torch.save holding the LDM state dict under 'model' (MAR release) or
      'state_dict' (LDM training checkpoint; its 'loss.*' discriminator/LPIPS keys are dropped),
      or the bare state dict.
    Returns `diffusers.AutoencoderKL` in eval mode on the CPU, every weight loaded with
    strict=True; `config.scaling_factor` is set to VAE_SCALE for reference (the codec calls below
    use VAE_SCALE directly). Raises FileNotFoundError for a missing file and a one-line ValueError
    naming the file and the offending keys for anything that is not an LDM KL VAE.
    """
    ckpt = checkpoints.read_state_dict(path, "--vae", unwrap=("model", "state_dict"))
    ldm_sd = {k: v for k, v in ckpt.items() if not k.startswith("loss.")}

    try:
        config = vae_config_from_ldm(ldm_sd)
    except ValueError as e:
        raise ValueError(f"--vae {path}: {e}") from None
    vae = AutoencoderKL(**config, scaling_factor=VAE_SCALE)
    sd = ldm_vae_to_diffusers(ldm_sd)
    problems = checkpoints.state_dict_mismatch(  # named as in the file (LDM keys)
        vae.state_dict(), sd, display=lambda key: _diffusers_key_to_ldm(key, len(config["up_block_types"])))
    if problems:
        raise ValueError(f"--vae {path}: not an LDM KL VAE checkpoint ({problems})")
    vae.load_state_dict(sd, strict=True)
    return vae.eval()


@torch.no_grad()
def vae_encode(vae, images, generator=None):
    """Images -> MAR latent tokens: VAE_SCALE * (sample of the VAE posterior).

    vae: AutoencoderKL from `load_vae` (frozen; no gradients are kept).
    images: (B, 3, H, W) in [0, 1]; H and W divisible by the VAE stride (16 for KL-16).
    generator: torch.Generator for the posterior sample z = mean + std * eps. None returns
      the posterior mean instead. Official MAR trains on posterior samples (its cached latents
      store the moments and resample each epoch), so pass a generator to match it; the mean is
      the deterministic choice for evaluation and tests.
    Returns latents (B, latent_channels, H/stride, W/stride), e.g. (B, 16, 16, 16) at 256 px.
    """
    if images.ndim != 4 or images.shape[1] != vae.config.in_channels:
        raise ValueError(f"vae_encode: images must be (B, {vae.config.in_channels}, H, W), "
                         f"got {tuple(images.shape)}")
    x = (2 * images - 1).to(vae.dtype)  # [0, 1] -> [-1, 1], the VAE's training range
    posterior = vae.encode(x).latent_dist  # moments = quant_conv(encoder(x)), logvar clamped
    z = posterior.mean if generator is None else posterior.sample(generator=generator)
    return z * VAE_SCALE  # (B, C_z, H/stride, W/stride)


@torch.no_grad()
def vae_decode(vae, latents):
    """MAR latent tokens -> images: decoder(post_quant_conv(latents / VAE_SCALE)), mapped to [0, 1].

    vae: AutoencoderKL from `load_vae` (frozen; no gradients are kept).
    latents: (B, latent_channels, h, w) as returned by `vae_encode` (or sampled by MAR).
    Returns images (B, 3, h * stride, w * stride) in [0, 1] (clamped).
    """
    x = vae.decode((latents / VAE_SCALE).to(vae.dtype)).sample  # (B, 3, H, W) in about [-1, 1]
    return ((x + 1) / 2).clamp(0, 1)


class PixelCodec:
    """Raw pixels as the latent image: images (B, 3, H, W) in [0, 1] <-> values in [-1, 1].
    With MAR(vae_stride=1, vae_embed_dim=3, patch_size=p) a token is one p×p×3 patch."""

    def encode(self, images, generator=None):
        return images * 2 - 1

    def decode(self, latents):
        return ((latents + 1) / 2).clamp(0, 1)


class VAECodec:
    """Images (B, 3, H, W) in [0, 1] <-> MAR latent images (B, 16, H/16, W/16), like PixelCodec."""

    def __init__(self, vae):
        self.vae = vae

    def encode(self, images, generator=None):
        return vae_encode(self.vae, images, generator)

    def decode(self, latents):
        return vae_decode(self.vae, latents)


class DiffusersCodec:
    """A VAE saved in diffusers' format (a folder with config.json and weights, e.g. the `vae/`
    folder of a NOVA pipeline), with its own latent scale and shift, as NOVA's pipeline applies
    them: latent = (posterior mean − shift) · scale; decode(latent / scale + shift). Local only."""

    def __init__(self, folder, flag="--vae", device="cpu"):
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"{flag}: no such VAE folder: {folder}")
        try:
            self.vae = AutoencoderKL.from_pretrained(folder, local_files_only=True).eval().requires_grad_(False).to(device)
        except (OSError, ValueError, EnvironmentError) as e:
            raise ValueError(f"{flag} {folder}: not a diffusers AutoencoderKL folder ({str(e).splitlines()[0][:200]})") from None
        self.scale = self.vae.config.scaling_factor
        self.shift = self.vae.config.shift_factor or 0.0

    @torch.no_grad()
    def encode(self, images, generator=None):
        posterior = self.vae.encode((2 * images - 1).to(self.vae.dtype)).latent_dist
        z = posterior.mean if generator is None else posterior.sample(generator=generator)
        return (z - self.shift) * self.scale

    @torch.no_grad()
    def decode(self, latents):
        x = self.vae.decode((latents / self.scale + self.shift).to(self.vae.dtype)).sample
        return ((x + 1) / 2).clamp(0, 1)
