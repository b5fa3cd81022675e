"""mar.py against the official MAR: the state-dict keys of the released models, the sampling loop,
the schedule, prompt conditioning, and loading official and own checkpoints."""

import argparse
import json
import math

import pytest
import torch

import mar
from infra import checkpoints
from models import loading
from tests.helpers import FIXTURES, tiny_mar
from tests.test_diffloss import official_p_sample_loop

torch.set_num_threads(1)

# the official models' state-dict listings and tiny official Harmon / NOVA runs (fixtures/README_adapters.md), the
# released GroundingDINO scorer's outputs and ten prompt records in the released format (docs/composition.md)
FIXTURE_SHA256 = {
    "README_adapters.md": "7b631887820239b23449071f66384a53ea37221a993c183c212d62a6e6842148",
    "composition_prompts.jsonl": "58661420a7ab585872289ccf15599976db4a61387b14cd3a1af1bdeb6a52cc0b",
    "gdino_released_scores.json": "014b5fc81e7d93b2bc2ba3d88496a8ace81418d28c7a32c6e9a96e470d2ac10e",
    "harmon_state_dict.json": "b50d180508b73a351f54216ecfabe670fac970f59fadba6f693fb1e5d78f2970",
    "harmon_tiny_official.pt": "c8cb7a3c6a77ac3117471376dd5ebc21485fa99d82b468eb7b51ac403790a546",
    "kl16_vae_state_dict.json": "6d4b7dcf56bddf2a27aef7f6189307a8bf74dbe8f487defe6a43c1de11a2fb8b",
    "mar_official_state_dict.json": "061600d1b671bb8a0a693558b42d4f92643a7f32914c39ff1784bbbac6a1a420",
    "nova_state_dict.json": "962f90177fd61c63b8b272ed9c1a91dfc3a6e2f505727d7e40cb02cd2a7b386b",
    "nova_tiny_official.pt": "6406b85b0d3441abd98b771f76a6db93a6e81fdd331c5a62816d6922439624d7",
}


def test_fixtures_are_the_recorded_files():
    """The fixtures are recorded data (made by the official and released code; the prompt records by hand):
    never edited (their sha256 pinned in this test)."""
    assert sorted(p.name for p in FIXTURES.iterdir()) == sorted(FIXTURE_SHA256)
    for name, digest in FIXTURE_SHA256.items():
        assert checkpoints.sha256(FIXTURES / name) == digest, name


@pytest.mark.parametrize("name", ["mar_base", "mar_large", "mar_huge"])
def test_mar_state_dict_matches_official_fixture(name):
    fixture = json.loads((FIXTURES / "mar_official_state_dict.json").read_text())[name]
    args = {k: v for k, v in fixture["constructor"].items()}
    with torch.device("meta"):
        model = getattr(mar, name)(**args)
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert shapes == fixture["state_dict"]
    assert sum(p.numel() for p in model.parameters()) == fixture["params"]
    assert mar.OFFICIAL_HEADS[name] == {k: args[k] for k in ("diffloss_d", "diffloss_w")}
    # the config inferred from the shapes of an official state dict rebuilds the same model
    sd = {k: torch.empty(v, device="meta") for k, v in fixture["state_dict"].items()}
    cfg = loading.mar_config_from_state_dict(sd)
    with torch.device("meta"):
        rebuilt = mar.build_mar(cfg)
    assert {k: list(v.shape) for k, v in rebuilt.state_dict().items()} == fixture["state_dict"]
    assert (cfg["encoder_num_heads"], cfg["img_size"]) == (model.encoder_blocks[0].attn.num_heads, 256)


