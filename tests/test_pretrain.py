"""demo/pretrain.py: the demo's pretraining. Its MAE loss learns, its mask ratio is the official one,
bad flags are one line, a non-finite step changes nothing, a signal stops it in one line, it
renders the world its flags ask for, continues from a base, and makes the shipped smoke base."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from scipy import stats

import demo
from demo import pretrain, shapes
from models import vae
from tests.helpers import ROOT, tiny_mar

torch.set_num_threads(1)
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def cli(capsys, *flags):
    """Run the pretraining's entry point in-process. Returns (exit status, stdout, stderr)."""
    capsys.readouterr()
    code = pretrain.processes.cli(pretrain.main, [str(f) for f in flags])
    out, err = capsys.readouterr()
    return code, out, err


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def test_tiny_mar_overfits_pixel_images():
    model = tiny_mar(diffusion_batch_mul=1).train()
    loss_of = pretrain.MAELoss(model)
    g = torch.Generator().manual_seed(0)
    imgs = vae.PixelCodec().encode(torch.rand(4, 3, 16, 16, generator=g).round())  # 4 binary images
    labels = torch.arange(4)

    def held_loss():  # the same masks, timesteps and noise before and after training
        with torch.no_grad():
            return sum(loss_of(imgs, labels=labels, generator=torch.Generator().manual_seed(i)).item() for i in range(8)) / 8

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    before = held_loss()
    for _ in range(80):
        loss = loss_of(imgs, labels=labels, generator=g)
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
        m = pretrain.random_masking(model, x, model.sample_orders(3, g), g)
        assert torch.equal(m[0].sum(), m[1].sum())
        ratios.append(m[0].mean().item())
    assert min(ratios) >= 0.7 - 1e-6 and max(ratios) <= 1.0
    # the official scipy truncnorm(loc 1, scale .25) on [0.7, 1], rounded up to whole tokens
    r = stats.truncnorm(-1.2, 0, loc=1, scale=0.25).rvs(100000, random_state=0)
    expected = float((torch.from_numpy(r) * 64).ceil().mean() / 64)
    assert abs(sum(ratios) / len(ratios) - expected) < 0.01, (sum(ratios) / len(ratios), expected)



BAD_FLAGS = {  # name -> (flags, words the error line must contain); {b}: a smoke base
    "--pretrain-from of another size": ("--pretrain-from {b} --embed-dim 48", ["--pretrain-from", "wrong shape"]),
    "--pretrain-from missing": ("--pretrain-from {t}/nope.pt", ["--pretrain-from", "nope.pt"]),
    "EMA of 1": ("--ema 1", ["--ema", "1"]),
    "image size not a multiple of the patch": ("--img-size 30 --patch-size 4", ["--img-size 30", "--patch-size 4"]),
    "width the heads do not divide": ("--embed-dim 33 --heads 2", ["--embed-dim 33", "--heads 2"]),
    "--unmentioned above 1": ("--unmentioned 1.5", ["--unmentioned 1.5", "must be a finite number in [0, 1]"]),
    "a GRPO flag": ("--lr 1e-4", ["--lr"]),
}


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_bad_flags_are_one_line_and_write_nothing(case, tmp_path, smoke_base, capsys):
    flags, words = BAD_FLAGS[case]
    out = tmp_path / "run"
    code, _, err = cli(capsys, "--preset", "smoke", *flags.format(b=smoke_base, t=tmp_path).split(), "--out", out)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert all(w in lines[0] for w in words), (words, lines[0])
    assert not out.exists()


def test_batch_that_does_not_divide_by_the_world_size():
    with pytest.raises(ValueError, match=r"--pretrain-batch 15 must divide by the world size 2"):
        pretrain.check_inputs(pretrain.parse_args(["--preset", "smoke", "--pretrain-batch", "15"]), world=2)


