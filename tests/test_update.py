"""How train.py combines the per-step losses of a micro-batch (train.backward_batch, the one function
it calls for the backward): their mean over the trained AR steps, L = −mean_i(P_i − β KL_i), averaged
once over DDP ranks. A toy loss with a closed-form gradient stands in for grpo.ar_step_loss."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import train


class ToyStepLoss(nn.Module):
    """A stand-in for train.PolicyLoss with the same call signature: loss_j = (j + 1) Σ_d a_d θ_d²,
    so ∇ mean_j loss_j = 2 a θ · mean_j (j + 1). It remembers which `old_logp` each step was given."""

    def __init__(self):
        super().__init__()
        self.theta = nn.Parameter(torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64))
        self.seen_old_logp = []

    def forward(self, ref, batch, j, settings, old_logp):
        self.seen_old_logp.append(old_logp)
        loss = (j + 1) * (batch.adv * self.theta ** 2).sum()
        return loss, {"j": torch.tensor(j)}, f"old{j}"


def toy_backward(module, n_steps, adv, old_logp):
    """The one call of train.backward_batch (the function that scales and accumulates the per-step
    losses), with the toy loss module on a micro-batch of which it reads the number of trained
    steps, the advantages and the ℓ_old of each; returns (per-step stats, the ℓ_old it kept)."""
    batch = SimpleNamespace(record=SimpleNamespace(steps=[None] * n_steps), adv=adv, old_logp=list(old_logp))
    stats = train.backward_batch(module, None, batch, None, contextlib.nullcontext)
    return stats, batch.old_logp


def toy_expected_grad(theta, adv, n_steps):
    return 2 * adv * theta.detach() * sum(j + 1 for j in range(n_steps)) / n_steps


def test_backward_batch_averages_the_per_step_losses():
    """L = −mean_i(P_i − βKL_i): backward_batch's accumulated gradient is that of the mean of the
    per-step losses over the trained AR steps (not their sum), and each step's ℓ_old is routed back."""
    toy, n = ToyStepLoss(), 3
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    stats, old_logp = toy_backward(toy, n, adv, ["a", "b", "c"])
    torch.testing.assert_close(toy.theta.grad, toy_expected_grad(toy.theta, adv, n), rtol=1e-12, atol=0,
                               msg=lambda m: f"the accumulated gradient is not ∇ mean_j loss_j (sum: ×{n})\n{m}")
    assert toy.seen_old_logp == ["a", "b", "c"] and old_logp == ["old0", "old1", "old2"]
    assert [float(s["loss"]) for s in stats] == pytest.approx([(j + 1) * (adv * toy.theta ** 2).sum().item()
                                                              for j in range(n)])


def _ddp_rank(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    toy = ToyStepLoss()
    module = torch.nn.parallel.DistributedDataParallel(toy)
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) * (rank + 1)  # each rank its own images
    toy_backward(module, 3, adv, [None] * 3)
    torch.save(toy.theta.grad, f"{out_dir}/grad{rank}.pt")
    dist.destroy_process_group()


def test_backward_batch_under_ddp_averages_over_ranks_once(tmp_path):
    """With 2 DDP ranks the gradient on every rank is the mean over ranks of ∇ mean_j loss_j: the
    world size divides exactly once (DDP's all-reduce), the number of steps exactly once."""
    torch.multiprocessing.start_processes(_ddp_rank, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2,
                                          join=True, start_method="fork")
    theta = ToyStepLoss().theta
    base = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    expected = (toy_expected_grad(theta, base * 1, 3) + toy_expected_grad(theta, base * 2, 3)) / 2
    for rank in range(2):
        torch.testing.assert_close(torch.load(tmp_path / f"grad{rank}.pt"), expected, rtol=1e-12, atol=0,
                                   msg=lambda m: f"rank {rank}: the gradient is not the mean over ranks of "
                                                 f"∇ mean_j loss_j\n{m}")
