"""The CLIP-based rewards (scorers/clip.py): CPU, tiny open_clip models with random weights, no downloads.

A tiny open_clip architecture is registered with `open_clip.add_model_config`; its random weights
are saved in every supported file format and loaded back through the reward's real path, and the
reward is compared with the score computed by hand from the in-memory model.
"""
import math
import re
import warnings

import open_clip
import pytest
import torch
import torch.nn.functional as F
import torchvision.transforms.functional as TF
from PIL import Image
from safetensors.torch import save_file
from torchvision.transforms import InterpolationMode

from scorers import clip as clip_rewards
from scorers import registry

TINY = "rewards-test-tiny"        # 32 px, patch 8, width 32, 2 layers, embed 16
TINY_WIDE = "rewards-test-wide"   # same but width 48: a file that does not fit TINY
PROMPTS = ["a red circle", "a blue square", "a red circle", "two green triangles"]


def tiny_model(seed, name=TINY, logit_scale=None):
    torch.manual_seed(seed)  # open_clip initialises from the global generator; tests only
    model = open_clip.create_model(name, pretrained=None).eval()
    if logit_scale is not None:
        model.logit_scale.data.fill_(math.log(logit_scale))
    return model


def open_clip_to_hf(state_dict):
    """The inverse of `clip_rewards.convert_pickscore_hf_to_open_clip`: open_clip CLIP keys -> HF
    `CLIPModel` keys (without `position_ids`). `in_proj` is split into q, k, v by rows. Writes the
    HF-format test files without `transformers`."""
    fixed = {oc: hf for hf, oc in clip_rewards._HF_FIXED.items()}
    layer_map = {oc: hf for hf, oc in clip_rewards._HF_LAYER.items()}
    out = {}
    for key, value in state_dict.items():
        if key in clip_rewards._IGNORED_KEYS:
            continue
        if key in fixed:
            hf = fixed[key]
            out[hf] = value.t().contiguous() if hf in clip_rewards._TRANSPOSED else value
            continue
        for hf_prefix, oc_prefix in clip_rewards._TOWERS.items():
            m = re.fullmatch(re.escape(oc_prefix) + r"(\d+)\.attn\.in_proj_(weight|bias)", key)
            if m is not None:
                layer, param = m.groups()
                for name, part in zip("qkv", value.chunk(3, dim=0)):           # 3 x (W, W) or (W,)
                    out[f"{hf_prefix}{layer}.self_attn.{name}_proj.{param}"] = part
                break
            m = re.fullmatch(re.escape(oc_prefix) + r"(\d+)\.(.+)\.(weight|bias)", key)
            if m is not None and m.group(2) in layer_map:
                layer, module, param = m.groups()
                out[f"{hf_prefix}{layer}.{layer_map[module]}.{param}"] = value
                break
        else:
            out[key] = value
    return out


def save_weights(model, path, fmt):
    """Save `model` in one of the formats checkpoints.read_state_dict accepts."""
    sd = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    if fmt == "state_dict":                       # the HPS files: {'state_dict': ...}
        torch.save({"state_dict": sd, "epoch": 3}, path)
    elif fmt == "plain":                          # open_clip_pytorch_model.bin
        torch.save(sd, path)
    elif fmt == "safetensors":                    # open_clip_model.safetensors
        save_file(sd, str(path))
    elif fmt == "torchscript":                    # OpenAI ViT-L-14.pt
        with warnings.catch_warnings():           # torch.jit is deprecated, but it is OpenAI's format
            warnings.simplefilter("ignore")
            torch.jit.save(torch.jit.script(model), str(path))
    elif fmt == "hf":                             # PickScore's HF CLIPModel model.safetensors
        hf = open_clip_to_hf(sd)
        hf["text_model.embeddings.position_ids"] = torch.arange(77)[None]
        hf["vision_model.embeddings.position_ids"] = torch.arange(17)[None]
        save_file({k: v.contiguous() for k, v in hf.items()}, str(path))
    return str(path)


