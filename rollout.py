"""Recording a rollout for RL, for any model of the MAR family (docs/method.md §1, §3).

The policy interface (what this file, policy.py and mte.py call on a model; mar.py, harmon.py and
nova.py implement it, and nothing outside a model's own file knows which one it is):

    model.condition(**inputs) -> cond            batch-first tensor, or dict of them
    model.null_condition_like(cond) -> cond_null  the classifier-free-guidance null, same structure
    model.predict_z(tokens, mask, cond) -> z      tokens (B, L, C), mask (B, L) float 1 = unknown,
                                                  z (B, L, D); deterministic in eval mode
    model.diffloss                                the head: p_mean_variance(x_t, t, z, cfg),
                                                  sample(z, temperature, cfg, generator, record_steps),
                                                  trainable_steps(), num_sampling_steps
    model.ar_schedule(num_iter, seq_len)          tokens written at each executed AR step
    model.sample_orders(bsz, generator)           (B, L) random generation orders
    model.seq_len, model.token_embed_dim, model.patchify, model.unpatchify

`inputs` are the raw condition inputs of a batch (MAR: prompt_ids or labels; Harmon: input_ids and
attention_mask; NOVA: prompt_embeds). The condition is embedded by the model itself, in the rollout and again
when the loss recomputes z, so that gradients reach whatever part of the model embeds it.

What a rollout records (docs/method.md §3), for each chosen AR step i only, so memory scales with the chosen
steps: the canvas, U_i, P_i, the head's chosen transitions on *all* unknown positions U_i (not only
P_i), and the previews x̂0 of steps i and i−1; after the last step the final tokens and, for every
position, the z (and null z, and guidance w) it was generated from.

Where this departs from the released trainers:
1. The released trainers run the head on all L positions at kept steps; this file runs it on U_i, which
   gives the same distribution for the positions that matter for less work.
2. The released Harmon trainer stores U_{i+1} as step i's unknown set, and the released NOVA trainer
   recomputes z with a canvas frame the sampler never saw; so their recomputed z is not the
   rollout's. This record holds exactly what the sampler fed the model, and recorded and
   recomputed log-probabilities agree (tested for MAR, Harmon and NOVA).
3. `transition_mean` recomputes the recorded transitions' means one diffusion step at a time,
   with an int step as the sampler calls the head: the same arithmetic, so recorded and
   recomputed log-probabilities agree to float rounding. With gradients on it keeps no head
   activations (each step's head call is recomputed in the backward pass), so the memory of a
   trained AR step does not grow with K or S.
4. With no chosen steps, the loop draws the same noise in the same order as `MAR.sample_tokens`,
   so a rollout and a plain sample with the same generator are the same images (tested).
"""

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from diffloss import step_list


@dataclass
class RolloutPlan:
    """Which steps of one rollout are recorded for training, chosen before it starts.

    ar_steps: sorted AR step indices i; diff_steps: K sampling-step indices of the head (ints, or a
    tensor, read once), a subset of `head.trainable_steps()`, recorded at every chosen AR step.
    """
    ar_steps: list
    diff_steps: list


@dataclass
class StepRecord:
    """One recorded AR step i, with n = |U_i| unknown positions per image and K diffusion steps.

    tokens (B, L, C): the canvas at the start of step i (zeros at unknown positions);
    unknown (B, L) bool: U_i; pred (B, L) bool: P_i ⊆ U_i, the positions written at step i;
    unk_idx (B, n): the positions of U_i, ascending (every image has the same n);
    cfg: the guidance w of this step (1.0 without guidance);
    diff_steps: the K recorded sampling steps, in sampling order (list of int);
    x_t, x_prev, std, logp (K, B, n, C): the head's transitions x^k -> x^{k-1} on U_i, the std
      s = τσ they were sampled with, and their per-element log-probability ℓ;
    preview (B, L, C): x̂0 of step i (known tokens + the head's result on U_i);
    preview_prev (B, L, C) or None: x̂0 of step i−1 (None for i = 0).
    """
    i: int
    tokens: torch.Tensor
    unknown: torch.Tensor
    pred: torch.Tensor
    unk_idx: torch.Tensor
    cfg: float
    diff_steps: list
    x_t: torch.Tensor
    x_prev: torch.Tensor
    std: torch.Tensor
    logp: torch.Tensor
    preview: torch.Tensor
    preview_prev: torch.Tensor | None


