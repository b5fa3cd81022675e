"""The test suite: CPU-only, tiny shapes, seeded; each test pins a piece of maths that a wrong
sign, mask or index would break. Sections follow the files: diffloss, mar, ..."""

import argparse
import contextlib
import json
import math
import os
from pathlib import Path

import pytest
import torch

import diffloss
import mar
import models
from diffloss import DiffLoss, transition_logprob

torch.set_num_threads(1)  # tiny ops: threads only add contention on a 2-core machine

# the official models' state-dict listings and tiny official Harmon / NOVA runs (fixtures/README_adapters.md), the
# released GroundingDINO scorer's outputs and ten prompt records in the released format (docs/composition.md)
FIXTURES = Path(__file__).resolve().parent / "fixtures"
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


def tiny_mar(**kw):
    """A MAR on 16×16 RGB pixels: 4×4 patches -> 16 tokens of 48 channels."""
    cfg = dict(img_size=16, vae_stride=1, patch_size=4, vae_embed_dim=3, encoder_embed_dim=32, encoder_depth=2,
               encoder_num_heads=4, decoder_embed_dim=32, decoder_depth=2, decoder_num_heads=4, class_num=5,
               buffer_size=4, diffloss_d=2, diffloss_w=32, num_sampling_steps="10", attn_dropout=0.0,
               proj_dropout=0.0, text_vocab_size=9)
    cfg.update(kw)
    torch.manual_seed(0)
    model = mar.build_mar(dict(cfg, norm_eps=1e-6))
    # give the zero-initialised parts of the head some weight so that tests see real functions
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adaLN_modulation" in name or "final_layer.linear" in name:
                p.normal_(0, 0.05)
    return model.eval()


# -----------------------------------------------------------------------------
# diffloss.py

def official_respacing(T, num_train=1000):
    """The official MAR schedule, transcribed independently: cosine betas (float64, capped at
    0.999), `space_timesteps(1000, str(T))`, and betas recomputed from the kept ᾱ."""
    def f(t):
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
    betas = [min(1 - f((i + 1) / num_train) / f(i / num_train), 0.999) for i in range(num_train)]
    alphas_cumprod, acc = [], 1.0
    for b in betas:
        acc *= 1 - b
        alphas_cumprod.append(acc)
    stride = (num_train - 1) / (T - 1) if T > 1 else 1
    cur, taken = 0.0, []
    for _ in range(T):
        taken.append(round(cur))
        cur += stride
    kept, new_betas, last = [], [], 1.0
    for i, a in enumerate(alphas_cumprod):
        if i in set(taken):
            kept.append(i)
            new_betas.append(1 - a / last)
            last = a
    return kept, [alphas_cumprod[i] for i in kept], new_betas


