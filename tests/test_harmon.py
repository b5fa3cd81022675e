"""Tests of the Harmon adapter (models/harmon.py): parity with the official code's numbers
(fixtures/harmon_tiny_official.pt, fixtures/README_adapters.md), the released models' state-dict
layout, and the policy interface's log-probability parity on tiny random models. CPU, seconds."""

import json
from pathlib import Path

import pytest
import torch

import diffloss
from models import harmon
from models import vae
from diffloss import transition_logprob

torch.set_num_threads(1)

FIXTURES = Path(__file__).resolve().parent / "fixtures"  # the official code run on tiny models (README_adapters.md)


def rel_err(a, b):
    """The fixture README's measure: max|a − b| / max(1, max|b|)."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()


@pytest.fixture(scope="module")
def official():
    """The fixture and a Harmon built from its config with its weights, in eval mode, its null
    prompt stored from the fixture's (unpadded) null ids."""
    fx = torch.load(FIXTURES / "harmon_tiny_official.pt", weights_only=True)
    model = harmon.build(fx["config"])
    model.load_state_dict(fx["state_dict"])
    model.eval()
    null_ids = fx["null_input_ids"][0][fx["null_attention_mask"][0]]
    model.set_null_prompt(null_ids, pad_token_id=int(fx["null_input_ids"][0, -1]))
    return fx, model


def tiny_config(**mar_overrides):
    """A tiny Harmon unlike the fixture's: other widths, heads, buffer, a 3×3 native grid, T = 8."""
    llm = dict(vocab_size=50, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6,
               tie_word_embeddings=True, hidden_act="silu")
    mar = dict(img_size=48, vae_stride=16, patch_size=1, vae_embed_dim=16, encoder_embed_dim=24, encoder_depth=1,
               encoder_num_heads=2, decoder_embed_dim=40, decoder_depth=2, decoder_num_heads=4, mlp_ratio=2.0,
               class_num=3, buffer_size=3, diffloss_d=2, diffloss_w=32, num_sampling_steps="8", layernorm_eps=1e-5)
    mar.update(mar_overrides)
    return dict(llm=llm, mar=mar, vae_scale=0.2325)


def tiny_harmon(seed, **mar_overrides):
    torch.manual_seed(seed)
    model = harmon.build(tiny_config(**mar_overrides))
    with torch.no_grad():  # give the head's zero-initialised layers weight, so it is a real function of z
        for name, p in model.diffloss.named_parameters():
            if "adaLN_modulation" in name or "final_layer.linear" in name:
                p.normal_(0, 0.05)
    model.set_null_prompt(torch.tensor([7, 8, 9]), pad_token_id=0)
    return model.eval()


def canvas(model, bsz, known, generator, image_shape=None):
    """Random O(1) tokens, and a mask (1 = unknown) with `known` known positions per row."""
    h, w = image_shape or model.image_shape
    tokens = torch.randn(bsz, h * w, model.token_embed_dim, generator=generator)
    orders = torch.argsort(torch.rand(bsz, h * w, generator=generator), dim=1)
    mask = torch.ones(bsz, h * w).scatter(1, orders[:, :known], 0.0)
    return tokens, mask


# -----------------------------------------------------------------------------
# parity with the official code (fixture)

def test_strict_load_and_condition_match_official(official):
    fx, model = official
    own = model.state_dict()
    assert set(own) == set(fx["state_dict"])  # official names, nothing extra or missing (vae.* excluded)
    assert all(torch.equal(own[k], v) for k, v in fx["state_dict"].items())
    assert own["llm.lm_head.weight"].data_ptr() == own["llm.model.embed_tokens.weight"].data_ptr()  # tied
    assert model.vae_scale == fx["config"]["vae_scale"] == vae.VAE_SCALE  # the codec applies this scale
    cond = model.condition(input_ids=fx["input_ids"], attention_mask=fx["attention_mask"])
    assert torch.equal(cond["input_ids"], fx["input_ids"]) and torch.equal(cond["attention_mask"], fx["attention_mask"])
    null = model.null_condition_like(cond)  # the official null rows: same ids, right padding
    assert torch.equal(null["attention_mask"], fx["null_attention_mask"])
    assert torch.equal(null["input_ids"], fx["null_input_ids"])