@dataclass
class Rollout:
    """Everything the loss needs from one rollout of B images.

    orders (B, L): generation order; tokens (B, L, C): the final tokens x_final;
    z_final (B, L, D): the z each token was generated from; z_final_null (B, L, D) or None: its
    null-condition z (with guidance); cfg_final (B, L): the w each token was generated with;
    steps: a StepRecord per chosen AR step, in order.
    """
    orders: torch.Tensor
    tokens: torch.Tensor
    z_final: torch.Tensor
    z_final_null: torch.Tensor | None
    cfg_final: torch.Tensor
    steps: list


def cat_rows(a, b):
    """Concatenate two batches of a condition (tensor or dict of tensors) along dim 0."""
    if isinstance(a, dict):
        return {key: torch.cat([a[key], b[key]]) for key in a}
    return torch.cat([a, b])


def guidance_weight(cfg, cfg_schedule, num_unknown_next, seq_len):
    """w of one AR step: constant, or "linear" (MAR, after Muse): rising with the fraction of
    tokens generated, 1 + (w − 1)(L − max(n_next, 1)) / L (the official code's max(…, 1))."""
    if cfg_schedule == "constant":
        return cfg
    if cfg_schedule == "linear":
        return 1 + (cfg - 1) * (seq_len - max(num_unknown_next, 1)) / seq_len
    raise ValueError(f"cfg_schedule {cfg_schedule!r}: choose 'linear' or 'constant'")


@torch.no_grad()
def record_rollout(model, inputs, num_iter, cfg=1.0, cfg_schedule="linear", temperature=1.0, plan=None,
                   generator=None, orders=None):
    """Generate B token grids with `model` and record the steps of `plan` (docs/method.md §3).

    model: implements the policy interface above; inputs: dict of condition inputs for
    model.condition, batch B; num_iter: AR steps N; cfg: guidance w (the batch is doubled with the
    null condition when w != 1); cfg_schedule: "linear" | "constant"; temperature: τ of the head's
    noise; plan: RolloutPlan (None: record nothing); generator: torch.Generator on the model's
    device; orders: optional (B, L) generation orders.
    returns tokens (B, L, C) and a Rollout.
    """
    cond = model.condition(**inputs)
    guided = cfg != 1.0
    if guided:
        cond = cat_rows(cond, model.null_condition_like(cond))  # (2B, ...) = [cond; null]
    head, device = model.diffloss, next(model.parameters()).device
    L, C = model.seq_len, model.token_embed_dim
    orders = model.sample_orders(len(next(iter(inputs.values()))), generator) if orders is None else orders.to(device)
    B = orders.shape[0]
    tokens = torch.zeros(B, L, C, device=device)
    unknown = torch.ones(B, L, dtype=torch.bool, device=device)
    diff_steps = step_list(plan.diff_steps) if plan is not None else []
    chosen = set(plan.ar_steps) if plan is not None else set()
    need_preview = chosen | {i - 1 for i in chosen if i >= 1}
    z_final = z_final_null = None
    cfg_final = torch.ones(B, L, device=device)
    records, previews = [], {}

    # Every image has the same number of unknown tokens at every step, so the positions the head
    # samples are a gather from the orders, not a boolean mask: no host sync in this loop beyond
    # what model.predict_z itself does.
    num_unknown = L
    for i, count in enumerate(model.ar_schedule(num_iter, L)):
        x = torch.cat([tokens, tokens]) if guided else tokens  # (B or 2B, L, C)
        m = unknown.to(tokens.dtype)
        m = torch.cat([m, m]) if guided else m  # (B or 2B, L)
        z = model.predict_z(x, m, cond).float()  # (B or 2B, L, D)
        D = z.shape[-1]
        if z_final is None:
            z_final = torch.zeros(B, L, D, device=device)
            z_final_null = torch.zeros_like(z_final) if guided else None

        # which positions are written this step: `count` more of each order (from its end, as MAR)
        n_next = num_unknown - count
        pred = torch.zeros(B, L, dtype=torch.bool, device=device)
        pred.scatter_(1, orders[:, n_next:num_unknown], True)  # (B, L) P_i; orders[:, :n_next] stay unknown
        w = guidance_weight(cfg, cfg_schedule, n_next, L) if guided else 1.0

        # the head samples P_i, or all of U_i at recorded steps and where a preview is needed; its
        # rows are image-major, positions ascending
        full = i in need_preview
        pos = (orders[:, :num_unknown] if full else orders[:, n_next:num_unknown]).sort(dim=1).values  # (B, m)
        rows = pos.shape[1]
        z_head = z[:B].gather(1, pos[..., None].expand(B, rows, D)).reshape(B * rows, D)  # (B·m, D)
        if guided:
            z_null_head = z[B:].gather(1, pos[..., None].expand(B, rows, D)).reshape(B * rows, D)
            z_head = torch.cat([z_head, z_null_head])  # (2·B·m, D) = [cond; null]
        if i in chosen:
            sampled, traj = head.sample(z_head, temperature, w, generator, record_steps=diff_steps)
        else:
            sampled = head.sample(z_head, temperature, w, generator)  # (B·m, C)
        # the canvas with the head's result on the sampled positions: x̂0 on U_i at a full step
        canvas = tokens.scatter(1, pos[..., None].expand(B, rows, C), sampled.reshape(B, rows, C).to(tokens.dtype))
        if full:
            previews[i] = canvas
        new_tokens = torch.where(pred[..., None], canvas, tokens)  # only P_i is written

        z_final = torch.where(pred[..., None], z[:B], z_final)
        if guided:
            z_final_null = torch.where(pred[..., None], z[B:], z_final_null)
        cfg_final = cfg_final.masked_fill(pred, float(w))
        if i in chosen:
            K = len(diff_steps)
            records.append(StepRecord(
                i=i, tokens=tokens, unknown=unknown, pred=pred, unk_idx=pos, cfg=float(w), diff_steps=traj["steps"],
                **{key: traj[key].reshape(K, B, rows, C) for key in ("x_t", "x_prev", "std", "logp")},
                preview=previews[i], preview_prev=previews.get(i - 1)))
        tokens, unknown, num_unknown = new_tokens, unknown & ~pred, n_next

    return tokens, Rollout(orders=orders, tokens=tokens, z_final=z_final, z_final_null=z_final_null,
                           cfg_final=cfg_final, steps=records)


