"""rewards.py and scorers/registry.py: the spec and its errors, the weight flags, the JPEG rewards, the weighted sum, and the
shapes reward (the verifier). The CLIP family's scores are tests/test_clip_rewards.py's, whose tiny
open_clip models these tests load too."""

import json

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image

import rewards
from demo import shapes, verifier
from scorers import registry
from tests.test_clip_rewards import TINY, TINY_WIDE, save_weights, tiny_model


# ----------------------------------------------------------------------------- spec and errors

def test_unknown_reward_and_bad_spec():
    with pytest.raises(ValueError, match=r"unknown reward 'x' \(--reward\); choose from shapes, "):
        registry.build_reward("x")
    with pytest.raises(ValueError, match="bad weight"):
        registry.build_reward("jpeg_compressibility:abc")
    with pytest.raises(ValueError, match="twice"):
        registry.build_reward("jpeg_compressibility,jpeg_compressibility:2")
    with pytest.raises(ValueError, match="unknown weights key"):
        registry.build_reward("jpeg_compressibility", weights={"hps": "x.pt"})
    with pytest.raises(ValueError, match="taken by none"):
        registry.build_reward("jpeg_compressibility", model_name=TINY)
    assert registry.parse_spec(" hpsv2:1.0, pickscore:0.5 ") == [("hpsv2", 1.0), ("pickscore", 0.5)]


def test_parse_reward_ckpt():
    assert registry.parse_reward_ckpt("/w/HPS_v2.1_compressed.pt", "hpsv2") == {"hpsv2": "/w/HPS_v2.1_compressed.pt"}
    got = registry.parse_reward_ckpt(["hpsv2=/w/a.pt", "aesthetic=/w/sac+logos+ava1-l14-linearMSE.pth,"
                                     "aesthetic_clip=/w/ViT-L-14.pt"], "hpsv2,aesthetic")
    assert got == {"hpsv2": "/w/a.pt", "aesthetic": "/w/sac+logos+ava1-l14-linearMSE.pth",
                   "aesthetic_clip": "/w/ViT-L-14.pt"}
    with pytest.raises(ValueError, match="key=PATH"):  # two files needed: a bare path is ambiguous
        registry.parse_reward_ckpt("/w/x.pth", "aesthetic")


def one_line(excinfo):
    return "\n" not in str(excinfo.value)


def test_missing_weights_fail_at_construction(tmp_path):
    # default architecture (ViT-H-14): the file check comes before the model is built
    with pytest.raises(FileNotFoundError) as e:
        registry.build_reward("hpsv2")
    assert one_line(e) and "--reward-ckpt hpsv2=" in str(e.value) and "HPS_v2.1_compressed.pt" in str(e.value)
    missing = tmp_path / "model.safetensors"
    with pytest.raises(FileNotFoundError) as e:
        registry.build_reward("pickscore", weights={"pickscore": str(missing)})
    assert one_line(e) and "--reward-ckpt" in str(e.value) and str(missing) in str(e.value)
    assert "yuvalkirstain/PickScore_v1" in str(e.value)
    with pytest.raises(FileNotFoundError) as e:
        registry.build_reward("aesthetic", weights={"aesthetic": str(missing)})
    assert one_line(e) and "sac+logos+ava1-l14-linearMSE.pth" in str(e.value)


def test_mismatched_weights_name_file_and_keys(tiny_configs, tmp_path):
    wide = save_weights(tiny_model(0, TINY_WIDE), tmp_path / "wide.pt", "plain")
    with pytest.raises(ValueError) as e:
        registry.build_reward("hpsv2", weights={"hpsv2": wide}, model_name=TINY)
    assert one_line(e) and wide in str(e.value) and "shape" in str(e.value) and "positional_embedding" in str(e.value)

    sd = tiny_model(0).state_dict()
    sd.pop("visual.proj")
    sd["extra.weight"] = torch.zeros(2)
    torch.save(sd, tmp_path / "partial.pt")
    with pytest.raises(ValueError) as e:
        registry.build_reward("clip_score", weights={"clip_score": str(tmp_path / "partial.pt")}, model_name=TINY)
    msg = str(e.value)
    assert one_line(e) and "partial.pt" in msg and "visual.proj" in msg and "extra.weight" in msg

    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="--reward-ckpt .*=.*junk.pt: cannot read weights: not a PyTorch checkpoint") as e:
        registry.build_reward("hpsv2", weights={"hpsv2": str(tmp_path / "junk.pt")}, model_name=TINY)
    assert one_line(e)

    clip = save_weights(tiny_model(0), tmp_path / "clip.safetensors", "safetensors")
    torch.save(torch.nn.Linear(16, 1).state_dict(), tmp_path / "head.pth")
    with pytest.raises(ValueError) as e:
        registry.build_reward("aesthetic", weights={"aesthetic": str(tmp_path / "head.pth"), "aesthetic_clip": clip},
                             model_name=TINY)
    assert one_line(e) and "head.pth" in str(e.value) and "layers.0.weight" in str(e.value)