def test_pretraining_skips_non_finite_loss(tmp_path, capsys, monkeypatch):
    """A NaN loss changes neither the weights nor the EMA (without the skip, base.pt would be NaN);
    too many in a row stop before base.pt is written."""
    def nan_losses_at(steps):
        calls, real = [], pretrain.MAELoss.forward

        def forward(self, *a, **k):
            loss = real(self, *a, **k)
            calls.append(1)
            return loss * float("nan") if len(calls) - 1 in steps else loss
        monkeypatch.setattr(pretrain.MAELoss, "forward", forward)
    nan_losses_at({2, 4})
    code, stdout, err = cli(capsys, "--preset", "smoke", "--pretrain-steps", "6", "--out", tmp_path / "a")
    assert code == 0, err
    assert "pretrain step 2: non-finite" in stdout and "(2 non-finite steps skipped)" in stdout
    ema = load(tmp_path / "a" / "base.pt")["model"]
    assert all(torch.isfinite(v).all() for v in ema.values() if v.is_floating_point())

    monkeypatch.undo()
    nan_losses_at({1, 2})
    code, _, err = cli(capsys, "--preset", "smoke", "--pretrain-steps", "6", "--max-bad-steps", "2", "--out", tmp_path / "b")
    assert code == 1 and "pretraining: 2 non-finite steps in a row (--max-bad-steps 2)" in err
    assert not (tmp_path / "b" / "base.pt").exists()


def test_pretraining_renders_the_world_its_flags_ask_for(tmp_path, capsys, monkeypatch):
    """--cell, --unmentioned, --relation-p, --relation-mirror and --categories reach the pretraining
    data (the demo's base was made with the first two, the relation bases with the others)."""
    seen = []
    make = shapes.make_dataset
    monkeypatch.setattr(shapes, "make_dataset", lambda *a, **k: seen.append(k) or make(*a, **k))
    code, _, err = cli(capsys, "--preset", "smoke", "--pretrain-steps", "2", "--img-size", "16", "--patch-size", "2",
                       "--cell", "8", "--unmentioned", "0.5", "--out", tmp_path / "a")
    assert code == 0, err
    assert seen == [dict(split="train", cell=8, unmentioned=0.5, relation_p=1.0, mirror_p=0.0,
                         categories=shapes.CATEGORIES)] * 2
    seen.clear()
    code, _, err = cli(capsys, "--preset", "smoke", "--pretrain-steps", "1", "--img-size", "16", "--patch-size", "2",
                       "--cell", "8", "--relation-p", "0.5", "--relation-mirror", "0.25", "--categories", "spatial",
                       "--out", tmp_path / "b")
    assert code == 0, err
    assert seen == [dict(split="train", cell=8, unmentioned=0.0, relation_p=0.5, mirror_p=0.25,
                         categories=("spatial",))]


def test_pretraining_continues_from_a_base(tmp_path, smoke_base, capsys):
    """--pretrain-from starts from the base's weights: with 0 steps the written base is that base;
    with steps it trains on from there (a fresh optimizer)."""
    code, stdout, err = cli(capsys, "--preset", "smoke", "--pretrain-steps", "0", "--pretrain-from", smoke_base,
                            "--out", tmp_path / "zero")
    assert code == 0, err
    assert f"from {smoke_base}" in stdout
    start, again = load(smoke_base)["model"], load(tmp_path / "zero" / "base.pt")["model"]
    assert all(torch.equal(start[k], again[k]) for k in start)
    code, _, err = cli(capsys, "--preset", "smoke", "--pretrain-steps", "3", "--pretrain-from", smoke_base,
                       "--out", tmp_path / "more")
    assert code == 0, err
    more = load(tmp_path / "more" / "base.pt")["model"]
    assert any(not torch.equal(start[k], more[k]) for k in start)


def test_the_smoke_preset_makes_the_shipped_smoke_base(tmp_path, capsys):
    """demo/smoke.pt is what `python -m demo.pretrain --preset smoke` writes: the same architecture,
    and the same weights up to the float rounding another CPU's kernels may give."""
    code, _, err = cli(capsys, "--preset", "smoke", "--out", tmp_path / "smoke")
    assert code == 0, err
    made, shipped = load(tmp_path / "smoke" / "base.pt"), load(demo.SMOKE_BASE)
    assert made["config"] == shipped["config"] and made["model"].keys() == shipped["model"].keys()
    for k, v in shipped["model"].items():
        torch.testing.assert_close(made["model"][k], v, rtol=0, atol=1e-3, msg=k)


def test_a_signal_during_pretraining_is_one_line(tmp_path):
    out = tmp_path / "base"
    proc = subprocess.Popen([sys.executable, "-m", "demo.pretrain", "--preset", "smoke", "--pretrain-steps", "100000",
                             "--out", str(out)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while "pretraining a" not in proc.stdout.readline():  # inside the loop (its first line is printed there)
        assert proc.poll() is None
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    lines = [line for line in stderr.splitlines() if line.startswith("error")]
    assert proc.returncode == 128 + signal.SIGTERM and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert "pretraining step" in lines[0] and "base.pt is not written" in lines[0]
    assert not (out / "base.pt").exists() and not (out / ".lock").exists()
