"""The reward server (scorers/server.py) and its client (scorers/remote.py): served scores equal the
in-process ones on the same 8-bit images (the compositional rewards with their records too), bad
requests are one-line 4xx answers after which the server goes on, and the faults a network brings,
each with a real server on the loopback address (a subprocess, stopped by its process id): killed
mid-run, hanging, restarted between steps, shared by two torchrun ranks and a second run.
docs/reward_server.md and docs/faults.md list the cases."""

import contextlib
import http.client
import io
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import uvicorn

import evaluate
import rewards
import train
from benchmarks import reward_load
from demo import shapes
from infra import processes
from scorers import remote, server, wire
from tests.helpers import ENV, ROOT, TRAIN, cli, grpo_flags, load, metrics
from tests.test_composition_models import records_of, save_gdino, save_git
from tests.test_evaluate import save_tiny_hps, tiny_hps

TOKEN = "a-test-token-of-enough-length"


@contextlib.contextmanager
def in_thread(served, token=None, max_body=1 << 20):
    """make_app(served) under uvicorn in a thread of this process (tiny models registered here
    are served as built here). Yields the URL."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    srv = uvicorn.Server(uvicorn.Config(server.make_app(served, token, max_body), log_level="error", access_log=False))
    thread = threading.Thread(target=srv.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(10)


def request(url, body=None, token=None, method="POST", path="/score"):
    """A raw request. Returns (status, decoded JSON answer)."""
    host, port, _ = remote.parse_url(url)
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request(method, path, body=body, headers={"Authorization": f"Bearer {token}"} if token else {})
    answer = conn.getresponse()
    status, data = answer.status, answer.read()
    conn.close()
    return status, json.loads(data)


def shapes_batch(b=4, size=16, seed=0):
    """b rendered shapes images (b, 3, size, size) in [0, 1] with noise off the 8-bit grid, their prompts and metas."""
    rng = np.random.default_rng(seed)
    metas = shapes.sample_prompts(b, rng)
    pixels = np.stack([shapes.render(m, size=size, rng=rng) for m in metas])                   # (b, H, W, 3) uint8
    images = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255
    images = (images + 0.004 * torch.randn(images.shape, generator=torch.Generator().manual_seed(seed))).clamp(0, 1)
    return images, [m["prompt"] for m in metas], metas


# -----------------------------------------------------------------------------
# What is scored: the 8-bit image, in process and served alike

class Seen(rewards.Reward):
    name = "seen"

    def score(self, images, prompts, metadata):
        self.images = images
        return images.mean((1, 2, 3)), {}


def test_every_reward_scores_the_8bit_image():
    x = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    seen = Seen()
    seen(x, ["a"] * 3)
    assert torch.equal(seen.images, (x * 255).round() / 255) and not torch.equal(seen.images, x)
    from_float = seen.images
    seen((x * 255).round().to(torch.uint8), ["a"] * 3)
    assert torch.equal(seen.images, from_float)  # the float image and its 8-bit PNG score alike
    jpeg = rewards.build_reward("jpeg_incompressibility")
    assert torch.equal(jpeg(x, ["a"] * 3)[0], jpeg((x * 255).round().to(torch.uint8), ["a"] * 3)[0])


def test_served_shapes_and_jpeg_equal_in_process_details_and_nan_images_too():
    images, prompts, metas = shapes_batch()
    spec = "shapes:2.0,jpeg_incompressibility:0.5"
    local = rewards.build_reward(spec)
    with in_thread({n: f for n, _, f in rewards.build_reward("shapes,jpeg_incompressibility").components}) as url:
        served = rewards.build_reward(spec, server=dict(url=url))
        (s, info), (s_local, info_local) = served(images, prompts, metas), local(images, prompts, metas)
        assert torch.equal(s, s_local) and s.min() < s.max()
        assert all(torch.equal(info["components"][k], info_local["components"][k]) for k in info_local["components"])
        assert info["means"] == info_local["means"] and info["weights"] == info_local["weights"]
        assert info["details"] == info_local["details"]  # the verifier's per-image checks, through JSON
        images[1, 0, 2, 2] = float("nan")  # cannot be sent as 8-bit: NaN, the update is skipped
        s_nan, _ = served(images, prompts, metas)
        assert s_nan[1].isnan() and torch.equal(s_nan[[0, 2, 3]], s_local[[0, 2, 3]])


def test_served_hps_git_and_gdino_equal_in_process_with_the_records(tmp_path, monkeypatch):
    """The nova_mix rewards, weighted, on the released records: served == in process (tiny models)."""
    hps = save_tiny_hps(tmp_path, "server-test-clip", layers=1, seed=4)
    tiny_hps(monkeypatch, "server-test-clip")
    weights = {"hpsv2": str(hps), "git_vqa": str(save_git(tmp_path / "git")), "gdino": str(save_gdino(tmp_path / "gdino"))}
    records = records_of("color", "spatial", "numeracy", "non")
    images = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    spec = "hpsv2:1.0,git_vqa:0.5,gdino:2.0"
    local = rewards.build_reward(spec, weights=weights)
    with in_thread({n: f for n, _, f in rewards.build_reward("hpsv2,git_vqa,gdino", weights=weights).components}) as url:
        s, info = rewards.build_reward(spec, server=dict(url=url))(images, [r["prompt"] for r in records], records)
    s_local, info_local = local(images, [r["prompt"] for r in records], records)
    assert torch.equal(s, s_local)
    for name in ("hpsv2", "git_vqa", "gdino"):
        assert torch.equal(info["components"][name], info_local["components"][name])
    assert info_local["components"]["git_vqa"][1] == 0 and 0 < info_local["components"]["git_vqa"][0] < 1


# -----------------------------------------------------------------------------
# Safe by default: bad requests are one-line 4xx answers, and the server goes on

def npy(array, **kw):
    buffer = io.BytesIO()
    np.save(buffer, array, **kw)
    return buffer.getvalue()


def test_bad_requests_are_one_line_4xx_answers_and_the_server_goes_on():
    images, prompts, metas = shapes_batch(b=2, size=16)
    good = wire.encode_request(["shapes"], rewards.to_8bit(images), prompts, metas)
    line, pixels = good.split(b"\n", 1)
    head = json.loads(line)
    array = (images * 255).round().to(torch.uint8).numpy()                     # (2, 3, 16, 16)
    with_head = lambda **kw: json.dumps({**head, **kw}).encode() + b"\n" + pixels  # noqa: E731
    bad = {
        "no token": (None, good, 401, "missing token"),
        "wrong token": ("x" * len(TOKEN), good, 401, "wrong token"),
        "body over the limit": (TOKEN, line + b"\n" + b" " * 20000, 413, "over the server's limit"),
        "no JSON line": (TOKEN, pixels, 400, "a line of JSON {rewards, prompts, metadata}"),
        "not JSON": (TOKEN, b"\x80\x03pickle\n" + pixels, 400, "a line of JSON"),
        "not an image": (TOKEN, line + b"\nGIF89a not an NPY", 400, "not an NPY array"),
        "a pickle": (TOKEN, line + b"\n" + pickle.dumps(array), 400, "not an NPY array"),
        "an object array": (TOKEN, line + b"\n" + npy(np.array([{}, {}]), allow_pickle=True), 400, "object"),
        "floats": (TOKEN, line + b"\n" + npy(array.astype(np.float32)), 400, "expected uint8 (B, 3, H, W)"),
        "four channels": (TOKEN, line + b"\n" + npy(np.zeros((2, 4, 16, 16), np.uint8)), 400, "(2, 4, 16, 16)"),
        "cut short": (TOKEN, good[:-8], 400, "bytes of pixels"),
        "a prompt short": (TOKEN, with_head(prompts=prompts[:1]), 400, "2 images, 1 prompts"),
        "unknown reward": (TOKEN, with_head(rewards=["hpsv2"]), 400, "unknown reward 'hpsv2': this server serves shapes"),
        "a name of two lines": (TOKEN, with_head(rewards=["a\nb"]), 400, "unknown reward 'a\\nb'"),
        "a prompt the reward cannot read": (TOKEN, with_head(prompts=["a photo of a cat"] * 2, metadata=None), 422,
                                            "shapes: shapes reward: 'a photo of a cat' is not a shapes prompt"),
    }
    with in_thread({"shapes": rewards.build_reward("shapes").components[0][2]}, TOKEN, max_body=10000) as url:
        want = request(url, good, TOKEN)
        assert want[0] == 200 and len(want[1]["scores"]["shapes"]) == 2
        for case, (token, payload, status, reason) in bad.items():
            got = request(url, payload, token)
            assert got[0] == status and reason in got[1]["error"] and "\n" not in got[1]["error"], (case, got)
            assert request(url, good, TOKEN) == want, case  # and the server goes on
        assert request(url, None, None, "GET", "/info")[0] == 401
        assert request(url, None, TOKEN, "GET", "/info")[1]["rewards"] == ["shapes"]


def test_the_server_refuses_bad_flags_and_open_addresses_without_a_token(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(wire.TOKEN_ENV, raising=False)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    (tmp_path / "short").write_text("short\n")
    cases = [(["--host", "0.0.0.0"], "--host 0.0.0.0: beyond loopback the server needs a shared token"),
             (["--token-file", tmp_path / "short"], "the token must be 16 or more printable ASCII characters"),
             (["--token-file", tmp_path / "nope"], "--token-file"),
             (["--port", str(taken.getsockname()[1])], f"--port {taken.getsockname()[1]}: cannot listen"),
             (["--reward", "shapes:2"], "the server serves rewards by name"),
             (["--reward", "hps"], "unknown reward 'hps'"),
             (["--reward", "hpsv2"], "--reward-ckpt hpsv2=PATH is required"),
             (["--max-body-mb", "nan"], "--max-body-mb nan: must be a number")]
    for flags, line in cases:
        argv = ["--reward", "shapes", "--port", "0", *map(str, flags)]
        capsys.readouterr()
        assert processes.cli(server.main, argv) == 2, flags
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("error: ") and line in err, (flags, err)
    taken.close()


def bad_run_flags(url):
    """(flags, the error line's part, the environment) of runs refused before anything is written."""
    return [(["--reward-url", "ftp://127.0.0.1:1"], "--reward-url ftp://127.0.0.1:1: write http://HOST:PORT", {}),
            (["--reward-url", url, "--reward", "hpsv2", "--reward-ckpt", "hpsv2=x.pt"],
             "--reward-ckpt hpsv2=x.pt: the reward server of --reward-url loads the reward weights", {}),
            (["--reward-url", url, "--reward-token-file", "nope.txt"], "--reward-token-file: no such file: nope.txt", {}),
            (["--reward-token-file", "nope.txt"], "give --reward-url", {}),
            (["--reward-url", url], "the server refused the token (missing token", {}),
            (["--reward-url", url], "the server refused the token (wrong token)", {wire.TOKEN_ENV: "y" * 20}),
            (["--reward-url", url, "--reward", "jpeg_compressibility"], "the server serves shapes, not jpeg_compressibility",
             {wire.TOKEN_ENV: TOKEN}),
            (["--reward-url", "http://127.0.0.1:9", "--reward-retries", "1"],
             "--reward-url http://127.0.0.1:9: no answer after 2 tries in", {})]


def test_bad_reward_server_flags_are_one_line_and_nothing_is_written(smoke_base, tmp_path, capsys, monkeypatch):
    with in_thread({"shapes": rewards.build_reward("shapes").components[0][2]}, TOKEN) as url:
        for flags, line, env in bad_run_flags(url):
            monkeypatch.delenv(wire.TOKEN_ENV, raising=False)
            for key, value in env.items():
                monkeypatch.setenv(key, value)
            out = tmp_path / "run"
            code, _, err = cli(capsys, *grpo_flags(smoke_base, out, *flags))
            lines = err.strip().splitlines()
            assert code == 2 and len(lines) == 1 and line in lines[0], (flags, err)
            assert not out.exists()
        (tmp_path / "token").write_text(TOKEN + "\n")  # the token from a file: the run goes
        code, _, err = cli(capsys, *grpo_flags(smoke_base, tmp_path / "ok", "--steps", "1", "--reward-url", url,
                                               "--reward-token-file", tmp_path / "token"))
        assert code == 0, err
        # the run records the token file's path, never the token
        assert TOKEN not in (tmp_path / "ok" / "config.json").read_text() + str(load(tmp_path / "ok" / "ckpt" / "latest.pt")["args"])


# -----------------------------------------------------------------------------
# The faults of a network, with a server in its own process

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
        assert evaluate.cli([str(f) for f in [*flags, "--out", tmp_path / name, *more]]) == 0, capsys.readouterr().err
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
        assert error_lines(err) == [f"error: --reward-url {url}: no answer within 1 s (--reward-timeout): the server hangs "
                                    "or is overloaded; checkpoints so far are intact, `--resume` continues once the server answers"]
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