def test_tokenizers_are_offline_builtins(tiny_configs, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("ViT-H-14", "ViT-L-14-quickgelu", TINY):
        tok = open_clip.get_tokenizer(name)
        assert isinstance(tok, open_clip.SimpleTokenizer), name
    ids = open_clip.get_tokenizer("ViT-H-14")(["a red circle"])
    assert ids.shape == (1, 77) and ids[0, 0] == 49406 and 49407 in ids[0].tolist()  # SOT ... EOT


# ----------------------------------------------------------------------------- jpeg and combining

def test_jpeg_sizes():
    g = torch.Generator().manual_seed(0)
    noise = torch.rand(1, 3, 64, 64, generator=g)
    flat = torch.full((1, 3, 64, 64), 0.5)
    images = torch.cat([noise, flat])
    inc, _ = registry.build_reward("jpeg_incompressibility")(images, ["a", "b"], None)
    comp, _ = registry.build_reward("jpeg_compressibility")(images, ["a", "b"], None)
    assert inc[0] > 3 * inc[1] > 0
    assert torch.equal(comp, -inc)
    inc_np, _ = registry.build_reward("jpeg_incompressibility")(images.numpy(), ["a", "b"], None)
    assert torch.equal(inc_np, inc)                               # numpy input is accepted too
    # the size of the noise image, measured independently with PIL
    buffer = __import__("io").BytesIO()
    pixels = (noise[0] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=95)
    assert inc[0].item() == pytest.approx(len(buffer.getvalue()) / 1000)


def test_weighted_sum_and_per_component_means():
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    images[1] = 0.2
    reward = registry.build_reward("jpeg_compressibility:2.0,jpeg_incompressibility:0.5")
    scores, info = reward(images, ["p"] * 3, None)
    size = rewards.jpeg_size_kb(images)
    assert torch.allclose(scores, 2.0 * (-size) + 0.5 * size)
    assert info["means"] == {"jpeg_compressibility": pytest.approx(-size.mean().item()),
                             "jpeg_incompressibility": pytest.approx(size.mean().item())}
    assert torch.allclose(info["components"]["jpeg_compressibility"], -size)
    assert info["weights"] == {"jpeg_compressibility": 2.0, "jpeg_incompressibility": 0.5}
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    json.dumps(info["means"])


# ----------------------------------------------------------------------------- shapes

def test_shapes_reward_equals_verifier():
    rng = np.random.default_rng(0)
    metas = shapes.sample_prompts(6, rng)
    pixels = np.stack([shapes.render(m, size=32, rng=rng) for m in metas])      # (B, H, W, 3) uint8
    images = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255        # (B, 3, H, W)
    prompts = [m["prompt"] for m in metas]
    reward = registry.build_reward("shapes")
    scores, info = reward(images, prompts, metas)
    assert torch.equal(scores, torch.ones(6))                                    # renders are correct
    assert len(info["details"]) == 6 and all(d["correct"] for d in info["details"])
    # wrong prompts for the same images: the reward is the verifier's score, also from prompts alone
    shuffled = metas[1:] + metas[:1]
    scores_w, info_w = reward(images, [m["prompt"] for m in shuffled], None)
    expected, _ = verifier.verify_batch(images, shuffled)
    assert torch.equal(scores_w, torch.from_numpy(expected)) and scores_w.min() < 1
    assert info_w["means"]["shapes"] == pytest.approx(float(expected.mean()))
    with pytest.raises(ValueError, match="not a shapes prompt"):
        reward(images[:1], ["a photo of a cat"], None)