def test_z_matches_official_every_ar_step(official):
    """z of every AR step of the official rollout (8×8 grid, off-native: resized position tables),
    cond and null rows each alone, and both stacked as the recorder does; the encoder output
    before and after the LLM residual; the probe canvases (O(1) tokens)."""
    fx, model = official
    cond = model.condition(input_ids=fx["input_ids"], attention_mask=fx["attention_mask"])
    null = model.null_condition_like(cond)
    both = {k: torch.cat([cond[k], null[k]]) for k in cond}
    model.set_image_shape(fx["sample"]["image_shape"])
    assert model.seq_len == fx["orders"].shape[1]
    with torch.no_grad():
        for i in range(fx["sample"]["num_iter"]):
            mask = fx["unknown"][i].float()  # (B, L) U_i
            for tokens, ref_z, ref_null in ((fx["tokens"][i], fx["z"][i], fx["z_null"][i]),
                                            (fx["probe"]["tokens"][i], fx["probe"]["z"][i], fx["probe"]["z_null"][i])):
                assert rel_err(model.predict_z(tokens, mask, cond), ref_z) < 1e-4
                assert rel_err(model.predict_z(tokens, mask, null), ref_null) < 1e-4
                z2 = model.predict_z(torch.cat([tokens, tokens]), torch.cat([mask, mask]), both)
                assert rel_err(z2, torch.cat([ref_z, ref_null])) < 1e-4
            x_enc_mar = model.mar_encoder(torch.cat([fx["tokens"][i]] * 2), torch.cat([mask, mask]))
            assert rel_err(x_enc_mar, fx["x_enc_mar"][i]) < 1e-4
            assert rel_err(model.llm_residual(x_enc_mar, both), fx["x_enc"][i]) < 1e-4
    # the rollout's tokens really are ~1e4 (so the probe is what catches scale errors)
    assert fx["tokens"][-1].abs().max() > 100


def test_z_matches_official_native_grid(official):
    fx, model = official
    nat = fx["native"]
    assert list(nat["image_shape"]) == [model.mar.seq_h, model.mar.seq_w]
    cond = model.condition(input_ids=fx["input_ids"], attention_mask=fx["attention_mask"])
    with torch.no_grad():
        for c, ref in ((cond, nat["z"]), (model.null_condition_like(cond), nat["z_null"])):
            z = model.predict_z(nat["tokens"], nat["unknown"].float(), c, image_shape=nat["image_shape"])
            assert rel_err(z, ref) < 1e-4


def test_head_matches_official_p_mean_variance(official):
    fx, model = official
    head = fx["head"]
    # the head's z are the rollout's z at the tokens written at AR step 1
    i = head["ar_step"]
    assert torch.equal(head["z"], fx["z"][i][head["rows"], head["positions"]])
    assert torch.equal(head["z_null"], fx["z_null"][i][head["rows"], head["positions"]])
    assert fx["pred"][i][head["rows"], head["positions"]].all()
    dl = model.diffloss
    assert dl.num_sampling_steps == len(head["t"])
    assert dl.gen_schedule.timesteps.tolist() == list(head["timestep_map"])
    z_both = torch.cat([head["z"], head["z_null"]])
    with torch.no_grad():
        for k in head["t"]:
            x_t = head["x_t"][k]
            t_orig = dl.gen_schedule.timesteps[k].expand(len(x_t))
            assert rel_err(dl.net(x_t, t_orig, head["z"]), head["net_out"][k]) < 1e-4
            plain = dl.p_mean_variance(x_t, k, head["z"])
            guided = dl.p_mean_variance(x_t, k, z_both, cfg=head["cfg"])  # z rows [cond; null]
            for out, names in ((plain, ("mean", "log_variance", "pred_x0")),
                               (guided, ("mean_cfg", "log_variance_cfg", "pred_x0_cfg"))):
                for ours, name in zip(out, names):
                    assert rel_err(ours, head[name][k]) < 1e-4, (k, name)
    # guidance moves the mean by more than the tolerance (so the guided check is not the unguided one twice)
    assert max(rel_err(head["mean_cfg"][k], head["mean"][k]) for k in head["t"]) > 5e-4


