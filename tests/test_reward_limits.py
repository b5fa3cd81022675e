"""The reward server's limits (scorers/limits.py, scorers/server.py) against idle, trickling,
oversize and hostile peers, with the server in its own process (`python -m scorers.server` with
short deadlines by flag): an authorised client is served while as many silent or trickling
connections as --max-connections, and more, are open; each of them is closed by the head deadline;
a trickled body by the body deadline; the memory of many large requests stays within
--max-inflight-mb; the server's log is one line per event and never holds the token. The client's
side (answers, timeouts, tokens): test_reward_client.py."""

import http.client
import json
import re
import socket
import threading
import time

import pytest
import torch

from benchmarks import reward_memory, reward_soak
from infra import processes
from scorers import registry, remote, server, wire
from tests.helpers import ENV
from tests.test_reward_server import shapes_batch

TOKEN = "a-limits-test-token-0123456789"
HEAD_S, BODY_S, CONNECTIONS, BODY_MB, INFLIGHT_MB = 3, 2, 16, 8, 16
FLAGS = ["--reward", "shapes", "--port", 0, "--threads", 1, "--max-connections", CONNECTIONS,
         "--header-timeout", HEAD_S, "--body-timeout", BODY_S, "--max-body-mb", BODY_MB,
         "--max-inflight-mb", INFLIGHT_MB]


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """The server of FLAGS, its token TOKEN. Yields (process, url, the path of its log)."""
    log = tmp_path_factory.mktemp("limits") / "server.txt"
    proc, url = server.launch(FLAGS, env=dict(ENV, **{wire.TOKEN_ENV: TOKEN}), log=open(log, "w"))
    yield proc, url, log
    proc.kill()
    proc.wait()


def connect(url):
    host, port, _ = remote.parse_url(url)
    return socket.create_connection((host, port), timeout=10)


def head(method="POST", path="/score", token=None, length=None, chunked=False):
    """The bytes of a request head."""
    lines = [f"{method} {path} HTTP/1.1", "Host: x"]
    lines += [f"Authorization: Bearer {token}"] if token else []
    lines += [f"Content-Length: {length}"] if length is not None else []
    lines += ["Transfer-Encoding: chunked"] if chunked else []
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def trickle(sock, data, every=0.2):
    """Send `data` a byte every `every` s from a thread, until it is sent or the server closes."""
    def run():
        try:
            for i in range(len(data)):
                sock.sendall(data[i:i + 1])
                time.sleep(every)
        except OSError:
            pass
    threading.Thread(target=run, daemon=True).start()


def read_answer(sock):
    """One whole answer from `sock` (its head, then its Content-Length bytes): (status, body)."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(1 << 16)
        assert part, f"closed without an answer: {data!r}"
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))
    while len(body) < length:
        body += sock.recv(1 << 16)
    return int(head.split(b" ")[1]), body[:length]


def until_closed(sock, seconds):
    """What the server sends on `sock` until it closes it (bytes); None if still open after
    `seconds`."""
    sock.settimeout(seconds)
    data, end = b"", time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            part = sock.recv(1 << 16)
            if not part:
                return data
            data += part
    except ConnectionResetError:
        return data
    except (TimeoutError, socket.timeout):
        return None
    return None


def client(url, retries=0):
    return registry.build_reward("shapes", server=dict(url=url, token=TOKEN, timeout=10,
                                                      retries=retries))


def test_idle_and_trickling_peers_cannot_keep_an_authorised_client_out(limited):
    _, url, log = limited
    images, prompts, metas = shapes_batch()
    want = registry.build_reward("shapes")(images, prompts, metas)[0]
    t0 = time.monotonic()
    silent = [connect(url) for _ in range(CONNECTIONS)]  # as many as --max-connections, mute
    loris = [connect(url) for _ in range(4)]             # a request head a byte at a time
    unauthorised = [connect(url) for _ in range(4)]      # a head without the token, a trickled body
    chunked = [connect(url) for _ in range(2)]           # a chunked body that never ends, no token
    kept = [connect(url) for _ in range(2)]              # a request answered, the connection kept
    for s in loris:
        trickle(s, head(token=TOKEN, length=100))
    for s in unauthorised:
        s.sendall(head(length=4 << 20))
        trickle(s, b"x" * 1000)
    for s in chunked:
        s.sendall(head(chunked=True) + b"10\r\n")
        trickle(s, b"x" * 1000)
    for s in kept:
        s.sendall(head("GET", "/info", TOKEN))
        assert read_answer(s)[0] == 200
    time.sleep(0.3)
    assert torch.equal(client(url)(images, prompts, metas)[0], want)  # no retry: room was made
    more = [connect(url) for _ in range(3 * CONNECTIONS)]  # three times as many more mute ones
    time.sleep(0.3)
    assert torch.equal(client(url)(images, prompts, metas)[0], want)
    assert time.monotonic() - t0 < HEAD_S, "too slow a machine: the head deadline came first"
    for s in unauthorised + chunked:
        assert read_answer(s)[0] == 401  # refused on the head, before any body is read
    # every peer without a request in progress is closed: to make room, or at the head deadline
    t1 = time.monotonic()
    for s in silent + loris + unauthorised + chunked + kept + more:
        got = until_closed(s, max(0.1, t1 + HEAD_S + 2 - time.monotonic()))
        assert got is not None, "a peer was left open past the head deadline"
        assert got == b"" or got.startswith(b"HTTP/1.1 408"), got[:100]
        s.close()
    assert time.monotonic() - t1 < HEAD_S + 2.5
    text = log.read_text()
    assert f"no whole request head within {HEAD_S} s (--header-timeout)" in text
    assert "to make room" in text


def test_a_trickled_body_is_dropped_and_a_full_house_answered_503(limited):
    _, url, _ = limited
    slow = [connect(url) for _ in range(CONNECTIONS)]  # authorised requests whose bodies trickle
    for s in slow:
        s.sendall(head(token=TOKEN, length=1000) + b"x" * 10)
        trickle(s, b"x" * 990)
    time.sleep(0.3)
    extra = connect(url)  # every connection has a request in progress: no room, 503 at once
    answer = until_closed(extra, 2)
    assert answer.startswith(b"HTTP/1.1 503") and b"--max-connections" in answer, answer
    images, prompts, metas = shapes_batch()
    t0 = time.monotonic()
    client(url, retries=4)(images, prompts, metas)  # served once the body deadline frees them
    for s in slow:
        got = until_closed(s, BODY_S + 2)
        assert got.startswith(b"HTTP/1.1 408") and b"--body-timeout" in got, got
    assert time.monotonic() - t0 < BODY_S + 4


def vm(pid, key):
    """A memory figure of /proc/PID/status in MiB (VmRSS, VmHWM)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024


