"""The reward server's client (scorers/remote.py) against broken and hostile servers, and the
token (scorers/auth.py) whatever a file or the variable holds: each answer that is not the wire
format's is one line naming the server and what was wrong (never a traceback blaming the reward,
never a value taken silently), whatever bytes the peer sent; --reward-timeout bounds the whole
answer however slowly it trickles; no error holds the token. The peers are scripted sockets in a
thread of the test (`scripted`); the server's own limits, in its own process:
test_reward_limits.py."""

import contextlib
import json
import math
import re
import socket
import threading
import time

import pytest

import rewards
from infra import processes
from scorers import auth, registry, remote, server, wire
from tables import paper
from tests.helpers import cli, grpo_flags
from tests.test_reward_server import shapes_batch

TOKEN = "a-hostile-test-token-0123456789"
def http(status, body=b"", kind=b"application/json", head=b""):
    """The bytes of an HTTP/1.1 answer."""
    return b"HTTP/1.1 %d X\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n%s" % (
        status, kind, len(body), head, body)


INFO = http(200, b'{"protocol": 1, "rewards": ["shapes"], "max_body_bytes": 67108864}')


def scores(values, **more):
    return http(200, json.dumps({"scores": {"shapes": values}, "info": {}, **more}).encode())


def read_request(conn, body=True):
    """Read one request from `conn`: its head, then (if `body`) its Content-Length bytes.
    Returns its path."""
    data = b""
    while b"\r\n\r\n" not in data:
        part = conn.recv(1 << 16)
        if not part:
            return None
        data += part
    head, _, rest = data.partition(b"\r\n\r\n")
    length = re.search(rb"content-length: *(\d+)", head, re.I)
    need = int(length.group(1)) if length else 0
    while body and len(rest) < need:
        part = conn.recv(1 << 20)
        if not part:
            break
        rest += part
    return head.split(b" ")[1].decode()


@contextlib.contextmanager
def scripted(score, info=INFO, read_body=True):
    """A peer on a free loopback port that answers GET .../info with `info` and POST .../score with
    `score`: bytes, or a function(conn) that writes what it likes. Yields its URL."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.02)
    stop = threading.Event()

    def handle(conn):
        with conn:
            conn.settimeout(20)
            try:
                path = read_request(conn, read_body)
                if path is not None:
                    answer = info if path.endswith("/info") else score
                    answer(conn) if callable(answer) else conn.sendall(answer)
                    time.sleep(0.05)
            except OSError:
                pass

    def accept():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            threading.Thread(target=handle, args=(conn,), daemon=True).start()
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        listener.close()


def assert_one_line(text, url=None):
    assert text.isprintable() and not {"\n", "\r", "\x1b"} & set(text), repr(text)
    assert TOKEN not in text, text
    if url is not None:
        assert url in text, text


def served(url, timeout=5.0, retries=0):
    return registry.build_reward("shapes", server=dict(url=url, token=TOKEN, timeout=timeout,
                                                      retries=retries))


def fails(url, **kw):
    """The error of scoring a batch on the peer at `url`, as train.py's rewards.score says it."""
    images, prompts, metas = shapes_batch(b=2)
    with pytest.raises(rewards.RewardFailed) as e:
        rewards.score(served(url, **kw), "shapes", images, prompts, metas)
    return str(e.value)


