"""Tests of models/nova.py / models/nova_heads.py: parity with the official NOVA code at a tiny configuration
(fixtures/nova_tiny_official.pt, fixtures/README_adapters.md), the released configurations' state
dicts, another tiny size, recorded = recomputed transition log-probabilities for both heads,
checkpoint loading and its errors, and the Phi-2 prompt embedding. CPU, tiny shapes, seeded."""

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from models import nova, nova_embed
from models import nova_heads
from diffloss import transition_logprob

torch.set_num_threads(1)

FIXTURES = Path(__file__).resolve().parent / "fixtures"  # the official code run on tiny models (README_adapters.md)
OFFICIAL = FIXTURES / "nova_tiny_official.pt"
TOL = 1e-4  # README_adapters.md: max|a − b| / max(1, max|b|)

FLOW = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0}


def close(a, b, tol=TOL):
    b = torch.as_tensor(b, dtype=torch.float32)
    return (a.float() - b).abs().max().item() / max(1.0, b.abs().max().item()) <= tol


@pytest.fixture(scope="module")
def official():
    return torch.load(OFFICIAL, weights_only=True)


@pytest.fixture(scope="module")
def model(official):
    m = nova.build(official["config"])
    m.load_state_dict(official["state_dict"], strict=True)
    return m.eval()


def save_pipeline(model, folder, config):
    """A NOVA pipeline folder as released: transformer/{config.json, safetensors}, scheduler/."""
    (folder / "transformer").mkdir(parents=True)
    (folder / "scheduler").mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    (folder / "transformer" / "config.json").write_text(json.dumps(
        {"_class_name": "NOVATransformer3DModel", **config["transformer"], "video_mixer_rank": None}))
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(config["scheduler"]))


# -----------------------------------------------------------------------------
# parity with the official code

def test_condition_and_z_match_official(model, official):
    d, B = official, official["sample"]["batch"]
    with torch.no_grad():
        text = model.text_embed(torch.cat([d["prompt_embeds"], d["null_prompt_embeds"]]))
        assert close(text, d["text_cond"])
        # per-prompt embeddings of length n are padded with text_embed.weight[n:T], as the pipeline does
        rows = [d["prompt_embeds"][i, :n] for i, n in enumerate(d["prompt_lengths"])]
        assert torch.equal(model.text_embed.pad(rows), d["prompt_embeds"])
        c = model.condition(prompt_embeds=rows)
        c_null = model.null_condition_like(c)
        assert close(c, d["video_cond"][:B]) and close(c_null, d["video_cond"][B:])
        for i in range(len(d["num_preds"])):  # every AR step, cond and null rows
            mask = d["unknown"][i].float()
            assert close(model.predict_z(d["tokens"][i], mask, c), d["z"][i]), i
            assert close(model.predict_z(d["tokens"][i], mask, c_null), d["z_null"][i]), i
        # a canvas with other values at the unknown positions gives the same z (they are ignored)
        mask = d["unknown"][2].float()
        noisy = d["tokens"][2] + 5 * mask[..., None] * torch.randn(d["tokens"][2].shape, generator=torch.Generator().manual_seed(0))
        assert close(model.predict_z(noisy, mask, c), d["z"][2])


def test_tokens_orders_and_schedule_match_official(model, official):
    d = official
    for i in range(len(d["num_preds"])):
        assert torch.equal(model.patchify(d["canvas"][i]), d["tokens"][i])  # NOVA's (p, p, C) layout
        assert torch.equal(model.unpatchify(d["tokens"][i]), d["canvas"][i])
    lat = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(model.unpatchify(model.patchify(lat)), lat)
    assert model.ar_schedule(d["sample"]["num_inference_steps"], model.seq_len) == d["num_preds"]
    for num_iter, L in ((64, 1024), (64, 4096), (25, 16), (7, 24), (100, 77)):  # the pipeline's numpy code
        mask_length = np.round(np.cos(0.5 * np.pi * np.arange(num_iter + 1) / num_iter) * L).astype("int64")
        expected = [int(n) for n in mask_length[:-1] - mask_length[1:] if n > 0]
        assert model.ar_schedule(num_iter, L) == expected and sum(expected) == L
    assert len(model.ar_schedule(64, 16)) < 64  # zero-count steps are skipped
    orders = model.sample_orders(d["sample"]["batch"], torch.Generator().manual_seed(d["sample"]["seed_generator"]))
    assert torch.equal(orders, d["orders"])  # the official draw: argsort of uniform noise
    start = 0
    for i, n in enumerate(d["num_preds"]):  # P_i is the next n positions of the order; U_i the rest
        assert torch.equal(d["pred_ids"][i], orders[:, start:start + n])
        unknown = torch.ones_like(d["unknown"][i]).scatter(1, orders[:, :start], False)
        assert torch.equal(unknown, d["unknown"][i])
        start += n