@pytest.mark.parametrize("T", [10, 25, 64, 100, 1000])
def test_schedule_matches_official_respacing(T):
    kept, alphas_cumprod, betas = official_respacing(T)
    sched = diffloss.GaussianSchedule(T)
    assert sched.timesteps.tolist() == kept
    torch.testing.assert_close(sched.alphas_cumprod.double(), torch.tensor(alphas_cumprod, dtype=torch.float64),
                               rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(sched.betas.double(), torch.tensor(betas, dtype=torch.float64), rtol=1e-4, atol=1e-9)


def test_reverse_step_matches_diffusers_ddpm_step():
    """Our learned-range posterior mean and variance equal diffusers' DDPMScheduler.step."""
    from diffusers import DDPMScheduler
    T, C = 25, 6
    sched = diffloss.GaussianSchedule(T)
    ddpm = DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2",
                         variance_type="learned_range", timestep_spacing="linspace", clip_sample=False)
    ddpm.set_timesteps(T)
    g = torch.Generator().manual_seed(1)
    for k in (T - 1, T // 2, 1):
        x_t, eps, noise = (torch.randn(4, C, generator=g) for _ in range(3))
        v = torch.rand(4, C, generator=g) * 2 - 1
        kk = torch.full((4,), k)
        mean, log_var, pred_x0 = sched.p_mean_variance(eps, v, x_t, kk)
        out = ddpm.step(torch.cat([eps, v], 1), int(sched.timesteps[k]), x_t, generator=None, return_dict=True)
        # diffusers adds exp(0.5 log σ²)·noise with its own noise; recover it from pred_original_sample
        torch.testing.assert_close(pred_x0, out.pred_original_sample, rtol=1e-4, atol=1e-4)
        mean_d = ddpm.step(torch.cat([eps, v], 1), int(sched.timesteps[k]), x_t, generator=torch.Generator().manual_seed(3)).prev_sample
        noise_d = torch.randn(x_t.shape, generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(mean_d, mean + torch.exp(0.5 * log_var) * noise_d, rtol=1e-4, atol=1e-4)


def test_transition_logprob_is_the_gaussian_density():
    g = torch.Generator().manual_seed(0)
    x, mu = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    s = torch.rand(5, 7, generator=g) + 0.1
    expected = torch.distributions.Normal(mu, s).log_prob(x)
    torch.testing.assert_close(transition_logprob(x, mu, s), expected)
    # closed form at x = μ, s = 1: −½ log 2π
    assert torch.allclose(transition_logprob(mu, mu, torch.ones_like(s)), torch.full_like(s, -0.5 * math.log(2 * math.pi)))


def test_normal_kl_matches_torch_distributions():
    g = torch.Generator().manual_seed(0)
    m1, m2, lv1, lv2 = (torch.randn(10, generator=g) for _ in range(4))
    expected = torch.distributions.kl_divergence(torch.distributions.Normal(m1, (0.5 * lv1).exp()),
                                                 torch.distributions.Normal(m2, (0.5 * lv2).exp()))
    torch.testing.assert_close(diffloss.normal_kl(m1, lv1, m2, lv2), expected)


def test_cfg_guides_only_eps_channels():
    head = tiny_mar().diffloss
    g = torch.Generator().manual_seed(0)
    x, zc, zu = torch.randn(3, 48, generator=g), torch.randn(3, 32, generator=g), torch.randn(3, 32, generator=g)
    k, w = 5, 3.0
    mean, log_var, x0 = head.p_mean_variance(x, k, torch.cat([zc, zu]), cfg=w)
    t = head.gen_schedule.timesteps[torch.full((3,), k)]
    out_c, out_u = head.net(x, t, zc), head.net(x, t, zu)
    eps = out_u[:, :48] + w * (out_c[:, :48] - out_u[:, :48])
    ref = head.gen_schedule.p_mean_variance(eps, out_c[:, 48:], x, torch.full((3,), k))
    for a, b in zip((mean, log_var, x0), ref):
        torch.testing.assert_close(a, b)
    # the official net-level CFG call gives the same guided ε
    off = official_forward_with_cfg(head.net, torch.cat([x, x]), torch.cat([t, t]), torch.cat([zc, zu]), w)
    torch.testing.assert_close(off[:3, :48], eps)


def official_forward_with_cfg(net, x, t, c, cfg_scale):
    """The official net-level CFG call (`SimpleMLPAdaLN.forward_with_cfg`), transcribed: x (2N, C)
    with identical halves, c (2N, D) = [cond; null]; (2N, 2C) with the ε channels guided in both
    halves and the variance channels of each half unguided."""
    half = x[: len(x) // 2]
    out = net(torch.cat([half, half]), t, c)
    eps, rest = out[:, :net.in_channels], out[:, net.in_channels:]
    cond_eps, uncond_eps = torch.split(eps, len(eps) // 2)
    half_eps = uncond_eps + cfg_scale * (cond_eps - uncond_eps)
    return torch.cat([torch.cat([half_eps, half_eps]), rest], dim=1)


def official_p_sample_loop(head, z, T, temperature, cfg, generator):
    """The official `p_sample_loop` with float64 schedule arrays, transcribed independently; the
    single adaptation: noise is drawn for the guided half only (the official null half is
    discarded) and not at the last step (where the official code multiplies it by zero)."""
    kept, alphas_cumprod, betas = official_respacing(T)
    ac = torch.tensor(alphas_cumprod, dtype=torch.float64)
    ac_prev = torch.cat([torch.ones(1, dtype=torch.float64), ac[:-1]])
    b = torch.tensor(betas, dtype=torch.float64)
    post_var = b * (1 - ac_prev) / (1 - ac)
    post_logvar = torch.log(torch.cat([post_var[1:2], post_var[1:]]))
    coef1, coef2 = b * ac_prev.sqrt() / (1 - ac), (1 - ac_prev) * (1 - b).sqrt() / (1 - ac)
    n = z.shape[0] // 2 if cfg != 1.0 else z.shape[0]
    img = torch.randn(n, head.in_channels, generator=generator)
    for i in reversed(range(T)):
        t = torch.full((2 * n if cfg != 1.0 else n,), kept[i])
        if cfg != 1.0:
            out = official_forward_with_cfg(head.net, torch.cat([img, img]), t, z, cfg)[:n]
        else:
            out = head.net(img, t, z)
        eps, v = out.split(head.in_channels, dim=1)
        frac = (v + 1) / 2
        logvar = frac * math.log(betas[i]) + (1 - frac) * post_logvar[i].float()
        x0 = (1 / ac[i]).sqrt().float() * img - (1 / ac[i] - 1).sqrt().float() * eps
        mean = coef1[i].float() * x0 + coef2[i].float() * img
        if i > 0:
            img = mean + torch.exp(0.5 * logvar) * torch.randn(img.shape, generator=generator) * temperature
        else:
            img = mean
    return img


@pytest.mark.parametrize("cfg", [1.0, 2.5])
def test_head_sampling_matches_official_loop(cfg):
    head = tiny_mar().diffloss
    z = torch.randn(6 if cfg != 1.0 else 3, 32, generator=torch.Generator().manual_seed(0))
    ours = head.sample(z, temperature=0.8, cfg=cfg, generator=torch.Generator().manual_seed(7))
    ref = official_p_sample_loop(head, z, 10, 0.8, cfg, torch.Generator().manual_seed(7))
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_recorded_transitions_recompute_exactly():
    """Recorded (x_t, x_{t-1}, s) re-evaluated with p_mean_variance at another batch layout give
    the recorded log-probabilities (CFG w = 3, τ = 0.7)."""
    head = tiny_mar().diffloss
    g = torch.Generator().manual_seed(0)
    z = torch.randn(10, 32, generator=g)  # 5 guided rows
    steps = torch.tensor([8, 4, 1])
    x0, traj = head.sample(z, temperature=0.7, cfg=3.0, generator=g, record_steps=steps)
    assert traj["x_t"].shape == (3, 5, 48) and traj["steps"] == [8, 4, 1]
    # all K steps at once, rows reversed: (K·N, C)
    K, N, C = traj["x_t"].shape
    zc, zu = z[:5].flip(0).repeat(K, 1), z[5:].flip(0).repeat(K, 1)
    mean, _, _ = head.p_mean_variance(traj["x_t"].flip(1).reshape(K * N, C), torch.tensor(traj["steps"]).repeat_interleave(N),
                                      torch.cat([zc, zu]), cfg=3.0)
    logp = transition_logprob(traj["x_prev"].flip(1).reshape(K * N, C), mean, traj["std"].flip(1).reshape(K * N, C))
    torch.testing.assert_close(logp, traj["logp"].flip(1).reshape(K * N, C), rtol=0, atol=1e-5)
    # s = τ σ: the recorded std is the temperature times the model's σ
    _, log_var, _ = head.p_mean_variance(traj["x_t"][0], 8, z, cfg=3.0)
    torch.testing.assert_close(traj["std"][0], 0.7 * torch.exp(0.5 * log_var))


def test_pure_noise_step_is_not_recordable():
    head = tiny_mar().diffloss
    assert list(diffloss.trainable_steps(10)) == list(range(1, 9))
    with pytest.raises(ValueError, match="record_steps"):
        head.sample(torch.zeros(2, 32), record_steps=torch.tensor([9]))


def test_diffloss_training_loss_decreases():
    torch.manual_seed(0)
    head = DiffLoss(target_channels=4, z_channels=8, depth=2, width=32, num_sampling_steps="10")
    g = torch.Generator().manual_seed(0)
    z = torch.randn(64, 8, generator=g)
    target = torch.tanh(z[:, :4])  # a deterministic function of z
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        loss = head(target, z, generator=g)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10, losses


# -----------------------------------------------------------------------------
# mar.py

def test_fixtures_are_the_recorded_files():
    """The fixtures are recorded data (made by the official and released code; the prompt records by hand):
    never edited (their sha256 pinned in this test)."""
    import checkpoints
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
    cfg = models.mar_config_from_state_dict(sd)
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


def test_tiny_mar_overfits_pixel_images():
    model = tiny_mar(diffusion_batch_mul=1).train()
    g = torch.Generator().manual_seed(0)
    imgs = mar.PixelCodec().encode(torch.rand(4, 3, 16, 16, generator=g).round())  # 4 binary images
    labels = torch.arange(4)

    def held_loss():  # the same masks, timesteps and noise before and after training
        with torch.no_grad():
            return sum(model(imgs, labels=labels, generator=torch.Generator().manual_seed(i)).item() for i in range(8)) / 8

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    before = held_loss()
    for _ in range(80):
        loss = model(imgs, labels=labels, generator=g)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = held_loss()
    assert after < 0.6 * before, (before, after)


def test_random_masking_ratio_in_range():
    model = tiny_mar(img_size=32)  # 64 tokens
    g = torch.Generator().manual_seed(0)
    x = torch.zeros(3, 64, 48)
    ratios = []
    for _ in range(200):
        m = model.random_masking(x, model.sample_orders(3, g), g)
        assert torch.equal(m[0].sum(), m[1].sum())
        ratios.append(m[0].mean().item())
    assert min(ratios) >= 0.7 - 1e-6 and max(ratios) <= 1.0
    # the official scipy truncnorm(loc 1, scale .25) on [0.7, 1], rounded up to whole tokens
    from scipy import stats
    r = stats.truncnorm(-1.2, 0, loc=1, scale=0.25).rvs(100000, random_state=0)
    expected = float((torch.from_numpy(r) * 64).ceil().mean() / 64)
    assert abs(sum(ratios) / len(ratios) - expected) < 0.01, (sum(ratios) / len(ratios), expected)


def test_load_checkpoint_official_format_and_errors(tmp_path):
    model = tiny_mar()
    ema = {k: v + 1.0 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    args = argparse.Namespace(model="tiny", img_size=16, vae_stride=1, patch_size=4, vae_embed_dim=3,
                              num_sampling_steps="10", diffloss_d=2, diffloss_w=32)
    path = tmp_path / "checkpoint-last.pth"
    torch.save({"model": model.state_dict(), "model_ema": ema, "args": args, "epoch": 3}, path)
    loaded = models.load_checkpoint(str(path))  # config inferred from shapes + pickled args
    assert not loaded.training
    torch.testing.assert_close(loaded.fake_latent, ema["fake_latent"])
    loaded = models.load_checkpoint(str(path), ema=False, model=tiny_mar())
    torch.testing.assert_close(loaded.fake_latent, model.fake_latent)

    with pytest.raises(ValueError, match=r"does not fit.*wrong shape.*fake_latent \(1, 32\) vs \(1, 64\)"):
        models.load_checkpoint(str(path), model=tiny_mar(encoder_embed_dim=64, decoder_embed_dim=64))
    with pytest.raises(ValueError, match=r"does not fit.*missing encoder_blocks.2"):
        models.load_checkpoint(str(path), model=tiny_mar(encoder_depth=3))
    with pytest.raises(FileNotFoundError, match="--init"):
        models.load_checkpoint(str(tmp_path / "nope.pth"))
    broken = tmp_path / "broken.pth"
    broken.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"--init .*broken.pth: cannot read checkpoint") as e:
        models.load_checkpoint(str(broken))
    assert "\n" not in str(e.value)
    other = tmp_path / "other.pth"
    torch.save({"state_dict": {"w": torch.zeros(1)}}, other)
    with pytest.raises(ValueError, match="not a MAR checkpoint"):
        models.load_checkpoint(str(other))


# -----------------------------------------------------------------------------
# The MAR-GRPO objective: rollout records, masks.py, mte.py, grpo.py, policy.py

import copy

import grpo
import masks
import mte
import policy
import processes
import rollout


def make_rollout(model, cfg=2.5, temperature=0.9, ar_steps=(0, 2, 3), diff_steps=(8, 5, 2), seed=0, bsz=4):
    """A recorded rollout of 4 images (2 prompts × G = 2) with CFG."""
    labels = torch.tensor([1, 1, 3, 3][:bsz])
    plan = rollout.RolloutPlan(ar_steps=list(ar_steps), diff_steps=torch.tensor(diff_steps))
    _, record = rollout.record_rollout(model, dict(labels=labels), 5, cfg, "linear", temperature, plan,
                                       torch.Generator().manual_seed(seed))
    return record, dict(labels=labels)


def test_record_contents_and_previews():
    model = tiny_mar()
    record, _ = make_rollout(model)
    assert [s.i for s in record.steps] == [0, 2, 3]
    final = record.tokens
    for s in record.steps:
        n = int(s.unknown[0].sum())
        assert s.unk_idx.shape == (4, n) and s.x_t.shape == (3, 4, n, 48)
        assert torch.equal(s.unk_idx, s.unknown.nonzero()[:, 1].reshape(4, n))
        known = ~s.unknown
        assert torch.equal(s.preview[known], s.tokens[known])  # K_i keeps its values
        assert torch.equal(s.preview[s.pred], final[s.pred])  # P_i is written from the preview
        assert (s.pred & ~s.unknown).sum() == 0
    # step 3's previous preview is step 2's preview; step 0 has none
    assert record.steps[0].preview_prev is None
    assert torch.equal(record.steps[2].preview_prev, record.steps[1].preview)
    # z_final holds, per position, the z it was generated from (the step's recomputed z)
    s = record.steps[1]
    z = model.predict_z(s.tokens, s.unknown.float(), model.condition(labels=torch.tensor([1, 1, 3, 3])))
    torch.testing.assert_close(record.z_final[s.pred], z[s.pred], rtol=1e-5, atol=1e-5)


def test_rollout_without_a_plan_is_the_official_sampler():
    """rollout.record_rollout draws the same noise in the same order as MAR.sample_tokens."""
    model = tiny_mar()
    labels = torch.tensor([1, 3])
    orders = model.sample_orders(2, torch.Generator().manual_seed(5))
    for cfg, schedule in ((1.0, "linear"), (2.5, "linear"), (2.5, "constant")):
        plain = model.sample_tokens(2, num_iter=5, cfg=cfg, cfg_schedule=schedule, labels=labels, temperature=0.9,
                                    orders=orders, generator=torch.Generator().manual_seed(11))
        tokens, record = rollout.record_rollout(model, dict(labels=labels), 5, cfg, schedule, 0.9,
                                                orders=orders, generator=torch.Generator().manual_seed(11))
        assert torch.equal(model.unpatchify(tokens), plain) and record.steps == []


class ToyPolicy(torch.nn.Module):
    """A model of the MAR family that is not a MAR: a bag-of-tokens encoder with positions and a
    class embedding, and the project's head. It implements rollout.py's policy interface and
    nothing else, to show that the recorder, MTE and the loss need nothing more."""

    def __init__(self, L=12, C=6, D=16, classes=4, T=8):
        super().__init__()
        self.seq_len, self.token_embed_dim = L, C
        self.embed = torch.nn.Linear(C, D)
        self.pos = torch.nn.Parameter(torch.randn(L, D) * 0.5)
        self.classes = torch.nn.Embedding(classes, D)
        self.null = torch.nn.Parameter(torch.randn(D) * 0.5)
        self.mix = torch.nn.Linear(2 * D, D)
        self.diffloss = DiffLoss(C, D, depth=1, width=16, num_sampling_steps=T, clip_denoised=True)
        with torch.no_grad():  # the zero-initialised layers of the head get weights, as in tiny_mar
            for name, p in self.diffloss.named_parameters():
                if "adaLN_modulation" in name or "final_layer.linear" in name:
                    p.normal_(0, 0.05)

    def condition(self, labels):
        return self.classes(labels)  # (B, D)

    def null_condition_like(self, cond):
        return self.null.expand(cond.shape)

    def predict_z(self, tokens, mask, cond):
        known = tokens * (1 - mask)[..., None]  # (B, L, C)
        context = self.embed(known).mean(1, keepdim=True) + cond[:, None]  # (B, 1, D)
        return self.mix(torch.cat([self.pos.expand(len(tokens), -1, -1), context.expand(-1, self.seq_len, -1)], -1))

    def ar_schedule(self, num_iter, seq_len):
        return [len(chunk) for chunk in torch.arange(seq_len).chunk(num_iter)]

    def sample_orders(self, bsz, generator=None):
        return torch.argsort(torch.rand(bsz, self.seq_len, generator=generator), dim=1)

    def patchify(self, latents):
        return latents.flatten(2).transpose(1, 2)  # (B, C, 3, 4) -> (B, 12, C)

    def unpatchify(self, tokens):
        return tokens.transpose(1, 2).reshape(len(tokens), self.token_embed_dim, 3, 4)


def test_recorder_and_loss_drive_a_model_that_is_not_a_mar():
    torch.manual_seed(0)
    model = ToyPolicy().eval()
    model.diffloss.requires_grad_(False)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        ref.mix.weight.add_(0.05)  # a reference that differs: the KL is not zero
    inputs = dict(labels=torch.tensor([0, 0, 2, 2]))
    plan = rollout.RolloutPlan(ar_steps=[1, 3], diff_steps=torch.tensor([5, 3]))
    tokens, record = rollout.record_rollout(model, inputs, 4, 2.0, "constant", 0.9, plan, torch.Generator().manual_seed(0))
    assert tokens.shape == (4, 12, 6) and [s.i for s in record.steps] == [1, 3]
    seeds = mte.sample_trajectories(model.diffloss, record.z_final, record.z_final_null, record.cfg_final, 0.9, 3,
                                    plan.diff_steps, torch.Generator().manual_seed(1))
    uncertain = masks.top_k_mask(masks.token_uncertainty(seeds["x0"]), 0.3)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    cfg = grpo.GRPOSettings(**grpo.METHODS["mar-grpo"])
    for j in range(2):
        model.zero_grad()
        loss, stats, _ = policy.rollout_loss(model, ref, record, j, inputs, adv, cfg, seeds, uncertain)
        loss.backward()
        assert stats["logp_parity_err"] < 1e-5 and stats["kl"] > 0 and torch.isfinite(loss)
        assert model.mix.weight.grad.abs().sum() > 0 and model.diffloss.net.input_proj.weight.grad is None


def test_record_memory_scales_with_chosen_steps():
    model = tiny_mar()

    def nbytes(ar_steps, diff_steps):
        record, _ = make_rollout(model, ar_steps=ar_steps, diff_steps=diff_steps)
        return sum(v.numel() * v.element_size() for s in record.steps for v in vars(s).values() if torch.is_tensor(v))
    one, two = nbytes((3,), (5,)), nbytes((3,), (5, 2))
    assert two > one and nbytes((3, 4), (5,)) > one


def test_recomputed_logp_equals_recorded():
    """docs/method.md §2 parity at training batch shapes: ρ = 1 to 1e-5 (the objective's value and gradient
    with every term active are pinned in test_objective.py)."""
    model = tiny_mar()
    record, cond = make_rollout(model, cfg=3.0, temperature=0.8)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    cfg = grpo.GRPOSettings(beta=0.01, tau=0.0)
    ref = copy.deepcopy(model)
    for j, s in enumerate(record.steps):
        _, stats, _ = policy.rollout_loss(model, ref, record, j, cond, adv, cfg)
        z, z_null = policy.recompute_z(model, s, cond, guided=True)
        mean = rollout.transition_mean(model.diffloss, s.x_t, s.diff_steps, z, z_null, s.cfg)
        logp = transition_logprob(s.x_prev, mean, s.std)
        assert (logp - s.logp).abs().max() < 1e-5 and stats["logp_parity_err"] < 1e-5
        assert torch.exp(logp - s.logp).sub(1).abs().max() < 1e-5


def test_train_cfg_1_recomputes_without_guidance():
    model = tiny_mar()
    record, cond = make_rollout(model, cfg=3.0)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    _, stats, _ = policy.rollout_loss(model, model, record, 1, cond, adv, grpo.GRPOSettings(train_cfg="1"))
    assert stats["logp_parity_err"] > 1e-3  # the released trainer's mismatch, made visible


def test_top_k_mask_hand_built():
    u = torch.tensor([[0.1, 0.5, 0.5, 0.2, 0.9, 0.0, 0.3, 0.5, 0.4, 0.6]])
    m = masks.top_k_mask(u, 0.3)  # k = int(10 · 0.3) = 3: 0.9, 0.6, then the first 0.5 (position 1)
    assert m[0].nonzero().flatten().tolist() == [1, 4, 9]
    assert masks.top_k_mask(u, 0.29)[0].sum() == 2  # int(2.9) = 2
    assert masks.top_k_mask(u, 0.01)[0].nonzero().flatten().tolist() == [4]  # at least one
    assert masks.top_k_mask(u, 0.0).sum() == 0 and masks.top_k_mask(u, 1.0).all()
    ties = masks.top_k_mask(torch.zeros(2, 6), 0.5)
    assert ties.tolist() == [[True] * 3 + [False] * 3] * 2  # ties: lower positions first
    # uncertainty: population std over seeds, mean over channels
    x0 = torch.tensor([[[[0.0, 2.0]]], [[[2.0, 2.0]]]])  # (S=2, B=1, L=1, C=2)
    assert torch.allclose(masks.token_uncertainty(x0), torch.tensor([[0.5]]))


def test_consistency_mask_hand_built():
    final = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])  # (1, 5, 2)
    prev = torch.tensor([[[0.0, 1.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [0.0, 1.0]]])
    cur = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0], [0.0, 1.0]]])
    # Δsim = [1, -1, 0, 0.7071, 0]
    unknown = torch.tensor([[True, True, True, True, False]])
    pred = torch.tensor([[False, True, False, False, False]])
    torch.testing.assert_close(masks.delta_sim(cur, prev, final), torch.tensor([[1.0, -1.0, 0.0, 0.7071068, 0.0]]))
    W = masks.consistency_mask(cur, prev, final, unknown, pred, tau=0.0)
    assert W.tolist() == [[True, True, False, True, False]]  # Δsim = 0 is not > τ; P always kept; K never
    assert masks.consistency_mask(cur, prev, final, unknown, pred, tau=0.8).tolist() == [[True, True, False, False, False]]
    assert masks.consistency_mask(cur, prev, final, unknown, pred, tau=-0.5).tolist() == [[True, True, True, True, False]]
    assert masks.consistency_mask(cur, None, final, unknown, pred).tolist() == unknown.tolist()  # first AR step
    assert masks.consistency_mask(cur, prev, final, unknown, pred, tau=None).tolist() == unknown.tolist()


