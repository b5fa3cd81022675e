"""The diffusion head of MAR ("Diffusion Loss", docs/method.md §1; §10, the official respacing to
T of the 1000 cosine-schedule steps): a small MLP turns a condition z ∈ R^D into a token x ∈ R^C by
T-step ancestral DDPM, whose transitions' per-element log-probability is the policy's (§2):

    x^T ~ N(0, I)
    x^{t-1} = μ(x^t, t, z) + τ σ_t(x^t, t, z) ε,     ε ~ N(0, I),  no noise at the last step
    μ = c1_t · x̂0 + c2_t · x^t,   x̂0 = (x^t − √(1−ᾱ_t) ε̂) / √ᾱ_t
    log σ_t² = (v+1)/2 · log β_t + (1 − (v+1)/2) · log β̃_t     (β̃: posterior variance)
    ε̂ = ε_u + w (ε_c − ε_u)                                  (guidance: the ε channels only)
    ℓ = −(x^{t-1} − μ)² / (2 s²) − log s − ½ log 2π,        s = τ σ_t (taken from the rollout)
"""

import math

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint
from diffusers import DDPMScheduler
from diffusers.models.embeddings import get_timestep_embedding

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


# -----------------------------------------------------------------------------
# The network: an MLP with adaLN conditioning (names and init as the official code)

def modulate(x, shift, scale):
    return x * (1 + scale) + shift


class TimestepEmbedder(nn.Module):
    """Sinusoidal embedding of a (possibly fractional) timestep, then a 2-layer MLP."""

    def __init__(self, hidden_size, frequency_embedding_size=256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(frequency_embedding_size, hidden_size), nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size))
        self.frequency_embedding_size = frequency_embedding_size

    def forward(self, t):
        # [cos | sin] of t · 10000^(−k/half): diffusers' function computes the official (DiT)
        # features
        t_freq = get_timestep_embedding(t, self.frequency_embedding_size, flip_sin_to_cos=True,
                                        downscale_freq_shift=0)  # (N, 256)
        return self.mlp(t_freq.to(self.mlp[0].weight.dtype))


class ResBlock(nn.Module):
    """x + gate * MLP(modulate(LN(x), shift, scale)), with (shift, scale, gate) from y."""

    def __init__(self, channels):
        super().__init__()
        self.channels = channels
        self.in_ln = nn.LayerNorm(channels, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(channels, channels), nn.SiLU(),
                                 nn.Linear(channels, channels))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(),
                                              nn.Linear(channels, 3 * channels, bias=True))

    def forward(self, x, y):
        shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(y).chunk(3, dim=-1)
        return x + gate_mlp * self.mlp(modulate(self.in_ln(x), shift_mlp, scale_mlp))


