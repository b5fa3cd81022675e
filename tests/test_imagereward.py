"""Tests of scorers/imagereward.py: CPU, a tiny random ImageReward saved in the released ImageReward.pt key
layout and loaded through the reward's real path, a tokenizer built from a vocab.txt the test writes;
no downloads.

`reference_scores` recomputes the score from the released key names with torch.nn.functional only,
following the structure of the released BLIP code (a timm ViT; BLIP's med.py BERT whose every
layer is self-attention, cross-attention to the image, FFN), so it shares nothing with transformers
or with the key converter.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from scorers import imagereward, registry

MEAN, STD = 0.16717362830052426, 1.0333394966054072     # ImageReward.__init__ in the official code
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
WORDS = "a red blue green yellow circle square squares triangle triangles two three of left right the".split()
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS       # BERT's special tokens, then words
PAD, UNK, CLS, SEP = 0, 1, 2, 3
DEC, ENC = len(VOCAB), len(VOCAB) + 1                                 # added by BLIP's init_tokenizer
TINY = dict(image_size=32, patch_size=8, vision_width=32, vision_layers=2, vision_heads=2, text_width=24,
            text_layers=2, text_heads=2, text_ffn=48, vocab_size=len(VOCAB) + 2, max_positions=40)
LONG = " ".join(["a red circle left of two blue squares"] * 5)         # 40 words: truncated to 35 tokens
PROMPTS = ["a red circle", "Two GREEN triangles", "a purple circle", "a red circle", LONG]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert-tiny-uncased")
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return folder


def released_state_dict(a, seed=None):
    """Random weights for arch `a` under ImageReward.pt's key names and shapes (BLIP_Pretrain's
    visual_encoder, text_encoder, vision_proj, text_proj, and ImageReward's mlp). Linear weights are
    scaled by 1/sqrt(fan_in) so every stage carries O(1) signal. seed=None: meta tensors (shapes only)."""
    g = None if seed is None else torch.Generator().manual_seed(seed)
    sd = {}

    def rand(*shape, std=1.0, mean=0.0):
        return torch.empty(shape, device="meta") if g is None else mean + std * torch.randn(shape, generator=g)

    def linear(name, n_out, n_in):
        sd[name + ".weight"] = rand(n_out, n_in, std=1 / math.sqrt(n_in))
        sd[name + ".bias"] = rand(n_out, std=0.1)

    def norm(name, n):
        sd[name + ".weight"], sd[name + ".bias"] = rand(n, std=0.1, mean=1.0), rand(n, std=0.1)

    V, Wv, p = "blip.visual_encoder.", a["vision_width"], a["patch_size"]
    sd[V + "cls_token"] = rand(1, 1, Wv)
    sd[V + "pos_embed"] = rand(1, 1 + (a["image_size"] // p) ** 2, Wv, std=0.5)
    sd[V + "patch_embed.proj.weight"] = rand(Wv, 3, p, p, std=1 / math.sqrt(3 * p * p))
    sd[V + "patch_embed.proj.bias"] = rand(Wv, std=0.1)
    for i in range(a["vision_layers"]):
        block = f"{V}blocks.{i}."
        norm(block + "norm1", Wv)
        linear(block + "attn.qkv", 3 * Wv, Wv)
        linear(block + "attn.proj", Wv, Wv)
        norm(block + "norm2", Wv)
        linear(block + "mlp.fc1", 4 * Wv, Wv)
        linear(block + "mlp.fc2", Wv, 4 * Wv)
    norm(V + "norm", Wv)

    T, Wt = "blip.text_encoder.", a["text_width"]
    sd[T + "embeddings.word_embeddings.weight"] = rand(a["vocab_size"], Wt)
    sd[T + "embeddings.position_embeddings.weight"] = rand(a["max_positions"], Wt)
    norm(T + "embeddings.LayerNorm", Wt)
    sd[T + "embeddings.position_ids"] = torch.arange(a["max_positions"])[None]   # a buffer med.py saves
    for i in range(a["text_layers"]):
        layer = f"{T}encoder.layer.{i}."
        for attn, kv_width in (("attention", Wt), ("crossattention", Wv)):
            linear(layer + attn + ".self.query", Wt, Wt)
            linear(layer + attn + ".self.key", Wt, kv_width)
            linear(layer + attn + ".self.value", Wt, kv_width)
            linear(layer + attn + ".output.dense", Wt, Wt)
            norm(layer + attn + ".output.LayerNorm", Wt)
        linear(layer + "intermediate.dense", a["text_ffn"], Wt)
        linear(layer + "output.dense", Wt, a["text_ffn"])
        norm(layer + "output.LayerNorm", Wt)
    linear("blip.vision_proj", 256, Wv)                                          # unused by the score
    linear("blip.text_proj", 256, Wt)
    for i, (n_out, n_in) in zip((0, 2, 4, 6, 7), ((1024, Wt), (128, 1024), (64, 128), (16, 64), (1, 16))):
        linear(f"mlp.layers.{i}", n_out, n_in)
    return sd


# ----------------------------------------------------------------------------- the reference forward

def lin(sd, name, x):
    return x @ sd[name + ".weight"].t() + sd[name + ".bias"]


def layer_norm(sd, name, x, eps):
    return F.layer_norm(x, x.shape[-1:], sd[name + ".weight"], sd[name + ".bias"], eps)


def attention(q, k, v, heads, key_bias=None):
    """Multi-head softmax(q k^T / sqrt(d) + key_bias) v. q: (B, Lq, W); k, v: (B, Lk, W); key_bias: (B, Lk)."""
    B, Lq, W = q.shape  # batch, queries, width
    Lk, d = k.shape[1], W // heads
    q = q.view(B, Lq, heads, d).transpose(1, 2)                                  # (B, heads, Lq, d)
    k = k.view(B, Lk, heads, d).transpose(1, 2)                                  # (B, heads, Lk, d)
    v = v.view(B, Lk, heads, d).transpose(1, 2)
    logits = q @ k.transpose(-1, -2) / math.sqrt(d)                              # (B, heads, Lq, Lk)
    if key_bias is not None:
        logits = logits + key_bias[:, None, None, :]
    return (logits.softmax(-1) @ v).transpose(1, 2).reshape(B, Lq, W)


def vit(sd, a, pixels):
    """BLIP's ViT: patches + [CLS] + positions, pre-norm blocks (eps 1e-6), final norm. -> (B, 1 + P, Wv)."""
    V, Wv = "blip.visual_encoder.", a["vision_width"]
    t = F.conv2d(pixels, sd[V + "patch_embed.proj.weight"], sd[V + "patch_embed.proj.bias"], stride=a["patch_size"])
    t = t.flatten(2).transpose(1, 2)                                             # (B, P, Wv)
    t = torch.cat([sd[V + "cls_token"].expand(len(t), -1, -1), t], 1) + sd[V + "pos_embed"]
    for i in range(a["vision_layers"]):
        block = f"{V}blocks.{i}."
        q, k, v = lin(sd, block + "attn.qkv", layer_norm(sd, block + "norm1", t, 1e-6)).split(Wv, dim=-1)
        t = t + lin(sd, block + "attn.proj", attention(q, k, v, a["vision_heads"]))
        t = t + lin(sd, block + "mlp.fc2", F.gelu(lin(sd, block + "mlp.fc1", layer_norm(sd, block + "norm2", t, 1e-6))))
    return layer_norm(sd, V + "norm", t, 1e-6)