def official_sample_tokens(model, bsz, num_iter, cfg, cfg_schedule, labels, temperature, orders, generator):
    """The official `MAR.sample_tokens` loop, transcribed independently (torch instead of numpy,
    no .cuda(), given orders), with the head sampled by `official_p_sample_loop`."""
    L = model.seq_len
    mask = torch.ones(bsz, L)
    tokens = torch.zeros(bsz, L, model.token_embed_dim)
    for step in range(num_iter):
        cur_tokens = tokens.clone()
        class_embedding = model.class_emb(labels) if labels is not None else model.fake_latent.repeat(bsz, 1)
        if cfg != 1.0:
            tokens = torch.cat([tokens, tokens], dim=0)
            class_embedding = torch.cat([class_embedding, model.fake_latent.repeat(bsz, 1)], dim=0)
            mask = torch.cat([mask, mask], dim=0)
        x = model.forward_mae_encoder(tokens, mask, class_embedding)
        z = model.forward_mae_decoder(x, mask)
        mask_ratio = math.cos(math.pi / 2.0 * (step + 1) / num_iter)
        mask_len = torch.tensor([float(math.floor(L * mask_ratio))])
        mask_len = torch.maximum(torch.tensor([1.0]), torch.minimum(torch.sum(mask, dim=-1, keepdim=True) - 1, mask_len))
        mask_next = torch.zeros(bsz, L).scatter(-1, orders[:, :int(mask_len[0].item())], 1.0).bool()
        mask_to_pred = mask[:bsz].bool() if step >= num_iter - 1 else torch.logical_xor(mask[:bsz].bool(), mask_next)
        mask = mask_next.float()
        if cfg != 1.0:
            mask_to_pred = torch.cat([mask_to_pred, mask_to_pred], dim=0)
        z = z[mask_to_pred.nonzero(as_tuple=True)]
        cfg_iter = 1 + (cfg - 1) * (L - mask_len[0].item()) / L if cfg_schedule == "linear" else cfg
        sampled = official_p_sample_loop(model.diffloss, z, model.diffloss.num_sampling_steps, temperature,
                                         cfg_iter, generator)
        if cfg != 1.0:
            mask_to_pred, _ = mask_to_pred.chunk(2, dim=0)
        cur_tokens[mask_to_pred.nonzero(as_tuple=True)] = sampled
        tokens = cur_tokens.clone()
    return model.unpatchify(tokens)


