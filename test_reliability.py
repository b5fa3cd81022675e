"""Reliability of train.py: bad input, non-finite steps, crashes, restarts, failing
rewards and long runs. CPU-only, smoke size. Most runs call `train.cli` in this process (the
script's own entry point, minus the ~6 s of imports a subprocess pays); a subprocess is used where
the exit status, a SIGKILL or torchrun is what is being tested."""

import functools
import hashlib
import importlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import checkpoints
import evaluate
import mar
import models
import rewards
import shapes
import train

torch.set_num_threads(1)  # tiny ops: threads only add contention on a 2-core machine

REPO = Path(__file__).resolve().parent
TRAIN = str(REPO / "train.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def cli(capsys, *flags):
    """Run train.py's entry point in-process. Returns (exit status, stdout, stderr)."""
    capsys.readouterr()
    code = train.cli([str(f) for f in flags])
    out, err = capsys.readouterr()
    return code, out, err


def grpo_flags(base, out, *more):
    return ["--preset", "smoke", "--stage", "grpo", "--init", base, "--out", out, *more]


def snapshot(folder):
    """path -> (sha1 of the bytes, mtime) of every file under folder."""
    return {str(p.relative_to(folder)): (hashlib.sha1(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, smoke_base):
    """A finished 2-step GRPO run folder with checkpoints at steps 1 and 2."""
    out = tmp_path_factory.mktemp("run")
    assert train.cli(grpo_flags(str(smoke_base), str(out), "--steps", "2", "--save-every", "1")) == 0
    return out


# -----------------------------------------------------------------------------
# Bad input: one line naming the flag or file, exit status 2, nothing written

# name -> (flags, words the error line must contain); {t}: a folder of bad files, {b}: a good base
G = "--stage grpo --init {b}"
BAD_INPUT = {
    "missing --init": ("--stage grpo --init {t}/nope.pt", ["--init", "no such file", "nope.pt"]),
    "--init not a MAR file": ("--stage grpo --init {t}/not_mar.pt", ["--init", "not_mar.pt", "not a MAR"]),
    "--init not a torch file": ("--stage grpo --init {t}/text.pt", ["--init", "text.pt", "cannot read"]),
    "--init truncated": ("--stage grpo --init {t}/truncated.pt", ["--init", "truncated.pt", "cannot read"]),
    "missing reward weights": (G + " --reward hpsv2", ["--reward-ckpt", "hpsv2=PATH"]),
    "reward weights file missing": (G + " --reward hpsv2 --reward-ckpt hpsv2={t}/gone.pt", ["--reward-ckpt", "gone.pt"]),
    "reward weights unreadable": (G + " --reward hpsv2 --reward-ckpt hpsv2={t}/junk.pt", ["junk.pt", "cannot read"]),
    "unknown reward": ("--reward nope", ["--reward", "nope"]),  # --stage all: fails before pretraining
    "unknown method": (G + " --method ppo", ["--method", "ppo"]),
    "empty prompt file": (G + " --prompts {t}/empty.txt", ["--prompts", "empty.txt", "no prompts"]),
    "binary prompt file": (G + " --prompts {t}/binary.txt", ["--prompts", "binary.txt", "UTF-8"]),
    "unparseable shapes prompt": ("--prompts {t}/elephant.txt", ["--prompts", "elephant.txt:2", "purple elephant"]),
    "shapes reward, class prompts": (G + " --model mar_base --vae {t}/vae.ckpt", ["--reward shapes", "mar_base"]),
    "group of one": (G + " --group-size 1", ["--group-size 1"]),
    "--out under a file": (G + " --out {t}/a_file/run", ["--out", "a_file"]),
    "--out is a file": (G + " --out {t}/a_file", ["--out", "a_file", "not a folder"]),
    "MTE with S = 1": (G + " --mte-seeds 1", ["--mte-seeds 1"]),
    "zero --save-every": (G + " --save-every 0", ["--save-every 0"]),
    "pretrain from --init": ("--stage pretrain --init {b}", ["--stage pretrain", "--init"]),
    "eval without --init": ("--eval-only", ["--eval-only", "--init"]),
    "--resume with nothing to resume": (G + " --resume", ["--resume", "no checkpoint"]),
    "unknown flag": (G + " --learning-rate 1", ["--learning-rate"]),
    "not a number": (G + " --steps ten", ["--steps", "ten"]),
    # numeric flags: range and finiteness at parse time, before pretraining (--stage all)
    "NaN learning rate": ("--lr nan", ["--lr", "nan"]),
    "infinite guidance": ("--cfg inf", ["--cfg", "inf"]),
    "negative KL weight": ("--beta -1", ["--beta", "-1"]),
    "zero temperature": ("--temperature 0", ["--temperature", "0"]),
    "top-k above 1": ("--top-k 1.5", ["--top-k", "1.5"]),
    "NaN tau": ("--tau nan", ["--tau", "nan"]),
    "EMA of 1": ("--ema 1", ["--ema", "1"]),
    "--out where no file can be made": ("--out /proc/margrpo_run", ["--out", "/proc"]),
    "--pretrain-from of another size": ("--stage pretrain --pretrain-from {b} --embed-dim 48", ["--pretrain-from", "wrong shape"]),
    "--pretrain-from missing": ("--stage pretrain --pretrain-from {t}/nope.pt", ["--pretrain-from", "nope.pt"]),
    "--pretrain-from without pretraining": ("--init {b} --pretrain-from {b}", ["--pretrain-from", "does not pretrain"]),
    # values a run multiplies by, sizes that must fit each other, inputs that would be ignored
    "NaN reward weight": ("--reward shapes:nan", ["--reward", "shapes:nan", "finite"]),
    "infinite reward weight": (G + " --reward shapes:inf", ["--reward", "shapes:inf", "finite"]),
    "image size not a multiple of the patch": ("--img-size 30 --patch-size 4", ["--img-size 30", "--patch-size 4"]),
    "width the heads do not divide": ("--embed-dim 33 --heads 2", ["--embed-dim 33", "--heads 2"]),
    "weights for a reward not in use": (G + " --reward-ckpt hpsv2={b}", ["--reward-ckpt", "hpsv2", "uses no hpsv2"]),
    "--resume with unreadable checkpoints, before pretraining": ("--resume --out {t}/junk_run", ["--resume", "can be read"]),
    # models that do not fit: LoRA and FSDP (docs/memory.md)
    "LoRA of rank 0": ("--lora 0", ["--lora", "0"]),
    "LoRA with a trained head": (G + " --lora 4 --method grpo", ["--lora 4", "head stays frozen"]),
    "LoRA without training": ("--eval-only --init {b} --lora 4", ["--lora", "--eval-only"]),
    "FSDP in one process": (G + " --fsdp", ["--fsdp", "torchrun"]),
    "LoRA adapters as --init": ("--stage grpo --init {t}/adapters.pt", ["--init", "adapters.pt", "python lora.py merge"]),
}


def make_bad_files(tmp, base):
    torch.save({"weights": torch.zeros(3)}, tmp / "not_mar.pt")
    (tmp / "text.pt").write_text("hello\n")
    blob = Path(base).read_bytes()
    (tmp / "truncated.pt").write_bytes(blob[:len(blob) // 2])
    (tmp / "junk.pt").write_bytes(b"\x00not a checkpoint")
    (tmp / "empty.txt").write_text("\n  \n")
    (tmp / "binary.txt").write_bytes(b"\xff\xfe\x00\x81")
    (tmp / "elephant.txt").write_text("a red circle\na purple elephant\n")
    (tmp / "a_file").write_text("")
    (tmp / "vae.ckpt").write_bytes(b"")
    (tmp / "junk_run" / "ckpt").mkdir(parents=True)  # a run folder whose only checkpoint is unreadable
    (tmp / "junk_run" / "ckpt" / "step_000003.pt").write_bytes(b"\x00junk")
    torch.save({"model": {}, "base": str(base), "config": {}, "lora": dict(rank=2, alpha=2.0, targets="x")},
               tmp / "adapters.pt")  # a checkpoint of train.py --lora: adapters over a base


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, tmp_path, smoke_base, capsys):
    make_bad_files(tmp_path, smoke_base)
    flags, words = BAD_INPUT[case]
    flags = flags.format(t=tmp_path, b=smoke_base).split()
    out = tmp_path / "run"
    if "--out" not in flags:
        flags += ["--out", str(out)]
    before = snapshot(tmp_path)
    code, stdout, stderr = cli(capsys, "--preset", "smoke", *flags)
    assert code == 2, (stdout, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not out.exists() and snapshot(tmp_path) == before  # nothing created, nothing changed


def test_empty_out_is_one_line(capsys):
    code, _, err = cli(capsys, "--preset", "smoke", "--out", "")
    assert code == 2 and err.strip().splitlines() == ["error: --out '': give a folder (or leave --out out: runs/<preset>)"]


def test_batch_that_does_not_divide_by_the_world_size():
    args = train.parse_args(["--preset", "smoke", "--prompts-per-step", "3"])
    with pytest.raises(ValueError, match=r"--prompts-per-step 3 must divide by the world size 2"):
        train.check_inputs(args, world=2)
    train.check_inputs(train.parse_args(["--preset", "smoke", "--prompts-per-step", "4", "--out", "/nonexistent/x"]), world=2)
    args = train.parse_args(["--preset", "smoke", "--stage", "pretrain", "--pretrain-batch", "15"])
    with pytest.raises(ValueError, match=r"--pretrain-batch 15 must divide by the world size 2"):
        train.check_inputs(args, world=2)


def test_mismatched_reward_weights(tmp_path, smoke_base, capsys, monkeypatch):
    """A reward weights file of another architecture (tiny open_clip models stand in for ViT-H)."""
    import open_clip
    for name, width in (("reliability-tiny", 32), ("reliability-wide", 48)):
        cfg = {"embed_dim": 16, "vision_cfg": {"image_size": 32, "layers": 1, "width": width, "head_width": 16, "patch_size": 16},
               "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": width, "heads": 2, "layers": 1}}
        (tmp_path / f"{name}.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(tmp_path)
    torch.save(open_clip.create_model("reliability-wide", pretrained=None).state_dict(), tmp_path / "wide.pt")
    tiny_hps = functools.partial(rewards.HPSv2Reward, model_name="reliability-tiny")
    monkeypatch.setitem(rewards.REWARDS, "hpsv2", (tiny_hps, ("hpsv2",), set()))
    out = tmp_path / "run"
    code, _, err = cli(capsys, *grpo_flags(smoke_base, out, "--reward", "hpsv2", "--reward-ckpt", f"hpsv2={tmp_path}/wide.pt"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "wide.pt" in err and "do not fit" in err and not out.exists()


def test_bad_input_leaves_an_existing_run_untouched(tmp_path, smoke_run, smoke_base, capsys):
    """Bad flags or files aimed at a finished run's folder, --resume or not, change none of its files;
    this includes resuming from a checkpoint of another model size."""
    run = tmp_path / "run"
    shutil.copytree(smoke_run, run)
    other = mar.build_mar(models.small_mar_config(train.parse_args(["--preset", "smoke", "--embed-dim", "48"])))
    torch.save({"model": other.state_dict(), "base": os.path.abspath(smoke_base), "optimizer": {}, "step": 9},
               run / "ckpt" / "step_000009.pt")
    before = snapshot(run)
    for flags, words in [
        (["--resume", "--reward", "nope"], ["--reward", "nope"]),
        (["--resume", "--prompts", str(run / "missing.txt")], ["--prompts", "missing.txt"]),
        (["--method", "ppo"], ["--method"]),
        (["--resume"], ["--resume", "step_000009.pt", "does not fit"]),  # a checkpoint of another size
    ]:
        code, _, err = cli(capsys, *grpo_flags(smoke_base, run, *flags))
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert all(w in err for w in words), (words, err)
        assert snapshot(run) == before


def test_cli_exit_status_without_traceback(tmp_path):
    """The real process: exit status 2, exactly one line on stderr, no traceback."""
    res = subprocess.run([sys.executable, TRAIN, *grpo_flags(str(tmp_path / "nope.pt"), str(tmp_path / "run"))],
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [f"error: --init: no such file: {tmp_path / 'nope.pt'}"]
    assert not (tmp_path / "run").exists()


def test_error_lines_name_the_rank_under_torchrun(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")  # what torchrun sets; the flag error comes before any process group
    code, _, err = cli(capsys, "--preset", "smoke", "--method", "ppo")
    assert code == 2 and err.startswith("error (rank 1): ") and "--method" in err


# -----------------------------------------------------------------------------
# Non-finite values: skipped, counted, logged; too many in a row stop the run

def nan_rewards_at(monkeypatch, steps):
    """The reward of the first image is NaN at these GRPO steps (one train.score call per step)."""
    calls, real = [], train.score

    def score(*a):
        scores, info = real(*a)
        if len(calls) in steps:
            scores = scores.clone()
            scores[0] = float("nan")
        calls.append(1)
        return scores, info
    monkeypatch.setattr(train, "score", score)


def nan_losses_at(monkeypatch, steps):
    """The pretraining loss is NaN at these steps (one MAR.forward call per step)."""
    calls, real = [], mar.MAR.forward

    def forward(self, *a, **k):
        loss = real(self, *a, **k)
        calls.append(1)
        return loss * float("nan") if len(calls) - 1 in steps else loss
    monkeypatch.setattr(mar.MAR, "forward", forward)


def test_nan_reward_skips_the_update_and_is_counted(tmp_path, smoke_base, capsys, monkeypatch):
    nan_rewards_at(monkeypatch, {1})
    out = tmp_path / "run"
    code, stdout, err = cli(capsys, *grpo_flags(smoke_base, out, "--steps", "3", "--save-every", "1", "--keep-last", "0"))
    assert code == 0, err
    rows = metrics(out)
    assert [r["skipped"] for r in rows] == [0, 1, 0] and [r["bad_steps_total"] for r in rows] == [0, 1, 1]
    assert math.isnan(rows[1]["reward_mean"]) and "step 1: non-finite" in stdout
    c1, c2, c3 = (load(out / "ckpt" / f"step_00000{i}.pt") for i in (1, 2, 3))
    adam_steps = [max(int(s["step"]) for s in c["optimizer"]["state"].values()) for c in (c1, c2, c3)]
    assert adam_steps == [1, 1, 2]  # no optimizer step at step 1, one at step 2
    assert all(torch.equal(c1["model"][k], c2["model"][k]) for k in c1["model"])  # the policy did not move
    assert all(torch.isfinite(v).all() for v in c3["model"].values() if v.is_floating_point())
    assert c3["bad_steps_total"] == 1


def test_max_bad_steps_stops_with_the_last_good_checkpoint(tmp_path, smoke_base, capsys, monkeypatch):
    nan_rewards_at(monkeypatch, {1, 2})
    out = tmp_path / "run"
    code, _, err = cli(capsys, *grpo_flags(smoke_base, out, "--steps", "5", "--save-every", "1", "--max-bad-steps", "2"))
    assert code == 1
    last = err.strip().splitlines()[-1]
    assert last == (f"error: 2 non-finite steps in a row (--max-bad-steps 2); "
                    f"the last good checkpoint: {out / 'ckpt' / 'step_000002.pt'}"), err
    assert "Traceback" not in err
    assert [r["step"] for r in metrics(out)] == [0, 1, 2]
    assert sorted(os.listdir(out / "ckpt")) == ["latest.pt", "step_000001.pt", "step_000002.pt"]
    good = load(out / "ckpt" / "latest.pt")
    assert good["step"] == 2 and all(torch.isfinite(v).all() for v in good["model"].values() if v.is_floating_point())


def test_pretraining_skips_non_finite_loss(tmp_path, capsys, monkeypatch):
    """A NaN loss changes neither the weights nor the EMA (without the skip, base.pt would be NaN);
    too many in a row stop before base.pt is written."""
    nan_losses_at(monkeypatch, {2, 4})
    code, stdout, err = cli(capsys, "--preset", "smoke", "--stage", "pretrain", "--pretrain-steps", "6",
                            "--out", tmp_path / "a")
    assert code == 0, err
    assert "pretrain step 2: non-finite" in stdout and "(2 non-finite steps skipped)" in stdout
    ema = load(tmp_path / "a" / "base.pt")["model"]
    assert all(torch.isfinite(v).all() for v in ema.values() if v.is_floating_point())

    monkeypatch.undo()
    nan_losses_at(monkeypatch, {1, 2})
    code, _, err = cli(capsys, "--preset", "smoke", "--stage", "pretrain", "--pretrain-steps", "6",
                       "--max-bad-steps", "2", "--out", tmp_path / "b")
    assert code == 1 and "pretraining: 2 non-finite steps in a row (--max-bad-steps 2)" in err
    assert not (tmp_path / "b" / "base.pt").exists()


def test_pretraining_renders_the_world_its_flags_ask_for(tmp_path, capsys, monkeypatch):
    """--cell and --unmentioned reach the pretraining data (the demo's base was made with both), and
    an --unmentioned outside [0, 1] is a one-line error naming the flag."""
    seen = []
    make = shapes.make_dataset
    monkeypatch.setattr(shapes, "make_dataset", lambda *a, **k: seen.append(k) or make(*a, **k))
    code, _, err = cli(capsys, "--preset", "smoke", "--stage", "pretrain", "--pretrain-steps", "2", "--img-size", "16",
                       "--patch-size", "2", "--cell", "8", "--unmentioned", "0.5", "--out", tmp_path / "a")
    assert code == 0, err
    assert seen == [dict(split="train", cell=8, unmentioned=0.5)] * 2
    code, _, err = cli(capsys, "--preset", "smoke", "--stage", "pretrain", "--unmentioned", "1.5", "--out", tmp_path / "b")
    assert code == 2 and err.startswith("error: --unmentioned 1.5: must be a finite number in [0, 1]"), err


def test_pretraining_continues_from_a_base(tmp_path, smoke_base, capsys):
    """--pretrain-from starts from the base's weights: with 0 steps the written base is that base;
    with steps it trains on from there (a fresh optimizer)."""
    code, stdout, err = cli(capsys, "--preset", "smoke", "--stage", "pretrain", "--pretrain-steps", "0",
                            "--pretrain-from", smoke_base, "--out", tmp_path / "zero")
    assert code == 0, err
    assert f"from {smoke_base}" in stdout
    start, again = load(smoke_base)["model"], load(tmp_path / "zero" / "base.pt")["model"]
    assert all(torch.equal(start[k], again[k]) for k in start)
    code, _, err = cli(capsys, "--preset", "smoke", "--stage", "pretrain", "--pretrain-steps", "3",
                       "--pretrain-from", smoke_base, "--out", tmp_path / "more")
    assert code == 0, err
    more = load(tmp_path / "more" / "base.pt")["model"]
    assert any(not torch.equal(start[k], more[k]) for k in start)


# -----------------------------------------------------------------------------
# Crashes, restarts, resume

# train.py run in a subprocess with a fault patched in (no test hooks in production code)
PATCHED_TRAIN = """
import os, signal, sys, time
import torch
import checkpoints, rollout, train
{patch}
sys.exit(train.cli(sys.argv[1:]))
"""
# every torch.save sleeps 2 s after writing, before the atomic rename: a window for SIGKILL
SLOW_SAVE = """
real_save = torch.save
def slow_save(*a, **k):
    real_save(*a, **k)
    time.sleep(2)
checkpoints.torch.save = slow_save
"""
# the last rank SIGKILLs itself as GRPO step 2 starts (its third rollout), on the first launch only
KILL_AT_STEP_2 = """
real_record, calls = rollout.record_rollout, []
def record(*a, **k):
    calls.append(1)
    if (len(calls) == 3 and int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1
            and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0):
        os.kill(os.getpid(), signal.SIGKILL)
    return real_record(*a, **k)
rollout.record_rollout = record
"""


def test_sigkill_while_writing_a_checkpoint_then_resume(tmp_path, smoke_base, capsys):
    out = tmp_path / "run"
    flags = grpo_flags(str(smoke_base), str(out), "--steps", "4", "--save-every", "1", "--keep-last", "0")
    log = open(tmp_path / "log.txt", "w")
    proc = subprocess.Popen([sys.executable, "-c", PATCHED_TRAIN.format(patch=SLOW_SAVE), *flags], cwd=REPO,
                            env=ENV, stdout=log, stderr=log)
    deadline = time.time() + 120
    while not list((out / "ckpt").glob("step_000002.pt.tmp.*")):  # the second checkpoint is being written
        assert proc.poll() is None and time.time() < deadline, (tmp_path / "log.txt").read_text()
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    log.close()
    ckpt = out / "ckpt"
    assert not (ckpt / "step_000002.pt").exists() and list(ckpt.glob("*.tmp.*"))
    assert load(ckpt / "latest.pt")["step"] == 1 and load(ckpt / "step_000001.pt")["step"] == 1

    code, stdout, err = cli(capsys, *flags, "--resume")
    assert code == 0, err
    assert "resumed from step 1" in stdout and not list(ckpt.glob("*.tmp.*"))
    assert [r["step"] for r in metrics(out)] == [0, 1, 2, 3]  # each step once, none lost or doubled
    assert load(ckpt / "latest.pt")["step"] == 4

    # a damaged newest checkpoint (disk, copy) is skipped with a warning; the one before is used
    blob = (ckpt / "step_000004.pt").read_bytes()
    (ckpt / "step_000004.pt").write_bytes(blob[:len(blob) // 3])
    code, stdout, err = cli(capsys, *flags, "--resume", "--steps", "5")
    assert code == 0 and "skipping unreadable checkpoint" in err and "resumed from step 3" in stdout
    assert [r["step"] for r in metrics(out)] == [0, 1, 2, 3, 4] and load(ckpt / "latest.pt")["step"] == 5


def test_torchrun_relaunch_resumes_after_a_rank_dies(tmp_path, smoke_base):
    """torchrun --max-restarts=1, 2 gloo processes; rank 1 is SIGKILLed as step 2 starts. The
    relaunch (TORCHELASTIC_RESTART_COUNT=1) resumes from step 2 on its own and finishes.
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it torchrun's relaunch may read the dead
    attempt's addresses from the store it shares with the workers and fail to connect or hang
    (pytorch/pytorch#135712; 2 of 8 tries on 2 CPU cores); the README tells users the same."""
    out = tmp_path / "run"
    script = tmp_path / "train_killed_at_step_2.py"
    script.write_text(PATCHED_TRAIN.format(patch=KILL_AT_STEP_2))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           str(script), *grpo_flags(str(smoke_base), str(out), "--steps", "4", "--save-every", "1")]
    env = dict(ENV, PYTHONPATH=str(REPO), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "resumed from step 2" in res.stdout
    assert [r["step"] for r in metrics(out)] == [0, 1, 2, 3]
    assert load(out / "ckpt" / "latest.pt")["step"] == 4


def test_fresh_run_replaces_an_old_run_and_resume_auto(tmp_path, smoke_run, smoke_base, capsys):
    """Without --resume a run starts over: the old run's checkpoints go (so pruning and a later
    --resume never mix two runs). --resume auto continues when there is a checkpoint."""
    run = tmp_path / "run"
    shutil.copytree(smoke_run, run)
    code, stdout, _ = cli(capsys, *grpo_flags(smoke_base, run, "--steps", "1"))
    assert code == 0 and "a fresh run" in stdout
    assert sorted(os.listdir(run / "ckpt")) == ["latest.pt", "step_000001.pt"] and len(metrics(run)) == 1
    code, stdout, _ = cli(capsys, *grpo_flags(smoke_base, run, "--steps", "2", "--resume", "auto"))
    assert code == 0 and "resumed from step 1" in stdout and [r["step"] for r in metrics(run)] == [0, 1]
    code, stdout, _ = cli(capsys, *grpo_flags(smoke_base, tmp_path / "new", "--steps", "1", "--resume", "auto"))
    assert code == 0 and "resumed" not in stdout  # nothing to resume: a fresh start


# -----------------------------------------------------------------------------
# A failing reward is reported, not swallowed

def test_failing_reward_names_the_reward_and_the_prompts(tmp_path, smoke_base, capsys, monkeypatch):
    seen, real = [], rewards.ShapesReward.score

    def flaky(self, images, prompts, metadata):
        seen.append(list(prompts))
        if len(seen) == 2:
            raise RuntimeError("verifier exploded")
        return real(self, images, prompts, metadata)
    monkeypatch.setattr(rewards.ShapesReward, "score", flaky)
    out = tmp_path / "run"
    code, _, err = cli(capsys, *grpo_flags(smoke_base, out, "--steps", "3", "--save-every", "1"))
    assert code == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: --reward 'shapes' failed on the prompts [") and "verifier exploded" in last
    assert all(p in last for p in seen[1])
    assert "Traceback" in err and "in flaky" in err  # the reward's own traceback comes first
    assert load(out / "ckpt" / "latest.pt")["step"] == 1  # the checkpoint before the failure is intact


# -----------------------------------------------------------------------------
# Long runs: flat memory, pruned checkpoints

def rss_mb():
    """Resident memory of this process in MiB (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc")
def test_long_run_memory_is_flat_and_checkpoints_are_pruned(tmp_path, smoke_base, capsys, monkeypatch):
    rss, real = [], evaluate.group_diversity

    def sampled(images, G):  # called once per GRPO step, in its logging stage
        rss.append(rss_mb())
        return real(images, G)
    monkeypatch.setattr(evaluate, "group_diversity", sampled)
    out = tmp_path / "run"
    code, _, err = cli(capsys, *grpo_flags(smoke_base, out, "--steps", "50", "--save-every", "10", "--keep-last", "2",
                                           "--sample-every", "1000"))
    assert code == 0, err
    assert len(rss) == 50
    # growth over steps 10-49 as a least-squares slope (single samples jitter by a few MiB): measured
    # about 0 MiB/step; keeping each step's rollout record alive measures 1.4 MiB/step
    slope = float(np.polyfit(np.arange(10, 50), rss[10:], 1)[0])
    assert slope < 0.5 and rss[49] - rss[10] < 50, (slope, rss)
    assert sorted(os.listdir(out / "ckpt")) == ["latest.pt", "step_000040.pt", "step_000050.pt"]


@pytest.mark.parametrize("preset,where,path,sha", [("demo", "flags", "DEMO_BASE", "DEMO_BASE_SHA256"),
                                                   ("free16", "study", "FREE16_BASE", "FREE16_BASE_SHA256")])
def test_shipped_bases_are_the_recorded_files_and_their_presets_models(preset, where, path, sha):
    """python train.py starts from bases/demo.pt (and the study's preset free16, registered by
    experiments/study.py, from experiments/bases/free16.pt): the file is the one whose checksum is
    recorded beside the preset, it loads through --init's path (float16 weights into a float32
    model), and it is the model the preset describes; --init scratch and --stage pretrain pretrain
    instead."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "experiments"))
    module = importlib.import_module(where)
    args = train.parse_args(["--preset", preset])
    assert args.init == getattr(module, path)
    assert checkpoints.sha256(args.init) == getattr(module, sha)
    model = models.load_policy(args, args.init)
    want = dict(models.small_mar_config(args), num_sampling_steps=str(args.num_sampling_steps))
    assert {k: model.config[k] for k in want} == want
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert train.parse_args(["--preset", preset, "--init", "scratch"]).init is None
    assert train.parse_args(["--preset", preset, "--stage", "pretrain"]).init is None
    assert train.parse_args(["--preset", preset, "--stage", "pretrain", "--init", "x.pt"]).init == "x.pt"  # check_inputs rejects it