def bert(sd, a, ids, mask, image):
    """BLIP's med.py BertModel in multimodal mode (image=None: cross-attention skipped). -> (B, L, Wt)."""
    T = "blip.text_encoder."
    h = sd[T + "embeddings.word_embeddings.weight"][ids]                         # (B, L, Wt)
    h = h + sd[T + "embeddings.position_embeddings.weight"][:ids.shape[1]]
    h = layer_norm(sd, T + "embeddings.LayerNorm", h, 1e-12)
    pad_bias = -10000.0 * (1 - mask.float())                                     # med.py's extended mask

    for i in range(a["text_layers"]):
        layer = f"{T}encoder.layer.{i}."

        def sublayer(name, h, kv, bias):
            out = attention(lin(sd, layer + name + ".self.query", h), lin(sd, layer + name + ".self.key", kv),
                            lin(sd, layer + name + ".self.value", kv), a["text_heads"], bias)
            out = lin(sd, layer + name + ".output.dense", out)
            return layer_norm(sd, layer + name + ".output.LayerNorm", out + h, 1e-12)

        h = sublayer("attention", h, h, pad_bias)
        if image is not None:
            h = sublayer("crossattention", h, image, None)
        ffn = lin(sd, layer + "output.dense", F.gelu(lin(sd, layer + "intermediate.dense", h)))
        h = layer_norm(sd, layer + "output.LayerNorm", ffn + h, 1e-12)
    return h


def hand_tokens(prompts, length=35):
    """Uncased whitespace WordPiece over the tiny vocab: [CLS] words [SEP], truncated, padded. -> ids, mask (B, L)."""
    rows = []
    for prompt in prompts:
        words = [VOCAB.index(w) if w in VOCAB else UNK for w in prompt.lower().split()][:length - 2]
        rows.append([CLS] + words + [SEP] + [PAD] * (length - 2 - len(words)))
    ids = torch.tensor(rows)
    return ids, (ids != PAD).long()