NASTY = "bad\r\nerror: forged line\x1b[31m red\x07 " + TOKEN  # breaks, colour, bell, the token
WITH_DETAILS = b'{"scores": {"shapes": [1, 1]}, "info": {"shapes": {"details": %s}}}'
ANSWERS = {  # a broken or hostile /score answer -> what the one line must say
    "not JSON": (http(200, b"<html>\r\n</html>"), "not JSON"),
    "a list": (http(200, b"[1, 2]"), "a list, not a JSON object"),
    "a count short": (scores([0.5]), "1 scores of shapes for 2 images"),
    "NaN": (scores([0.5, math.nan]), "score 1 of shapes: nan, not a finite float32"),
    "Infinity": (http(200, b'{"scores": {"shapes": [Infinity, 1]}}'), "not a finite float32"),
    "beyond float32": (scores([1e39, 0.0]), "score 0 of shapes: 1e+39, not a finite float32"),
    "a huge integer": (scores([10 ** 400, 0]), "not a finite float32"),
    "strings": (scores(["0.5", "1"]), "score 0 of shapes: a string, not a number"),
    "bools": (scores([True, False]), "score 0 of shapes: true, not a number"),
    "nested lists": (scores([[0.5], [1.0]]), "score 0 of shapes: a list, not a number"),
    "null": (scores(None), "scores of shapes: null, not a list of 2 numbers"),
    "no scores of the reward": (http(200, b'{"scores": {}}'), "no scores of shapes"),
    "a reward not asked": (http(200, b'{"scores": {"shapes": [1, 1], "x\\ny": [1, 1]}}'),
                           "scores of 'x\\ny', a reward not asked for"),
    "an extra field": (scores([1, 1], more=NASTY), "an unexpected field 'more'"),
    "no scores field": (http(200, b'{"info": {}}'), "no field 'scores'"),
    "info not an object": (http(200, b'{"scores": {"shapes": [1, 1]}, "info": [1]}'),
                           "info: a list, not an object"),
    "details short": (http(200, WITH_DETAILS % b"[{}]"), "details must be a list of 2 objects"),
    "a detail's flag a string": (http(200, WITH_DETAILS % b'[{"correct": "yes"}, {}]'),
                                 "detail 0's correct is a string"),
    "HTML as JSON's type": (http(200, b'{"scores": {"shapes": [1, 1]}}', kind=b"text/html"),
                            "of type text/html"),
    "no type": (http(200, b'{"scores": {"shapes": [1, 1]}}', kind=b""), "not application/json"),
    "over the answer limit": (http(200, b"[" + b"1," * (9 << 20) + b"1]"),
                              "an answer over 16777216 bytes"),
    "a redirect": (http(302, head=b"Location: http://10.0.0.1/\r\n"),
                   "HTTP 302 (a redirect, not followed)"),
    "102": (http(102), "HTTP 102"),
    "a proxy's 500 page": (http(500, NASTY.encode(), kind=b"text/html"),
                           "HTTP 500 (bad\\r\\nerror: forged line\\x1b[31m"),
    "418": (http(418, json.dumps({"error": NASTY}).encode()), "HTTP 418 (bad\\r\\nerror: forged"),
    "not HTTP": (b"SSH-2.0-OpenSSH_9\r\n" + NASTY.encode() + b"\r\n\r\n",
                 "not an HTTP answer (BadStatusLine"),
    "a status line of letters": (b"HTTP/1.1 2OO OK\r\n\r\n", "not an HTTP answer"),
    "a header line over 64 KiB": (b"HTTP/1.1 200 OK\r\nX: " + b"a" * (1 << 17) + b"\r\n\r\n",
                                  "not an HTTP answer"),
}


def test_every_broken_or_hostile_answer_is_one_line_naming_the_server_and_what_was_wrong():
    for case, (answer, said) in ANSWERS.items():
        with scripted(answer) as url:
            error = fails(url)
        assert_one_line(error, url)
        assert error.startswith(f"--reward-url {url}: ") and said in error, (case, error)
    # a reward server's own 422 / 500: the reward's failure, the peer's bytes escaped, no token
    with scripted(http(500, json.dumps({"error": NASTY}).encode())) as url:
        error = fails(url)
    assert_one_line(error, url)
    assert "ValueError: bad\\r\\nerror: forged line\\x1b[31m red\\x07 <the token of the token>" \
        in error, error
    # 503 with control characters, tried again, then one line; an answer cut short likewise
    for answer, said in ((http(503, json.dumps({"error": NASTY}).encode()),
                          "(the last: HTTP 503 bad\\r\\nerror"),
                         (http(200, b'{"scores": {"sh')[:-3], "(the last: IncompleteRead")):
        with scripted(answer) as url:
            error = fails(url, retries=1)
        assert_one_line(error, url)
        assert "no answer after 2 tries in" in error and said in error, error


def info(protocol=1, rewards=("shapes",), max_body=5, **more):
    """The body of an /info answer (str)."""
    fields = {"protocol": protocol, "rewards": rewards, "max_body_bytes": max_body, **more}
    return json.dumps({k: v for k, v in fields.items() if v is not None})


INFOS = {  # a broken /info -> what the one line at construction must say
    "protocol 2": (info(protocol=2), "protocol 2, where this client speaks 1"),
    "protocol true": (info(protocol=True), "protocol true"),
    "no max_body_bytes": (info(max_body=None), "no field 'max_body_bytes'"),
    "max_body_bytes a string": (info(max_body="64"), "max_body_bytes: \"64\", not a positive"),
    "max_body_bytes 0": (info(max_body=0), "max_body_bytes: 0"),
    "rewards a string": (info(rewards="shapes"), "rewards: a string"),
    "an extra field": (info(x=1), "an unexpected field 'x'"),
    "not JSON": ("<html>", "not JSON"),
    "a name with a line break": (info(rewards=["a\nb\x1b"]),
                                 "the server serves a\\nb\\x1b, not shapes"),
}