@pytest.mark.parametrize("kind", ["ddpm", "flow"])
def test_heads_match_official(model, official, kind):
    h, T = official["head"], official["config"]["num_diffusion_steps"]
    H = h[kind]
    head = model.diffloss if kind == "ddpm" else nova.build({**official["config"], "scheduler": FLOW}).diffloss
    if kind == "flow":
        head.net.load_state_dict(model.image_decoder.state_dict())
    z2, w = torch.cat([h["z"], h["z_null"]]), h["cfg"]
    flat = lambda t: t.reshape(-1, t.shape[-1])  # (B, n, 16) -> (B·n, 16), row b·n + j
    assert head.num_sampling_steps == T
    assert head.arrays["timesteps"].flip(0).tolist() == pytest.approx(H["timesteps"])
    out = ("eps", "eps_null", "eps_cfg") if kind == "ddpm" else ("v", "v_null", "v_cfg")
    with torch.no_grad():
        for s in range(T):  # scheduler position s, noisiest first; step index k = T−1−s
            k, x = T - 1 - s, flat(H["x_t"][s])
            assert close(head.model_output(x, k, h["z"]), flat(H[out[0]][s]))
            assert close(head.model_output(x, k, h["z_null"]), flat(H[out[1]][s]))
            assert close(head.model_output(x, k, z2, w), flat(H[out[2]][s]))
            mean, log_var, x0 = head.p_mean_variance(x, k, h["z"])
            mean_cfg, log_var_cfg, x0_cfg = head.p_mean_variance(x, k, z2, w)
            assert torch.equal(log_var, log_var_cfg)
            if kind == "ddpm":
                assert close(x0, flat(H["pred_x0"][s])) and close(x0_cfg, flat(H["pred_x0_cfg"][s]))
                assert close(mean, flat(H["mean"][s])) and close(mean_cfg, flat(H["mean_cfg"][s]))
                assert log_var.exp().unique().item() == pytest.approx(H["var"][s], rel=1e-5, abs=1e-12)
            else:
                assert close(mean, flat(H["sde_mean"][s])) and close(mean_cfg, flat(H["sde_mean_cfg"][s]))
                assert (0.5 * log_var).exp().unique().item() == pytest.approx(H["sde_std"][s], rel=1e-5)
                assert close(head.ode_step(x, k, z2, w), flat(H["ode_prev_cfg"][s]))
    # the last DDPM step adds no noise (no density); every flow SDE step does
    assert list(head.trainable_steps()) == (list(range(1, T)) if kind == "ddpm" else list(range(T)))


# -----------------------------------------------------------------------------
# released configurations

def test_released_configs_state_dicts():
    released = json.loads((FIXTURES / "nova_state_dict.json").read_text())
    for name, entry in released.items():
        with torch.device("meta"):
            m = nova.build({"transformer": entry["constructor"], "scheduler": FLOW})
        assert {k: list(v.shape) for k, v in m.state_dict().items()} == entry["state_dict"], name
        assert sum(p.numel() for p in m.parameters()) == entry["params"], name
        assert m.seq_len == 64 * 64 and m.token_embed_dim == 16 and m.diffloss.num_sampling_steps == 25


# -----------------------------------------------------------------------------
# another tiny NOVA; rollouts with recorded log-probabilities

def tiny_config(scheduler):
    """A NOVA unlike the fixture's: image_stride 16 (p = 1), 8 latent channels, a 4×6 grid."""
    return {"transformer": dict(image_dim=8, image_size=[64, 96], image_stride=16, text_token_dim=12, text_token_len=6,
                                image_base_size=[4, 6], video_base_size=[1, 2, 3], rotary_pos_embed=False,
                                arch=["vit_d2w48", "vit_d3w48", "mlp_d3w40"]),
            "arch_defs": {"vit_d2w48": dict(kind="video_encoder", depth=2, embed_dim=48, num_heads=3),
                          "vit_d3w48": dict(kind="image_encoder", depth=3, embed_dim=48, num_heads=6),
                          "mlp_d3w40": dict(kind="image_decoder", depth=3, embed_dim=40)},
            "scheduler": scheduler, "num_diffusion_steps": 6}


