"""NOVA's diffusion head as a policy of Gaussian transitions: its `DiffusionMLP` net (official
parameter names, so the `image_decoder.*` weights of a released NOVA load key for key) and two
samplers around it, both with the contract of diffloss.DiffLoss (p_mean_variance / sample /
trainable_steps / num_sampling_steps, step index k = 0 … T−1 with T−1 the noisiest):

(a) `DDPMHead`, ε-prediction with diffusers' `DDPMScheduler` arrays, "fixed_small" variance:
        x̂0 = (x − √(1−ᾱ_t) ε̂) / √ᾱ_t,   μ = √ᾱ_p β_t/(1−ᾱ_t) x̂0 + √α_t (1−ᾱ_p)/(1−ᾱ_t) x,
        σ² = β̃_t = β_t (1−ᾱ_p)/(1−ᾱ_t),   α_t = ᾱ_t/ᾱ_p,  β_t = 1 − α_t,
    with ᾱ_p the ᾱ of the previous *sampling* timestep (1 after the last one).
(b) `FlowSDEHead`, velocity prediction on diffusers' `FlowMatchEulerDiscreteScheduler` sigmas,
    sampled with the SDE step of MAR-GRPO (`sde_step_with_logprob`), noise level a = 0.7:
        s0 = a √(σ/(1−σ')),  σ' = σ except σ' = sigmas[1] at σ = 1,   dt = σ_next − σ < 0,
        μ = x (1 + s0² dt/(2σ)) + v̂ (1 + s0² (1−σ)/(2σ)) dt,   std = s0 √(−dt),   x̂0 = x − σ v̂.
The net sees the scheduler's timestep value (DDPM: the integer t; flow: σ·1000). Classifier-free
guidance mixes the whole net output, u + w (c − u), with z rows [cond; null] (NOVA's
`GuidanceScaler` with a constant scale). The policy log-probability of a transition is
diffloss.transition_logprob(x_prev, μ, τ·std), per element.

Where this file departs from the official code (NOVA `diffnext`, MAR-GRPO `transformer_3d.py`):
1. The net works on tokens (N, p·p·C) in NOVA's (p, p, C) patch layout instead of on a latent
   image plus `pred_ids`; its patch conv is applied as the equal linear map on a patch.
2. DDPM's last step (k = 0) has β̃ = 0: it adds no noise and has no density, so it is not
   trainable (`trainable_steps`). The released trainer gives it variance 1e-12 and trains it,
   which multiplies any rounding difference of the recomputed mean by 1e12 in the log-prob.
   The DDPM noisiest step is also left out when its α_t < 1e-4 (cosine-capped schedules; see
   `DDPMHead.trainable_steps`). log σ² is computed from β̃ clamped at 1e-20, as diffusers does.
3. Every flow SDE step adds noise (the last one goes σ = 1/1000 → 0 with std ≈ 7e-4), so all T
   steps are trainable, as in Flow-GRPO; the released trainer samples 10 of the 25 steps.
4. Temperature τ scales each step's noise std (the recorded std is τ·σ); the starting noise is
   N(0, I). NOVA has no temperature (the released trainer sets `image_gen_temperature = 1` and
   never uses it), so τ = 1 reproduces it.
5. NOVA samples its own images with the deterministic Euler (ODE) step x + v̂ dt;
   `FlowSDEHead.sample(..., ode=True)` does that (no log-probabilities: it has no density).
6. Schedule arrays are computed once per head in float64 from the diffusers scheduler and used
   in float32; the head always runs in fp32, also under autocast.
7. DDPM follows diffusers' `DDPMScheduler` (what MAR-GRPO's `posterior_mean_variance` runs),
   except that x̂0 is never clipped: NOVA's own `diffnext` DDPMScheduler ignores `clip_sample`
   and `thresholding` (clipping VAE latents to [-1, 1] would be wrong). NOVA's scheduler takes
   the previous timestep as t − 1000 // T, diffusers (and this file) the next timestep sampled;
   the two agree for "leading" spacing, NOVA's default and the fixture's.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler
from diffusers.models.embeddings import get_timestep_embedding

from diffloss import reverse_sample


# -----------------------------------------------------------------------------
# The net: NOVA's DiffusionMLP, token-wise (official parameter names)

class PatchEmbed(nn.Module):
    """A p×p stride-p conv (`proj`), applied to tokens in (p, p, C) layout as a linear map."""

    def __init__(self, image_dim, embed_dim, patch_size):
        super().__init__()
        self.proj = nn.Conv2d(image_dim, embed_dim, patch_size, patch_size)

    def forward(self, tokens):
        """tokens: (..., p·p·C) in (p, p, C) order -> (..., D)."""
        weight = self.proj.weight.permute(0, 2, 3, 1).flatten(1)  # (D, C, p, p) -> (D, p·p·C)
        return F.linear(tokens, weight, self.proj.bias)


class Projector(nn.Module):
    """fc1 -> SiLU -> fc2."""

    def __init__(self, dim, mlp_dim, out_dim):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, mlp_dim), nn.Linear(mlp_dim, out_dim)

    def forward(self, x):
        return self.fc2(F.silu(self.fc1(x)))


class AdaLayerNormZero(nn.Module):
    """LN(x)·(1 + scale) + shift, with (scale, shift, *rest) = proj(SiLU(y)); returns (h, rest)."""

    def __init__(self, dim, num_stats):
        super().__init__()
        self.proj = nn.Linear(dim, num_stats * dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
        self.num_stats = num_stats

    def forward(self, x, y):
        scale, shift, *rest = self.proj(F.silu(y)).chunk(self.num_stats, dim=-1)
        return self.norm(x) * (1 + scale) + shift, rest


class DiffusionBlock(nn.Module):
    """x + gate · LN(MLP(adaLN(x, y)))."""

    def __init__(self, dim):
        super().__init__()
        self.norm1 = AdaLayerNormZero(dim, num_stats=3)
        self.proj, self.norm2 = Projector(dim, dim, dim), nn.LayerNorm(dim)

    def forward(self, x, y):
        h, (gate,) = self.norm1(x, y)
        return x + self.norm2(self.proj(h)) * gate


class TimeCondEmbed(nn.Module):
    """y = condition_proj(z) + timestep_proj([cos | sin](t · 10000^(−i/128)))."""

    def __init__(self, cond_dim, embed_dim, freq_dim=256):
        super().__init__()
        self.timestep_proj = Projector(freq_dim, embed_dim, embed_dim)
        self.condition_proj = Projector(cond_dim, embed_dim, embed_dim)
        self.freq_dim = freq_dim

    def forward(self, timestep, z):
        freq = get_timestep_embedding(timestep, self.freq_dim, flip_sin_to_cos=True, downscale_freq_shift=0)  # (N, 256) [cos | sin]
        return self.condition_proj(z) + self.timestep_proj(freq.to(z.dtype))


class DiffusionMLP(nn.Module):
    """NOVA's denoiser. forward(x, timestep, z):
        x: (N, p·p·C) noisy tokens; timestep: (N,) scheduler timestep values; z: (N, D) conditions
    returns (N, p·p·C): ε̂ (DDPM) or the velocity v̂ = noise − x0 (flow matching)."""

    def __init__(self, depth, embed_dim, cond_dim, patch_size=2, image_dim=4):
        super().__init__()
        self.patch_embed = PatchEmbed(image_dim, embed_dim, patch_size)
        self.time_cond_embed = TimeCondEmbed(cond_dim, embed_dim)
        self.blocks = nn.ModuleList(DiffusionBlock(embed_dim) for _ in range(depth))
        self.norm = AdaLayerNormZero(embed_dim, num_stats=2)
        self.head = nn.Linear(embed_dim, patch_size ** 2 * image_dim)

    def forward(self, x, timestep, z):
        x, y = self.patch_embed(x), self.time_cond_embed(timestep, z)  # (N, W) each
        for block in self.blocks:
            x = block(x, y)
        return self.head(self.norm(x, y)[0])


# -----------------------------------------------------------------------------
# Heads: the net plus a sampler whose transitions are Gaussians

class TransitionHead(nn.Module):
    """The shared part of both heads: guided net calls, ancestral sampling with recording.

    Subclasses set `self.arrays` (dict of (T,) float64 CPU tensors indexed by step k, including
    "timesteps", the value the net sees) and implement `gaussian(x_t, k, out)` (the transition's
    mean, log-variance and x̂0 from the guided net output), `noisy(k)` and `trainable_steps()`.
    """

    def __init__(self, net):
        super().__init__()
        self.net = net
        self._on_device = {}

    @property
    def num_sampling_steps(self):
        return len(self.arrays["timesteps"])

    def arr(self, name, k, like):
        """Schedule array `name` at step k (an int: every row) or step indices k (N,), as (N, 1) in
        like's device and dtype (N = like's rows). An int k indexes on the host side: no sync."""
        key = (like.device, like.dtype)
        if key not in self._on_device:  # copy the small arrays to a device once
            self._on_device[key] = {n: a.to(like.device, like.dtype) for n, a in self.arrays.items()}
        a = self._on_device[key][name]
        return (a[k].expand(like.shape[0]) if isinstance(k, int) else a[k])[:, None]

    @staticmethod
    def step_rows(t, n):
        """A step as `arr` takes it: an int stays one, a tensor becomes (n,) long indices."""
        return t if isinstance(t, int) else t.long().reshape(-1).expand(n)

    def model_output(self, x_t, t, z, cfg=1.0):
        """The (guided) net output at sampling step t.

        x_t: (N, C); t: int or (N,) step indices; z: (N, D), or (2N, D) = [cond; null] for guidance
        with weight cfg (float or (N,) tensor). returns (N, C) = u + w (c − u), or the plain output.
        """
        n = x_t.shape[0]
        k = self.step_rows(t, n)
        guided = z.shape[0] == 2 * n
        x_in = torch.cat([x_t, x_t]) if guided else x_t  # (N or 2N, C)
        timestep = self.arr("timesteps", k, x_t)[:, 0].repeat(2 if guided else 1)
        out = self.net(x_in, timestep, z)
        if not guided:
            return out
        w = cfg.to(out.dtype).reshape(-1, 1) if torch.is_tensor(cfg) else cfg  # a float stays a Python number
        cond, null = out[:n], out[n:]
        return null + w * (cond - null)

    def p_mean_variance(self, x_t, t, z, cfg=1.0):
        """The Gaussian transition x^t -> x^{t-1}, differentiable in z and in the net.

        x_t: (N, C); t: int or (N,) step indices 0 … T−1 (T−1 noisiest); z: (N, D), or (2N, D) =
        [cond; null] for guidance with weight cfg (float or (N,) tensor).
        returns (mean, log_variance, pred_x0), each (N, C), for the (guided) rows.
        """
        if torch.is_autocast_enabled(x_t.device.type):  # the head always runs in fp32
            with torch.autocast(x_t.device.type, enabled=False):
                return self.p_mean_variance(x_t.float(), t, z.float(), cfg)
        k = self.step_rows(t, x_t.shape[0])
        return self.gaussian(x_t, k, self.model_output(x_t, k, z, cfg))

    def sample(self, z, temperature=1.0, cfg=1.0, generator=None, record_steps=None):
        """Ancestral sampling from step T−1 down to 0: diffloss.reverse_sample with this head (its
        arguments and returns; the starting noise is N(0, I), τ scales each step's noise std)."""
        return reverse_sample(self, z, self.net.head.out_features, temperature, cfg, generator, record_steps)


def _scheduler(cls, config, num_steps):
    """A diffusers scheduler from a config dict, with `num_steps` sampling steps, on the CPU."""
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.device("cpu"):  # also when the model is built under torch.device("meta")
        scheduler = cls.from_config(config)
        scheduler.set_timesteps(int(num_steps))
    return scheduler


class DDPMHead(TransitionHead):
    """ε-prediction DDPM with β̃ ("fixed_small") variance, on diffusers' `DDPMScheduler`."""

    def __init__(self, net, scheduler_config, num_sampling_steps):
        super().__init__(net)
        sch = _scheduler(DDPMScheduler, scheduler_config, num_sampling_steps)
        if sch.config.prediction_type != "epsilon" or sch.config.variance_type not in ("fixed_small", "fixed_small_log"):
            raise ValueError(f"scheduler: DDPMHead needs prediction_type 'epsilon' and a fixed_small variance, got "
                             f"{sch.config.prediction_type!r} / {sch.config.variance_type!r}")
        ts = sch.timesteps.flip(0).long()  # (T,) ascending: ts[k] is the timestep of step k
        prev = torch.stack([torch.as_tensor(sch.previous_timestep(t)) for t in ts]).long()  # -1 after the last
        acp = sch.alphas_cumprod.double()
        acp_t = acp[ts]
        acp_p = torch.where(prev >= 0, acp[prev.clamp(min=0)], torch.ones_like(acp_t))
        alpha = acp_t / acp_p
        beta = 1 - alpha
        self.arrays = dict(
            timesteps=ts.double(), alpha=alpha,
            sqrt_recip_acp=acp_t.rsqrt(), sqrt_recipm1_acp=(1 / acp_t - 1).sqrt(),
            coef_x0=acp_p.sqrt() * beta / (1 - acp_t), coef_xt=alpha.sqrt() * (1 - acp_p) / (1 - acp_t),
            log_var=torch.log((beta * (1 - acp_p) / (1 - acp_t)).clamp(min=1e-20)))
        top = len(ts) - 1  # decided once, on the host (see trainable_steps)
        self.trainable = range(1, top if top > 0 and float(alpha[top]) < 1e-4 else top + 1)

    def gaussian(self, x_t, k, eps):
        pred_x0 = self.arr("sqrt_recip_acp", k, x_t) * x_t - self.arr("sqrt_recipm1_acp", k, x_t) * eps
        mean = self.arr("coef_x0", k, x_t) * pred_x0 + self.arr("coef_xt", k, x_t) * x_t
        return mean, self.arr("log_var", k, x_t).expand_as(x_t), pred_x0

    def noisy(self, k):
        return k > 0  # the last step's β̃ is 0: x_prev = μ

    def trainable_steps(self):
        """Steps 1 … T−1: step 0 adds no noise (no density). The noisiest step is left out too
        when its α_t < 1e-4 (a cosine schedule capped at β = 0.999): there μ amplifies the float32
        rounding of ε̂ by 1/√α_t relative to σ, and its log-probability cannot be recomputed to
        1e-5. NOVA's scaled-linear schedules keep it (α_t ≈ 0.6 at T = 25)."""
        return self.trainable


class FlowSDEHead(TransitionHead):
    """Velocity prediction on diffusers' `FlowMatchEulerDiscreteScheduler`, sampled with the SDE
    step of MAR-GRPO (noise level `noise_level`), or NOVA's Euler ODE step with `ode=True`."""

    def __init__(self, net, scheduler_config, num_sampling_steps, noise_level=0.7):
        super().__init__(net)
        sch = _scheduler(FlowMatchEulerDiscreteScheduler, scheduler_config, num_sampling_steps)
        if sch.config.use_dynamic_shifting:
            raise ValueError("scheduler: dynamic shifting (resolution-dependent mu) is not supported")
        sigmas = sch.sigmas.double()  # (T+1,) descending, last 0; scheduler position s = T−1−k
        sigma, sigma_next = sigmas[:-1].flip(0), sigmas[1:].flip(0)  # (T,) indexed by k
        dt = sigma_next - sigma
        sigma_cap = torch.where(sigma == 1, sigmas[1], sigma)  # σ' (MAR-GRPO's sigma_max = sigmas[1])
        s0_sq = (noise_level * (sigma / (1 - sigma_cap)).sqrt()) ** 2
        self.arrays = dict(
            timesteps=sch.timesteps.double().flip(0), sigma=sigma, dt=dt,
            coef_x=1 + s0_sq * dt / (2 * sigma), coef_v=(1 + s0_sq * (1 - sigma) / (2 * sigma)) * dt,
            log_var=torch.log(s0_sq * -dt))

    def gaussian(self, x_t, k, v):
        mean = self.arr("coef_x", k, x_t) * x_t + self.arr("coef_v", k, x_t) * v
        pred_x0 = x_t - self.arr("sigma", k, x_t) * v
        return mean, self.arr("log_var", k, x_t).expand_as(x_t), pred_x0

    def ode_step(self, x_t, t, z, cfg=1.0):
        """NOVA's own (deterministic Euler) step: x + v̂ dt. Same arguments as p_mean_variance."""
        k = self.step_rows(t, x_t.shape[0])
        return x_t + self.arr("dt", k, x_t) * self.model_output(x_t, k, z, cfg)

    @torch.no_grad()
    def sample(self, z, temperature=1.0, cfg=1.0, generator=None, record_steps=None, ode=False):
        """As `TransitionHead.sample`; ode=True runs NOVA's deterministic Euler sampler instead."""
        if not ode:
            return super().sample(z, temperature, cfg, generator, record_steps)
        if record_steps is not None:
            raise ValueError("record_steps: the ODE sampler has no transition densities")
        guided = torch.is_tensor(cfg) or cfg != 1.0
        x = torch.randn(z.shape[0] // (2 if guided else 1), self.net.head.out_features, device=z.device,
                        generator=generator)
        for k in range(self.num_sampling_steps - 1, -1, -1):
            x = self.ode_step(x, k, z.float(), cfg)
        return x

    def noisy(self, k):
        return True

    def trainable_steps(self):
        """All steps 0 … T−1: every SDE step adds noise (std ≈ 7e-4 even at the last one)."""
        return range(self.num_sampling_steps)


HEADS = {"DDPMScheduler": DDPMHead, "FlowMatchEulerDiscreteScheduler": FlowSDEHead}


def make_head(net, scheduler_config, num_sampling_steps):
    """The head for a diffusers scheduler config dict: its "_sample_class_name" (diffnext's key
    for the sampling scheduler) or else its "_class_name" selects it."""
    name = scheduler_config.get("_sample_class_name", scheduler_config.get("_class_name"))
    if name not in HEADS:
        raise ValueError(f"scheduler: _class_name {name!r} is not one of {sorted(HEADS)}")
    return HEADS[name](net, scheduler_config, num_sampling_steps)
