"""A supervised positive control for the GRPO arms (not in the paper): reward-ranked fine-tuning,
RAFT-style. Each step draws the same rollouts as a GRPO step (train.py's `collect`), and instead of
the policy-gradient loss regresses MAR's own training loss (`demo.pretrain.MAELoss`: a random share
of the tokens masked, the diffusion loss on them) on the reward-best rollout of every group whose
reward varies; a group whose rollouts tie teaches nothing, as it has no advantage in GRPO either.
It shows whether a target is reachable from a base with the rollouts GRPO sees, at the same budget.

    python -m experiments.lab --loss raft FLAGS     # train.py with this loss in place of GRPO's

The GRPO step's statistics (the KL to the base, the parity of the recorded log-probabilities) are
measured on the same rollouts without gradients, so a RAFT run's metrics.jsonl reads as a GRPO run's.
"""

import torch
import torch.nn as nn

import grpo
from demo.pretrain import MAELoss


def group_best(scores, group_size):
    """The index of each group's reward-best rollout (the first of equal ones) among groups whose
    reward varies. scores: (B,), groups of `group_size` consecutive rollouts. Returns (n,) int64."""
    s = scores.view(-1, group_size)  # (B / G, G)
    varies = s.max(1).values > s.min(1).values  # (B / G,)
    return (s.argmax(1) + torch.arange(len(s), device=s.device) * group_size)[varies]


class RAFTLoss(nn.Module):
    """train.PolicyLoss's interface with the supervised loss: forward(ref, batch, j, settings,
    old_logp) -> (loss, stats, old_logp). The loss of one trained AR step j is one MAE draw over the batch's best
    rollouts (so a step's loss averages as many draws as GRPO trains AR steps); 0 (with a graph, so
    every rank's backward matches) where no group's reward varies."""

    def __init__(self, model, group_size):
        super().__init__()
        self.model, self.group_size = model, group_size
        self.mae = MAELoss(model)

    def forward(self, ref, batch, j, settings, old_logp):
        with torch.no_grad():  # GRPO's statistics of this step, for the same metrics
            _, stats, old_logp = grpo.ar_step_loss(self.model, ref, batch.record, j, batch.inputs, batch.adv,
                                                   settings, batch.trajectories, old_logp)
        best = group_best(batch.scores, self.group_size)  # (n,)
        if len(best) == 0:
            loss = sum(p.sum() * 0 for p in self.model.parameters() if p.requires_grad)
        else:  # the best rollouts' final tokens (n, L, C) as images, under their own prompts (labels, prompt_ids)
            inputs = {key: value[best] for key, value in batch.inputs.items()}
            loss = self.mae(self.model.unpatchify(batch.record.tokens[best]), **inputs)
        stats.update(raft_images=torch.tensor(float(len(best))), raft_loss=loss.detach())
        return loss, stats, old_logp