def test_ar_schedule_matches_official_masks(official):
    fx, model = official
    L, N = fx["orders"].shape[1], fx["sample"]["num_iter"]
    counts = model.ar_schedule(N, L)
    assert counts == list(fx["num_pred"]) and sum(counts) == L
    assert [L - sum(counts[:i]) for i in range(N)] == list(fx["num_unknown"])
    for i in range(N):  # U_i is the last |U_i| positions of each order; P_i = U_i \ U_{i+1}
        unknown = torch.zeros(fx["orders"].shape, dtype=torch.bool).scatter(1, fx["orders"][:, :fx["num_unknown"][i]], True)
        assert torch.equal(unknown, fx["unknown"][i])
        nxt = fx["unknown"][i + 1] if i + 1 < N else torch.zeros_like(unknown)
        assert torch.equal(fx["pred"][i], unknown & ~nxt) and (fx["pred"][i].sum(1) == counts[i]).all()
    # more steps than tokens: steps that would write nothing are left out
    assert model.ar_schedule(8, 4) == [1, 1, 1, 1]


def test_real_configs_match_released_state_dicts():
    ref = json.loads((FIXTURES / "harmon_state_dict.json").read_text())
    assert set(harmon.CONFIGS) == set(ref)
    for name, cfg in harmon.CONFIGS.items():
        with torch.device("meta"):
            model = harmon.build(cfg)
        shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
        assert shapes == ref[name]["state_dict"], name
        assert sum(p.numel() for p in model.parameters()) == ref[name]["params"]  # tied weights counted once
        assert model.llm.lm_head.weight is model.llm.model.embed_tokens.weight
        assert model.seq_len == 32 * 32 and model.vae_scale == vae.VAE_SCALE  # sampled at 512 px


# -----------------------------------------------------------------------------
# tiny models at another size and seed

def test_other_size_shapes_determinism_padding_and_gradients():
    model = tiny_harmon(seed=1)
    again = tiny_harmon(seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 50, (2, 6), generator=g)
    am = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    cond = model.condition(input_ids=ids, attention_mask=am)
    for shape in [(3, 3), (5, 4)]:  # native and off-native (non-square) grids
        tokens, mask = canvas(model, 2, 4, g, shape)
        with torch.no_grad():
            z = model.predict_z(tokens, mask, cond, image_shape=shape)
            assert z.shape == (2, shape[0] * shape[1], 40) and torch.isfinite(z).all()
            assert torch.equal(z, model.predict_z(tokens, mask, cond, image_shape=shape))  # deterministic
            assert torch.equal(z, again.predict_z(tokens, mask, cond, image_shape=shape))
            # values at unknown positions are ignored; the prompt matters
            noisy = torch.where(mask.bool()[..., None], torch.randn(tokens.shape, generator=g), tokens)
            assert rel_err(model.predict_z(noisy, mask, cond, image_shape=shape), z) < 1e-6
            other = model.condition(input_ids=(ids + 1) % 50, attention_mask=am)
            assert rel_err(model.predict_z(tokens, mask, other, image_shape=shape), z) > 1e-3
    # padding: extra right padding and left padding leave z unchanged (masked, position ids from the mask)
    model.set_image_shape((4, 4))
    assert model.seq_len == 16 and model.sample_orders(2, g).shape == (2, 16)
    tokens, mask = canvas(model, 2, 5, g)
    with torch.no_grad():
        z = model.predict_z(tokens, mask, cond)
        right = model.condition(input_ids=torch.cat([ids, torch.zeros(2, 3, dtype=torch.long)], 1),
                                attention_mask=torch.cat([am, torch.zeros(2, 3, dtype=torch.bool)], 1))
        assert rel_err(model.predict_z(tokens, mask, right), z) < 1e-5
        left = model.condition(input_ids=torch.stack([ids[0], torch.cat([ids[1, 4:], ids[1, :4]])]),
                               attention_mask=torch.stack([am[0], torch.cat([am[1, 4:], am[1, :4]])]))
        assert rel_err(model.predict_z(tokens, mask, left), z) < 1e-5
    # the null condition matches cond's layout, and is what an all-null prompt gives
    null = model.null_condition_like(cond)
    assert null["input_ids"].shape == cond["input_ids"].shape and null["attention_mask"].sum(1).tolist() == [3, 3]
    short = model.condition(input_ids=ids[:, :2])  # shorter than the null prompt: padded to its length
    assert short["input_ids"].shape == (2, 3) and short["attention_mask"].sum(1).tolist() == [2, 2]
    # differentiable in the MAR, the projectors and the LLM
    z = model.predict_z(tokens, mask, cond)
    z.square().sum().backward()
    for p in (model.mar.encoder_blocks[0].attn.qkv.weight, model.mar.fake_latent, model.proj_in[0].weight,
              model.proj_out[2].weight, model.llm.model.layers[0].mlp.up_proj.weight, model.mar.mask_token):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_patchify_roundtrip_layout():
    model = tiny_harmon(seed=0)
    model.set_image_shape((2, 3))
    lat = torch.arange(2 * 16 * 2 * 3, dtype=torch.float).reshape(2, 16, 2, 3)  # (B, C, h, w)
    tokens = model.patchify(lat)
    assert tokens.shape == (2, 6, 16) and torch.equal(tokens[1, 4], lat[1, :, 1, 1])  # row-major, C channels
    assert torch.equal(model.unpatchify(tokens), lat)