def test_group_advantages():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0, 0.0, 1.0, 0.0, 1.0])
    adv = grpo.group_advantages(r, 4)
    g = torch.tensor([1.0, 2.0, 3.0, 4.0])
    torch.testing.assert_close(adv[:4], (g - 2.5) / (g.std() + 1e-4))  # unbiased std, as released
    assert torch.equal(adv[4:8], torch.zeros(4))  # equal rewards: exactly zero, not NaN
    torch.testing.assert_close(adv[8:], torch.tensor([-1.0, 1.0, -1.0, 1.0]) * 0.5 / (0.5773503 + 1e-4))
    for G in range(2, 5):  # each group's advantages sum to zero, groups are independent
        x = torch.randn(4 * G, generator=torch.Generator().manual_seed(G))
        a = grpo.group_advantages(x, G).reshape(4, G)
        assert a.sum(1).abs().max() < 1e-5
        torch.testing.assert_close(a[1], grpo.group_advantages(x[G:2 * G], G))
    with pytest.raises(ValueError, match="group size"):
        grpo.group_advantages(r, 5)


def test_kl_choices_closed_forms():
    mean, mean_ref, std = torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.0]), torch.tensor([0.5, 2.0])
    torch.testing.assert_close(grpo.kl_term("gaussian", mean, mean_ref, std), torch.tensor([0.5, 0.0]))
    gauss_kl = torch.distributions.kl_divergence(torch.distributions.Normal(mean, std), torch.distributions.Normal(mean_ref, std))
    torch.testing.assert_close(grpo.kl_term("gaussian", mean, mean_ref, std), gauss_kl)
    d = torch.tensor(-0.5)
    torch.testing.assert_close(grpo.kl_term("mean-k3", mean, mean_ref, std)[0], torch.exp(d) - d - 1)
    logp, logp_ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0])
    torch.testing.assert_close(grpo.kl_term("k3", mean, mean_ref, std, logp, logp_ref),
                               torch.tensor([math.exp(-0.5) + 0.5 - 1, 0.0]))
    for kind in grpo.KL_KINDS:  # zero when the policy equals the reference
        assert grpo.kl_term(kind, mean, mean, std, logp, logp).abs().max() == 0
    # k3 is an unbiased estimator of KL(π_θ || π_ref) on samples from π_θ
    x = mean[0] + std[0] * torch.randn(200000, generator=torch.Generator().manual_seed(0))
    n_t, n_r = torch.distributions.Normal(mean[0], std[0]), torch.distributions.Normal(mean_ref[0], std[0])
    est = grpo.kl_term("k3", None, None, None, n_t.log_prob(x), n_r.log_prob(x)).mean()
    assert abs(est - 0.5) < 0.02


