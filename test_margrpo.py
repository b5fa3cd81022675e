"""The test suite: CPU-only, tiny shapes, seeded; each test pins a piece of maths that a wrong
sign, mask or index would break. Sections follow the files: diffloss, mar, ..."""

import argparse
import json
import math
import os
from pathlib import Path

import pytest
import torch

import diffloss
import mar
from diffloss import DiffLoss, transition_logprob

torch.set_num_threads(1)  # tiny ops: threads only add contention on a 2-core machine

# verbatim copies of the project's shared/fixtures (official state-dict keys and shapes), kept in
# the repository so that a clean checkout tests against them
FIXTURES = Path(__file__).resolve().parent / "fixtures"
SHARED_FIXTURES = Path(__file__).resolve().parent.parent / "shared" / "fixtures"


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
    off = head.net.forward_with_cfg(torch.cat([x, x]), torch.cat([t, t]), torch.cat([zc, zu]), w)
    torch.testing.assert_close(off[:3, :48], eps)


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
            out = head.net.forward_with_cfg(torch.cat([img, img]), t, z, cfg)[:n]
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
    assert traj["x_t"].shape == (3, 5, 48) and traj["steps"].tolist() == [8, 4, 1]
    # all K steps at once, rows reversed: (K·N, C)
    K, N, C = traj["x_t"].shape
    zc, zu = z[:5].flip(0).repeat(K, 1), z[5:].flip(0).repeat(K, 1)
    mean, _, _ = head.p_mean_variance(traj["x_t"].flip(1).reshape(K * N, C), traj["steps"].repeat_interleave(N),
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

@pytest.mark.skipif(not SHARED_FIXTURES.exists(), reason="no shared/ beside this checkout")
def test_fixture_copies_are_verbatim():
    for name in ("mar_official_state_dict.json", "kl16_vae_state_dict.json"):
        assert (FIXTURES / name).read_bytes() == (SHARED_FIXTURES / name).read_bytes()


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
    cfg = mar.mar_config_from_state_dict(sd)
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
    loaded = mar.load_checkpoint(str(path))  # config inferred from shapes + pickled args
    assert not loaded.training
    torch.testing.assert_close(loaded.fake_latent, ema["fake_latent"])
    loaded = mar.load_checkpoint(str(path), ema=False, model=tiny_mar())
    torch.testing.assert_close(loaded.fake_latent, model.fake_latent)

    with pytest.raises(ValueError, match=r"does not fit.*wrong shape.*fake_latent \(1, 32\) vs \(1, 64\)"):
        mar.load_checkpoint(str(path), model=tiny_mar(encoder_embed_dim=64, decoder_embed_dim=64))
    with pytest.raises(ValueError, match=r"does not fit.*missing \['encoder_blocks.2"):
        mar.load_checkpoint(str(path), model=tiny_mar(encoder_depth=3))
    with pytest.raises(FileNotFoundError, match="--init"):
        mar.load_checkpoint(str(tmp_path / "nope.pth"))
    broken = tmp_path / "broken.pth"
    broken.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"--init .*broken.pth: cannot read checkpoint") as e:
        mar.load_checkpoint(str(broken))
    assert "\n" not in str(e.value)
    other = tmp_path / "other.pth"
    torch.save({"state_dict": {"w": torch.zeros(1)}}, other)
    with pytest.raises(ValueError, match="not a MAR checkpoint"):
        mar.load_checkpoint(str(other))
