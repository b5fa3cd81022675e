"""Where a run meets another run, a signal, a full disk, or one of the scripts beside train.py: one
line, the right exit status, and nothing lost (docs/faults.md lists every case; the bad flags and
files of train.py are test_reliability.py's table). CPU-only, smoke size."""

import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train
from infra import checkpoints, processes
from tests.helpers import ENV, ROOT, TRAIN, cli, grpo_flags, load, metrics


def start(*flags):
    """train.py in its own process (stdout, stderr to pipes)."""
    return subprocess.Popen([sys.executable, TRAIN, *map(str, flags)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for_rows(out, n, proc, timeout=120):
    """Until metrics.jsonl of `out` has n rows (the run is inside its GRPO loop)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        path = Path(out) / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError(f"no {n} metrics rows in {timeout} s")


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error")]


# -----------------------------------------------------------------------------
# One writer per run folder

def test_a_second_run_on_the_same_out_stops_and_a_killed_runs_lock_does_not_block_resume(tmp_path, smoke_base):
    out = tmp_path / "run"
    first = start(*grpo_flags(smoke_base, out, "--steps", "400", "--save-every", "1"))
    try:
        wait_for_rows(out, 2, first)
        second = subprocess.run([sys.executable, TRAIN, *grpo_flags(str(smoke_base), str(out), "--steps", "3")], env=ENV,
                                capture_output=True, text=True, timeout=120)
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert str(out) in lines[0] and f"process {first.pid}" in lines[0] and "another run" in lines[0]
        assert first.poll() is None  # the first run goes on, its folder its own
        rows_before = len(metrics(out))
    finally:
        first.kill()  # SIGKILL: its lock stays behind
        first.wait()
    assert (out / ".lock").exists() and str(first.pid) in (out / ".lock").read_text()
    assert len(metrics(out)) >= rows_before  # nothing of the first run was undone by the second
    done = load(out / "ckpt" / "latest.pt")["step"]
    resumed = subprocess.run([sys.executable, TRAIN, *grpo_flags(str(smoke_base), str(out), "--steps", str(done + 1),
                                                                  "--save-every", "1", "--resume")],
                             env=ENV, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0 and f"resumed from step {done}" in resumed.stdout, resumed.stderr
    assert load(out / "ckpt" / "latest.pt")["step"] == done + 1 and not (out / ".lock").exists()


def test_the_lock_is_released_after_a_run_and_after_a_failure(tmp_path, smoke_base, capsys):
    out = tmp_path / "run"
    code, _, err = cli(capsys, *grpo_flags(smoke_base, out, "--steps", "1"))
    assert code == 0 and not (out / ".lock").exists(), err
    lock = checkpoints.RunLock(str(out)).acquire()  # a live holder: this process
    code, _, err = cli(capsys, *grpo_flags(smoke_base, out, "--steps", "1"))
    assert code == 2 and f"process {os.getpid()}" in err
    lock.release()
    assert not (out / ".lock").exists()


# -----------------------------------------------------------------------------
# SIGINT and SIGTERM: stop at a step boundary, one line, and --resume continues bit for bit

@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, smoke_base):
    out = tmp_path_factory.mktemp("full")
    assert train.cli(grpo_flags(str(smoke_base), str(out), "--steps", "8", "--save-every", "100")) == 0
    return out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_after_the_step_and_resume_is_bit_exact(sig, tmp_path, smoke_base, uninterrupted, capsys):
    out = tmp_path / "run"
    proc = start(*grpo_flags(smoke_base, out, "--steps", "8", "--save-every", "100"))
    wait_for_rows(out, 2, proc)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    lines = error_lines(stderr)
    done = len(metrics(out))
    assert proc.returncode == 128 + sig and len(lines) == 1, stderr
    assert lines[0] == (f"error: interrupted ({signal.Signals(sig).name}) after step {done - 1}; "
                        f"`--resume` continues from step {done}"), lines[0]
    assert "Traceback" not in stderr and done < 8 and load(out / "ckpt" / "latest.pt")["step"] == done
    assert not (out / ".lock").exists()
    code, _, err = cli(capsys, *grpo_flags(smoke_base, out, "--steps", "8", "--save-every", "100", "--resume"))
    assert code == 0, err
    a, b = load(out / "ckpt" / "latest.pt"), load(uninterrupted / "ckpt" / "latest.pt")
    assert a["step"] == b["step"] == 8 and all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("t_")} for r in rows]  # noqa: E731
    assert strip(metrics(out)) == strip(metrics(uninterrupted))


# -----------------------------------------------------------------------------
# A write that fails (disk full): one line naming the file, no partial file, nothing lost

def test_disk_full_while_writing_a_checkpoint(tmp_path, smoke_base, capsys, monkeypatch):
    out = tmp_path / "run"
    real = torch.save

    def full(obj, path, *a, **k):
        if "step_000002" in str(path):
            with open(path, "wb") as f:
                f.write(b"\0" * 100)  # a partial file, then the disk is full
            raise OSError(28, "No space left on device")
        return real(obj, path, *a, **k)
    monkeypatch.setattr(torch, "save", full)
    code, _, err = cli(capsys, *grpo_flags(smoke_base, out, "--steps", "3", "--save-every", "1"))
    lines = error_lines(err)
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0] == f"error: cannot write {out / 'ckpt' / 'step_000002.pt'}: No space left on device"
    assert sorted(os.listdir(out / "ckpt")) == ["latest.pt", "step_000001.pt"]  # no partial file
    assert load(out / "ckpt" / "latest.pt")["step"] == 1 and not (out / ".lock").exists()


def test_unwritable_metrics_file(tmp_path, smoke_base, capsys, monkeypatch):
    out = tmp_path / "run"
    real = open

    def refuse(path, mode="r", *a, **k):
        if str(path).endswith("metrics.jsonl") and "a" in mode:
            raise OSError(28, "No space left on device")
        return real(path, mode, *a, **k)
    monkeypatch.setattr("builtins.open", refuse)
    code, _, err = cli(capsys, *grpo_flags(smoke_base, out, "--steps", "2"))
    lines = error_lines(err)
    assert code == 1 and lines == [f"error: cannot write {out / 'metrics.jsonl'}: No space left on device"], err


# -----------------------------------------------------------------------------
# The scripts beside train.py

def run_script(*cmd, timeout=120):
    res = subprocess.run([sys.executable, *map(str, cmd)], env=ENV, capture_output=True, text=True, timeout=timeout,
                         cwd=ROOT)
    return res.returncode, res.stderr.strip().splitlines()


# each case a script's flags, one of them bad (run in-process through the script's own entry)
BAD_SCRIPT_FLAGS = [
    (["-m", "models.nova_embed", "--init", "nope", "--text-encoder", "nope", "--prompts", "gone.txt", "--out", "x.pt"],
     ["--prompts", "gone.txt"]),
    (["-m", "models.nova_embed", "--prompts", "x.txt"], ["--init"]),
    (["-m", "benchmarks.bench", "--sections", "nope"], ["--sections", "nope"]),
    (["-m", "benchmarks.bench", "--repeats", "0"], ["--repeats", "0"]),
    (["-m", "benchmarks.bench", "--device", "tpu"], ["--device", "tpu"]),
    (["-m", "experiments.probes", "--context-probe", "gone.pt"], ["--context-probe", "gone.pt"]),
    (["-m", "experiments.probes"], ["--context-probe", "--noise-probe"]),
    (["-m", "experiments.study", "--study", "nope"], ["--study", "nope"]),
    (["-m", "experiments.study"], ["--study"]),
    (["-m", "demo.pretrain", "--pretrain-steps", "-1"], ["--pretrain-steps", "-1"]),
    (["-m", "models.merge_lora"], ["usage: python -m models.merge_lora CKPT OUT"]),
]


@pytest.mark.parametrize("case", range(len(BAD_SCRIPT_FLAGS)), ids=[" ".join(cmd[1:3]) for cmd, _ in BAD_SCRIPT_FLAGS])
def test_scripts_answer_bad_input_in_one_line(case, capsys, monkeypatch):
    """A script beside train.py given a bad flag: exit status 2 and one line naming it, from its
    main through processes.cli, as `python -m SCRIPT` runs it (the next test)."""
    cmd, words = BAD_SCRIPT_FLAGS[case]
    monkeypatch.chdir(ROOT)
    code = processes.cli(importlib.import_module(cmd[1]).main, cmd[2:])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert all(w in lines[0] for w in words), lines[0]


def test_every_script_runs_its_main_through_cli():
    """`python -m SCRIPT` ends in sys.exit(cli(main)), so the one-line answers above are what a user
    sees (a subprocess shows it for experiments.study: the test below)."""
    for module in sorted({cmd[1] for cmd, _ in BAD_SCRIPT_FLAGS}):
        text = (ROOT / (module.replace(".", "/") + ".py")).read_text()
        assert re.search(r'\nif __name__ == "__main__":\n    sys\.exit\((processes\.)?cli\(main\)\)\n*$', text), module


def test_study_checks_every_runs_flags_before_the_first_run(tmp_path, smoke_base):
    code, lines = run_script("-m", "experiments.study", "--study", "hack", "--preset", "smoke", "--study-steps", "2",
                             "--study-arms", "mar-grpo", "--study-out", tmp_path / "study", "--study-train-flags", "--lr nan")
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: --lr nan: must be a finite number"), lines
    assert not (tmp_path / "study").exists()


def test_study_exits_non_zero_with_the_failed_runs_reason(tmp_path, smoke_base):
    # a flag that parses but fails in the run: the study says which run, why, and where its log is
    code, lines = run_script("-m", "experiments.study", "--study", "hack", "--preset", "smoke", "--study-steps", "2",
                             "--study-arms", "mar-grpo", "--study-out", tmp_path / "study",
                             "--study-train-flags=--resume", timeout=600)
    assert code == 1 and lines and lines[-1].startswith("error: study: 1 run(s) failed"), lines
    assert "--resume: no checkpoint" in lines[-1] and "log_hack_mar-grpo_0.txt" in lines[-1]


def test_smoke_summary_says_its_numbers_mean_nothing(tmp_path, smoke_base, capsys):
    code, out, err = cli(capsys, "--preset", "smoke", "--init", smoke_base, "--out", tmp_path / "run", "--steps", "1")
    assert code == 0, err
    assert "a toy model trained for seconds: its numbers test the pipeline only" in out
    assert json.loads((tmp_path / "run" / "eval" / "summary.json").read_text())


def test_a_probe_names_its_own_flag_for_an_unreadable_base(tmp_path):
    bad = tmp_path / "cut.pt"
    bad.write_bytes(b"\0 not a checkpoint")
    code, lines = run_script("-m", "experiments.probes", "--context-probe", bad)
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: --context-probe {bad}: cannot read"), lines