def tiny_nova(scheduler, seed=7):
    torch.manual_seed(seed)
    m = nova.build(tiny_config(scheduler))
    with torch.no_grad():  # a small output layer keeps an untrained head's samples O(1)
        m.image_decoder.head.weight.mul_(0.1)
    return m.eval()


def rollout(model, prompt_embeds, num_iter, cfg, temperature, generator):
    """One guided rollout through the policy interface; records every trainable head step."""
    B, L, C = len(prompt_embeds), model.seq_len, model.token_embed_dim  # prompts, tokens, token size
    head = model.diffloss
    record_steps = torch.tensor(list(head.trainable_steps()))
    with torch.no_grad():
        c = model.condition(prompt_embeds=prompt_embeds)
        c2 = torch.cat([c, model.null_condition_like(c)])  # rows [cond; null]
        orders = model.sample_orders(B, generator)
        tokens, mask, steps, start = torch.zeros(B, L, C), torch.ones(B, L), [], 0
        for n in model.ar_schedule(num_iter, L):
            pred = orders[:, start:start + n]  # (B, n) positions written now
            z = model.predict_z(torch.cat([tokens, tokens]), torch.cat([mask, mask]), c2)  # (2B, L, D)
            idx = pred[..., None].expand(-1, -1, z.shape[-1])
            z_rows = torch.cat([z[:B].gather(1, idx).flatten(0, 1), z[B:].gather(1, idx).flatten(0, 1)])  # (2·B·n, D)
            x0, traj = head.sample(z_rows, temperature, cfg, generator, record_steps=record_steps)
            steps.append(dict(tokens=tokens.clone(), mask=mask.clone(), pred=pred, traj=traj))
            tokens = tokens.scatter(1, pred[..., None].expand(-1, -1, C), x0.reshape(B, n, C))
            mask = mask.scatter(1, pred, 0.0)
            start += n
    return tokens, mask, steps


def recompute_logp(model, prompt_embeds, step, cfg, guided=True):
    """ℓ of a recorded AR step from a fresh condition and fresh z (cond and null in separate
    calls, unlike the rollout), through p_mean_variance; differentiable."""
    c = model.condition(prompt_embeds=prompt_embeds)
    traj, pred = step["traj"], step["pred"]
    K, N, C = traj["x_t"].shape
    zs = []
    for cond in (c, model.null_condition_like(c)) if guided else (c,):
        z = model.predict_z(step["tokens"], step["mask"], cond)
        zs.append(z.gather(1, pred[..., None].expand(-1, -1, z.shape[-1])).flatten(0, 1).repeat(K, 1))  # (K·N, D)
    mean, _, _ = model.diffloss.p_mean_variance(traj["x_t"].flatten(0, 1), torch.tensor(traj["steps"]).repeat_interleave(N),
                                                torch.cat(zs), cfg if guided else 1.0)
    return transition_logprob(traj["x_prev"], mean.reshape(K, N, C), traj["std"])