def test_recorded_logp_is_recomputed_from_a_fresh_predict_z():
    """Sample with guidance and recorded steps from predict_z's z on [cond; null], then recompute
    μ on the recorded x_t from a fresh predict_z (other batch layout: cond and null rows apart)."""
    model = tiny_harmon(seed=3)
    g = torch.Generator().manual_seed(4)
    model.set_image_shape((4, 4))
    ids = torch.randint(1, 50, (2, 5), generator=g)
    cond = model.condition(input_ids=ids, attention_mask=torch.tensor([[1] * 5, [1, 1, 1, 0, 0]]))
    null = model.null_condition_like(cond)
    both = {k: torch.cat([cond[k], null[k]]) for k in cond}
    tokens, mask = canvas(model, 2, 6, g)
    cfg, temperature = 3.0, 0.9
    with torch.no_grad():
        z = model.predict_z(torch.cat([tokens, tokens]), torch.cat([mask, mask]), both)  # (2B, L, D)
    idx = mask.bool().nonzero(as_tuple=True)  # U_i
    z_head = torch.cat([z[:2][idx], z[2:][idx]])  # (2N, D) [cond; null]
    steps = torch.tensor(list(diffloss.trainable_steps(model.diffloss.num_sampling_steps)))
    _, traj = model.diffloss.sample(z_head, temperature, cfg, generator=g, record_steps=steps)
    K, N, C = traj["x_t"].shape

    z_c, z_n = model.predict_z(tokens, mask, cond), model.predict_z(tokens, mask, null)  # fresh, with gradients
    z_rows = torch.cat([z_c[idx].repeat(K, 1), z_n[idx].repeat(K, 1)])  # (2·K·N, D)
    mean, _, _ = model.diffloss.p_mean_variance(traj["x_t"].reshape(K * N, C), torch.tensor(traj["steps"]).repeat_interleave(N),
                                                z_rows, cfg)
    logp = transition_logprob(traj["x_prev"].reshape(K * N, C), mean, traj["std"].reshape(K * N, C))
    err = (logp - traj["logp"].reshape(K * N, C)).abs() / traj["logp"].reshape(K * N, C).abs().clamp(min=1.0)
    assert err.max() < 1e-5, err.max()
    # without guidance the recomputation would not match (so the check above sees the guidance)
    mean_u, _, _ = model.diffloss.p_mean_variance(traj["x_t"].reshape(K * N, C), torch.tensor(traj["steps"]).repeat_interleave(N),
                                                  z_c[idx].repeat(K, 1))
    assert (transition_logprob(traj["x_prev"].reshape(K * N, C), mean_u, traj["std"].reshape(K * N, C))
            - traj["logp"].reshape(K * N, C)).abs().max() > 1e-2
    logp.sum().backward()  # the log-probability reaches the MAR encoder through the LLM residual
    assert model.mar.encoder_blocks[0].mlp.fc1.weight.grad.abs().sum() > 0
    assert model.proj_in[0].weight.grad.abs().sum() > 0