class FinalLayer(nn.Module):
    def __init__(self, model_channels, out_channels):
        super().__init__()
        self.norm_final = nn.LayerNorm(model_channels, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(model_channels, out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(),
                                              nn.Linear(model_channels, 2 * model_channels,
                                                        bias=True))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class SimpleMLPAdaLN(nn.Module):
    """The denoising MLP of the diffusion head. forward(x, t, c):
        x: (N, C_in) noisy tokens x^t
        t: (N,) original diffusion timesteps (0 … 999), or one 0-dim timestep for all rows
        c: (N, D) condition vectors z from the MAR decoder
    returns (N, C_out) = [ε̂ (C_in) | v (C_in)] for the learned-range variance.
    """

    def __init__(self, in_channels, model_channels, out_channels, z_channels, num_res_blocks,
                 grad_checkpointing=False):
        super().__init__()
        self.in_channels, self.model_channels, self.out_channels = (
            in_channels, model_channels, out_channels)
        self.num_res_blocks, self.grad_checkpointing = num_res_blocks, grad_checkpointing

        self.time_embed = TimestepEmbedder(model_channels)
        self.cond_embed = nn.Linear(z_channels, model_channels)
        self.input_proj = nn.Linear(in_channels, model_channels)
        self.res_blocks = nn.ModuleList([ResBlock(model_channels) for _ in range(num_res_blocks)])
        self.final_layer = FinalLayer(model_channels, out_channels)
        self.initialize_weights()

    def initialize_weights(self):
        def _basic_init(module):
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.constant_(module.bias, 0)
        self.apply(_basic_init)
        nn.init.normal_(self.time_embed.mlp[0].weight, std=0.02)
        nn.init.normal_(self.time_embed.mlp[2].weight, std=0.02)
        # adaLN modulations and the output layer start at zero, as in DiT
        zeroed = [b.adaLN_modulation[-1] for b in self.res_blocks] + [
            self.final_layer.adaLN_modulation[-1], self.final_layer.linear]
        for p in (p for layer in zeroed for p in layer.parameters()):
            nn.init.constant_(p, 0)

    def forward(self, x, t, c):
        x = self.input_proj(x)
        # a 0-dim t (sampling: one step for all rows) runs the time MLP once; no host sync
        # either way
        # (N, W), or (1, W) broadcast + (N, W)
        y = self.time_embed(t.reshape(-1)) + self.cond_embed(c)
        for block in self.res_blocks:
            x = (checkpoint(block, x, y, use_reentrant=False)
                 if self.grad_checkpointing and torch.is_grad_enabled() else block(x, y))
        return self.final_layer(x, y)


# -----------------------------------------------------------------------------
# The noise schedule: diffusers' arrays, respaced as the official code does

def respaced_timesteps(num_sampling_steps, num_train_timesteps=1000):
    """The original timesteps kept by the sampler, ascending: diffusers' "linspace" spacing,
    round(linspace(0, 999, T)), which is the official `space_timesteps(1000, "T")`."""
    scheduler = DDPMScheduler(num_train_timesteps=num_train_timesteps,
                              beta_schedule="squaredcos_cap_v2", variance_type="learned_range",
                              timestep_spacing="linspace", clip_sample=False)
    scheduler.set_timesteps(int(num_sampling_steps))
    return scheduler.timesteps.flip(0).long(), scheduler.betas.double()


class GaussianSchedule(nn.Module):
    """Arrays of a (respaced) DDPM schedule, indexed by step k = 0 … K−1, as float32 buffers.

    `timesteps[k]` is the original timestep fed to the net. All other arrays follow
    improved-DDPM: β_k = 1 − ᾱ_k / ᾱ_{k−1} over the kept steps, posterior
    q(x_{k−1} | x_k, x0) coefficients and its variance β̃_k (log clipped at k = 0 to β̃_1, as
    the official code does).
    """

    def __init__(self, num_steps, num_train_timesteps=1000):
        super().__init__()
        timesteps, base_betas = respaced_timesteps(num_steps, num_train_timesteps)
        base_alphas_cumprod = torch.cumprod(1.0 - base_betas, dim=0)  # float64 (1000,)
        alphas_cumprod = base_alphas_cumprod[timesteps]  # (K,)
        alphas_cumprod_prev = torch.cat([torch.ones(1, dtype=torch.float64), alphas_cumprod[:-1]])
        betas = 1.0 - alphas_cumprod / alphas_cumprod_prev
        posterior_variance = betas * (1.0 - alphas_cumprod_prev) / (1.0 - alphas_cumprod)
        clipped = (torch.cat([posterior_variance[1:2], posterior_variance[1:]]) if len(betas) > 1
                   else betas)
        arrays = dict(betas=betas, log_betas=torch.log(betas), alphas_cumprod=alphas_cumprod,
                      sqrt_alphas_cumprod=alphas_cumprod.sqrt(),
                      sqrt_one_minus_alphas_cumprod=(1.0 - alphas_cumprod).sqrt(),
                      sqrt_recip_alphas_cumprod=(1.0 / alphas_cumprod).sqrt(),
                      sqrt_recipm1_alphas_cumprod=(1.0 / alphas_cumprod - 1.0).sqrt(),
                      posterior_log_variance_clipped=torch.log(clipped),
                      posterior_mean_coef1=(betas * alphas_cumprod_prev.sqrt()
                                            / (1.0 - alphas_cumprod)),
                      posterior_mean_coef2=((1.0 - alphas_cumprod_prev) * (1.0 - betas).sqrt()
                                            / (1.0 - alphas_cumprod)))
        self.num_steps = len(timesteps)
        self.register_buffer("timesteps", timesteps, persistent=False)
        for name, value in arrays.items():
            self.register_buffer(name, value.float(), persistent=False)

    def q_posterior(self, x0, x_t, k):
        """Mean and clipped log-variance of q(x_{k−1} | x_k, x0). x0, x_t: (N, C); k: (N,) or
        int."""
        mean = self.posterior_mean_coef1[k, None] * x0 + self.posterior_mean_coef2[k, None] * x_t
        return mean, self.posterior_log_variance_clipped[k, None].expand_as(x_t)

    def p_mean_variance(self, eps, v, x_t, k, clip_denoised=False):
        """Model mean, log-variance and x̂0 from the net's ε̂ and v. All (N, C); k: (N,) or int.
        clip_denoised clamps x̂0 to [-1, 1] before it enters the mean (for pixel tokens)."""
        frac = (v + 1) / 2
        log_variance = (frac * self.log_betas[k, None]
                        + (1 - frac) * self.posterior_log_variance_clipped[k, None])
        pred_x0 = (self.sqrt_recip_alphas_cumprod[k, None] * x_t
                   - self.sqrt_recipm1_alphas_cumprod[k, None] * eps)
        if clip_denoised:
            pred_x0 = pred_x0.clamp(-1, 1)
        mean, _ = self.q_posterior(pred_x0, x_t, k)
        return mean, log_variance, pred_x0


# -----------------------------------------------------------------------------
# Training-loss helpers (improved DDPM: ε-MSE + variational bound for the variance)

def normal_kl(mean1, logvar1, mean2, logvar2):
    """KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)), elementwise, in nats."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2)
                  + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def discretized_gaussian_log_likelihood(x, means, log_scales):
    """log-likelihood of x ∈ [-1, 1] under a Gaussian discretised to 256 bins (the t = 0 decoder
    term of the variational bound), elementwise. Uses the tanh approximation of the normal CDF."""
    def cdf(u):
        return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (u + 0.044715 * u ** 3)))
    centered = x - means
    inv_stdv = torch.exp(-log_scales)
    cdf_plus = cdf(inv_stdv * (centered + 1.0 / 255.0))
    cdf_min = cdf(inv_stdv * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_cdf_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus,
                       torch.where(x > 0.999, log_one_minus_cdf_min, log_cdf_delta))


# -----------------------------------------------------------------------------
# The policy's per-element transition log-probability (docs/method.md §2:
# ℓ = −(x − μ)²/(2s²) − log s − ½ log 2π)

def transition_logprob(x_prev, mean, std):
    """ℓ = −(x_prev − μ)² / (2 s²) − log s − ½ log 2π, elementwise, no reduction.

    x_prev: (..., C) the recorded x^{t-1};  mean: (..., C) μ (carries the gradient);
    std: (..., C) s = τ σ_t, held fixed (detach it before calling if it came from the model).
    """
    return -((x_prev - mean) ** 2) / (2 * std ** 2) - torch.log(std) - LOG_SQRT_2PI


def trainable_steps(num_steps):
    """Sampling steps k whose transitions RL may train: 1 … T−2. k = 0 adds no noise (no
    density). k = T−1 leaves pure noise: its mean is x/√α − (…)ε̂ with
    α = ᾱ_999/ᾱ_{t_{T−2}} ≈ 1e-7 (the cosine schedule's β cap of 0.999), so float32
    rounding of ε̂ (~1e-7, batch-layout dependent) moves μ by ~1e-3 σ: its ℓ cannot be
    recomputed reproducibly (the parity of docs/method.md §2, recomputed
    ℓ = −(x − μ)²/(2s²) − log s − ½ log 2π equal to the recorded one, fails). The
    released trainers record every step; this one is left out."""
    return range(1, num_steps - 1)


# -----------------------------------------------------------------------------
# The head

class DiffLoss(nn.Module):
    """Diffusion head: training loss, guided posterior mean/variance, and ancestral sampling.

    target_channels: C, the token size; z_channels: D; depth/width: the MLP's residual blocks
    and width; num_sampling_steps: T (int or the official string, e.g. "100");
    clip_denoised: clamp x̂0 to [-1, 1] when sampling (VAE latents: no, as official; pixel
    tokens: yes).
    """

    def __init__(self, target_channels, z_channels, depth, width, num_sampling_steps,
                 grad_checkpointing=False, clip_denoised=False):
        super().__init__()
        self.in_channels, self.clip_denoised = target_channels, clip_denoised
        self.net = SimpleMLPAdaLN(in_channels=target_channels, model_channels=width,
                                  z_channels=z_channels,
                                  # ε and the variance interpolation v
                                  out_channels=target_channels * 2,
                                  num_res_blocks=depth, grad_checkpointing=grad_checkpointing)
        self.train_schedule = GaussianSchedule(1000)
        self.gen_schedule = GaussianSchedule(int(num_sampling_steps))

    num_sampling_steps = property(lambda self: self.gen_schedule.num_steps)

    # the sampling steps RL may train (the policy interface; `trainable_steps`)
    def trainable_steps(self):
        return trainable_steps(self.num_sampling_steps)

    def forward(self, target, z, mask=None, generator=None):
        """The official training loss: ε-MSE + variational-bound term (bits) for the variance.

        target: (N, C) clean tokens; z: (N, D) conditions; mask: (N,) weights (1 = counts);
        returns a scalar (mean over the masked rows).
        """
        sched = self.train_schedule
        n, c = target.shape
        t = torch.randint(0, sched.num_steps, (n,), device=target.device, generator=generator)
        noise = torch.randn(target.shape, device=target.device, dtype=target.dtype,
                            generator=generator)
        x_t = (sched.sqrt_alphas_cumprod[t, None] * target
               + sched.sqrt_one_minus_alphas_cumprod[t, None] * noise)
        eps, v = self.net(x_t, sched.timesteps[t], z).split(c, dim=1)  # (N, C) each
        mse = ((noise - eps) ** 2).mean(dim=1)
        # the variance is trained through the bound only; ε̂ is frozen there (improved DDPM)
        mean, log_variance, _ = sched.p_mean_variance(eps.detach(), v, x_t, t)
        true_mean, true_log_variance = sched.q_posterior(target, x_t, t)
        kl = normal_kl(true_mean, true_log_variance, mean, log_variance).mean(dim=1) / math.log(2.0)
        nll = (-discretized_gaussian_log_likelihood(target, mean, 0.5 * log_variance).mean(dim=1)
               / math.log(2.0))
        loss = mse + torch.where(t == 0, nll, kl)  # (N,)
        if mask is not None:
            return (loss * mask).sum() / mask.sum()
        return loss.mean()

    def p_mean_variance(self, x_t, t, z, cfg=1.0):
        """One reverse step's Gaussian, differentiable in z and in the net.

        x_t: (N, C) noisy tokens at sampling step t
        t:   int (one step for all rows: what the sampler and the loss pass) or a tensor, (N,) or
             0-dim, of sampling-step indices 0 … T−1 (T−1 = pure noise)
        z:   (N, D) conditions, or (2N, D) = [cond; null] for classifier-free guidance
        cfg: guidance scale w, a float or (N,) tensor; used only when z has 2N rows
        returns (mean, log_variance, pred_x0), each (N, C), for the guided rows.
        An int step indexes the schedule on the host side and a float w stays a Python number, so a
        call makes no host-device copy and no sync (a tensor built from a Python number would).
        """
        if torch.is_autocast_enabled(x_t.device.type):  # the head always runs in fp32
            with torch.autocast(x_t.device.type, enabled=False):
                mean, log_variance, pred_x0 = self.p_mean_variance(x_t.float(), t, z.float(), cfg)
            return mean, log_variance, pred_x0
        sched = self.gen_schedule
        n, c = x_t.shape
        guided = z.shape[0] == 2 * n
        x_in = torch.cat([x_t, x_t], dim=0) if guided else x_t  # (N or 2N, C)
        if isinstance(t, int):  # one step: a 0-dim timestep, the time MLP runs once
            t_net, k = sched.timesteps[t], t
        else:
            k = t.long().reshape(-1).expand(n)  # (N,), also from a 0-dim tensor
            t_net = sched.timesteps[k].repeat(2 if guided else 1)  # (N or 2N,)
        out = self.net(x_in, t_net, z)  # (N or 2N, 2C)
        eps, v = out[:n, :c], out[:n, c:]  # conditional rows; v is never guided
        if guided:
            w = cfg.to(x_t.dtype).reshape(-1, 1) if torch.is_tensor(cfg) else cfg
            eps_null = out[n:, :c]
            eps = eps_null + w * (eps - eps_null)
        return sched.p_mean_variance(eps, v, x_t, k, self.clip_denoised)

    def noisy(self, k):  # whether sampling step k adds noise: all but the last, k = 0
        return k > 0

    def sample(self, z, temperature=1.0, cfg=1.0, generator=None, record_steps=None):
        """Ancestral sampling of tokens from conditions (docs/method.md §1: x^T ~ N(0, I),
        x^{t−1} = μ + τ σ_t ε): `reverse_sample` with this head."""
        return reverse_sample(self, z, self.in_channels, temperature, cfg, generator, record_steps)


# -----------------------------------------------------------------------------
# The reverse loop every head shares (MAR's, Harmon's and NOVA's heads)

def step_list(steps):  # sampling-step indices as Python ints (one host sync if a device tensor)
    return steps.tolist() if torch.is_tensor(steps) else [int(k) for k in steps]


@torch.no_grad()
def reverse_sample(head, z, channels, temperature=1.0, cfg=1.0, generator=None, record_steps=None,
                   x_T=None, noise=None):
    """Ancestral sampling from step T−1 down to 0 with any head that has `p_mean_variance(x_t, k,
    z, cfg)`, `noisy(k)`, `trainable_steps()` and `num_sampling_steps`, recording chosen
    transitions.

    z: (N, D), or (2N, D) = [cond; null] when guided (cfg a tensor or cfg != 1; the official layout:
       the two halves share their noise); channels: C, the token size; temperature: τ scales each
       step's noise std (x^T is N(0, I): the notes at the end, item 2); cfg: w, a float or (N,)
       tensor;
    record_steps: optional sampling-step indices k in `head.trainable_steps()` (ints, or a tensor)
       whose transitions x^k → x^{k−1} are recorded for log-probability recomputation;
    x_T, noise: given draws instead of the generator's, x_T (N, C) and {k: (N, C)} per noisy step.
    returns x0: (N, C), and when record_steps is given also a dict with x_t, x_prev, std = τ σ,
       logp, each (K, N, C), and steps: the K recorded step indices in sampling order (list of int).
    Nothing in the loop syncs with the device: steps are Python ints, w a float or a tensor."""
    guided = torch.is_tensor(cfg) or cfg != 1.0  # the official rule: z is doubled iff cfg != 1
    if guided and z.shape[0] % 2:
        raise ValueError(f"with cfg != 1, z must hold [cond; null] rows; got {z.shape[0]} rows")
    n = z.shape[0] // 2 if guided else z.shape[0]
    z = z.float()  # the head samples in fp32, also under bf16 autocast
    record = {} if record_steps is None else dict.fromkeys(step_list(record_steps))
    if any(k not in head.trainable_steps() for k in record):
        raise ValueError(f"record_steps must lie in {head.trainable_steps()} "
                         f"(see trainable_steps); got {sorted(record)}")
    x = (torch.randn(n, channels, device=z.device, dtype=z.dtype, generator=generator)
         if x_T is None else x_T)
    for k in range(head.num_sampling_steps - 1, -1, -1):
        mean, log_variance, _ = head.p_mean_variance(x, k, z, cfg)
        if not head.noisy(k):  # DDPM's last step adds no noise
            x_prev = mean
        else:
            std = temperature * torch.exp(0.5 * log_variance)
            eps = (torch.randn(x.shape, device=x.device, dtype=x.dtype, generator=generator)
                   if noise is None else noise[k])
            x_prev = mean + std * eps
            if k in record:
                record[k] = (x, x_prev, std, transition_logprob(x_prev, mean, std))
        x = x_prev
    if record_steps is None:
        return x
    steps = sorted(record, reverse=True)  # in sampling order
    x_t, x_prev, std, logp = (torch.stack([record[k][i] for k in steps]) for i in range(4))
    return x, dict(x_t=x_t, x_prev=x_prev, std=std, logp=logp, steps=steps)


def transition_mean(head, x_t, steps, z, z_null, w, checkpoint_head=True):
    """μ of recorded transitions, differentiable in z and the head (any head with the
    `p_mean_variance` contract of DiffLoss: MAR's, Harmon's, NOVA's).

    x_t: (K, *rows, C) noisy tokens (rows: (B, n) or (S, B, n)); steps: the K sampling steps (ints);
    z, z_null: (*rows, D) conditions broadcast over K (z_null None without guidance); w: guidance;
    checkpoint_head: with gradients on, keep no head activations: each diffusion step's head call is
      recomputed in the backward pass (torch.utils.checkpoint), so a trained AR step holds one head
      graph at a time instead of K (S × K with MTE); same values and gradients, two forwards.
    returns μ: (K, *rows, C). One call per diffusion step with an int step, as the sampler makes
    it: the same arithmetic, so recomputed and recorded ℓ agree to float rounding
    (docs/method.md §2: ℓ = −(x − μ)²/(2s²) − log s − ½ log 2π).
    """
    K, C = x_t.shape[0], x_t.shape[-1]
    n = x_t[0, ..., 0].numel()  # rows per diffusion step
    z_rows = z.reshape(n, -1)  # (n, D)
    if z_null is not None:
        z_rows = torch.cat([z_rows, z_null.reshape(n, -1)])  # (2n, D) = [cond; null]
    steps = step_list(steps)

    def mean_at(x, rows, k):
        return head.p_mean_variance(x, k, rows, w)[0]
    store = checkpoint_head and torch.is_grad_enabled()
    mean = [checkpoint(mean_at, x_t[j].reshape(n, C), z_rows, steps[j], use_reentrant=False,
                       preserve_rng_state=False)
            if store else mean_at(x_t[j].reshape(n, C), z_rows, steps[j]) for j in range(K)]
    return torch.stack(mean).reshape(x_t.shape)


# -----------------------------------------------------------------------------
# Notes: the official head, and where this file departs from what one might expect
#
# Sources: "official" is GitHub `LTH14/mar@fe470ac`: models/diffloss.py (the head) and diffusion/
# (gaussian_diffusion.py and respace.py: the schedule, the reverse step, the training loss).
# "Released" is the MAR-GRPO code, GitHub `AMAP-ML/mar-grpo@fcb7969`, whose trainers
# src/grpo/src/open_r1/trainer/grpo_trainer_nova_v1_2.py and grpo_trainer_harmon_v1_2.py choose the
# diffusion steps that train (`trainable_steps`).
#
# The head's MLP, `SimpleMLPAdaLN`, predicts the noise ε and the interpolation v of the learned
# variance (improved-DDPM "learned range"). The respacing is the official one (docs/method.md §10):
# keep round(linspace(0, 999, T)) of the 1000 cosine-schedule steps. With classifier-free guidance
# the net runs on [z_cond; z_null] and only the ε channels are mixed; the variance channels stay
# those of the conditional row, as in the official code.
#
# Where this file departs from what one might expect:
# 1. The schedule arrays come from diffusers' `DDPMScheduler` (cosine, 1000 steps, "linspace"),
#    respaced as the official code (β_k = 1 − ᾱ_{t_k} / ᾱ_{t_{k-1}}), float64 -> float32
#    buffers.
# 2. x^T is *not* scaled by τ: the official code scales only the per-step noise (the paper's
#    N(0, τ² I) would; official checkpoints are calibrated to the code). x^T enters no
#    log-probability.
# 3. With CFG, `x_t` has the N guided rows and `z` 2N rows [cond; null] (the official first half).
# 4. Steps are indexed k = 0 … T−1 (k = T−1 pure noise); the net sees the original timestep t_k.
#    RL trains only steps 1 … T−2 (`trainable_steps`).
# 5. `clip_denoised` (off, as official) clamps x̂0 to [-1, 1] (1/√α ≈ 1300 at the pure-noise
#    step, T = 25: a briefly trained head samples tokens of size ~800); the small (pixel) models
#    clamp.