def test_a_broken_info_is_one_line_at_the_start():
    for case, (body, said) in INFOS.items():
        with scripted(b"", info=http(200, body.encode())) as url, pytest.raises(ValueError) as e:
            served(url)
        assert_one_line(str(e.value), url)
        assert said in str(e.value), (case, str(e.value))
    for answer, said in ((http(200, info().encode(), kind=b"text/plain"), "of type text/plain"),
                         (http(301, head=b"Location: http://x/\r\n"), "GET /info answered 301"),
                         (http(404, b"Not Found\r\n\x1b[2J", kind=b"text/plain"),
                          "404: Not Found\\r\\n\\x1b[2J")):
        with scripted(b"", info=answer) as url, pytest.raises(ValueError) as e:
            served(url)
        assert_one_line(str(e.value), url)
        assert said in str(e.value), str(e.value)


def trickle(data, every):
    """A peer's answer: `data` a byte at a time, `every` seconds apart."""
    def send(conn):
        for i in range(len(data)):
            conn.sendall(data[i:i + 1])
            time.sleep(every)
    return send


def test_the_timeout_bounds_the_whole_answer_however_slowly_it_comes():
    answer = scores([0.5, 0.5])
    slow = {"head": trickle(answer, 0.05),  # ~4 s in all
            "body": lambda conn: (conn.sendall(answer[:-30]), trickle(answer[-30:], 0.2)(conn)),
            "nothing": lambda conn: time.sleep(5)}
    for case, send in slow.items():
        with scripted(send) as url:
            t0 = time.monotonic()
            error = fails(url, timeout=1.0, retries=3)
            took = time.monotonic() - t0
        assert_one_line(error, url)
        assert "no whole answer within 1 s (--reward-timeout)" in error and took < 1.8, (case, took)
    # a server that never reads the body: the send is bounded too
    with scripted(lambda conn: time.sleep(5), read_body=False) as url:
        fn = served(url, timeout=1.0)
        t0 = time.monotonic()
        status, _, _, why = fn.request("POST", "/score", b"x" * (64 << 20), remote.MAX_ANSWER)
    assert status is None and "no whole answer within 1 s" in why, why
    assert time.monotonic() - t0 < 1.8
    # and an honest answer within the timeout is taken
    with scripted(trickle(scores([0.25, 0.75]), 0.002)) as url:
        images, prompts, metas = shapes_batch(b=2)
        assert served(url, timeout=5.0)(images, prompts, metas)[0].tolist() == [0.25, 0.75]


def test_a_bad_url_is_one_line_and_credentials_in_it_are_never_echoed():
    for url, said in ((f"http://user:{TOKEN}@127.0.0.1:1", "--reward-url: a user or password"),
                      ("http://127.0.0.1:1/\r\nX: y", "http://127.0.0.1:1/\\r\\nX: y: holds"),
                      ("http://127.0.0.1:1/\x1b[31m", "holds a control character")):
        with pytest.raises(ValueError) as e:
            remote.parse_url(url)
        assert_one_line(str(e.value))
        assert said in str(e.value), str(e.value)


# -----------------------------------------------------------------------------
# The token, whatever it holds

SECRET = "VERY-secret-PART-0123456789"
MALFORMED = {  # what a token file or the variable holds -> what the line says of it
    "a newline inside": (SECRET + "\n" + SECRET, "printable ASCII characters without spaces"),
    "a carriage return": (SECRET + "\r" + SECRET, "printable ASCII"),
    "control characters": (SECRET + "\x1b[31m\x00", "printable ASCII"),
    "a space inside": (SECRET + " " + SECRET, "printable ASCII"),
    "not ASCII": (SECRET + "é→😀", "printable ASCII"),
    "short": ("VERY-secret", "16 or more"),
    "huge": (SECRET * 200, "at most 4096"),
    "white space only": (" \t\n \n", "white space only"),
}


def check_line(text, where):
    assert_one_line(text)
    assert SECRET not in text and "VERY-secret" not in text and where in text, text


def run_flags(**more):
    """What remote.settings reads of a run's flags."""
    flags = dict(reward_url="http://127.0.0.1:1", reward_token_file=None, reward_timeout=1.0,
                 reward_retries=0)
    return type("Args", (), {**flags, **more})()


