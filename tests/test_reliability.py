"""Reliability of train.py: bad input, non-finite steps, crashes, restarts, failing
rewards and long runs. CPU-only, smoke size. Most runs call `train.cli` in this process (the
script's own entry point, minus the ~6 s of imports a subprocess pays); a subprocess is used where
the exit status, a SIGKILL or torchrun is what is being tested."""

import functools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import demo
import mar
import rewards
import train
from demo import pretrain, verifier
from experiments import lab
from infra import checkpoints, flags, processes
from models import loading
from scorers import clip, registry
from tests.helpers import ENV, TRAIN, cli, grpo_flags, load, metrics, snapshot

torch.set_num_threads(1)  # tiny ops: threads only add contention on a 2-core machine



# -----------------------------------------------------------------------------
# Bad input: one line naming the flag or file, exit status 2, nothing written

# name -> (flags, words the error line must contain); {t}: a folder of bad files, {b}: a good base
G = "--eval-prompts 0 --init {b}"
BAD_INPUT = {
    "missing --init": ("--eval-prompts 0 --init {t}/nope.pt", ["--init", "no such file", "nope.pt"]),
    "--init not a MAR file": ("--eval-prompts 0 --init {t}/not_mar.pt", ["--init", "not_mar.pt", "not a MAR"]),
    "--init not a torch file": ("--eval-prompts 0 --init {t}/text.pt", ["--init", "text.pt", "not a PyTorch checkpoint"]),
    "--init truncated": ("--eval-prompts 0 --init {t}/truncated.pt", ["--init", "truncated.pt", "cut short"]),
    "missing reward weights": (G + " --reward hpsv2", ["--reward-ckpt", "hpsv2=PATH"]),
    "reward weights file missing": (G + " --reward hpsv2 --reward-ckpt hpsv2={t}/gone.pt", ["--reward-ckpt", "gone.pt"]),
    "reward weights unreadable": (G + " --reward hpsv2 --reward-ckpt hpsv2={t}/junk.pt", ["junk.pt", "cannot read"]),
    "unknown reward": ("--reward nope", ["--reward", "nope"]),
    "unknown method": (G + " --method ppo", ["--method", "ppo"]),
    "empty prompt file": (G + " --prompts {t}/empty.txt", ["--prompts", "empty.txt", "no prompts"]),
    "binary prompt file": (G + " --prompts {t}/binary.txt", ["--prompts", "binary.txt", "UTF-8"]),
    "unparseable shapes prompt": ("--prompts {t}/elephant.txt", ["--prompts", "elephant.txt:2", "purple elephant"]),
    "shapes reward, class prompts": (G + " --model mar_base --vae {t}/vae.ckpt", ["--reward shapes", "mar_base"]),
    "group of one": (G + " --group-size 1", ["--group-size 1"]),
    "--out under a file": (G + " --out {t}/a_file/run", ["--out", "a_file"]),
    "--out is a file": (G + " --out {t}/a_file", ["--out", "a_file", "not a folder"]),
    "MTE with S = 1": (G + " --mte-trajectories 1", ["--mte-trajectories 1"]),
    "zero --save-every": (G + " --save-every 0", ["--save-every 0"]),
    "a preset without a base, no --init": ("--preset adapter_smoke", ["--init", "give the base checkpoint"]),
    "--resume with nothing to resume": (G + " --resume", ["--resume", "no checkpoint"]),
    "unknown flag": (G + " --learning-rate 1", ["--learning-rate"]),
    "not a number": (G + " --steps ten", ["--steps", "ten"]),
    # numeric flags: range and finiteness at parse time
    "NaN learning rate": ("--lr nan", ["--lr", "nan"]),
    "infinite guidance": ("--cfg inf", ["--cfg", "inf"]),
    "negative KL weight": ("--beta -1", ["--beta", "-1"]),
    "zero temperature": ("--temperature 0", ["--temperature", "0"]),
    "top-k above 1": ("--top-k 1.5", ["--top-k", "1.5"]),
    "NaN consistency threshold": ("--consistency-threshold nan", ["--consistency-threshold", "nan"]),
    "--tau is not a flag": (G + " --tau 0", ["--tau"]),
    "--out where no file can be made": ("--out /proc/margrpo_run", ["--out", "/proc"]),
    # values a run multiplies by, sizes that must fit each other, inputs that would be ignored
    "NaN reward weight": ("--reward shapes:nan", ["--reward", "shapes:nan", "finite"]),
    "infinite reward weight": (G + " --reward shapes:inf", ["--reward", "shapes:inf", "finite"]),
    "weights for a reward not in use": (G + " --reward-ckpt hpsv2={b}", ["--reward-ckpt", "hpsv2", "uses no hpsv2"]),
    "--resume with unreadable checkpoints": (G + " --resume --out {t}/junk_run", ["--resume", "can be read"]),
    # models that do not fit: LoRA and FSDP (docs/memory.md)
    "LoRA of rank 0": ("--lora 0", ["--lora", "0"]),
    "LoRA with a trained head": (G + " --lora 4 --method grpo", ["--lora 4", "head stays frozen"]),
    "LoRA without training": ("--eval-only --init {b} --lora 4", ["--lora", "--eval-only"]),
    "FSDP in one process": (G + " --fsdp", ["--fsdp", "torchrun"]),
    # what a run records must be what runs
    "--img-size against the base": (G + " --img-size 16", ["--img-size 16", "32-px images"]),
    # the project's own words, whole
    "--init a folder": ("--eval-prompts 0 --init {t}", ["--init", "a folder, not a checkpoint file"]),
    "--init empty": ("--eval-prompts 0 --init {t}/empty.pt", ["--init", "empty.pt", "the file is empty"]),
    "--init a pickled module": ("--eval-prompts 0 --init {t}/module.pt", ["--init", "module.pt", "save the model's state_dict()"]),
    "LoRA adapters as --init of a new run": (G.replace("{b}", "{t}/adapters.pt"), ["--init", "adapters.pt", "--resume",
                                                                                   "python -m models.merge_lora"]),
}