def reference_scores(sd, a, images, prompts, token0=CLS, cross=True):
    """(raw MLP output, standardised score), both (B,), from the released weights `sd`."""
    x = (images.clamp(0, 1) * 255).round() / 255                                 # 8-bit, as a saved image
    H, W, S = images.shape[2], images.shape[3], a["image_size"]
    h, w = (S, int(S * W / H)) if H <= W else (int(S * H / W), S)                # shortest side -> S
    x = F.interpolate(x, size=(h, w), mode="bicubic", align_corners=False, antialias=True).clamp(0, 1)
    top, left = int(round((h - S) / 2)), int(round((w - S) / 2))
    x = x[:, :, top:top + S, left:left + S]                                      # (B, 3, S, S)
    x = (x - torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)) / torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    ids, mask = hand_tokens(prompts)
    ids[:, 0] = token0
    feature = bert(sd, a, ids, mask, vit(sd, a, x) if cross else None)[:, 0]     # (B, Wt)
    for i in (0, 2, 4, 6, 7):                                                    # five affine maps
        feature = lin(sd, f"mlp.layers.{i}", feature)
    raw = feature[:, 0]
    return raw, (raw - MEAN) / STD


def images_batch(seed, b=5, h=40, w=48):
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(b, 3, h // 4, w // 4, generator=g)
    return F.interpolate(low, size=(h, w), mode="bilinear", align_corners=False).clamp(0, 1)


def build(path, tokenizer_dir, **options):
    weights = {"imagereward": str(path), "imagereward_tokenizer": str(tokenizer_dir)}
    return registry.build_reward("imagereward", weights=weights, options={"imagereward": {"arch": TINY, **options}})


def one_line(excinfo):
    return "\n" not in str(excinfo.value)


# ----------------------------------------------------------------------------- tests

def test_score_is_standardised_mlp_of_first_token(tmp_path, tokenizer_dir):
    sd = released_state_dict(TINY, seed=0)
    torch.save(sd, tmp_path / "ImageReward.pt")
    reward = build(tmp_path / "ImageReward.pt", tokenizer_dir, batch_size=2)       # 5 pairs in 3 chunks
    x = images_batch(1)                                                            # (5, 3, 40, 48): cropped
    scores, info = reward(x, PROMPTS, None)
    with torch.no_grad():
        raw, expected = reference_scores(sd, TINY, x, PROMPTS)
        _, with_enc = reference_scores(sd, TINY, x, PROMPTS, token0=ENC)
        _, no_cross = reference_scores(sd, TINY, x, PROMPTS, cross=False)
    assert torch.allclose(scores, expected, atol=1e-4), (scores, expected)
    assert info["means"]["imagereward"] == pytest.approx(expected.mean().item(), abs=1e-4)
    # each of these mistakes would move the scores far beyond the tolerance above
    for wrong in (raw, raw - MEAN, raw / STD, with_enc, no_cross):
        assert (wrong - expected).abs().max() > 1e-2
    assert (expected[0] - expected[3]).abs() > 1e-3                               # same prompt, other image
    single, _ = reward(x[4:], PROMPTS[4:], None)                                   # batching changes nothing
    assert torch.allclose(single, scores[4:], atol=1e-5)


def test_tokenizer_is_bert_uncased_with_blip_tokens(tmp_path, tokenizer_dir):
    torch.save(released_state_dict(TINY, seed=1), tmp_path / "ImageReward.pt")
    reward = build(tmp_path / "ImageReward.pt", tokenizer_dir)
    scorer = reward.components[0][2]
    tokenizer = scorer.tokenizer
    assert tokenizer.convert_tokens_to_ids(["[DEC]", "[ENC]"]) == [DEC, ENC] and len(tokenizer) == TINY["vocab_size"]
    tokens = tokenizer(PROMPTS, padding="max_length", truncation=True, max_length=scorer.arch.max_length,
                       return_tensors="pt")
    ids, mask = hand_tokens(PROMPTS)
    assert torch.equal(tokens["input_ids"], ids) and torch.equal(tokens["attention_mask"], mask)
    assert ids.shape == (5, 35) and (ids[:, 0] == CLS).all() and ids[4, -1] == SEP and ids[2, 2] == UNK


def test_default_arch_has_the_released_v1_shapes():
    """The defaults build exactly the released v1.0 layout (ViT-L/16 at 224, BERT-base, vocab 30524)."""
    v1 = dict(image_size=224, patch_size=16, vision_width=1024, vision_layers=24, vision_heads=16, text_width=768,
              text_layers=12, text_heads=12, text_ffn=3072, vocab_size=30524, max_positions=512)
    with torch.device("meta"):                                                     # shapes only: no memory
        model = imagereward.ImageRewardModel()
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    released = imagereward.convert_imagereward_checkpoint(released_state_dict(v1))
    assert ours == {k: tuple(v.shape) for k, v in released.items()}
    assert ours["visual_encoder.embeddings.position_embedding"] == (1, 197, 1024)
    assert ours["text_encoder.encoder.layer.11.crossattention.self.key.weight"] == (768, 1024)
    assert sum(math.prod(shape) for shape in ours.values()) == pytest.approx(446.2e6, rel=1e-3)
    # LayerNorm eps: BLIP's ViT 1e-6 (transformers' default would be 1e-5), med_config.json 1e-12
    eps = lambda module: {m.eps for m in module.modules() if isinstance(m, torch.nn.LayerNorm)}
    assert eps(model.visual_encoder) == {1e-6} and eps(model.text_encoder) == {1e-12}


def test_missing_files_name_the_flag(tmp_path, tokenizer_dir):
    with pytest.raises(FileNotFoundError) as e:
        registry.build_reward("imagereward", weights={"imagereward_tokenizer": str(tokenizer_dir)})
    assert one_line(e) and "--reward-ckpt imagereward=PATH is required" in str(e.value)
    assert "ImageReward.pt" in str(e.value) and "THUDM/ImageReward" in str(e.value)
    missing = tmp_path / "ImageReward.pt"
    with pytest.raises(FileNotFoundError) as e:
        build(missing, tokenizer_dir)
    assert one_line(e) and f"--reward-ckpt imagereward={missing}: no such file" in str(e.value)
    torch.save({}, missing)
    with pytest.raises(FileNotFoundError) as e:
        build(missing, tmp_path / "bert-base-uncased")
    assert one_line(e) and "imagereward_tokenizer=" in str(e.value) and "no such folder" in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError) as e:
        build(missing, tmp_path / "empty")
    assert one_line(e) and f"imagereward_tokenizer={tmp_path / 'empty'}: no vocab.txt" in str(e.value)
    got = registry.parse_reward_ckpt(["imagereward=/w/ImageReward.pt,imagereward_tokenizer=/w/bert"], "imagereward")
    assert got == {"imagereward": "/w/ImageReward.pt", "imagereward_tokenizer": "/w/bert"}