def images_batch(seed, b=4, h=40, w=24):
    """Smooth random images in [0, 1]: (b, 3, h, w)."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(b, 3, h // 4, w // 4, generator=g)
    return F.interpolate(low, size=(h, w), mode="bilinear", align_corners=False).clamp(0, 1)


def cosine(a, b):
    """Row-wise cosine written out: a.b / (|a| |b|)."""
    return (a * b).sum(-1) / (a.pow(2).sum(-1).sqrt() * b.pow(2).sum(-1).sqrt())


def hand_features(model, pixels, prompts):
    img = model.encode_image(pixels)
    txt = model.encode_text(open_clip.get_tokenizer(TINY)(prompts))
    return img, txt


# ----------------------------------------------------------------------------- preprocessing

def test_resize_longest_side_and_pad_geometry():
    x = torch.ones(2, 3, 16, 32)                                  # wide: pad top and bottom
    y = clip_rewards.resize_longest_side_and_pad(x, 32)
    assert y.shape == (2, 3, 32, 32)
    assert (y[:, :, :8] == 0).all() and (y[:, :, 24:] == 0).all() and torch.allclose(y[:, :, 8:24], torch.ones(1))
    x = torch.ones(1, 3, 33, 10)                                  # tall, odd pad: extra column right
    y = clip_rewards.resize_longest_side_and_pad(x, 32)                # -> 32 x 10, pad_w 22 -> 11 + 11
    assert (y[..., :11] == 0).all() and (y[..., 21:] == 0).all() and torch.allclose(y[..., 11:21], torch.ones(1))
    x = torch.ones(1, 3, 32, 21)                                  # 32 x 21, pad 11 -> 5 left, 6 right
    y = clip_rewards.resize_longest_side_and_pad(x, 32)
    assert (y[..., :5] == 0).all() and (y[..., 26:] == 0).all() and (y[..., 5:26] == 1).all()


def test_hps_preprocessing_matches_pil_reference():
    """Against HPSv2's PIL pipeline: ResizeMaxSize (bicubic, pad 0, centred) then ToTensor."""
    for h, w in ((40, 24), (24, 56), (64, 64)):
        x = images_batch(3, b=1, h=h, w=w)
        ours = clip_rewards.resize_longest_side_and_pad(clip_rewards.quantize_8bit(x), 32)[0]
        pil = Image.fromarray((x[0] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy())
        scale = 32 / max(h, w)
        nh, nw = round(h * scale), round(w * scale)
        ref = TF.resize(pil, [nh, nw], InterpolationMode.BICUBIC)
        ref = TF.to_tensor(TF.pad(ref, [(32 - nw) // 2, (32 - nh) // 2, 32 - nw - (32 - nw) // 2,
                                        32 - nh - (32 - nh) // 2], fill=0))
        assert ours.shape == ref.shape == (3, 32, 32)
        assert (ours - ref).abs().mean() < 1 / 255
        assert ((ref == 0).all(0) <= (ours < 2 / 255).all(0)).all()  # padding lands on the same pixels


def test_center_crop_matches_pil_reference():
    x = images_batch(4, b=1, h=48, w=64)
    ours = clip_rewards.resize_shortest_side_and_center_crop(clip_rewards.quantize_8bit(x), 32)[0]
    pil = Image.fromarray((x[0] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy())
    ref = TF.to_tensor(TF.center_crop(TF.resize(pil, 32, InterpolationMode.BICUBIC), 32))
    assert ours.shape == ref.shape == (3, 32, 32)
    assert (ours - ref).abs().mean() < 1 / 255


# ----------------------------------------------------------------------------- CLIP-based rewards

@pytest.mark.parametrize("fmt", ["state_dict", "plain", "safetensors", "torchscript", "hf"])
def test_hpsv2_score_is_cosine(tiny_configs, tmp_path, fmt):
    model = tiny_model(1)
    path = save_weights(model, tmp_path / f"HPS_v2.1_compressed.{fmt}", fmt)
    reward = registry.build_reward("hpsv2", weights={"hpsv2": path}, model_name=TINY)
    x = images_batch(0)                                           # (4, 3, 40, 24): non-square, padded
    scores, info = reward(x, PROMPTS, None)
    with torch.no_grad():
        pixels = clip_rewards.resize_longest_side_and_pad(clip_rewards.quantize_8bit(x), 32)
        mean = torch.tensor(clip_rewards.OPENAI_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(clip_rewards.OPENAI_STD).view(1, 3, 1, 1)
        img, txt = hand_features(model, (pixels - mean) / std, PROMPTS)
    expected = cosine(img, txt)
    assert torch.allclose(scores, expected, atol=1e-5), (scores, expected)
    assert scores.abs().max() > 1e-3 and info["means"]["hpsv2"] == pytest.approx(expected.mean().item(), abs=1e-5)


def test_batch_order_does_not_change_scores(tiny_configs, tmp_path):
    hps = save_weights(tiny_model(2), tmp_path / "hps.pt", "state_dict")
    pick = save_weights(tiny_model(3, logit_scale=80.0), tmp_path / "model.safetensors", "hf")
    reward = registry.build_reward("hpsv2,pickscore", weights={"hpsv2": hps, "pickscore": pick}, model_name=TINY)
    x = images_batch(5, b=6, h=32, w=32)
    prompts = PROMPTS + ["a red circle", "three yellow squares"]
    scores, info = reward(x, prompts, None)
    perm = torch.tensor([4, 2, 5, 0, 1, 3])
    scores_p, info_p = reward(x[perm], [prompts[i] for i in perm], None)
    assert torch.allclose(scores_p, scores[perm], atol=1e-5)
    for name in ("hpsv2", "pickscore"):
        assert torch.allclose(info_p["components"][name], info["components"][name][perm], atol=1e-5)
    single, _ = reward(x[:1], prompts[:1], None)                  # batch size does not matter either
    assert torch.allclose(single, scores[:1], atol=1e-5)


def test_pickscore_converter_round_trip(tiny_configs):
    sd = tiny_model(4).state_dict()
    hf = open_clip_to_hf(sd)
    # HF CLIPModel names (transformers' CLIPModel, layer 0 of each tower shown)
    expected_some = {
        "logit_scale", "text_projection.weight", "visual_projection.weight",
        "text_model.embeddings.token_embedding.weight", "text_model.embeddings.position_embedding.weight",
        "text_model.final_layer_norm.weight", "text_model.final_layer_norm.bias",
        "vision_model.embeddings.class_embedding", "vision_model.embeddings.patch_embedding.weight",
        "vision_model.embeddings.position_embedding.weight", "vision_model.pre_layrnorm.weight",
        "vision_model.post_layernorm.bias",
    }
    for tower in ("text_model", "vision_model"):
        for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj",
                       "layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2"):
            expected_some |= {f"{tower}.encoder.layers.1.{module}.weight", f"{tower}.encoder.layers.1.{module}.bias"}
    assert expected_some <= set(hf)
    assert not [k for k in hf if not k.startswith(("text_model.", "vision_model.", "text_projection",
                                                    "visual_projection", "logit_scale"))]
    w = 32
    in_proj = sd["visual.transformer.resblocks.1.attn.in_proj_weight"]            # (3W, W): q, k, v rows
    assert torch.equal(hf["vision_model.encoder.layers.1.self_attn.k_proj.weight"], in_proj[w:2 * w])
    assert torch.equal(hf["visual_projection.weight"], sd["visual.proj"].t())     # (D, W) vs (W, D)
    assert torch.equal(hf["text_projection.weight"], sd["text_projection"].t())
    hf["text_model.embeddings.position_ids"] = torch.arange(77)[None]
    back = clip_rewards.convert_pickscore_hf_to_open_clip(hf)
    assert set(back) == set(sd) - {"attn_mask"}
    assert all(torch.equal(back[k], sd[k]) for k in back)


def test_pickscore_is_logit_scale_times_cosine(tiny_configs, tmp_path):
    model = tiny_model(5, logit_scale=50.0)
    path = save_weights(model, tmp_path / "model.safetensors", "hf")
    reward = registry.build_reward("pickscore", weights={"pickscore": path}, model_name=TINY)
    x = images_batch(6, h=48, w=40)                               # shortest side 40 -> 32, centre crop
    scores, _ = reward(x, PROMPTS, None)
    with torch.no_grad():
        pixels = clip_rewards.normalize(clip_rewards.resize_shortest_side_and_center_crop(clip_rewards.quantize_8bit(x), 32))
        img, txt = hand_features(model, pixels, PROMPTS)
    expected = 50.0 * cosine(img, txt)
    assert torch.allclose(scores, expected, atol=1e-3), (scores, expected)


def test_clip_score_is_100_cosine(tiny_configs, tmp_path):
    model = tiny_model(6)
    path = save_weights(model, tmp_path / "open_clip_model.safetensors", "safetensors")
    reward = registry.build_reward("clip_score", weights={"clip_score": path}, options={"clip_score": {"model_name": TINY}})
    x = images_batch(7, h=32, w=32)
    scores, _ = reward(x, PROMPTS, None)
    with torch.no_grad():
        img, txt = hand_features(model, clip_rewards.normalize(clip_rewards.quantize_8bit(x)), PROMPTS)
    assert torch.allclose(scores, 100 * cosine(img, txt), atol=1e-3)
    model.text_projection.data.neg_()                             # flips every cosine: no clamp at 0
    path = save_weights(model, tmp_path / "flipped.bin", "plain")
    flipped, _ = registry.build_reward("clip_score", weights={"clip_score": path}, model_name=TINY)(x, PROMPTS, None)
    assert torch.allclose(flipped, -scores, atol=1e-3) and (flipped < 0).any()


def test_aesthetic_is_linear_head_on_normalised_embedding(tiny_configs, tmp_path):
    model = tiny_model(7)
    clip = save_weights(model, tmp_path / "ViT-L-14.pt", "torchscript")
    torch.manual_seed(8)
    head = clip_rewards.AestheticMLP(16)
    torch.save(head.state_dict(), tmp_path / "sac+logos+ava1-l14-linearMSE.pth")
    assert sorted(head.state_dict()) == sorted(f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias"))
    reward = registry.build_reward("aesthetic", model_name=TINY, weights={
        "aesthetic": str(tmp_path / "sac+logos+ava1-l14-linearMSE.pth"), "aesthetic_clip": clip})
    x = images_batch(9, h=40, w=40)
    scores, _ = reward(x, PROMPTS, None)
    with torch.no_grad():
        pixels = clip_rewards.normalize(clip_rewards.resize_shortest_side_and_center_crop(clip_rewards.quantize_8bit(x), 32))
        e = model.encode_image(pixels)
        e = e / e.norm(dim=-1, keepdim=True)
        h = e
        for i in (0, 2, 4, 6, 7):                                  # five affine maps, no nonlinearity
            layer = head.layers[i]
            h = h @ layer.weight.t() + layer.bias
    assert torch.allclose(scores, h[:, 0], atol=1e-5)


def test_multi_reward_with_per_reward_files(tiny_configs, tmp_path):
    hps_model, pick_model = tiny_model(10), tiny_model(11, logit_scale=100.0)
    weights = {"hpsv2": save_weights(hps_model, tmp_path / "HPS_v2_compressed.pt", "state_dict"),
               "pickscore": save_weights(pick_model, tmp_path / "model.safetensors", "hf"),
               "aesthetic": "/not/used/when/aesthetic/is/not/in/the/spec.pth"}
    reward = registry.build_reward("hpsv2:1.0,pickscore:0.5", weights=weights, model_name=TINY)
    x = images_batch(12, h=32, w=32)
    scores, info = reward(x, PROMPTS, None)
    hps_alone, _ = registry.build_reward("hpsv2", weights=weights, model_name=TINY)(x, PROMPTS, None)
    pick_alone, _ = registry.build_reward("pickscore", weights=weights, model_name=TINY)(x, PROMPTS, None)
    assert torch.allclose(scores, hps_alone + 0.5 * pick_alone, atol=1e-4)
    assert info["means"]["hpsv2"] == pytest.approx(hps_alone.mean().item(), abs=1e-5)
    assert info["means"]["pickscore"] == pytest.approx(pick_alone.mean().item(), abs=1e-3)
    assert not torch.allclose(hps_alone * 100, pick_alone, atol=1e-2)  # each reward got its own file


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rewards_on_cuda_match_cpu(tiny_configs, tmp_path):
    hps = save_weights(tiny_model(13), tmp_path / "hps.pt", "state_dict")
    pick = save_weights(tiny_model(14, logit_scale=90.0), tmp_path / "model.safetensors", "hf")
    spec, weights = "hpsv2,pickscore:0.5,jpeg_incompressibility:0.01", {"hpsv2": hps, "pickscore": pick}
    x = images_batch(15, h=48, w=40)
    cpu, _ = registry.build_reward(spec, weights=weights, model_name=TINY)(x, PROMPTS, None)
    gpu, info = registry.build_reward(spec, device="cuda", weights=weights, model_name=TINY)(x.cuda(), PROMPTS, None)
    assert gpu.device.type == "cpu" and info["components"]["hpsv2"].device.type == "cpu"
    assert torch.allclose(gpu, cpu, atol=1e-3)

