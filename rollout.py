"""Recording a rollout for RL (docs/method.md §3), for any model of the MAR family: a `Recorder`
watches the generation loop (mar.MaskedAR.generate, which MAR, Harmon and NOVA share) and keeps
what the loss of grpo.py needs, for each chosen AR step i only (so memory scales with the chosen
steps):

    step i:     the canvas, U_i, P_i ⊆ U_i (written at step i), the step's w, and on all of U_i
                (not only P_i) the head's transitions x^k -> x^{k-1}, their s = τσ_k and ℓ,
                (K, B, n, C) each; the previews x̂0^(i) and x̂0^(i−1)
    the end:    x_final, and for every position the z (null z, w) it was generated from
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch

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
    unknown (B, L) bool: U_i; written (B, L) bool: P_i ⊆ U_i, the positions written at step i;
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
    written: torch.Tensor
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
class RolloutRecord:
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


class StepRequest(NamedTuple):
    """What an observer of `MaskedAR.generate` asks of AR step i (`wants(i)`; None: nothing, the
    head samples P_i alone)."""
    all_unknown: bool    # the head samples all of U_i, not only P_i (the preview x̂0^(i) on U_i)
    record_steps: list | None  # the diffusion steps whose transitions it records, or None


class Recorder:
    """The observer of `MaskedAR.generate` that records the steps of a RolloutPlan (None:
    nothing): `wants(i)` -> StepRequest or None before step i's head call, `saw(view)` after it
    (view: a mar.StepView)."""

    def __init__(self, plan):
        self.diff_steps = step_list(plan.diff_steps) if plan is not None else []
        self.chosen = set(plan.ar_steps) if plan is not None else set()
        # steps whose x̂0 is needed
        self.previewed = self.chosen | {i - 1 for i in self.chosen if i >= 1}
        self.previews, self.steps = {}, []
        self.z_final = self.z_final_null = self.cfg_final = None

    def wants(self, i):
        """Step i's request: all of U_i at a chosen step and at the step before one (its preview),
        with the diffusion steps to record at a chosen step; None at the other steps."""
        if i not in self.previewed:
            return None
        return StepRequest(all_unknown=True,
                           record_steps=self.diff_steps if i in self.chosen else None)

    def saw(self, view):
        """Step `view.i` of the loop (a mar.StepView: the canvas it started from, U_i, P_i, the
        positions the head sampled, z, w, the canvas with the head's result, its transitions)."""
        i, tokens, unknown, written, pos, z, w, canvas, traj = view
        B, L, C = tokens.shape
        if self.z_final is None:
            self.z_final = torch.zeros(B, L, z.shape[-1], device=z.device)
            self.z_final_null = torch.zeros_like(self.z_final) if z.shape[0] == 2 * B else None
            self.cfg_final = torch.ones(B, L, device=z.device)
        self.z_final = torch.where(written[..., None], z[:B], self.z_final)
        if self.z_final_null is not None:
            self.z_final_null = torch.where(written[..., None], z[B:], self.z_final_null)
        self.cfg_final = self.cfg_final.masked_fill(written, float(w))
        if i in self.previewed:
            self.previews[i] = canvas
        if i in self.chosen:
            K, n = len(self.diff_steps), pos.shape[1]
            self.steps.append(StepRecord(
                i=i, tokens=tokens, unknown=unknown, written=written, unk_idx=pos, cfg=float(w),
                diff_steps=traj["steps"],
                **{key: traj[key].reshape(K, B, n, C) for key in ("x_t", "x_prev", "std", "logp")},
                preview=canvas, preview_prev=self.previews.get(i - 1)))

    def record(self, orders, tokens):
        return RolloutRecord(orders=orders, tokens=tokens, z_final=self.z_final,
                             z_final_null=self.z_final_null, cfg_final=self.cfg_final,
                             steps=self.steps)


@torch.no_grad()
def record_rollout(model, inputs, num_iter, cfg=1.0, cfg_schedule="linear", temperature=1.0,
                   plan=None, generator=None, orders=None):
    """Generate B token grids with `model` and record the steps of `plan` (docs/method.md §3, what
    a rollout records: per chosen AR step the canvas, U_i, P_i, the head's transitions on U_i and
    the previews x̂0^(i), x̂0^(i−1); after the last step x_final, z_final and cfg_final).

    model: a mar.MaskedAR (MAR, Harmon, NOVA); inputs: dict of condition inputs for
    model.condition, batch B; num_iter: AR steps N; cfg: guidance w; cfg_schedule: "linear" |
    "constant"; temperature: τ of the head's noise; plan: RolloutPlan (None: record nothing);
    generator: torch.Generator on the model's device; orders: optional (B, L) generation orders.
    returns tokens (B, L, C) and a RolloutRecord.
    """
    cond = model.condition(**inputs)
    bsz = len(next(iter(inputs.values())))
    device = next(model.parameters()).device
    orders = model.sample_orders(bsz, generator) if orders is None else orders.to(device)
    recorder = Recorder(plan)
    tokens = model.generate(cond, orders, num_iter, cfg, cfg_schedule, temperature, generator,
                            observer=recorder)
    return tokens, recorder.record(orders, tokens)


# -----------------------------------------------------------------------------
# Notes: where this file departs from the released trainers
#
# "Released" is the MAR-GRPO code, GitHub `AMAP-ML/mar-grpo@fcb7969`: the samplers that record a
# rollout, src/grpo/src/diffnext/models/transformers/transformer_3d.py (NOVA, `generate_frame`; z
# recomputed by `single_forward_without_head`) and
# src/grpo/src/harmon/harmon_generate_image_with_logp.py (Harmon, `sample_with_logp`), and the
# trainers that read it, src/grpo/src/open_r1/trainer/grpo_trainer_nova_v1_2.py and
# grpo_trainer_harmon_v1_2.py.
#
# Where this departs from the released trainers:
# 1. The released trainers run the head on all L positions at kept steps; this file runs it on U_i,
#    which gives the same distribution for the positions that matter for less work.
# 2. The released Harmon trainer stores U_{i+1} as step i's unknown set, and the released NOVA
#    trainer recomputes z with a canvas frame the sampler never saw; so their recomputed z is not
#    the rollout's. This record holds exactly what the sampler fed the model, and recorded and
#    recomputed log-probabilities agree (tested for MAR, Harmon and NOVA).
# 3. With no chosen steps, the recorder changes nothing: a rollout and `MAR.sample_tokens` with the
#    same generator are the same images (tested).