def transition_mean(head, x_t, steps, z, z_null, w, checkpoint_head=True):
    """μ of recorded transitions, differentiable in z and the head (any head with the
    `p_mean_variance` contract of DiffLoss: MAR's, Harmon's, NOVA's).

    x_t: (K, *rows, C) noisy tokens (rows: (B, n) or (S, B, n)); steps: the K sampling steps (ints);
    z, z_null: (*rows, D) conditions broadcast over K (z_null None without guidance); w: guidance;
    checkpoint_head: when gradients are on, keep no head activations: each diffusion step's head
      call is recomputed in the backward pass, one step at a time (torch.utils.checkpoint), so a
      trained AR step holds one head graph at a time instead of K (S × K with MTE). The values and
      gradients are the same; the head's forward runs twice.
    returns μ: (K, *rows, C)
    """
    K, C = x_t.shape[0], x_t.shape[-1]
    n = x_t[0, ..., 0].numel()  # rows per diffusion step
    z_rows = z.reshape(n, -1)  # (n, D)
    if z_null is not None:
        z_rows = torch.cat([z_rows, z_null.reshape(n, -1)])  # (2n, D) = [cond; null]
    steps = step_list(steps)

    # one call per diffusion step with an int step, as the sampler makes it: the same arithmetic,
    # so recomputed and recorded log-probabilities agree to float rounding (docs/method.md §2)
    def mean_at(x, rows, k):
        return head.p_mean_variance(x, k, rows, w)[0]
    store = checkpoint_head and torch.is_grad_enabled()
    mean = [checkpoint(mean_at, x_t[j].reshape(n, C), z_rows, steps[j], use_reentrant=False, preserve_rng_state=False)
            if store else mean_at(x_t[j].reshape(n, C), z_rows, steps[j]) for j in range(K)]
    return torch.stack(mean).reshape(x_t.shape)