def test_mismatched_checkpoint_and_tokenizer_name_the_file(tmp_path, tokenizer_dir):
    wide = released_state_dict(dict(TINY, text_width=32), seed=2)                  # another BERT width
    torch.save(wide, tmp_path / "wide.pt")
    with pytest.raises(ValueError) as e:
        build(tmp_path / "wide.pt", tokenizer_dir)
    msg = str(e.value)
    assert one_line(e) and "wide.pt" in msg and "shape" in msg and "word_embeddings" in msg

    sd = released_state_dict(TINY, seed=3)
    sd.pop("blip.visual_encoder.blocks.1.mlp.fc2.weight")
    sd["blip.itm_head.weight"] = torch.zeros(2, 24)
    torch.save(sd, tmp_path / "partial.pt")
    with pytest.raises(ValueError) as e:
        build(tmp_path / "partial.pt", tokenizer_dir)
    msg = str(e.value)
    assert one_line(e) and "partial.pt" in msg
    assert "encoder.layers.1.mlp.fc2.weight" in msg and "blip.itm_head.weight" in msg

    torch.save(released_state_dict(TINY, seed=4), tmp_path / "ImageReward.pt")
    small_vocab = tmp_path / "short_vocab"
    small_vocab.mkdir()
    (small_vocab / "vocab.txt").write_text("\n".join(VOCAB[:-1]) + "\n")
    with pytest.raises(ValueError) as e:
        build(tmp_path / "ImageReward.pt", small_vocab)
    assert one_line(e) and str(small_vocab) in str(e.value) and f"{TINY['vocab_size']}" in str(e.value)
    with pytest.raises(ValueError, match="unknown fields"):
        registry.build_reward("imagereward", weights={"imagereward": str(tmp_path / "ImageReward.pt"),
                                                     "imagereward_tokenizer": str(tokenizer_dir)},
                             options={"imagereward": {"arch": dict(TINY, depth=3)}})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu(tmp_path, tokenizer_dir):
    torch.save(released_state_dict(TINY, seed=5), tmp_path / "ImageReward.pt")
    x = images_batch(6)
    cpu, _ = build(tmp_path / "ImageReward.pt", tokenizer_dir)(x, PROMPTS, None)
    gpu_reward = registry.build_reward("imagereward", device="cuda", weights={
        "imagereward": str(tmp_path / "ImageReward.pt"), "imagereward_tokenizer": str(tokenizer_dir)},
        options={"imagereward": {"arch": TINY}})
    gpu, _ = gpu_reward(x.cuda(), PROMPTS, None)
    assert gpu.device.type == "cpu" and torch.allclose(gpu, cpu, atol=1e-3)