def make_bad_files(tmp, base):
    torch.save({"weights": torch.zeros(3)}, tmp / "not_mar.pt")
    (tmp / "text.pt").write_text("hello\n")
    blob = Path(base).read_bytes()
    (tmp / "truncated.pt").write_bytes(blob[:len(blob) // 2])
    (tmp / "junk.pt").write_bytes(b"\x00not a checkpoint")
    (tmp / "empty.pt").write_bytes(b"")
    torch.save({"model": torch.nn.Linear(2, 2)}, tmp / "module.pt")  # a module, not a state dict
    (tmp / "empty.txt").write_text("\n  \n")
    (tmp / "binary.txt").write_bytes(b"\xff\xfe\x00\x81")
    (tmp / "elephant.txt").write_text("a red circle\na purple elephant\n")
    (tmp / "a_file").write_text("")
    (tmp / "vae.ckpt").write_bytes(b"")
    (tmp / "junk_run" / "ckpt").mkdir(parents=True)  # a run folder whose only checkpoint is unreadable
    (tmp / "junk_run" / "ckpt" / "step_000003.pt").write_bytes(b"\x00junk")
    torch.save({"model": {}, "base": str(base), "config": {}, "lora": dict(rank=2, alpha=2.0, targets=mar.MAR.LORA_TARGETS)},
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
        flags.check_run_inputs(args, 2, train.grpo_settings(args).train_head)
    args = train.parse_args(["--preset", "smoke", "--prompts-per-step", "4", "--out", "/nonexistent/x"])
    flags.check_run_inputs(args, 2, train.grpo_settings(args).train_head)


def test_mismatched_reward_weights(tmp_path, smoke_base, capsys, monkeypatch):
    """A reward weights file of another architecture (tiny open_clip models stand in for ViT-H)."""
    import open_clip
    for name, width in (("reliability-tiny", 32), ("reliability-wide", 48)):
        cfg = {"embed_dim": 16, "vision_cfg": {"image_size": 32, "layers": 1, "width": width, "head_width": 16, "patch_size": 16},
               "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": width, "heads": 2, "layers": 1}}
        (tmp_path / f"{name}.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(tmp_path)
    torch.save(open_clip.create_model("reliability-wide", pretrained=None).state_dict(), tmp_path / "wide.pt")
    tiny_hps = functools.partial(clip.HPSv2Reward, model_name="reliability-tiny")
    monkeypatch.setitem(registry.REWARDS, "hpsv2", (tiny_hps, ("hpsv2",), set()))
    out = tmp_path / "run"
    code, _, err = cli(capsys, *grpo_flags(smoke_base, out, "--reward", "hpsv2", "--reward-ckpt", f"hpsv2={tmp_path}/wide.pt"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "wide.pt" in err and "do not fit" in err and not out.exists()


def test_bad_input_leaves_an_existing_run_untouched(tmp_path, smoke_run, smoke_base, capsys):
    """Bad flags or files aimed at a finished run's folder, --resume or not, change none of its files;
    this includes resuming from a checkpoint of another model size."""
    run = tmp_path / "run"
    shutil.copytree(smoke_run, run)
    other = mar.build_mar(pretrain.small_mar_config(pretrain.parse_args(["--preset", "smoke", "--embed-dim", "48"])))
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


def test_every_command_stops_on_a_failed_reward_in_one_line_and_keeps_a_bug_s_traceback(capsys):
    """processes.cli, which every script's main runs through: an exception whose class sets
    stops_the_run (rewards.RewardFailed, processes.Stop) is exit status 1 with the cause's traceback
    and one closing line; any other exception is a bug and propagates."""
    def failing(argv):
        try:
            raise ZeroDivisionError("inside the scorer")
        except ZeroDivisionError as e:
            raise rewards.RewardFailed("reward 'shapes' failed on prompts ['a red circle']") from e
    assert processes.cli(failing) == 1
    err = capsys.readouterr().err
    assert "ZeroDivisionError: inside the scorer" in err
    assert err.strip().splitlines()[-1] == "error: reward 'shapes' failed on prompts ['a red circle']"
    assert processes.cli(lambda argv: (_ for _ in ()).throw(processes.Stop("5 non-finite steps"))) == 1
    with pytest.raises(RuntimeError, match="a bug"):
        processes.cli(lambda argv: (_ for _ in ()).throw(RuntimeError("a bug")))


def test_error_lines_name_the_rank_under_torchrun(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")  # what torchrun sets; the flag error comes before any process group
    code, _, err = cli(capsys, "--preset", "smoke", "--method", "ppo")
    assert code == 2 and err.startswith("error (rank 1): ") and "--method" in err


# -----------------------------------------------------------------------------
# Non-finite values: skipped, counted, logged; too many in a row stop the run

def nan_rewards_at(monkeypatch, steps):
    """The reward of the first image is NaN at these GRPO steps (one rewards.score call per step)."""
    calls, real = [], rewards.score

    def score(*a):
        scores, info = real(*a)
        if len(calls) in steps:
            scores = scores.clone()
            scores[0] = float("nan")
        calls.append(1)
        return scores, info
    monkeypatch.setattr(rewards, "score", score)


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


# -----------------------------------------------------------------------------
# A failing reward is reported, not swallowed

def test_failing_reward_names_the_reward_and_the_prompts(tmp_path, smoke_base, capsys, monkeypatch):
    seen, real = [], verifier.ShapesReward.score

    def flaky(self, images, prompts, metadata):
        seen.append(list(prompts))
        if len(seen) == 2:
            raise RuntimeError("verifier exploded")
        return real(self, images, prompts, metadata)
    monkeypatch.setattr(verifier.ShapesReward, "score", flaky)
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
    rss, real = [], train.group_diversity

    def sampled(images, G):  # called once per GRPO step, in its logging stage
        rss.append(rss_mb())
        return real(images, G)
    monkeypatch.setattr(train, "group_diversity", sampled)
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


@pytest.mark.parametrize("preset,base,sha", [("demo", demo.BASE, demo.BASE_SHA256),
                                             ("smoke", demo.SMOKE_BASE, demo.SMOKE_BASE_SHA256),
                                             ("free16", lab.FREE16_BASE, lab.FREE16_BASE_SHA256),
                                             ("relation", lab.RELATION_BASE, lab.RELATION_BASE_SHA256),
                                             ("mirror05", lab.MIRROR_BASES["05"], lab.MIRROR_SHA256["05"]),
                                             ("mirror07", lab.MIRROR_BASES["07"], lab.MIRROR_SHA256["07"])])
def test_shipped_bases_are_the_recorded_files_and_their_presets_models(preset, base, sha):
    """python train.py starts from demo/base.pt, --preset smoke from demo/smoke.pt (and
    the lab's presets from experiments/bases/): the file is the one whose checksum is recorded
    beside it, it loads through --init's path (float16 weights into a float32 model), and it is the
    model of its pretraining preset (demo/pretrain.py)."""
    args = train.parse_args(["--preset", preset])
    assert args.init == base and checkpoints.sha256(base) == sha
    model = loading.load_policy(args, args.init)
    pre = pretrain.parse_args(["--preset", preset, "--num-sampling-steps", str(args.num_sampling_steps)])
    want = pretrain.small_mar_config(pre)
    assert {k: model.config[k] for k in want} == want
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_the_run_record_describes_the_model_that_ran(tmp_path, capsys):
    """--preset smoke (32-px flags) from the demo's 16-px base: config.json and the checkpoint's flags
    say 16 px (the base's), config.json holds the model's own configuration and how its base was
    made (the 8-px cells of its pretraining world)."""
    out = tmp_path / "run"
    code, _, err = cli(capsys, "--preset", "smoke", "--init", demo.BASE, "--steps", "1", "--eval-prompts", "0", "--out", out)
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    ckpt = load(out / "ckpt" / "latest.pt")
    assert config["img_size"] == ckpt["args"]["img_size"] == config["model"]["img_size"] == 16
    assert config["model"] == ckpt["config"] and config["model"]["encoder_embed_dim"] == 128  # not the smoke preset's 32
    assert config["base"]["path"] == demo.BASE and config["base"]["stage"] == "pretrain"
    assert config["base"]["args"]["cell"] == 8 and config["base"]["args"]["unmentioned"] == 0.5


def test_faults_doc_lists_every_bad_input():
    """docs/faults.md's table holds a row for every case of BAD_INPUT (tests/test_evaluate.py's cases
    are listed there too)."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "faults.md").read_text()
    rows = {line.split("|")[1].strip() for line in doc.splitlines() if line.startswith("| ")}
    assert set(BAD_INPUT) <= rows, sorted(set(BAD_INPUT) - rows)