def test_ppo_surrogate_clipping():
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 1.0])).requires_grad_()
    old = torch.zeros(4)
    adv = torch.tensor([1.0, -1.0, -1.0, 2.0])
    surr, ratio = grpo.policy_surrogate(logp, old, adv, clip_eps=0.2)
    torch.testing.assert_close(surr.detach(), torch.tensor([1.2, -1.5, -0.8, 2.0]))
    surr.sum().backward()
    # clipped elements carry no gradient; unclipped ones d(ρA)/dℓ = ρA
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -1.5, 0.0, 2.0]))


def test_inner_epochs_1_is_the_released_objective_and_ppo_reuses_old_logp():
    model = tiny_mar()
    record, cond = make_rollout(model)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])

    def grads(cfg, old=None):
        model.zero_grad()
        loss, stats, new_old = policy.rollout_loss(model, model, record, 1, cond, adv, cfg, old=old)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, new_old, stats

    l1, g1, old, _ = grads(grpo.GRPOSettings(beta=0.0, inner_epochs=1))
    l2, g2, _, _ = grads(grpo.GRPOSettings(beta=0.0, inner_epochs=3, clip_eps=0.2))  # first epoch: clip cannot bind
    assert torch.equal(l1, l2) and all(torch.equal(g1[n], g2[n]) for n in g1)
    # a later epoch after a parameter change: ρ moves away from 1 and clipping is reported
    with torch.no_grad():
        model.decoder_embed.weight.add_(0.5 * torch.randn_like(model.decoder_embed.weight))
    _, _, _, stats = grads(grpo.GRPOSettings(beta=0.0, inner_epochs=3, clip_eps=0.01), old=old)
    assert stats["ratio_max_dev"] > 0.01 and stats["clip_frac"] > 0


