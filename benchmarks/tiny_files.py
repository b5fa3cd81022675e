"""Tiny random Harmon and NOVA models written as the released files are laid out, for the smoke
pipelines of benchmarks/gpu_check.py (`train.py --preset adapter_smoke --model harmon|nova`): they go
through the same loading code as real weights. The sizes are the test suite's (tests/test_harmon.py,
tests/test_nova.py); the values are random.

- Harmon: a plain state dict (`harmon_*.pth`), its config as JSON (--model-config), a word-level
  tokenizer folder (--tokenizer), an LDM-format KL VAE of stride 16 (--vae), a prompt file;
- NOVA: a pipeline folder (transformer/ with config.json and safetensors, scheduler/, vae/ a diffusers
  AutoencoderKL), a prompt file and its Phi-2-sized --prompt-embeds file (random rows).
"""

import json
import pathlib

import torch
from diffusers import AutoencoderKL
from safetensors.torch import save_file

from models import harmon, nova
from benchmarks.stand_ins import random_ldm_sd, save_tokenizer

PROMPTS = ["a red cube", "a blue ball", "the red ball"]  # in the words of the stand-in tokenizer
HARMON = dict(llm=dict(vocab_size=50, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, hidden_act="silu"),
              mar=dict(img_size=48, vae_stride=16, patch_size=1, vae_embed_dim=16, encoder_embed_dim=24, encoder_depth=1,
                       encoder_num_heads=2, decoder_embed_dim=40, decoder_depth=2, decoder_num_heads=4, mlp_ratio=2.0,
                       class_num=3, buffer_size=3, diffloss_d=2, diffloss_w=32, num_sampling_steps="8", layernorm_eps=1e-5),
              vae_scale=0.2325)
# NOVA's text-to-image transformer at 4 × 6 tokens, its architectures named in the config (arch_defs), a flow head
NOVA = dict(image_dim=8, image_size=[64, 96], image_stride=16, text_token_dim=12, text_token_len=6, image_base_size=[4, 6],
            video_base_size=[1, 2, 3], rotary_pos_embed=False, arch=["vit_d2w48", "vit_d3w48", "mlp_d3w40"],
            arch_defs={"vit_d2w48": dict(kind="video_encoder", depth=2, embed_dim=48, num_heads=3),
                       "vit_d3w48": dict(kind="image_encoder", depth=3, embed_dim=48, num_heads=6),
                       "mlp_d3w40": dict(kind="image_decoder", depth=3, embed_dim=40)})
FLOW = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}


def write_prompts(folder):
    (folder / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return folder / "prompts.txt"


def harmon_files(folder, seed=21):
    """Write the tiny Harmon's files into `folder` (a new pathlib.Path). Returns train.py's flags for them."""
    folder.mkdir(parents=True)
    torch.manual_seed(seed)
    model = harmon.build(HARMON)
    with torch.no_grad():  # the head's zero-initialised layers get weight, so the head is a function of z
        for name, p in model.diffloss.named_parameters():
            if "adaLN_modulation" in name or "final_layer.linear" in name:
                p.normal_(0, 0.05)
    torch.save(model.state_dict(), folder / "harmon_tiny.pth")
    (folder / "harmon_tiny.json").write_text(json.dumps(HARMON))
    save_tokenizer(folder / "tokenizer")
    arch = dict(ch=32, ch_mult=(1, 1, 1, 1, 1), num_res_blocks=1, z=16, enc_attn_levels=(4,))  # stride 16, 16 channels
    torch.save({"model": {k: v.float() for k, v in random_ldm_sd(arch, seed=seed + 1).items()}}, folder / "kl16_tiny.ckpt")
    return ["--model", "harmon", "--init", folder / "harmon_tiny.pth", "--model-config", folder / "harmon_tiny.json",
            "--vae", folder / "kl16_tiny.ckpt", "--tokenizer", folder / "tokenizer", "--prompts", write_prompts(folder)]


def nova_files(folder, seed=41):
    """Write the tiny NOVA pipeline and its prompt files into `folder` (a new pathlib.Path). Returns train.py's flags."""
    pipe = folder / "pipeline"
    (pipe / "transformer").mkdir(parents=True)
    (pipe / "scheduler").mkdir()
    torch.manual_seed(seed)
    model = nova.build({"transformer": NOVA, "scheduler": FLOW, "num_diffusion_steps": 6})
    with torch.no_grad():  # a small output layer keeps an untrained head's samples O(1)
        model.image_decoder.head.weight.mul_(0.1)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(pipe / "transformer" / "diffusion_pytorch_model.safetensors"))
    (pipe / "transformer" / "config.json").write_text(json.dumps({"_class_name": "NOVATransformer3DModel", **NOVA}))
    (pipe / "scheduler" / "scheduler_config.json").write_text(json.dumps(FLOW))
    torch.manual_seed(seed + 1)  # 4 downsamplings: the image stride 16 of the config, its 8 latent channels
    vae = AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 5, up_block_types=("UpDecoderBlock2D",) * 5,
                        block_out_channels=(8,) * 5, layers_per_block=1, latent_channels=NOVA["image_dim"],
                        norm_num_groups=4, sample_size=NOVA["image_size"][0], scaling_factor=0.6, shift_factor=0.1)
    vae.save_pretrained(str(pipe / "vae"))
    g = torch.Generator().manual_seed(seed + 2)
    embeds = torch.randn(len(PROMPTS), NOVA["text_token_len"], NOVA["text_token_dim"], generator=g)
    torch.save({"prompts": PROMPTS, "embeds": embeds}, folder / "embeds.pt")
    return ["--model", "nova", "--init", pipe, "--prompt-embeds", folder / "embeds.pt", "--prompts", write_prompts(folder)]


def smoke_flags(work):
    """{model: train.py's flags of its smoke pipeline} under `work` (a folder; the Harmon and NOVA files are written)."""
    work = pathlib.Path(work)
    return {"small": ["--preset", "smoke"],
            "harmon": ["--preset", "adapter_smoke", *harmon_files(work / "harmon")],
            "nova": ["--preset", "adapter_smoke", *nova_files(work / "nova")]}
