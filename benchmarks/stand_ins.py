"""Random stand-ins for released files, in their released layouts: what the tests and the memory
measurements load where the real weights are not at hand (they are never downloaded). Their values
are random; their keys, shapes and formats are the released ones, so they go through the same
loading code as the real files.

- `ldm_vae_shapes`, `random_ldm_sd`: an LDM-format AutoencoderKL state dict (the KL-16 VAE's layout);
- `save_tokenizer`: a word-level tokenizer folder in place of Qwen2.5's (Harmon's prompts).
"""

import json
import math

import torch
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers

# the KL-16 VAE of MAR and Harmon (LDM `ch`, `ch_mult`, blocks, latent channels, attention levels)
KL16 = dict(ch=128, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2, z=16, enc_attn_levels=(4,))
# the words of the stand-in tokenizer: Harmon's chat template and a few prompt words
WORDS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "Generate", "an", "image", ":", ".",
         "a", "the", "red", "blue", "cube", "ball"]


def ldm_vae_shapes(ch, ch_mult, num_res_blocks, z, enc_attn_levels=(), dec_attn_levels=(), in_ch=3):
    """{LDM key: shape} of an LDM AutoencoderKL (taming/LDM `Encoder`/`Decoder` layout)."""
    shapes = {}

    def conv(name, c_out, c_in, k):
        shapes[f"{name}.weight"] = (c_out, c_in, k, k)
        shapes[f"{name}.bias"] = (c_out,)

    def norm(name, c):
        shapes[f"{name}.weight"] = (c,)
        shapes[f"{name}.bias"] = (c,)

    def resnet(name, c_in, c_out):
        norm(f"{name}.norm1", c_in)
        conv(f"{name}.conv1", c_out, c_in, 3)
        norm(f"{name}.norm2", c_out)
        conv(f"{name}.conv2", c_out, c_out, 3)
        if c_in != c_out:
            conv(f"{name}.nin_shortcut", c_out, c_in, 1)

    def attn(name, c):
        norm(f"{name}.norm", c)
        for proj in ("q", "k", "v", "proj_out"):
            conv(f"{name}.{proj}", c, c, 1)

    def mid(name, c):
        resnet(f"{name}.block_1", c, c)
        attn(f"{name}.attn_1", c)
        resnet(f"{name}.block_2", c, c)

    widths = [ch * m for m in ch_mult]
    num_levels = len(widths)
    conv("encoder.conv_in", ch, in_ch, 3)
    c = ch
    for i, width in enumerate(widths):
        for j in range(num_res_blocks):
            resnet(f"encoder.down.{i}.block.{j}", c, width)
            c = width
            if i in enc_attn_levels:
                attn(f"encoder.down.{i}.attn.{j}", c)
        if i != num_levels - 1:
            conv(f"encoder.down.{i}.downsample.conv", c, c, 3)
    mid("encoder.mid", c)
    norm("encoder.norm_out", c)
    conv("encoder.conv_out", 2 * z, c, 3)  # mean and logvar

    conv("decoder.conv_in", c, z, 3)
    mid("decoder.mid", c)
    for i in reversed(range(num_levels)):
        for j in range(num_res_blocks + 1):  # one more res block per level than the encoder
            resnet(f"decoder.up.{i}.block.{j}", c, widths[i])
            c = widths[i]
            if i in dec_attn_levels:
                attn(f"decoder.up.{i}.attn.{j}", c)
        if i != 0:
            conv(f"decoder.up.{i}.upsample.conv", c, c, 3)
    norm("decoder.norm_out", c)
    conv("decoder.conv_out", in_ch, c, 3)

    conv("quant_conv", 2 * z, 2 * z, 1)
    conv("post_quant_conv", z, z, 1)
    return shapes


def random_ldm_sd(arch, seed, dtype=torch.float64):
    """Random weights in the LDM layout, scaled so activations stay O(1) through the network."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for key, shape in ldm_vae_shapes(**arch).items():
        noise = torch.randn(shape, generator=g, dtype=dtype)
        if len(shape) == 1:  # GroupNorm affine or a bias
            is_norm_scale = key.endswith(".weight")
            sd[key] = 1 + 0.2 * noise if is_norm_scale else 0.2 * noise
        else:  # conv weight (C_out, C_in, k, k)
            sd[key] = noise / math.sqrt(shape[1] * shape[2] * shape[3])
    return sd


def save_tokenizer(folder, words=WORDS):
    """A word-level tokenizer folder (tokenizers' own format, `folder` a new pathlib.Path) standing in
    for Qwen2.5's: its special tokens, then `words`."""
    backend = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"])
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", pad_token="<pad>", unk_token="<unk>", eos_token="<|im_end|>")))