def _loss_and_grads(model, record, cond, adv, cfg, seeds=None, uncertain=None):
    model.zero_grad()
    total = 0.0
    for j in range(len(record.steps)):
        loss, _, _ = policy.rollout_loss(model, model, record, j, cond, adv, cfg, seeds, uncertain)
        (loss / len(record.steps)).backward()
        total += loss.item() / len(record.steps)
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_mar_grpo_path_with_components_off_equals_fixed_head():
    model = tiny_mar()
    for p in model.diffloss.parameters():
        p.requires_grad_(False)
    record, cond = make_rollout(model)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    fixed = grpo.GRPOSettings(**grpo.METHODS["grpo-fixed-head"])
    l0, g0 = _loss_and_grads(model, record, cond, adv, fixed)
    # the mar-grpo path, run with seeds but an empty uncertainty mask and a threshold that keeps all
    seeds = mte.sample_trajectories(model.diffloss, record.z_final, record.z_final_null, record.cfg_final,
                                    0.9, 3, record.steps[0].diff_steps, torch.Generator().manual_seed(1))
    off = grpo.GRPOSettings(**dict(grpo.METHODS["mar-grpo"], tau=-3.0))
    empty = masks.top_k_mask(masks.token_uncertainty(seeds["x0"]), 0.0)
    l1, g1 = _loss_and_grads(model, record, cond, adv, off, seeds, empty)
    assert l0 == l1 and g0.keys() == g1.keys() and all(torch.equal(g0[n], g1[n]) for n in g0)
    assert not any(n.startswith("diffloss.") for n in g0)  # a frozen head gets no gradient
    # switching the components on changes the gradient
    on = grpo.GRPOSettings(**grpo.METHODS["mar-grpo"])
    l2, g2 = _loss_and_grads(model, record, cond, adv, on, seeds, masks.top_k_mask(masks.token_uncertainty(seeds["x0"]), 0.3))
    assert any(not torch.allclose(g0[n], g2[n]) for n in g0)
    # end-to-end GRPO: the head trains
    for p in model.diffloss.parameters():
        p.requires_grad_(True)
    _, g3 = _loss_and_grads(model, record, cond, adv, grpo.GRPOSettings(**grpo.METHODS["grpo"]))
    assert any(n.startswith("diffloss.") and g.abs().sum() > 0 for n, g in g3.items())