def test_many_large_requests_stay_within_the_memory_limit(limited):
    """12 concurrent requests of nearly --max-body-mb each (refused once read and decoded: their
    prompts are one short), 96 MiB of bodies: the server's peak grows by about --max-inflight-mb."""
    proc, url, _ = limited
    pixels = torch.randint(0, 256, (10, 3, 512, 512), dtype=torch.uint8)   # 7.5 MiB
    body = wire.encode_request(["shapes"], pixels.float() / 255, ["a red circle"] * 9, None)
    host, port, _ = remote.parse_url(url)

    def post(out):
        conn = http.client.HTTPConnection(host, port, timeout=30)
        conn.request("POST", "/score", body=body, headers={"Authorization": f"Bearer {TOKEN}"})
        answer = conn.getresponse()
        out.append((answer.status, json.loads(answer.read())["error"]))
        conn.close()
    post([])  # a warm-up: the threads and the allocator's first arenas
    with open(f"/proc/{proc.pid}/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to VmRSS
    before, answers = vm(proc.pid, "VmRSS"), []
    threads = [threading.Thread(target=post, args=(answers,)) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    grown = vm(proc.pid, "VmHWM") - before
    assert answers == [(400, "10 images, 9 prompts and no metadata: one of each per image")] * 12
    assert grown < INFLIGHT_MB + 16, f"peak RSS grew by {grown:.0f} MiB"


def test_the_log_is_one_line_an_event_and_never_holds_the_token(limited):
    _, url, log = limited
    images, _, _ = shapes_batch(b=2)
    prompt = "a\x1b[31mred\rforged:\x9b\u2028x\nforged"
    forged = wire.encode_request(["shapes"], images, [prompt] * 2, None)
    for request, status in ((head(length=0), 401), (head(token="wrong-" + TOKEN, length=0), 401),
                            (head(token=TOKEN, length=(BODY_MB << 20) + 1), 413),
                            (head(token=TOKEN, length=len(forged)) + forged, 422)):
        s = connect(url)
        s.sendall(request)
        code, answer = read_answer(s)
        error = json.loads(answer)["error"]
        assert code == status and error.isprintable() and TOKEN not in error, (code, error)
        s.close()
    time.sleep(0.5)
    text = log.read_text()
    assert TOKEN not in text and "\x1b" not in text and "\x9b" not in text, text
    assert "422 shapes: shapes reward: 'a\\x1b[31mred\\rforged:\\x9b\\u2028x\\nforged' is not" \
        in text, text
    assert not any(line.startswith("forged") for line in text.splitlines())


def test_the_soak_and_memory_benchmarks_run_and_refuse_bad_flags(capsys):
    """A few seconds of benchmarks/reward_soak.py and one point of reward_memory.py, small."""
    soak = reward_soak.main(["--seconds", "4", "--normal", "1", "--silent", "2", "--slow", "3",
                             "--large-every", "1.5", "--max-body-mb", "2", "--connections", "8",
                             "--server-flags", "--header-timeout 1 --body-timeout 1"])
    assert soak["normal_requests"] > 0 and soak["failed"] == 0 and soak["server_alive"], soak
    assert soak["p99_ms"] >= soak["p50_ms"] > 0 and soak["peak_mib"] >= soak["rss_max_mib"] > 0
    assert soak["others"].get("large (2 images of 512 px): 200", 0) >= 1, soak["others"]
    memory = reward_memory.main(["--concurrent", "3", "--max-body-mb", "1", "--size", "64"])
    assert memory["rows"][0]["statuses"] == [200] * 3 and memory["rows"][0]["peak_mib"] > 0
    for main, flags, line in ((reward_soak.main, ["--seconds", "0"], "--seconds 0"),
                              (reward_memory.main, ["--concurrent", "0"], "--concurrent 0")):
        capsys.readouterr()
        assert processes.cli(main, flags) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and line in err, err
