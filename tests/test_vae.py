"""Tests for the KL-16 VAE section (models/vae.py, docs/method.md §10).

The reference below is an independent re-implementation of the LDM AutoencoderKL forward pass that
reads the LDM-named state dict directly (written from the released MAR `models/vae.py` as the
description of the maths). diffusers' `AutoencoderKL` loaded through our converter must compute
the same function. The comparisons run in float64 so that small slips (a GroupNorm eps of 1e-5
instead of 1e-6, a symmetric instead of an asymmetric downsampling pad) cannot hide under float32
rounding.
"""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL

from benchmarks.stand_ins import ldm_vae_shapes, random_ldm_sd
from models.vae import (_ATTN_PROJ_WEIGHT, VAE_SCALE, _count_indices, _diffusers_key_to_ldm, ldm_vae_to_diffusers,
                 load_vae, vae_config_from_ldm, vae_decode, vae_encode)

_HERE = Path(__file__).resolve().parent
_FIXTURE = _HERE / "fixtures" / "kl16_vae_state_dict.json"  # the official key listing (test_margrpo pins the file)


def diffusers_vae_to_ldm(sd):
    """The inverse of `vae.ldm_vae_to_diffusers` (test-only): diffusers `AutoencoderKL` names -> LDM names.

    sd: {diffusers key: tensor}. Returns {LDM key: tensor}; attention projection weights go from
    (C, C) back to (C, C, 1, 1). `diffusers_vae_to_ldm(ldm_vae_to_diffusers(sd)) == sd` exactly.
    """
    num_up_levels = _count_indices(sd, r"decoder\.up_blocks\.(\d+)\.")
    out = {}
    for key, value in sd.items():
        if _ATTN_PROJ_WEIGHT.search(key) and value.ndim == 2:
            value = value[:, :, None, None]  # (C, C) -> (C, C, 1, 1)
        out[_diffusers_key_to_ldm(key, num_up_levels)] = value
    return out


def _fixture():
    return json.loads(_FIXTURE.read_text())


# ---------------------------------------------------------------- LDM layout and reference forward

# tiny LDM KL VAE: 3 levels (two downsamplings, 16 px -> 4×4 latents), widths 32, 32, 64,
# attention in the lowest-resolution encoder level and in both mid blocks, like KL-16
TINY = dict(ch=32, ch_mult=(1, 1, 2), num_res_blocks=1, z=4, enc_attn_levels=(2,))
# the same with attention in the decoder's full-resolution level too (diffusers up_blocks.2)
TINY_DEC_ATTN = dict(TINY, dec_attn_levels=(0,))


def _gn(sd, name, x):
    return F.group_norm(x, 32, sd[f"{name}.weight"], sd[f"{name}.bias"], eps=1e-6)