def test_mte_on_predicted_positions_equals_mte_with_the_mask_restricted_to_p_i():
    """--mte-positions predicted = the released MTE with M_unc ∧ P_i of the trained step."""
    model = tiny_mar()
    model.diffloss.requires_grad_(False)
    record, cond = make_rollout(model)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    seeds = mte.sample_trajectories(model.diffloss, record.z_final, record.z_final_null, record.cfg_final,
                                    0.9, 3, record.steps[0].diff_steps, torch.Generator().manual_seed(1))
    uncertain = masks.top_k_mask(masks.token_uncertainty(seeds["x0"]), 0.5)  # (B, L)
    released = grpo.GRPOSettings(**grpo.METHODS["mar-grpo"])
    predicted = grpo.GRPOSettings(**dict(grpo.METHODS["mar-grpo"], mte_positions="predicted"))
    def grad(j, cfg, unc):  # the loss's gradient at AR step j, flattened over the trained parameters
        model.zero_grad()
        loss, stats, _ = policy.rollout_loss(model, model, record, j, cond, adv, cfg, seeds, unc)
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), stats

    differ = 0
    for j, step in enumerate(record.steps):
        restricted = uncertain & step.pred  # (B, L)
        want, _ = grad(j, released, restricted)
        got, stats = grad(j, predicted, uncertain)
        broad, _ = grad(j, released, uncertain)
        assert torch.equal(got, want)
        assert stats["uncertain_frac"] == restricted.gather(1, step.unk_idx).float().mean().item()
        if (uncertain & ~step.pred & step.unknown).any():  # uncertain unknown tokens outside P_i
            assert not torch.allclose(got, broad)
            differ += 1
    assert differ  # the rollout has a step where the two variants differ


def test_mte_seed_gradient_has_zero_mean_where_the_seeds_were_drawn():
    """A property of MTE (docs/method.md §4; docs/research_log.md): the seeds are head trajectories drawn under
    z_final, with each token's τ and w. On P_i they are evaluated under that same z (z_i = z_final),
    so each seed's ∇_z ℓ is the score of the distribution it was drawn from, whose mean is zero:
    E_{x ~ p(·|z)} ∇_z log p(x | z) = 0. The seeds' term (1/S) Σ_s ρ⁽ˢ⁾A therefore carries no
    gradient in expectation there (noise shrinking as 1/√S): on P_i, MTE removes the uncertain
    tokens from the policy gradient. Under another z (U_i outside P_i, the released placement)
    the mean does not vanish."""
    torch.manual_seed(0)
    head = DiffLoss(3, 16, 2, 32, "16", clip_denoised=True)
    with torch.no_grad():  # a head whose output depends on z (the official init zeroes the last layer)
        for p in head.parameters():
            p.add_(0.2 * torch.randn_like(p))
    L, S, D = 4, 2048, 16
    z_final = torch.randn(1, L, D)
    steps = torch.tensor([4, 2, 1])
    seeds = mte.sample_trajectories(head, z_final, None, None, 0.7, S, steps, torch.Generator().manual_seed(1))

    def grad_z(z_eval, s):  # ∇_z of the seeds' mean ℓ over the seeds `s` (a slice), all evaluated under z_eval
        z = z_eval.clone().requires_grad_(True)
        x_t, x_prev, std = (seeds[key][s].transpose(0, 1) for key in ("x_t", "x_prev", "std"))  # (K, S', 1, L, C)
        mean = rollout.transition_mean(head, x_t, steps, z.expand(x_t.shape[1], 1, L, D), None, 1.0)
        return torch.autograd.grad(transition_logprob(x_prev, mean, std).sum() / x_t.shape[1], z)[0]

    def ratio(z_eval):  # |mean over S seeds| / mean |one seed|
        single = torch.stack([grad_z(z_eval, slice(s, s + 1)).norm() for s in range(16)]).mean()
        return (grad_z(z_eval, slice(None)).norm() / single).item()

    assert ratio(z_final) < 3 / S ** 0.5  # ≈ 1/√S: zero mean
    assert ratio(z_final + 0.5 * torch.randn_like(z_final)) > 0.3  # another z: a real direction