@pytest.mark.parametrize("cfg,schedule", [(1.0, "linear"), (3.0, "linear"), (2.0, "constant")])
def test_sample_tokens_matches_official_loop(cfg, schedule):
    model = tiny_mar()
    labels = torch.tensor([0, 3, 4])
    orders = model.sample_orders(3, torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = model.sample_tokens(3, num_iter=5, cfg=cfg, cfg_schedule=schedule, labels=labels, temperature=0.9,
                                   orders=orders, generator=torch.Generator().manual_seed(11))
        ref = official_sample_tokens(model, 3, 5, cfg, schedule, labels, 0.9, orders, torch.Generator().manual_seed(11))
    # float32 rounding of ε̂ is amplified ~3e3× by the pure-noise step (see diffloss.trainable_steps),
    # and this random head's tokens are large (~1e4), so compare relatively: a logic error moves
    # every element by O(1) relative
    rel = (ours - ref).abs() / ref.abs().clamp(min=1.0)
    assert rel.max() < 1e-3 and rel.median() < 1e-5, (rel.max(), rel.median())


def test_sample_tokens_deterministic_each_token_once_cosine_schedule(monkeypatch):
    model = tiny_mar()
    g = lambda: torch.Generator().manual_seed(3)
    a = model.sample_tokens(2, num_iter=6, cfg=2.0, prompt_ids=torch.tensor([[1, 2], [3, 0]]), generator=g())
    b = model.sample_tokens(2, num_iter=6, cfg=2.0, prompt_ids=torch.tensor([[1, 2], [3, 0]]), generator=g())
    assert torch.equal(a, b) and a.shape == (2, 3, 16, 16)

    # replace the head by a stamp of the step number, and watch what reaches it
    calls = []

    def stamp(z, temperature, cfg, generator=None, record_steps=None):
        calls.append(z.shape[0])
        return torch.full((z.shape[0] // 2, model.token_embed_dim), float(len(calls)))
    monkeypatch.setattr(model.diffloss, "sample", stamp)
    orders = model.sample_orders(2, g())
    tokens = model.patchify(model.sample_tokens(2, num_iter=6, cfg=2.0, labels=torch.tensor([1, 2]), orders=orders))
    written_at = tokens[..., 0]  # (B, L): the step (1-based) that wrote each position
    # the cosine schedule, computed independently: unknown counts after each step
    L, unknown, expected = 16, [16], []
    for i in range(6):
        n = 0 if i == 5 else max(1, min(unknown[-1] - 1, math.floor(L * math.cos(math.pi / 2 * (i + 1) / 6))))
        expected.append(unknown[-1] - n)
        unknown.append(n)
    assert sum(expected) == L and all(e >= 1 for e in expected)
    for b in range(2):  # position orders[b, j] is written at the step where j falls
        steps = torch.tensor([next(i for i in range(6) if j >= unknown[i + 1]) + 1 for j in range(L)], dtype=torch.float)
        assert torch.equal(written_at[b, orders[b]], steps)  # every token once, at its scheduled step
    # CFG doubles only inside: the head saw 2 × (tokens written) rows each step
    assert calls == [2 * 2 * e for e in expected]


def test_prompt_conditioning_leaves_class_path_and_null_condition():
    model = tiny_mar()
    tokens, mask = torch.randn(2, 16, 48), torch.ones(2, 16)
    ids = torch.tensor([[1, 2, 0], [4, 0, 0]])
    cond = model.condition(prompt_ids=ids)
    assert cond.shape == (2, 3, 32)
    assert torch.equal(cond[0, 2], model.fake_latent[0]) and torch.equal(cond[0, 0], model.text_emb.weight[1])
    # the null condition of a prompt is the same buffer as the class path's null condition
    z_null_prompt = model.predict_z(tokens, mask, model.null_condition_like(cond))
    z_null_class = model.predict_z(tokens, mask, model.condition(bsz=2))
    torch.testing.assert_close(z_null_prompt, z_null_class)
    # word order matters (each slot has its own position embedding)
    z_ab = model.predict_z(tokens, mask, model.condition(prompt_ids=torch.tensor([[1, 2, 0]] * 2)))
    z_ba = model.predict_z(tokens, mask, model.condition(prompt_ids=torch.tensor([[2, 1, 0]] * 2)))
    assert not torch.allclose(z_ab, z_ba)


def test_load_checkpoint_official_format_and_errors(tmp_path):
    model = tiny_mar()
    ema = {k: v + 1.0 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    args = argparse.Namespace(model="tiny", img_size=16, vae_stride=1, patch_size=4, vae_embed_dim=3,
                              num_sampling_steps="10", diffloss_d=2, diffloss_w=32)
    path = tmp_path / "checkpoint-last.pth"
    torch.save({"model": model.state_dict(), "model_ema": ema, "args": args, "epoch": 3}, path)
    loaded = loading.load_checkpoint(str(path))  # config inferred from shapes + pickled args
    assert not loaded.training
    torch.testing.assert_close(loaded.fake_latent, ema["fake_latent"])
    loaded = loading.load_checkpoint(str(path), ema=False, model=tiny_mar())
    torch.testing.assert_close(loaded.fake_latent, model.fake_latent)

    with pytest.raises(ValueError, match=r"does not fit.*wrong shape.*fake_latent \(1, 32\) vs \(1, 64\)"):
        loading.load_checkpoint(str(path), model=tiny_mar(encoder_embed_dim=64, decoder_embed_dim=64))
    with pytest.raises(ValueError, match=r"does not fit.*missing encoder_blocks.2"):
        loading.load_checkpoint(str(path), model=tiny_mar(encoder_depth=3))
    with pytest.raises(FileNotFoundError, match="--init"):
        loading.load_checkpoint(str(tmp_path / "nope.pth"))
    broken = tmp_path / "broken.pth"
    broken.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"--init .*broken.pth: cannot read checkpoint") as e:
        loading.load_checkpoint(str(broken))
    assert "\n" not in str(e.value)
    other = tmp_path / "other.pth"
    torch.save({"state_dict": {"w": torch.zeros(1)}}, other)
    with pytest.raises(ValueError, match="not a MAR checkpoint"):
        loading.load_checkpoint(str(other))

