"""Fixtures shared by the test files."""

import json
import shutil

import open_clip
import pytest
import torch

import demo
import train
from models import nova
from benchmarks.stand_ins import WORDS, random_ldm_sd, save_tokenizer
from tests import test_harmon, test_nova
from tests.helpers import ADAPTER_PROMPTS as PROMPTS, grpo_flags
from tests.test_clip_rewards import TINY, TINY_WIDE


@pytest.fixture(scope="session")
def smoke_base(tmp_path_factory):
    """A smoke-size base model: a copy of the shipped demo/smoke.pt in a folder of its own (tests
    write beside it), as `python -m demo.pretrain --preset smoke` makes it."""
    path = tmp_path_factory.mktemp("base") / "base.pt"
    shutil.copyfile(demo.SMOKE_BASE, path)
    return path


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, smoke_base):
    """A finished 2-step GRPO run folder with checkpoints at steps 1 and 2."""
    out = tmp_path_factory.mktemp("run")
    assert train.cli(grpo_flags(str(smoke_base), str(out), "--steps", "2", "--save-every", "1")) == 0
    return out


@pytest.fixture(scope="module")
def harmon_files(tmp_path_factory):
    """Weights, config, tokenizer, KL-16 VAE and prompt file of a tiny Harmon (3×3 tokens, 48 px)."""
    d = tmp_path_factory.mktemp("harmon")
    model = test_harmon.tiny_harmon(seed=21)
    config = test_harmon.tiny_config()
    assert config["mar"]["vae_stride"] == 16 and len(WORDS) <= config["llm"]["vocab_size"]
    torch.save(model.state_dict(), d / "harmon_tiny.pth")  # the released layout: a plain state dict
    (d / "harmon_tiny.json").write_text(json.dumps(config))
    save_tokenizer(d / "tok")
    # LDM-format KL VAE: 5 levels (4 downsamplings: stride 16), 16 latent channels as the MAR's tokens
    arch = dict(ch=32, ch_mult=(1, 1, 1, 1, 1), num_res_blocks=1, z=config["mar"]["vae_embed_dim"], enc_attn_levels=(4,))
    sd = {k: v.float() for k, v in random_ldm_sd(arch, seed=22).items()}
    torch.save({"model": sd}, d / "kl16_tiny.ckpt")
    (d / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return dict(init=d / "harmon_tiny.pth", config=d / "harmon_tiny.json", tok=d / "tok", vae=d / "kl16_tiny.ckpt",
                prompts=d / "prompts.txt")


@pytest.fixture
def tiny_archs(monkeypatch):
    """Register test_nova's tiny architecture names in NOVA's registry for this test: a released
    pipeline's config.json names only registry entries (nova.load_nova's arch_defs argument is
    not reachable from train.py)."""
    for name, entry in test_nova.tiny_config(None)["arch_defs"].items():
        monkeypatch.setitem(nova.ARCHS, name, entry)


@pytest.fixture(scope="module")
def nova_common(tmp_path_factory):
    """The prompt file and its --prompt-embeds file (random (T, D_text) rows, test_nova's sizes)."""
    d = tmp_path_factory.mktemp("nova")
    (d / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    t = test_nova.tiny_config(None)["transformer"]
    g = torch.Generator().manual_seed(31)
    torch.save({"prompts": PROMPTS, "embeds": torch.randn(len(PROMPTS), t["text_token_len"], t["text_token_dim"], generator=g)},
               d / "embeds.pt")
    return dict(prompts=d / "prompts.txt", embeds=d / "embeds.pt")


@pytest.fixture(scope="module")
def tiny_configs(tmp_path_factory):
    """Two tiny open_clip architectures registered by name (TINY and TINY_WIDE of test_clip_rewards)."""
    folder = tmp_path_factory.mktemp("open_clip_configs")
    for name, width in ((TINY, 32), (TINY_WIDE, 48)):
        cfg = {"embed_dim": 16,
               "vision_cfg": {"image_size": 32, "layers": 2, "width": width, "head_width": 16, "patch_size": 8},
               "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": width, "heads": 2, "layers": 2}}
        (folder / f"{name}.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(folder)
    return folder