def test_policy_positions_predicted_keeps_exactly_the_tokens_written_at_the_step(monkeypatch):
    """--policy-positions predicted: W = P_i, the tokens the trained step wrote into the image (the
    released W = U_i ∧ (H ∨ P_i) always contains P_i, so the consistency mask no longer matters)."""
    model = tiny_mar()
    model.diffloss.requires_grad_(False)
    record, cond = make_rollout(model)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    released = grpo.GRPOSettings(**grpo.METHODS["mar-grpo"], beta=0.0)
    predicted = grpo.GRPOSettings(**grpo.METHODS["mar-grpo"], beta=0.0, policy_positions="predicted")
    got = _loss_and_grads(model, record, cond, adv, predicted)
    assert all(0 < s.pred.sum() < s.unknown.sum() for s in record.steps[1:])  # P_i ⊊ U_i: the test can tell
    real = masks.consistency_mask
    monkeypatch.setattr(masks, "consistency_mask", lambda preview, prev, final, unknown, pred, tau: pred & unknown)
    want = _loss_and_grads(model, record, cond, adv, released)
    monkeypatch.setattr(masks, "consistency_mask", real)
    broad = _loss_and_grads(model, record, cond, adv, released)
    assert got[0] == pytest.approx(want[0], rel=1e-6) and got[0] != pytest.approx(broad[0], rel=1e-3)
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g)


