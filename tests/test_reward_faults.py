"""The faults a network brings to a run scored by a reward server, each with a real server on the
loopback address (`python -m scorers.server` in its own process, stopped by its process id): killed
mid-run (then --resume), hanging, restarted between steps, shared by two torchrun ranks and a
second run; served runs and the paper's table equal to those in process; the load benchmark.
docs/faults.md ("The reward server") lists the cases."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import train
from benchmarks import reward_load
from infra import processes
from scorers import server
from tables import paper
from tests.helpers import ENV, ROOT, TRAIN, cli, grpo_flags, load, metrics
from tests.test_reward_server import request


def start_server(port=0, log=None):
    return server.launch(["--reward", "shapes,jpeg_incompressibility", "--port", port, "--threads", "1"], env=ENV, log=log)


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    """A reward server of `shapes` and `jpeg_incompressibility` in its own process. Yields (process, url)."""
    proc, url = start_server(log=open(tmp_path_factory.mktemp("server") / "log.txt", "w"))
    yield proc, url
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, smoke_base):
    """The reference: 5 steps with the reward in process, a checkpoint after each."""
    out = tmp_path_factory.mktemp("local")
    assert train.cli(grpo_flags(str(smoke_base), str(out), "--steps", "5", "--save-every", "1")) == 0
    return out


def assert_same_run(a, b, rows=None):
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("t_")} for r in rs]  # noqa: E731
    assert strip(metrics(a))[:rows] == strip(metrics(b))[:rows]
    if rows is None:
        x, y = load(Path(a) / "ckpt" / "latest.pt"), load(Path(b) / "ckpt" / "latest.pt")
        assert x["step"] == y["step"] and all(torch.equal(x["model"][k], y["model"][k]) for k in y["model"])


def when_rows(out, n, action):
    """action() in a thread as soon as out/metrics.jsonl has n rows."""
    def watch():
        path, deadline = Path(out) / "metrics.jsonl", time.time() + 300
        while time.time() < deadline:
            if path.exists() and len(path.read_text().splitlines()) >= n:
                return action()
            time.sleep(0.01)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def error_lines(err):
    return [line for line in err.splitlines() if line.startswith("error")]


def test_a_served_run_equals_the_run_in_process(local_run, shared_server, smoke_base, tmp_path, capsys):
    code, _, err = cli(capsys, *grpo_flags(smoke_base, tmp_path / "run", "--steps", "5", "--save-every", "1",
                                           "--reward-url", shared_server[1]))
    assert code == 0, err
    assert_same_run(tmp_path / "run", local_run)


def test_evaluate_with_a_server_writes_the_table_of_the_rewards_in_process(shared_server, smoke_base, tmp_path, capsys):
    (tmp_path / "prompts.txt").write_text("a red circle\ntwo blue squares\n")
    flags = ["--ckpt", f"base={smoke_base}", "--prompts", tmp_path / "prompts.txt", "--images-per-prompt", "2",
             "--reward", "shapes,jpeg_incompressibility", "--preset", "smoke", "--num-iter", "2", "--num-sampling-steps", "4"]
    tables = {}
    for name, more in (("local", []), ("served", ["--reward-url", shared_server[1]])):
        capsys.readouterr()
        assert paper.cli([str(f) for f in [*flags, "--out", tmp_path / name, *more]]) == 0, capsys.readouterr().err
        tables[name] = (tmp_path / name / "table.md").read_text(), (tmp_path / name / "base" / "scores.jsonl").read_text()
    assert tables["served"] == tables["local"] and "shapes_accuracy" in tables["local"][1]


def test_a_server_that_hangs_stops_the_run_in_one_line(shared_server, smoke_base, tmp_path, capsys):
    proc, url = shared_server
    out = tmp_path / "run"
    watcher = when_rows(out, 1, lambda: os.kill(proc.pid, signal.SIGSTOP))  # the server stops answering
    try:
        t0 = time.time()
        code, _, err = cli(capsys, *grpo_flags(smoke_base, out, "--steps", "5", "--reward-url", url, "--reward-timeout", "1"))
        assert time.time() - t0 < 60 and code == 1 and "Traceback" not in err, err
        assert error_lines(err) == [
            f"error: --reward-url {url}: no whole answer within 1 s (--reward-timeout): the server "
            "hangs, trickles or is overloaded; checkpoints so far are intact, `--resume` continues "
            "once the server answers"]
    finally:
        watcher.join()
        os.kill(proc.pid, signal.SIGCONT)  # and it serves again (the other tests use it)
    assert request(url, None, None, "GET", "/info")[0] == 200


def test_a_server_killed_mid_run_stops_it_and_resume_after_its_restart_is_exact(local_run, smoke_base, tmp_path, capsys):
    log = open(tmp_path / "server.txt", "w")
    proc, url = start_server(log=log)
    servers, port = [proc], url.rsplit(":", 1)[1]

    def restart():  # SIGKILL by its process id, then a new server on the same address
        servers[-1].kill()
        servers[-1].wait()
        servers.append(start_server(port, log=log)[0])
    out = tmp_path / "run"
    flags = grpo_flags(smoke_base, out, "--steps", "5", "--save-every", "1", "--reward-url", url, "--reward-retries", "2")
    try:
        watcher = when_rows(out, 2, proc.kill)
        t0 = time.time()
        code, _, err = cli(capsys, *flags)
        watcher.join()
        lines = error_lines(err)
        assert code == 1 and len(lines) == 1 and "Traceback" not in err and time.time() - t0 < 120, err
        assert lines[0].startswith(f"error: --reward-url {url}: no answer after 3 tries in ") and "--resume" in lines[0]
        done = len(metrics(out))
        assert 2 <= done < 5 and load(out / "ckpt" / "latest.pt")["step"] == done  # the last checkpoint, intact

        restart()  # the server is back: --resume continues as the uninterrupted run, bit for bit
        code, stdout, err = cli(capsys, *flags, "--resume")
        assert code == 0 and f"resumed from step {done}" in stdout, err
        assert_same_run(out, local_run)

        # a run goes on across a restart of the server between its steps (within its retries)
        watcher = when_rows(tmp_path / "across", 2, restart)
        code, _, err = cli(capsys, *grpo_flags(smoke_base, tmp_path / "across", "--steps", "5", "--save-every", "1",
                                               "--reward-url", url, "--reward-retries", "8"))
        watcher.join()
        assert code == 0 and len(servers) == 3, err
        assert_same_run(tmp_path / "across", local_run)
    finally:
        for p in servers:
            p.kill()
            p.wait()


def test_two_torchrun_ranks_and_another_run_share_one_server(shared_server, local_run, smoke_base, tmp_path, capsys):
    url = shared_server[1]
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", TRAIN,
         *grpo_flags(str(smoke_base), str(tmp_path / "ranks"), "--steps", "2", "--reward-url", url)],
        cwd=ROOT, env=dict(ENV, PYTHONPATH=str(ROOT), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:  # meanwhile a second run, in this process, on the same server
        code, _, err = cli(capsys, *grpo_flags(smoke_base, tmp_path / "other", "--steps", "3", "--reward-url", url))
        assert code == 0, err
        assert_same_run(tmp_path / "other", local_run, rows=3)
        output, _ = torchrun.communicate(timeout=300)
    finally:
        torchrun.kill()
    assert torchrun.returncode == 0, output[-3000:]
    # 2 ranks draw what 1 process with 2 micro-batches draws: the same images, so the same served rewards
    code, _, err = cli(capsys, *grpo_flags(smoke_base, tmp_path / "accum", "--steps", "1", "--grad-accum", "2"))
    assert code == 0, err
    ranks, accum = metrics(tmp_path / "ranks"), metrics(tmp_path / "accum")
    assert len(ranks) == 2 and ranks[0]["reward_mean"] == pytest.approx(accum[0]["reward_mean"], abs=1e-6)


def test_the_load_benchmark_measures_a_running_server_and_refuses_bad_flags(shared_server, tmp_path, capsys):
    figures = reward_load.main(["--url", shared_server[1], "--clients", "1,2", "--requests", "2", "--images", "2",
                                "--step-images", "4", "--repeats", "1", "--json", str(tmp_path / "load.json")])
    assert [r["clients"] for r in figures["load"]] == [1, 2] and all(r["p99_ms"] >= r["p50_ms"] > 0 for r in figures["load"])
    assert set(figures["step_seconds"]) == {"in process", "served"} and (tmp_path / "load.json").exists()
    for flags, line in ((["--clients", "0"], "--clients"), (["--reward", "hpsv2"], "--reward-ckpt hpsv2=PATH is required"),
                        (["--url", "ftp://x"], "--reward-url ftp://x")):
        capsys.readouterr()
        assert processes.cli(reward_load.main, flags) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and line in err, err
