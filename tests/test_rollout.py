"""rollout.py: what a rollout records, and that recording changes nothing about sampling."""

import copy

import torch

import grpo
import mte
import rollout
from tests.helpers import ToyPolicy, make_rollout, settings, tiny_mar

torch.set_num_threads(1)


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
        assert torch.equal(s.preview[s.written], final[s.written])  # P_i is written from the preview
        assert (s.written & ~s.unknown).sum() == 0
    # step 3's previous preview is step 2's preview; step 0 has none
    assert record.steps[0].preview_prev is None
    assert torch.equal(record.steps[2].preview_prev, record.steps[1].preview)
    # z_final holds, per position, the z it was generated from (the step's recomputed z)
    s = record.steps[1]
    z = model.predict_z(s.tokens, s.unknown.float(), model.condition(labels=torch.tensor([1, 1, 3, 3])))
    torch.testing.assert_close(record.z_final[s.written], z[s.written], rtol=1e-5, atol=1e-5)


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
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    cfg = settings("mar-grpo")
    for j in range(2):
        model.zero_grad()
        loss, stats, _ = grpo.ar_step_loss(model, ref, record, j, inputs, adv, cfg, seeds)
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