@pytest.mark.parametrize("kind", ["ddpm", "flow"])
def test_recorded_logp_equals_recomputed(kind):
    ddpm = {"_class_name": "DDPMScheduler", "beta_schedule": "scaled_linear", "beta_start": 0.00085,
            "beta_end": 0.012, "clip_sample": False, "timestep_spacing": "trailing"}
    model = tiny_nova(ddpm if kind == "ddpm" else {**FLOW, "shift": 3.0})
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randn(n, 12, generator=g) for n in (2, 6, 4)]  # variable prompt lengths
    tokens, mask, steps = rollout(model, prompts, num_iter=5, cfg=4.0, temperature=0.9, generator=g)
    assert mask.sum() == 0 and torch.isfinite(tokens).all()
    assert len(steps) == len(model.ar_schedule(5, model.seq_len))
    worst, T = 0.0, model.diffloss.num_sampling_steps
    for step in steps:
        assert step["traj"]["steps"] == sorted(model.diffloss.trainable_steps(), reverse=True)
        logp = recompute_logp(model, prompts, step, 4.0)
        worst = max(worst, (logp.detach() - step["traj"]["logp"]).abs().max().item())
        # the recorded std is τ·σ of the step (σ does not depend on z)
        _, log_var, _ = model.diffloss.p_mean_variance(step["traj"]["x_t"][0], step["traj"]["steps"][0],
                                                       torch.zeros(step["traj"]["x_t"].shape[1], 48))
        assert torch.allclose(step["traj"]["std"][0], 0.9 * (0.5 * log_var).exp())
    assert worst < 1e-5, worst
    assert (T - 1 in model.diffloss.trainable_steps()) and ((0 in model.diffloss.trainable_steps()) == (kind == "flow"))
    # recomputing without guidance (what the released trainer does) does not reproduce them
    off = recompute_logp(model, prompts, steps[2], 4.0, guided=False).detach() - steps[2]["traj"]["logp"]
    assert off.abs().max() > 1e-2
    # the log-probability is differentiable in the transformer, not only in the head
    recompute_logp(model, prompts, steps[2], 4.0).sum().backward()
    assert model.image_encoder.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    assert model.text_embed.proj.weight.grad.abs().sum() > 0


def test_tiny_nova_other_size_loads_and_runs(tmp_path):
    model = tiny_nova({**FLOW, "shift": 2.0}, seed=3)
    assert (model.seq_len, model.token_embed_dim, model.patch_size) == (24, 8, 1)
    # the head is the image decoder: listed once, frozen with it, tied to it in a deep copy
    assert not any(k.startswith("diffloss") for k in model.state_dict())
    assert sum(p.numel() for p in model.diffloss.parameters()) == sum(p.numel() for p in model.image_decoder.parameters())
    ref = copy.deepcopy(model)
    assert ref.diffloss.net is ref.image_decoder and ref.diffloss.net is not model.image_decoder
    model.diffloss.requires_grad_(False)
    assert not any(p.requires_grad for p in model.image_decoder.parameters())
    # tokens: positions row-major over the non-square 4×6 grid
    lat = torch.randn(2, 8, 4, 6, generator=torch.Generator().manual_seed(4))
    assert torch.equal(model.patchify(lat)[:, 1 * 6 + 4], lat[:, :, 1, 4]) and torch.equal(model.unpatchify(model.patchify(lat)), lat)
    # sampling: NOVA's deterministic Euler sampler and the SDE give finite tokens of the right size
    z = torch.randn(10, 48, generator=torch.Generator().manual_seed(0))
    for ode in (True, False):
        x0 = model.diffloss.sample(z, cfg=3.0, generator=torch.Generator().manual_seed(1), ode=ode)
        assert x0.shape == (5, 8) and torch.isfinite(x0).all()
    ref.set_scheduler({"_class_name": "DDPMScheduler"}, 6)  # DDPM's last step has no density
    with pytest.raises(ValueError, match="record_steps"):
        ref.diffloss.sample(z, record_steps=torch.tensor([0]))
    # load_nova reads a pipeline folder written like a released one and reproduces z
    save_pipeline(model, tmp_path / "pipe", tiny_config({**FLOW, "shift": 2.0}))
    loaded = nova.load_nova(tmp_path / "pipe", num_sampling_steps=6, arch_defs=tiny_config(None)["arch_defs"])
    prompts = torch.randn(2, 3, 12, generator=torch.Generator().manual_seed(2))
    tokens = torch.randn(2, 24, 8, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 24).scatter(1, torch.tensor([[0, 5, 9], [1, 2, 23]]), 0.0)
    with torch.no_grad():
        z_a = model.predict_z(tokens, mask, model.condition(prompt_embeds=prompts))
        z_b = loaded.predict_z(tokens, mask, loaded.condition(prompt_embeds=prompts))
    assert z_a.shape == (2, 24, 48) and torch.equal(z_a, z_b)
    assert isinstance(loaded.diffloss, nova_heads.FlowSDEHead) and not loaded.training
    uneven = mask.clone()
    uneven[0, 1] = 0.0  # row 0 now knows 4 tokens, row 1 knows 3
    with pytest.raises(ValueError, match="same number of known"):
        model.predict_z(tokens, uneven, z_a[:, :6])