def test_mte_trajectories_are_one_batched_head_call(monkeypatch):
    model = tiny_mar()
    record, _ = make_rollout(model)
    calls = []
    real = model.diffloss.sample
    monkeypatch.setattr(model.diffloss, "sample", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    seeds = mte.sample_trajectories(model.diffloss, record.z_final, record.z_final_null, record.cfg_final,
                                    0.9, 3, torch.tensor([8, 5, 2]), torch.Generator().manual_seed(0))
    assert calls == [torch.Size([2 * 3 * 4 * 16, 32])]
    assert seeds["x_t"].shape == (3, 3, 4, 16, 48) and seeds["x0"].shape == (3, 4, 16, 48)
    # seed s of position p is a head trajectory from z_final[p] with that token's guidance w
    g = torch.Generator().manual_seed(0)
    S, B, L = 3, 4, 16
    z = torch.cat([record.z_final.expand(S, B, L, 32).reshape(-1, 32), record.z_final_null.expand(S, B, L, 32).reshape(-1, 32)])
    x0 = real(z, 0.9, record.cfg_final.expand(S, B, L).reshape(-1), g)
    torch.testing.assert_close(seeds["x0"], x0.reshape(S, B, L, 48))
    assert len(set(record.cfg_final.flatten().tolist())) > 1  # tokens of different steps, different w
    u = masks.token_uncertainty(seeds["x0"])
    assert u.shape == (4, 16) and (u > 0).all()


def test_choose_train_steps():
    g = torch.Generator().manual_seed(0)
    ar, diff = grpo.choose_train_steps(64, 12, diffloss.trainable_steps(25), 10, g)
    assert len(ar) == 12 and ar == sorted(set(ar)) and all(0 <= i < 64 for i in ar)
    assert len(diff) == 10 and diff == sorted(set(diff), reverse=True)
    assert all(1 <= k <= 23 for k in diff)
    ar, diff = grpo.choose_train_steps(4, 12, diffloss.trainable_steps(5), 10, g)
    assert ar == [0, 1, 2, 3] and diff == [3, 2, 1]


# -----------------------------------------------------------------------------
# train.py: the smoke pipeline, torchrun, distributed gradients, resume

import subprocess
import sys

import train

REPO = Path(__file__).resolve().parent
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def run_train(*flags, torchrun=0, check=True, env=None, timeout=300):
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
           if torchrun else [sys.executable]) + [str(REPO / "train.py"), *flags]
    out = subprocess.run(cmd, cwd=REPO, env=env or ENV, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"{cmd} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def test_smoke_pipeline_end_to_end(tmp_path):
    out = tmp_path / "run"
    res = run_train("--preset", "smoke", "--out", str(out), "--threads", "1")
    for name in ["base.pt", "config.json", "metrics.jsonl", "curves.png", "ckpt/latest.pt",
                 "eval/base/results.jsonl", "eval/tuned/results.jsonl", "eval/tuned_train/results.jsonl",
                 "eval/summary.json"]:
        assert (out / name).exists(), name
    assert list((out / "samples").glob("step_*.png"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ["reward_mean", "reward_std", "adv_abs_mean", "kl", "policy_term", "grad_norm", "keep_frac",
                "uncertain_frac", "t_rollout", "t_reward", "t_update", "logp_parity_err", "diversity", "reward/shapes"]:
        assert key in rows[0] and math.isfinite(rows[0][key]), key
    assert max(r["logp_parity_err"] for r in rows) < 1e-4
    line = json.loads((out / "eval/tuned/results.jsonl").read_text().splitlines()[0])
    assert {"prompt", "file", "reward", "details"} <= line.keys() and (out / "eval/tuned" / line["file"]).exists()
    assert "held-out prompts" in res.stdout and "training-split prompts" in res.stdout and "accuracy" in res.stdout
    summary = json.loads((out / "eval/summary.json").read_text())
    assert set(summary) == {"base", "tuned", "base_train", "tuned_train"} and summary["base"]["n"] == 4
    ckpt = torch.load(out / "ckpt/latest.pt", weights_only=True)  # plain dicts only
    assert ckpt["step"] == 3 and isinstance(ckpt["config"], dict)
    # the cached base is reused by the next run in the same folder
    again = run_train("--preset", "smoke", "--out", str(out), "--steps", "1", "--eval-prompts", "0")
    assert "reusing the cached base model" in again.stdout


def test_seeded_generators_live_on_the_draws_device(smoke_base, monkeypatch):
    """No random draw of a GRPO step may use a generator of another device than the draw (a CUDA
    draw with a CPU generator raises), nor the global RNG (a resumed run would not repeat it).
    Every torch sampling function is wrapped to check both during a smoke GRPO step; processes.seeded
    puts its generator on the device it is given."""
    assert processes.seeded(torch.device("cpu"), 0, 1).device == torch.device("cpu")
    if torch.cuda.is_available():
        assert processes.seeded(torch.device("cuda"), 0, 1).device.type == "cuda"
    seen = []

    def checked(fn):
        def draw(*a, generator=None, device=None, **k):
            out = fn(*a, generator=generator, device=device, **k) if device is not None else fn(*a, generator=generator, **k)
            assert generator is not None, f"torch.{fn.__name__} drew from the global RNG"
            assert generator.device.type == out.device.type, (fn.__name__, generator.device, out.device)
            seen.append(fn.__name__)
            return out
        return draw
    for name in ("rand", "randn", "randint", "randperm"):
        monkeypatch.setattr(torch, name, checked(getattr(torch, name)))
    out = Path(str(smoke_base)).parent / "device_check"
    assert train.cli(["--preset", "smoke", "--stage", "grpo", "--init", str(smoke_base), "--steps", "1",
                      "--out", str(out), "--threads", "1"]) == 0
    assert {"rand", "randn"} <= set(seen)  # the checks ran: orders and the head's noise


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_smoke_pipeline_on_cuda(tmp_path):
    """The whole smoke pipeline (pretraining, rollouts, MTE, update under bf16 autocast,
    evaluation) on the GPU; recorded and recomputed log-probabilities still agree."""
    out = tmp_path / "cuda"
    run_train("--preset", "smoke", "--out", str(out), "--device", "cuda")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and max(r["logp_parity_err"] for r in rows) < 1e-3
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)


def test_resume_continues_identically(tmp_path, smoke_base):
    common = ["--preset", "smoke", "--stage", "grpo", "--init", str(smoke_base), "--save-every", "1"]
    run_train(*common, "--steps", "4", "--out", str(tmp_path / "full"))
    run_train(*common, "--steps", "2", "--out", str(tmp_path / "part"))
    run_train(*common, "--steps", "4", "--resume", "--out", str(tmp_path / "part"))

    def rows(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: {k: v for k, v in r.items() if not k.startswith("t_")} for r in map(json.loads, lines)}
    full, part = rows("full"), rows("part")
    assert sorted(part) == [0, 1, 2, 3]
    for s in (2, 3):
        assert full[s] == part[s], (s, full[s], part[s])
    a = torch.load(tmp_path / "full/ckpt/latest.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "part/ckpt/latest.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def _ddp_worker(rank, world, init_file, out_dir):
    """One rank of the distributed-gradient test: its own half of the rollouts, DDP backward."""
    torch.set_num_threads(1)
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model, records = _ddp_setup()
    record, cond, adv = records[rank]
    module = torch.nn.parallel.DistributedDataParallel(policy.PolicyLoss(model))
    cfg = grpo.GRPOSettings(**grpo.METHODS["grpo-fixed-head"])
    policy.backward_rollout(module, True, copy.deepcopy(model), record, cond, adv, cfg, None, None, [None] * 3, contextlib.nullcontext)
    torch.save({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, f"{out_dir}/grad{rank}.pt")
    dist.destroy_process_group()


def _ddp_setup():
    model = tiny_mar()
    model.diffloss.requires_grad_(False)
    model.text_emb.requires_grad_(False)
    records = []
    for r in range(2):
        record, cond = make_rollout(model, seed=100 + r)
        adv = grpo.group_advantages(torch.randn(4, generator=torch.Generator().manual_seed(r)), 2)
        records.append((record, cond, adv))
    return model, records


def test_ddp_gradient_equals_single_process(tmp_path):
    torch.multiprocessing.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    model, records = _ddp_setup()
    cfg = grpo.GRPOSettings(**grpo.METHODS["grpo-fixed-head"])
    loss_module = policy.PolicyLoss(model)
    for record, cond, adv in records:  # single process: both halves, accumulated
        policy.backward_rollout(loss_module, False, copy.deepcopy(model), record, cond, adv, cfg, None, None, [None] * 3, contextlib.nullcontext)
    g0, g1 = torch.load(tmp_path / "grad0.pt"), torch.load(tmp_path / "grad1.pt")
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        torch.testing.assert_close(g0[n], p.grad / 2, rtol=0, atol=1e-6)
        torch.testing.assert_close(g1[n], g0[n], rtol=0, atol=0)  # all-reduced: identical on both ranks


def test_clip_denoised_bounds_x0_and_keeps_parity():
    model = tiny_mar(clip_denoised=True)
    head = model.diffloss
    x = 50 * torch.randn(6, 48, generator=torch.Generator().manual_seed(0))
    _, _, x0 = head.p_mean_variance(x, 5, torch.randn(6, 32))
    assert x0.abs().max() <= 1.0
    _, _, x0_free = tiny_mar().diffloss.p_mean_variance(x, 5, torch.randn(6, 32))
    assert x0_free.abs().max() > 1.0
    record, cond = make_rollout(model)
    loss, stats, _ = policy.rollout_loss(model, model, record, 1, cond, torch.tensor([1.0, -1.0, 0.5, -0.5]),
                                         grpo.GRPOSettings())
    assert stats["logp_parity_err"] < 1e-4 and torch.isfinite(loss)


def test_gradient_step_moves_logp_toward_positive_advantages():
    """The sign of the whole objective: a small SGD step on the loss raises Σ_b A_b ℓ_b, the
    advantage-weighted log-probability of the recorded transitions (kept elements)."""
    model = tiny_mar()
    model.diffloss.requires_grad_(False)
    record, cond = make_rollout(model, cfg=2.0)
    adv = torch.tensor([1.5, -1.5, 0.5, -0.5])
    cfg = grpo.GRPOSettings(beta=0.0, tau=None)

    def weighted_logp():
        with torch.no_grad():
            total = 0.0
            for s in record.steps:
                z, z_null = policy.recompute_z(model, s, cond, guided=True)
                mean = rollout.transition_mean(model.diffloss, s.x_t, s.diff_steps, z, z_null, s.cfg)
                logp = transition_logprob(s.x_prev, mean, s.std).sum(dim=(0, 2, 3))  # (B,)
                total += (adv * logp).sum().item()
            return total

    before = weighted_logp()
    _loss_and_grads(model, record, cond, adv, cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 1e-4 * p.grad
    assert weighted_logp() > before


def test_bench_sections_run_at_smoke_size(capsys):
    """bench.py's figures at toy size: every section runs and reports ratios in their ranges."""
    import bench
    res = bench.main(["--preset", "smoke", "--sections", "step,reward,flops", "--repeats", "1"])
    step = res["step"]
    assert step["ratio"] > 0 and step["recording_overhead"] > 0 and step["record_bytes_per_image"] > 0
    assert 0.99 < sum(step["shares"].values()) < 1.01 and step["shares"]["mte"] > 0  # the MAR-GRPO step's parts
    assert 0 < res["flops"]["utilisation"] and res["reward"]["verifier_images_per_s_32px"] > 0
    assert "MAR-GRPO step / fixed-head GRPO step" in capsys.readouterr().out
