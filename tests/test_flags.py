"""Flags that no preset sets reach what they name (infra/flags.py): a flag that parses but changes nothing
is a bug. Each test sets one and looks where it must arrive."""

import importlib.util

import pytest
import torch

import evaluate
import mar
import rollout
import train
from demo import pretrain, shapes
from models import loading, vae

torch.set_num_threads(1)


def test_split_all_draws_held_out_compositions_too():
    heldout = {m["prompt"] for m in shapes.all_prompts("heldout")}
    drawn = {}
    for split in ("train", "all"):
        args = train.parse_args(["--preset", "smoke", "--split", split])
        prompts = loading.load_prompts(args, None)
        drawn[split] = {m["prompt"] for step in range(20) for m in prompts.sample(16, 0, step)}
    assert not drawn["train"] & heldout and drawn["all"] & heldout


def test_eval_temperatures_are_the_temperatures_of_evaluation_images(monkeypatch):
    """generate samples at the run's τ and guidance unless told others; --eval-temperatures is the
    evaluation's sweep (a comma-separated list of positive numbers)."""
    seen = []
    monkeypatch.setattr(rollout, "record_rollout", lambda model, inputs, num_iter, cfg, schedule, temperature, **k:
                        seen.append((temperature, cfg)) or (torch.zeros(1, 4, 12), None))
    model = mar.build_mar(pretrain.small_mar_config(pretrain.parse_args(["--preset", "smoke", "--img-size", "4", "--patch-size", "2"])))
    args = train.parse_args(["--preset", "smoke", "--eval-temperatures", "0.3,0.7"])
    assert args.eval_temperatures == [0.3, 0.7] and args.temperature == 0.5
    evaluate.generate(model, vae.PixelCodec(), {}, args, None)
    evaluate.generate(model, vae.PixelCodec(), {}, args, None, temperature=0.3, cfg=2.0)
    assert seen == [(0.5, args.cfg), (0.3, 2.0)]


def test_diffusion_batch_mul_repeats_the_pretraining_targets():
    args = pretrain.parse_args(["--preset", "smoke", "--img-size", "8", "--patch-size", "4", "--diffusion-batch-mul", "3"])
    model = mar.build_mar(pretrain.small_mar_config(args))
    rows = []
    model.diffloss.forward = lambda target, z, mask=None, generator=None: rows.append(len(target)) or target.sum()
    pretrain.MAELoss(model)(torch.zeros(2, 3, 8, 8), prompt_ids=torch.tensor([[1, 2], [3, 0]]))
    assert model.diffusion_batch_mul == 3 and rows == [3 * 2 * 4]


def test_weight_decay_reaches_the_grpo_optimizer(smoke_base, tmp_path, capsys):
    out = tmp_path / "run"
    assert train.cli(["--preset", "smoke", "--eval-prompts", "0", "--init", str(smoke_base), "--steps", "1",
                      "--weight-decay", "0.25", "--out", str(out)]) == 0
    state = torch.load(out / "ckpt" / "latest.pt", weights_only=True)
    assert [g["weight_decay"] for g in state["optimizer"]["param_groups"]] == [0.25]


def test_consistency_threshold_reaches_the_settings():
    assert train.grpo_settings(train.parse_args(["--consistency-threshold", "0.25"])).consistency_threshold == 0.25
    assert train.grpo_settings(train.parse_args(["--consistency-threshold", "off"])).consistency_threshold is None
    assert train.grpo_settings(train.parse_args(["--method", "grpo"])).consistency_threshold is None


def test_the_long_preset_is_the_recipe_measured_over_1200_steps():
    """--preset long: the demo's base, MAR-GRPO without MTE at lr 1e-5 (no budget caps it), every
    100th checkpoint kept; the flags given still win."""
    args = train.parse_args(["--preset", "long"])
    settings = train.grpo_settings(args)
    assert args.init == train.parse_args([]).init  # the demo's base
    assert (args.steps, args.lr, args.lr_budget, args.save_every, args.keep_last) == (1200, 1e-5, None, 100, 0)
    assert settings.mte_trajectories == 0 and settings.consistency_threshold == 0.0
    assert not settings.train_head and settings.beta == 0.01
    assert train.parse_args(["--preset", "long", "--steps", "300"]).steps == 300


def test_wandb_without_the_package_is_a_one_line_error(smoke_base, tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    out = tmp_path / "run"
    code = train.cli(["--preset", "smoke", "--eval-prompts", "0", "--init", str(smoke_base), "--wandb", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --wandb") and not out.exists()


def test_lr_budget_caps_learning_rate_times_steps_and_reaches_the_optimizer(smoke_base, tmp_path, capsys):
    """--lr-budget b: the learning rate is min(--lr, b / --steps); the demo preset's 0.006 keeps its
    40 steps at 1e-4 and gives 1200 steps 5e-6 (the run docs/method.md §8 measured to hold)."""
    lr = lambda *argv: train.parse_args(list(argv)).lr  # noqa: E731
    assert lr() == 1e-4 and lr("--steps", "60") == 1e-4  # the demo's 40 steps, and the budget's edge
    assert lr("--steps", "1200") == 0.006 / 1200 and lr("--steps", "120") == 5e-5
    assert lr("--steps", "1200", "--lr", "3e-6") == 3e-6  # a smaller --lr is kept
    assert lr("--steps", "1200", "--lr-budget", "off") == 1e-4
    assert lr("--preset", "smoke", "--steps", "1200") == 1e-4  # the other presets: no budget
    for bad in ("0", "-1", "nan", "x"):
        with pytest.raises(ValueError, match="--lr-budget"):
            train.parse_args(["--lr-budget", bad])
    out = tmp_path / "run"
    assert train.cli(["--preset", "smoke", "--eval-prompts", "0", "--init", str(smoke_base), "--steps", "2",
                      "--lr-budget", "1e-4", "--out", str(out)]) == 0
    state = torch.load(out / "ckpt" / "latest.pt", weights_only=True)
    assert [g["lr"] for g in state["optimizer"]["param_groups"]] == [5e-5]
    assert "lr 5e-05 (--lr 0.0001 capped at --lr-budget 0.0001 / 2 steps)" in capsys.readouterr().out
    # resumed, the optimizer keeps its restored rate whatever the flags give now, and says so
    assert train.cli(["--preset", "smoke", "--eval-prompts", "0", "--init", str(smoke_base), "--steps", "3",
                      "--lr-budget", "off", "--resume", "--out", str(out)]) == 0
    assert "lr 5e-05 (restored from the checkpoint; the flags give 0.0001);" in capsys.readouterr().out