def test_a_malformed_token_is_named_never_shown(tmp_path, monkeypatch, capsys):
    """Each case from a file and from the variable, read by a client and by the server: one line
    naming the flag and file or the variable, nothing of the token's value."""
    monkeypatch.delenv(wire.TOKEN_ENV, raising=False)
    serve = ["--reward", "shapes", "--port", "0"]
    for case, (text, said) in MALFORMED.items():
        path = tmp_path / "token"
        path.write_bytes(text.encode())
        with pytest.raises(ValueError) as e:
            remote.settings(run_flags(reward_token_file=str(path)))
        check_line(str(e.value), f"--reward-token-file {path}: ")
        assert said in str(e.value), (case, str(e.value))
        assert processes.cli(server.main, [*serve, "--token-file", str(path)]) == 2
        check_line(capsys.readouterr().err.strip(), f"--token-file {path}: ")
        if "\x00" not in text:  # a variable cannot hold a NUL
            monkeypatch.setenv(wire.TOKEN_ENV, text)
            with pytest.raises(ValueError) as e:
                remote.settings(run_flags())
            check_line(str(e.value), f"{wire.TOKEN_ENV}: ")
            assert processes.cli(server.main, serve) == 2
            check_line(capsys.readouterr().err.strip(), f"{wire.TOKEN_ENV}: ")
            monkeypatch.delenv(wire.TOKEN_ENV)
    files = {"empty": (b"", "empty"),
             "not UTF-8": (SECRET.encode() + b"\xff\xfe", "not text (UTF-8)"),
             "a megabyte": (SECRET.encode() * 40000, "over 65536 bytes"),
             "a folder": (None, "not a file"), "missing": (False, "no such file")}
    for case, (data, said) in files.items():
        path = tmp_path / case.replace(" ", "_")
        if data is None:
            path.mkdir()
        elif data is not False:
            path.write_bytes(data)
        with pytest.raises((ValueError, FileNotFoundError)) as e:
            auth.read(str(path), "--reward-token-file")
        check_line(str(e.value), f"--reward-token-file {path}: {said}")
    monkeypatch.setenv(wire.TOKEN_ENV, "")
    with pytest.raises(ValueError) as e:
        remote.settings(run_flags())
    check_line(str(e.value), f"{wire.TOKEN_ENV}: set, but empty")
    # a good token prints as where it came from, in the settings, their repr and any f-string
    monkeypatch.setenv(wire.TOKEN_ENV, f"  {SECRET}\n")
    got = remote.settings(run_flags())
    assert got["token"].reveal() == SECRET
    assert SECRET not in repr(got) + str(got) + f"{got['token']}"


def test_a_run_stops_in_one_line_on_a_hostile_server_and_a_malformed_token(smoke_base, tmp_path,
                                                                            capsys, monkeypatch):
    """train.py and the paper's table: one 'error:' line, no token, no traceback, no forged line."""
    monkeypatch.setenv(wire.TOKEN_ENV, TOKEN)
    with scripted(http(418, json.dumps({"error": NASTY}).encode())) as url:
        code, _, err = cli(capsys, *grpo_flags(smoke_base, tmp_path / "run", "--steps", "1",
                                               "--reward-url", url))
        lines = [line for line in err.splitlines() if "error" in line.lower()]  # (and tqdm's bar)
        assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
        assert_one_line(lines[0], url)
        assert "HTTP 418 (bad\\r\\nerror: forged line\\x1b[31m red\\x07 <the token of " \
               "MARGRPO_REWARD_TOKEN>)" in lines[0], err
        (tmp_path / "prompts.txt").write_text("a red circle\n")
        capsys.readouterr()
        flags = ["--ckpt", f"base={smoke_base}", "--prompts", tmp_path / "prompts.txt",
                 "--images-per-prompt", "2", "--reward", "shapes", "--preset", "smoke",
                 "--num-iter", "2", "--num-sampling-steps", "4", "--out", tmp_path / "eval",
                 "--reward-url", url]
        code = paper.cli([str(f) for f in flags])
        err = capsys.readouterr().err
        assert code == 1 and "Traceback" not in err, err
        said = [line for line in err.splitlines() if "error" in line.lower() or "\x1b" in line]
        assert said == err.strip().splitlines()[-1:]
        assert_one_line(said[0], url)
    monkeypatch.setenv(wire.TOKEN_ENV, SECRET + "\n" + SECRET)  # a token no header could carry
    code, _, err = cli(capsys, *grpo_flags(smoke_base, tmp_path / "bad", "--reward-url",
                                           "http://127.0.0.1:1"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and not (tmp_path / "bad").exists(), err
    check_line(err.strip(), f"error: {wire.TOKEN_ENV}: ")