def test_ddpm_trainable_steps():
    """Step 0 never (β̃ = 0); the noisiest step only where its α_t is not vanishing."""
    net = nova_heads.DiffusionMLP(depth=1, embed_dim=8, cond_dim=4, patch_size=1, image_dim=2)
    cosine = {"_class_name": "DDPMScheduler", "beta_schedule": "squaredcos_cap_v2", "timestep_spacing": "linspace"}
    head = nova_heads.make_head(net, cosine, 10)
    assert head.arrays["timesteps"][-1] == 999 and head.arrays["alpha"][-1] < 1e-4
    assert head.trainable_steps() == range(1, 9)
    head = nova_heads.make_head(net, {**cosine, "beta_schedule": "scaled_linear"}, 10)
    assert head.trainable_steps() == range(1, 10)
    assert head.arrays["log_var"][0].exp() < 1e-19  # the last step: variance 0 (clamped like diffusers)
    head = nova_heads.make_head(net, {**cosine, "clip_sample": True}, 10)  # NOVA never clips x̂0
    _, _, x0 = head.p_mean_variance(torch.full((3, 2), 5.0), 2, torch.zeros(3, 4))
    assert x0.abs().max() > 2
    with pytest.raises(ValueError, match="_class_name"):
        nova_heads.make_head(net, {"_class_name": "DDIMScheduler"}, 10)


def test_load_nova_errors_are_one_line(tmp_path):
    model = tiny_nova(FLOW)
    config = tiny_config(FLOW)
    save_pipeline(model, tmp_path / "good", config)
    defs = config["arch_defs"]
    with pytest.raises(FileNotFoundError, match="no such file"):
        nova.load_nova(tmp_path / "absent")
    # a checkpoint with a missing key and a wrong-shaped key
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "mask_embed.bos_token"}
    sd["image_decoder.head.bias"] = torch.zeros(7)
    bad = tmp_path / "bad.safetensors"
    save_file(sd, str(bad))
    (tmp_path / "config.json").write_text(json.dumps(config["transformer"]))
    for path, pattern in ((bad, "does not fit"), (tmp_path / "junk.safetensors", "cannot read weights")):
        if not path.exists():
            path.write_bytes(b"not a safetensors file")
        with pytest.raises(ValueError) as err:
            nova.load_nova(path, scheduler=FLOW, arch_defs=defs)
        message = str(err.value)
        assert pattern in message and str(path) in message and "\n" not in message
    with pytest.raises(ValueError) as err:
        nova.load_nova(bad, scheduler=FLOW, arch_defs=defs)
    assert "mask_embed.bos_token" in str(err.value) and "image_decoder.head.bias" in str(err.value)
    with pytest.raises(ValueError, match="_class_name"):
        nova.load_nova(tmp_path / "good", scheduler={"_class_name": "EulerDiscreteScheduler"}, arch_defs=defs)
    with pytest.raises(ValueError, match="arch"):
        nova.load_nova(tmp_path / "good")  # tiny architecture names are not in the official registry


def test_embed_prompts_from_a_local_phi(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {w: i for i, w in enumerate("<unk> a red cube on the blue ball".split())}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(tmp_path / "tokenizer")
    phi_cfg = transformers.PhiConfig(vocab_size=len(vocab), hidden_size=12, intermediate_size=24, num_hidden_layers=2,
                                     num_attention_heads=3, partial_rotary_factor=0.5,
                                     max_position_embeddings=32)
    torch.manual_seed(0)
    phi = transformers.PhiForCausalLM(phi_cfg).eval()  # keys model.* and lm_head.*, as NOVA's text_encoder/
    phi.save_pretrained(tmp_path / "text_encoder")
    model = tiny_nova(FLOW)  # text_token_dim 12, text_token_len 6
    emb = nova_embed.embed_prompts(["a red cube", "a red cube on the blue ball", ""], tmp_path / "text_encoder", model)
    assert emb.shape == (3, 6, 12)
    w = model.text_embed.weight
    with torch.no_grad():
        h = phi.model(input_ids=torch.tensor([[1, 2, 3, 4, 5, 6]])).last_hidden_state[0]  # (6, 12)
    assert torch.allclose(emb[0, :3], h[:3], atol=1e-5) and torch.equal(emb[0, 3:], w[3:6])
    assert torch.allclose(emb[1], h, atol=1e-5)  # 7 words truncated to text_token_len 6
    assert torch.equal(emb[2], w[:6])  # the empty prompt is the null prompt