def _conv(sd, name, x):
    w = sd[f"{name}.weight"]  # (C_out, C_in, k, k), "same" padding
    return F.conv2d(x, w, sd[f"{name}.bias"], padding=w.shape[-1] // 2)


def _ref_resnet(sd, name, x):
    h = _conv(sd, f"{name}.conv1", F.silu(_gn(sd, f"{name}.norm1", x)))
    h = _conv(sd, f"{name}.conv2", F.silu(_gn(sd, f"{name}.norm2", h)))
    skip = _conv(sd, f"{name}.nin_shortcut", x) if f"{name}.nin_shortcut.weight" in sd else x
    return skip + h


def _ref_attn(sd, name, x):
    """x + proj_out(v · softmax(qᵀk / sqrt(C))ᵀ), one head over all H·W positions."""
    B, C, H, W = x.shape
    h = _gn(sd, f"{name}.norm", x)
    q, k, v = (_conv(sd, f"{name}.{p}", h).reshape(B, C, H * W) for p in "qkv")  # (B, C, HW)
    attn = torch.softmax(q.transpose(1, 2) @ k / math.sqrt(C), dim=-1)  # (B, HW_query, HW_key)
    out = (v @ attn.transpose(1, 2)).reshape(B, C, H, W)  # out[:, :, i] = Σ_j attn[i, j] v[:, :, j]
    return x + _conv(sd, f"{name}.proj_out", out)


def _ref_mid(sd, name, h):
    h = _ref_resnet(sd, f"{name}.block_1", h)
    h = _ref_attn(sd, f"{name}.attn_1", h)
    return _ref_resnet(sd, f"{name}.block_2", h)


def ref_encode(sd, arch, x):
    """LDM posterior of x in [-1, 1], (B, 3, H, W) -> (mean, logvar), each (B, z, h, w)."""
    num_levels = len(arch["ch_mult"])
    h = _conv(sd, "encoder.conv_in", x)
    for i in range(num_levels):
        for j in range(arch["num_res_blocks"]):
            h = _ref_resnet(sd, f"encoder.down.{i}.block.{j}", h)
            if f"encoder.down.{i}.attn.{j}.q.weight" in sd:
                h = _ref_attn(sd, f"encoder.down.{i}.attn.{j}", h)
        if i != num_levels - 1:  # zero-pad right and bottom only, then a stride-2 3×3 conv
            name = f"encoder.down.{i}.downsample.conv"
            h = F.conv2d(F.pad(h, (0, 1, 0, 1)), sd[f"{name}.weight"], sd[f"{name}.bias"], stride=2)
    h = _ref_mid(sd, "encoder.mid", h)
    h = _conv(sd, "encoder.conv_out", F.silu(_gn(sd, "encoder.norm_out", h)))
    moments = _conv(sd, "quant_conv", h)  # (B, 2z, h, w)
    mean, logvar = moments.chunk(2, dim=1)
    return mean, logvar.clamp(-30.0, 20.0)


def ref_decode(sd, arch, z):
    """LDM decoder: z (B, z, h, w) -> image (B, 3, H, W), roughly in [-1, 1]."""
    h = _conv(sd, "decoder.conv_in", _conv(sd, "post_quant_conv", z))
    h = _ref_mid(sd, "decoder.mid", h)
    for i in reversed(range(len(arch["ch_mult"]))):  # lowest resolution first
        for j in range(arch["num_res_blocks"] + 1):
            h = _ref_resnet(sd, f"decoder.up.{i}.block.{j}", h)
            if f"decoder.up.{i}.attn.{j}.q.weight" in sd:
                h = _ref_attn(sd, f"decoder.up.{i}.attn.{j}", h)
        if i != 0:
            h = _conv(sd, f"decoder.up.{i}.upsample.conv", F.interpolate(h, scale_factor=2.0, mode="nearest"))
    return _conv(sd, "decoder.conv_out", F.silu(_gn(sd, "decoder.norm_out", h)))


def diffusers_vae(ldm_sd):
    """diffusers AutoencoderKL holding `ldm_sd` (dtype kept), strict load, eval mode."""
    vae = AutoencoderKL(**vae_config_from_ldm(ldm_sd)).to(next(iter(ldm_sd.values())).dtype)
    vae.load_state_dict(ldm_vae_to_diffusers(ldm_sd), strict=True)
    return vae.eval()


def _shapes(sd):
    return {k: tuple(v.shape) for k, v in sd.items()}


def _meta_sd(shapes):
    return {k: torch.empty(s, device="meta") for k, s in shapes.items()}


# ---------------------------------------------------------------- fixture: the official KL-16 VAE

def test_reference_layout_matches_official_fixture():
    """The LDM layout the reference tests use is exactly the released KL-16 VAE's."""
    fx = _fixture()
    shapes = ldm_vae_shapes(ch=128, ch_mult=tuple(fx["constructor"]["ch_mult"]), num_res_blocks=2,
                            z=fx["constructor"]["embed_dim"], enc_attn_levels=(4,))
    assert shapes == {k: tuple(s) for k, s in fx["state_dict"].items()}


def test_config_from_fixture_shapes():
    fx = _fixture()
    config = vae_config_from_ldm(_meta_sd(fx["state_dict"]))
    assert config["block_out_channels"] == (128, 128, 256, 256, 512)
    assert config["layers_per_block"] == 2
    assert config["latent_channels"] == 16
    assert config["in_channels"] == config["out_channels"] == 3
    assert config["down_block_types"] == ("DownEncoderBlock2D",) * 4 + ("AttnDownEncoderBlock2D",)
    assert config["up_block_types"] == ("UpDecoderBlock2D",) * 5
    assert config["mid_block_add_attention"] is True
    assert config["norm_num_groups"] == 32


def test_diffusers_model_keys_and_shapes_equal_fixture_both_ways():
    fx = _fixture()
    official = {k: tuple(s) for k, s in fx["state_dict"].items()}
    with torch.device("meta"):
        vae = AutoencoderKL(**vae_config_from_ldm(_meta_sd(official)))
    diffusers_sd = vae.state_dict()
    assert sum(v.numel() for v in diffusers_sd.values()) == fx["params"]
    # diffusers -> LDM names gives exactly the official keys and shapes ...
    assert _shapes(diffusers_vae_to_ldm(diffusers_sd)) == official
    # ... and LDM -> diffusers names gives exactly what AutoencoderKL expects
    assert _shapes(ldm_vae_to_diffusers(_meta_sd(official))) == _shapes(diffusers_sd)


# ---------------------------------------------------------------- converter

@pytest.mark.parametrize("arch", [TINY, TINY_DEC_ATTN])
def test_round_trip_is_exact(arch):
    ldm_sd = random_ldm_sd(arch, seed=0)
    back = diffusers_vae_to_ldm(ldm_vae_to_diffusers(ldm_sd))
    assert list(back) == list(ldm_sd)
    assert all(torch.equal(back[k], ldm_sd[k]) for k in ldm_sd)

    torch.manual_seed(0)  # only AutoencoderKL's own initialisation; no test value depends on it
    diffusers_sd = AutoencoderKL(**vae_config_from_ldm(ldm_sd)).state_dict()
    again = ldm_vae_to_diffusers(diffusers_vae_to_ldm(diffusers_sd))
    assert list(again) == list(diffusers_sd)
    assert all(torch.equal(again[k], diffusers_sd[k]) for k in diffusers_sd)


def test_renames_of_single_keys():
    ldm_sd = _meta_sd(ldm_vae_shapes(**TINY_DEC_ATTN))
    sd = ldm_vae_to_diffusers(ldm_sd)
    expected = {  # LDM name -> diffusers name, one of each kind (3 levels: up.i -> up_blocks.2-i)
        "encoder.down.1.block.0.conv1.weight": "encoder.down_blocks.1.resnets.0.conv1.weight",
        "encoder.down.2.block.0.nin_shortcut.weight": "encoder.down_blocks.2.resnets.0.conv_shortcut.weight",
        "encoder.down.0.downsample.conv.bias": "encoder.down_blocks.0.downsamplers.0.conv.bias",
        "encoder.down.2.attn.0.norm.weight": "encoder.down_blocks.2.attentions.0.group_norm.weight",
        "encoder.down.2.attn.0.proj_out.weight": "encoder.down_blocks.2.attentions.0.to_out.0.weight",
        "encoder.mid.block_2.norm2.bias": "encoder.mid_block.resnets.1.norm2.bias",
        "encoder.mid.attn_1.q.weight": "encoder.mid_block.attentions.0.to_q.weight",
        "encoder.norm_out.weight": "encoder.conv_norm_out.weight",
        "decoder.up.2.block.1.conv2.weight": "decoder.up_blocks.0.resnets.1.conv2.weight",
        "decoder.up.2.upsample.conv.weight": "decoder.up_blocks.0.upsamplers.0.conv.weight",
        "decoder.up.1.block.0.nin_shortcut.bias": "decoder.up_blocks.1.resnets.0.conv_shortcut.bias",
        "decoder.up.0.block.1.norm1.weight": "decoder.up_blocks.2.resnets.1.norm1.weight",
        "decoder.up.0.attn.1.k.weight": "decoder.up_blocks.2.attentions.1.to_k.weight",
        "decoder.norm_out.bias": "decoder.conv_norm_out.bias",
        "quant_conv.weight": "quant_conv.weight",
    }
    for ldm_key, diffusers_key in expected.items():
        assert diffusers_key in sd, (ldm_key, diffusers_key)
    back = diffusers_vae_to_ldm(sd)
    assert all(ldm_key in back for ldm_key in expected)
    assert sd["encoder.mid_block.attentions.0.to_v.weight"].shape == (64, 64)  # 1×1 conv squeezed


def test_config_for_decoder_attention_and_bad_state_dicts():
    config = vae_config_from_ldm(_meta_sd(ldm_vae_shapes(**TINY_DEC_ATTN)))
    # LDM level 0 (full resolution) is diffusers' last up block
    assert config["up_block_types"] == ("UpDecoderBlock2D", "UpDecoderBlock2D", "AttnUpDecoderBlock2D")
    assert config["down_block_types"] == ("DownEncoderBlock2D",) * 2 + ("AttnDownEncoderBlock2D",)
    with pytest.raises(ValueError, match="not an LDM KL VAE"):
        vae_config_from_ldm({"weight": torch.zeros(1)})
    sd = _meta_sd(ldm_vae_shapes(**TINY))
    del sd["post_quant_conv.weight"]
    with pytest.raises(ValueError, match="missing post_quant_conv.weight"):
        vae_config_from_ldm(sd)


# ---------------------------------------------------------------- same function as the LDM VAE

@pytest.mark.parametrize("arch", [TINY, TINY_DEC_ATTN])
def test_diffusers_computes_the_ldm_vae(arch):
    ldm_sd = random_ldm_sd(arch, seed=1)
    vae = diffusers_vae(ldm_sd)
    g = torch.Generator().manual_seed(2)
    x = 2 * torch.rand(2, 3, 16, 16, generator=g, dtype=torch.float64) - 1
    z = torch.randn(2, 4, 4, 4, generator=g, dtype=torch.float64)

    with torch.no_grad():
        posterior = vae.encode(x).latent_dist
        decoded = vae.decode(z).sample
    mean, logvar = ref_encode(ldm_sd, arch, x)
    torch.testing.assert_close(posterior.mean, mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(posterior.logvar, logvar, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(decoded, ref_decode(ldm_sd, arch, z), rtol=1e-10, atol=1e-10)
    assert mean.std() > 0.1 and decoded.std() > 0.1  # the comparison is not between near-zeros


def test_codec_helpers_scale_sample_and_map_ranges():
    assert VAE_SCALE == 0.2325  # official MAR latent scale (docs/method.md §10)
    ldm_sd = random_ldm_sd(TINY, seed=3)
    vae = diffusers_vae(ldm_sd)
    g = torch.Generator().manual_seed(4)
    images = torch.rand(2, 3, 16, 16, generator=g, dtype=torch.float64)  # in [0, 1]
    mean, logvar = ref_encode(ldm_sd, TINY, 2 * images - 1)

    latents = vae_encode(vae, images)  # generator=None: the posterior mean
    assert latents.shape == (2, 4, 4, 4)
    torch.testing.assert_close(latents, VAE_SCALE * mean, rtol=1e-10, atol=1e-10)

    sampled = vae_encode(vae, images, generator=torch.Generator().manual_seed(5))
    eps = torch.randn(mean.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    torch.testing.assert_close(sampled, VAE_SCALE * (mean + torch.exp(0.5 * logvar) * eps),
                               rtol=1e-10, atol=1e-10)
    assert not torch.allclose(sampled, latents)

    decoded = vae_decode(vae, latents)
    expected = ((ref_decode(ldm_sd, TINY, latents / VAE_SCALE) + 1) / 2).clamp(0, 1)
    torch.testing.assert_close(decoded, expected, rtol=1e-10, atol=1e-10)
    assert decoded.shape == images.shape and 0 <= decoded.min() and decoded.max() <= 1
    assert ((decoded > 0) & (decoded < 1)).float().mean() > 0.5  # mostly unclamped values

    with pytest.raises(ValueError, match="vae_encode"):
        vae_encode(vae, images[:, :1])


# ---------------------------------------------------------------- load_vae through a file

def test_load_vae_from_released_and_training_checkpoints(tmp_path):
    ldm_sd = random_ldm_sd(TINY, seed=6, dtype=torch.float32)
    released = tmp_path / "kl16.ckpt"
    torch.save({"model": ldm_sd}, released)
    vae = load_vae(str(released))
    assert isinstance(vae, AutoencoderKL) and not vae.training
    assert vae.config.scaling_factor == VAE_SCALE
    expected = ldm_vae_to_diffusers(ldm_sd)
    assert all(torch.equal(v, expected[k]) for k, v in vae.state_dict().items())

    x = 2 * torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(7)) - 1
    with torch.no_grad():
        mean = vae.encode(x).latent_dist.mean
    sd64 = {k: v.double() for k, v in ldm_sd.items()}
    torch.testing.assert_close(mean.double(), ref_encode(sd64, TINY, x.double())[0], rtol=1e-4, atol=1e-5)

    # an LDM training checkpoint: weights under 'state_dict', plus loss.* keys that are dropped
    training = tmp_path / "last.ckpt"
    torch.save({"state_dict": {**ldm_sd, "loss.logvar": torch.zeros(())}, "epoch": 3}, training)
    vae2 = load_vae(str(training))
    assert all(torch.equal(v, expected[k]) for k, v in vae2.state_dict().items())


def _one_line_value_error(path, *fragments):
    with pytest.raises(ValueError) as info:
        load_vae(str(path))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"--vae {path}:"), message
    for fragment in fragments:
        assert fragment in message, message


def test_load_vae_errors(tmp_path):
    ldm_sd = random_ldm_sd(TINY, seed=8, dtype=torch.float32)

    missing = dict(ldm_sd)
    del missing["encoder.down.2.attn.0.q.weight"]
    torch.save({"model": missing}, tmp_path / "missing.ckpt")
    _one_line_value_error(tmp_path / "missing.ckpt", "missing encoder.down.2.attn.0.q.weight")

    wrong = dict(ldm_sd, **{"decoder.conv_in.weight": torch.zeros(64, 5, 3, 3)})
    torch.save({"model": wrong}, tmp_path / "wrong.ckpt")
    _one_line_value_error(tmp_path / "wrong.ckpt",
                          "wrong shape (file vs model) decoder.conv_in.weight (64, 5, 3, 3) "
                          "vs (64, 4, 3, 3)")

    extra = dict(ldm_sd, **{"encoder.extra.weight": torch.zeros(3)})
    torch.save({"model": extra}, tmp_path / "extra.ckpt")
    _one_line_value_error(tmp_path / "extra.ckpt", "unexpected encoder.extra.weight")

    torch.save({"model": {"net.weight": torch.zeros(2)}}, tmp_path / "other.ckpt")
    _one_line_value_error(tmp_path / "other.ckpt", "not an LDM KL VAE checkpoint")

    (tmp_path / "text.ckpt").write_text("not a checkpoint\n")
    _one_line_value_error(tmp_path / "text.ckpt", "cannot read weights: not a PyTorch checkpoint")

    with pytest.raises(FileNotFoundError, match="--vae: no such file"):
        load_vae(str(tmp_path / "absent.ckpt"))
