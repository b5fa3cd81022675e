"""The reward server (scorers/server.py) and its client (scorers/remote.py), served in a thread of
the test: every reward scores the 8-bit image, served scores equal the in-process ones on the same
images (the compositional rewards with their records too, NaN images, 503 tried again), bad requests
are one-line 4xx answers after which the server goes on, bad flags of the server and of a run are
one line. The faults of a network, with a server in its own process: test_reward_faults.py."""

import contextlib
import http.client
import io
import json
import pickle
import socket
import threading
import time

import numpy as np
import pytest
import torch
import uvicorn
from fastapi.responses import JSONResponse

import rewards
from demo import shapes
from infra import processes
from scorers import registry, remote, server, wire
from tests.helpers import cli, grpo_flags, load
from tests.test_composition_models import records_of, save_gdino, save_git
from tests.test_evaluate import save_tiny_hps, tiny_hps

TOKEN = "a-test-token-of-enough-length"


@contextlib.contextmanager
def in_thread(served, token=None, max_body=1 << 20, busy=0):
    """make_app(served) under uvicorn in a thread of this process (tiny models registered here
    are served as built here), its first `busy` POSTs answered 503. Yields the URL."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    app, busy = server.make_app(served, token, max_body), [busy]

    @app.middleware("http")
    async def overloaded(request, call_next):
        if request.method == "POST" and busy[0] > 0:
            busy[0] -= 1
            return JSONResponse({"error": "busy"}, status_code=503)
        return await call_next(request)
    srv = uvicorn.Server(uvicorn.Config(app, log_level="error", access_log=False))
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
    jpeg = registry.build_reward("jpeg_incompressibility")
    assert torch.equal(jpeg(x, ["a"] * 3)[0], jpeg((x * 255).round().to(torch.uint8), ["a"] * 3)[0])


def test_served_shapes_and_jpeg_equal_in_process_details_and_nan_images_too():
    images, prompts, metas = shapes_batch()
    spec = "shapes:2.0,jpeg_incompressibility:0.5"
    local = registry.build_reward(spec)
    with in_thread({n: f for n, _, f in registry.build_reward("shapes,jpeg_incompressibility").components}) as url:
        served = registry.build_reward(spec, server=dict(url=url))
        (s, info), (s_local, info_local) = served(images, prompts, metas), local(images, prompts, metas)
        assert torch.equal(s, s_local) and s.min() < s.max()
        assert all(torch.equal(info["components"][k], info_local["components"][k]) for k in info_local["components"])
        assert info["means"] == info_local["means"] and info["weights"] == info_local["weights"]
        assert info["details"] == info_local["details"]  # the verifier's per-image checks, through JSON
        images[1, 0, 2, 2] = float("nan")  # cannot be sent as 8-bit: NaN, the update is skipped
        s_nan, _ = served(images, prompts, metas)
        assert s_nan[1].isnan() and torch.equal(s_nan[[0, 2, 3]], s_local[[0, 2, 3]])
    images = shapes_batch()[0]
    with in_thread({"shapes": local.components[0][2]}, busy=2) as url:  # 503 is tried again, within the retries
        assert torch.equal(registry.build_reward("shapes", server=dict(url=url, retries=2))(images, prompts, metas)[0],
                           local.components[0][2](images, prompts, metas)[0])
    with in_thread({"shapes": local.components[0][2]}, busy=2) as url, pytest.raises(rewards.RewardFailed) as e:
        registry.build_reward("shapes", server=dict(url=url, retries=1))(images, prompts, metas)
    assert f"{url}: no answer after 2 tries in" in str(e.value) and "(the last: HTTP 503 busy)" in str(e.value)


def test_served_hps_git_and_gdino_equal_in_process_with_the_records(tmp_path, monkeypatch):
    """The nova_mix rewards, weighted, on the released records: served == in process (tiny models)."""
    hps = save_tiny_hps(tmp_path, "server-test-clip", layers=1, seed=4)
    tiny_hps(monkeypatch, "server-test-clip")
    weights = {"hpsv2": str(hps), "git_vqa": str(save_git(tmp_path / "git")), "gdino": str(save_gdino(tmp_path / "gdino"))}
    records = records_of("color", "spatial", "numeracy", "non")
    images = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    spec = "hpsv2:1.0,git_vqa:0.5,gdino:2.0"
    local = registry.build_reward(spec, weights=weights)
    with in_thread({n: f for n, _, f in registry.build_reward("hpsv2,git_vqa,gdino", weights=weights).components}) as url:
        s, info = registry.build_reward(spec, server=dict(url=url))(images, [r["prompt"] for r in records], records)
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
    with in_thread({"shapes": registry.build_reward("shapes").components[0][2]}, TOKEN, max_body=10000) as url:
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
    with in_thread({"shapes": registry.build_reward("shapes").components[0][2]}, TOKEN) as url:
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