# -----------------------------------------------------------------------------
# checkpoints and tokenization

def test_load_harmon_checkpoints_and_one_line_errors(tmp_path):
    model = tiny_harmon(seed=5)
    cfg = tiny_config()
    sd = model.state_dict()

    # the released layout: a plain dict; vae.* is ignored, the tied lm_head may be absent
    plain = {k: v for k, v in sd.items() if k != "llm.lm_head.weight"}
    plain["vae.encoder.conv_in.weight"] = torch.zeros(3)
    torch.save(plain, tmp_path / "harmon_tiny.pth")
    loaded = harmon.load_harmon(str(tmp_path / "harmon_tiny.pth"), cfg)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in sd.items()) and not loaded.training
    # wrapped with DDP prefixes, and safetensors
    torch.save({"state_dict": {"module." + k: v for k, v in plain.items()}}, tmp_path / "wrapped.pth")
    assert torch.equal(harmon.load_harmon(str(tmp_path / "wrapped.pth"), cfg).proj_out[2].bias, sd["proj_out.2.bias"])
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in plain.items()}, str(tmp_path / "model.safetensors"))
    assert torch.equal(harmon.load_harmon(str(tmp_path / "model.safetensors"), cfg).mar.fake_latent, sd["mar.fake_latent"])

    bad_missing = {k: v for k, v in plain.items() if k != "mar.z_proj.bias"}
    bad_shape = dict(plain, **{"proj_out.2.bias": torch.zeros(5)})
    bad_extra = dict(plain, **{"mar.text_emb.weight": torch.zeros(2, 24)})
    for name, bad, needle in (("missing.pth", bad_missing, "mar.z_proj.bias"), ("shape.pth", bad_shape, "proj_out.2.bias"),
                              ("extra.pth", bad_extra, "mar.text_emb.weight")):
        path = tmp_path / name
        torch.save(bad, path)
        with pytest.raises(ValueError) as info:
            harmon.load_harmon(str(path), cfg)
        msg = str(info.value)
        assert str(path) in msg and needle in msg and "\n" not in msg, msg
    with pytest.raises(FileNotFoundError, match="nothing_here.pth"):
        harmon.load_harmon(str(tmp_path / "nothing_here.pth"), cfg)
    with pytest.raises(ValueError, match="unknown Harmon config"):
        harmon.load_harmon(str(tmp_path / "harmon_tiny.pth"), "harmon_7b")


def test_tokenizer_helpers_template_padding_and_null_prompt(tmp_path):
    """A word-level tokenizer folder (tokenizers' own format; transformers is only imported by
    models/harmon.py) stands in for Qwen2.5's: the template, the right padding and the null prompt."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "Generate", "an", "image", ":", ".",
             "a", "red", "cube"]
    vocab = {w: i for i, w in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"])
    (tmp_path / "tok").mkdir()
    backend.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", pad_token="<pad>", unk_token="<unk>", eos_token="<|im_end|>")))
    tok = harmon.load_tokenizer(str(tmp_path / "tok"))
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        harmon.load_tokenizer(str(tmp_path / "no_such_dir"))

    ids = harmon.prompt_ids(tok, ["a red cube", "cube"])
    head, tail = ["<|im_start|>", "user", "Generate", "an", "image", ":"], ["<|im_end|>", "<|im_start|>", "assistant"]
    long, short = [vocab[w] for w in head + ["a", "red", "cube"] + tail], [vocab[w] for w in head + ["cube"] + tail]
    assert ids["input_ids"].tolist() == [long, short + [vocab["<pad>"]] * 2]  # right padding
    assert ids["attention_mask"].sum(1).tolist() == [len(long), len(short)]

    model = tiny_harmon(seed=0)
    harmon.set_null_prompt_from_tokenizer(model, tok)
    null = model.null_condition_like(model.condition(**ids))
    expected = [vocab[w] for w in ["<|im_start|>", "user", "Generate", "an", "image", "."] + tail]
    assert null["input_ids"][0, :len(expected)].tolist() == expected and null["attention_mask"].sum(1).tolist() == [len(expected)] * 2
