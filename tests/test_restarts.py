"""train.py across crashes and restarts: a SIGKILL while a checkpoint is written, a torchrun relaunch
after a rank dies, a fresh run over an old one and --resume auto; each continues exactly. CPU-only,
smoke size (docs/faults.md lists every case)."""

import os
import shutil
import signal
import subprocess
import sys
import time


from tests.helpers import ENV, ROOT, cli, grpo_flags, load, metrics


# train.py run in a subprocess with a fault patched in (no test hooks in production code)
PATCHED_TRAIN = """
import os, signal, sys, time
import torch
import rollout, train
from infra import checkpoints
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
    proc = subprocess.Popen([sys.executable, "-c", PATCHED_TRAIN.format(patch=SLOW_SAVE), *flags], cwd=ROOT,
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
    (pytorch/pytorch#135712; 2 of 8 tries on 2 CPU cores); docs/real_models.md tells users the same."""
    out = tmp_path / "run"
    script = tmp_path / "train_killed_at_step_2.py"
    script.write_text(PATCHED_TRAIN.format(patch=KILL_AT_STEP_2))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           str(script), *grpo_flags(str(smoke_base), str(out), "--steps", "4", "--save-every", "1")]
    env = dict(ENV, PYTHONPATH=str(ROOT), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
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


