"""experiments/curve.py: each checkpoint at its best τ against steps, and the run's stability."""

import json

import pytest

import evaluate
from experiments import curve

TEMPS = [0.1, 0.5, 1.0]
# a known curve: strict accuracy by step, split and τ. The best τ on the training split moves
# (0.1, then 1, then a tie of 0.5 and 1, which goes to the higher) and the held-out split's own best is elsewhere each time, so reading the
# held-out cell at the held-out split's best (or at a fixed τ) gives other numbers.
KNOWN = {0: {"train": (0.50, 0.40, 0.30), "heldout": (0.20, 0.60, 0.10)},
         1: {"train": (0.30, 0.40, 0.70), "heldout": (0.90, 0.10, 0.35)},
         2: {"train": (0.10, 0.80, 0.80), "heldout": (0.40, 0.70, 0.65)}}


def fake_sweep(calls):
    """evaluate.sweep_splits's signature over the known curve (the step read from out_dir), with
    evaluate.temperature_sweep choosing, as the real sweep does."""
    def sweep(args, ctx, model, codec, prompts, splits, reward_fns, out_dir, temperatures,
              cfgs=(None,), choose_on="train"):
        step = int(out_dir.rsplit("step_", 1)[1])
        calls.append(step)
        assert set(splits) == {"heldout", "train"} and temperatures == TEMPS
        assert args.seed == 5  # the curve's --seed, not the run's (0): every run on the same draws
        def score(t, w):
            return {s: {"accuracy": KNOWN[step][s][TEMPS.index(t)], "n": 10} for s in splits}
        return evaluate.temperature_sweep(score, temperatures, cfgs, choose_on)
    return sweep


def test_each_checkpoint_is_read_at_the_best_tau_of_the_training_split_and_swept_once(
        smoke_run, tmp_path):
    o = curve.parse_args([str(smoke_run), "--out", str(tmp_path), "--eval-temperatures",
                          "0.1,0.5,1", "--eval-prompts", "2", "--seed", "5"])
    calls = []
    points = curve.sweep_run(str(smoke_run), o, sweep=fake_sweep(calls))
    assert calls == [0, 1, 2]
    assert [(p["step"], p["temperature"], p["train"], p["heldout"]) for p in points] == [
        (0, 0.1, 0.50, 0.20), (1, 1.0, 0.70, 0.35), (2, 1.0, 0.80, 0.65)]
    assert points[1]["heldout_by_tau"] == {"0.1": 0.9, "0.5": 0.1, "1": 0.35}
    # a second call sweeps nothing (the cache), and --steps picks
    again = curve.sweep_run(str(smoke_run), o, steps=[0, 2], sweep=fake_sweep(calls))
    assert calls == [0, 1, 2] and again == [points[0], points[2]]
    with pytest.raises(FileNotFoundError, match="no checkpoint of step \\[7\\]"):
        curve.sweep_run(str(smoke_run), o, steps=[0, 7], sweep=fake_sweep(calls))


def test_stability_and_windows_of_known_rows():
    rows = [dict(step=s, grad_norm=1.0 if s < 100 else 4.0, kl=0.5, reward_mean=s / 10,
                 diversity=0.3, skipped=int(s == 3), ratio_max_dev=0.0) for s in range(300)]
    s = curve.stability(rows)
    assert s["grad_growth"] == pytest.approx(4.0) and s["kl_cv"] == pytest.approx(0.0)
    assert s["grad_cv"] == pytest.approx((2 / 9) ** 0.5 * 3 / 3, rel=1e-6)  # values 1 (1/3), 4
    w = curve.windows(rows[:40], 20)
    assert [(x["first"], x["last"]) for x in w] == [(0, 19), (20, 39)]
    assert w[0]["skipped"] == pytest.approx(1 / 20) and w[1]["reward_mean"] == pytest.approx(2.95)


def test_the_command_sweeps_a_real_run_and_draws_its_curve(smoke_run, tmp_path, capsys):
    out = tmp_path / "curve"
    curves = curve.main([str(smoke_run), "--out", str(out), "--eval-prompts", "2",
                         "--eval-images-per-prompt", "1", "--eval-temperatures", "0.5,1",
                         "--window", "1", "--threads", "1"])
    (name, c), = curves.items()
    assert [p["step"] for p in c["points"]] == [0, 1, 2]
    for p in c["points"]:
        assert p["temperature"] in (0.5, 1.0) and p["heldout_n"] == p["train_n"] == 4
        assert p["heldout"] == p["heldout_by_tau"][f"{p['temperature']:g}"]
    assert len(c["windows"]) == 2 and json.loads((out / "curve.json").read_text()) == curves
    assert (out / "curve.png").stat().st_size > 0 and f"| {name} | 2 |" in (out / "curve.md").read_text()
    assert "curve.png" in capsys.readouterr().out
