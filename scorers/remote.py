"""The reward server's client: a rewards.Reward whose component scores come from `python -m
scorers.server` (scorers/server.py), summed with the spec's weights here exactly as
rewards.WeightedSum sums them in-process. train.py and the paper's table build it with
`registry.build_reward(spec, server=settings(args))` (scorers/registry.py) when `--reward-url URL` is given.

Each call sends the batch once (scorers/wire.py: the 8-bit pixels as NPY, the prompts and each
image's metadata as JSON) and asks for every component of the spec. What the network can do to a
call, and what the run sees:
- no connection (refused, reset, the server killed mid-request), or 502 / 503 / 504: tried again
  `retries` times, waiting 0.5 s, 1 s, 2 s, ... (at most 15 s) between tries; then the run stops in
  one line naming the URL (rewards.RewardFailed, exit status 1); its checkpoints are intact and
  `--resume` continues once the server answers;
- no whole answer within `timeout` seconds of starting the request (connecting, sending the
  batch and reading the answer together, however slowly the server trickles it): the run stops at
  once in one line (a request that timed out may still be running on the server: sending it again
  would pile up work);
- 4xx / 5xx: the server's one-line reason (422 and 500 as the reward server writes them, a reward
  that refused or failed on the batch, are said as an in-process reward's failure, with the
  batch's prompts);
- anything else (a redirect, another status, an answer that is not the wire format's, over
  MAX_ANSWER bytes, with scores that are not B finite numbers of each reward asked): the run stops
  in one line naming the URL and what was wrong (wire.decode_answer).
Every error is one line: what the server sent is quoted with its control characters escaped
(wire.one_line) and the token, should the server echo it, is replaced by its name.
At construction GET /info checks that the server answers, accepts the token, speaks this protocol
and serves every name of the spec: if not, a one-line ValueError naming --reward-url (exit status
2, nothing written). The token (scorers/auth.py) is read from --reward-token-file or
MARGRPO_REWARD_TOKEN and checked before anything is sent; no error names its value.
Images with a non-finite pixel cannot be sent as 8-bit: they get NaN scores (the update is then
skipped, as for any non-finite reward) and are not sent.
"""

import http.client
import json
import math
import socket
import time
import urllib.parse

import torch

from rewards import Reward, RewardFailed, WeightedSum
from scorers import auth, wire

FLAG = "--reward-url"
RETRY_STATUS = (502, 503, 504)      # a proxy or the server itself saying: try again later
BACKOFF, MAX_BACKOFF = 0.5, 15.0    # seconds before the first retry, and at most between two
MAX_ANSWER = 16 << 20               # bytes of a scores answer read at most
MAX_SMALL = 64 << 10                # bytes of an /info or error answer read at most
one_line = wire.one_line


def parse_url(url):
    """'http://HOST[:PORT][/PATH]' -> (host, port, path prefix); a one-line ValueError naming
    --reward-url (without what precedes an @: it may be a password)."""
    if not url.isprintable():
        raise ValueError(f"{FLAG} {one_line(url)}: holds a control character or a line break")
    parts = urllib.parse.urlsplit(url)
    if "@" in parts.netloc:
        raise ValueError(f"{FLAG}: a user or password in the URL is not sent; write "
                         f"http://HOST:PORT and give the token in {wire.TOKEN_ENV} or "
                         "--reward-token-file")
    try:
        port = parts.port or 80
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None or parts.query or parts.fragment:
        raise ValueError(f"{FLAG} {one_line(url)}: write http://HOST:PORT (python -m "
                         "scorers.server prints it); for TLS, tunnel the port "
                         "(docs/reward_server.md)")
    return parts.hostname, port, parts.path.rstrip("/")


def settings(args):
    """The `server` argument of registry.build_reward for a run's flags: None without --reward-url,
    else {"url", "token", "timeout", "retries"}, the token (an auth.Secret or None) read from
    --reward-token-file or MARGRPO_REWARD_TOKEN and checked (a one-line error naming either)."""
    if args.reward_url is None:
        return None
    token = auth.read(args.reward_token_file, "--reward-token-file")
    return dict(url=args.reward_url, token=token, timeout=args.reward_timeout,
                retries=args.reward_retries)


class DeadlineSocket(socket.socket):
    """A TCP socket whose sends and receives, all together, end by `deadline` (time.monotonic()):
    each waits at most the time left, and none starts once it is spent (TimeoutError)."""

    deadline = math.inf

    def left(self):
        """Set the socket's timeout to the seconds left; TimeoutError if none are."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        self.settimeout(left)

    def recv_into(self, *args):
        self.left()
        return super().recv_into(*args)

    def recv(self, *args):
        self.left()
        return super().recv(*args)

    def sendall(self, *args):
        self.left()  # sendall's timeout bounds the whole send (Python >= 3.5)
        return super().sendall(*args)

    def send(self, *args):
        self.left()
        return super().send(*args)


class DeadlineConnection(http.client.HTTPConnection):
    """An HTTP connection whose whole exchange, connecting included, ends by `deadline`."""

    def __init__(self, host, port, deadline):
        super().__init__(host, port, timeout=max(deadline - time.monotonic(), 1e-3))
        self.deadline = deadline

    def connect(self):
        error = OSError(f"no address for {self.host}")
        for family, kind, proto, _, address in socket.getaddrinfo(self.host, self.port,
                                                                  type=socket.SOCK_STREAM):
            sock = DeadlineSocket(family, kind, proto)
            sock.deadline = self.deadline
            try:
                sock.left()
                sock.connect(address)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.sock = sock
                return
            except OSError as e:
                sock.close()
                if isinstance(e, TimeoutError):
                    raise
                error = e
        raise error


class TooLarge(Exception):
    """An answer over the bytes the client reads."""


def read_at_most(answer, limit):
    """The body of `answer` (http.client.HTTPResponse): TooLarge past `limit` bytes, IncompleteRead
    if the connection ends before its Content-Length."""
    chunks, total = [], 0
    while True:
        part = answer.read(min(1 << 20, limit + 1 - total))
        if not part:
            if answer.length:  # read(amt) does not say that a body was cut short
                raise http.client.IncompleteRead(b"".join(chunks), answer.length)
            return b"".join(chunks)
        chunks.append(part)
        total += len(part)
        if total > limit:
            raise TooLarge(f"an answer over {limit} bytes")


class RemoteReward(Reward):
    """sum_k w_k r_k with every r_k scored by the reward server at `url`.

    items: [(name, weight)] of the spec; token: the server's shared token (auth.Secret, a str
    checked as one, or None); timeout: seconds one request may take in all, from connecting to
    the last byte of its answer; retries: tries after the first when there is no connection.
    """

    name = "served"

    def __init__(self, items, url, token=None, timeout=120.0, retries=8):
        self.items, self.url, self.timeout, self.retries = list(items), url, timeout, retries
        self.token = auth.check(token, "the token") if isinstance(token, str) else token
        self.host, self.port, self.prefix = parse_url(url)
        status, kind, body, reason = self.request("GET", "/info", None, MAX_SMALL)
        if reason is not None:
            raise ValueError(self.said(f"{reason}; start it with python -m scorers.server"))
        if status == 401:
            raise ValueError(self.said(f"the server refused the token ({error_of(body)}); set "
                                       f"{wire.TOKEN_ENV} or --reward-token-file to the server's "
                                       "token"))
        if status != 200:
            raise ValueError(self.said(f"not a reward server (GET /info answered {status}: "
                                       f"{error_of(body)})"))
        try:
            json_type(kind)
            served, self.max_body = wire.decode_info(body)
        except ValueError as e:
            raise ValueError(self.said(f"not a reward server (GET /info answered {e})")) from None
        missing = [name for name, _ in self.items if name not in served]
        if missing:
            names = ", ".join(map(one_line, served)) or "nothing"
            raise ValueError(self.said(f"the server serves {names}, not {', '.join(missing)} "
                                       "(--reward); start it with them"))

    def said(self, text):
        """'--reward-url URL: text' as one line, the token replaced by its name wherever a peer
        put it."""
        return self.redacted(f"{FLAG} {one_line(self.url)}: {text}")

    def redacted(self, text):
        return text if self.token is None else self.token.redact(text)

    def request(self, method, path, body, limit):
        """One HTTP request, tried again while there is no connection. Returns (status, content
        type, body, None), or (None, None, None, why): the tries spent, no whole answer within the
        timeout (not tried again), or an answer that is not HTTP or over `limit` bytes."""
        headers = {"Content-Type": "application/octet-stream", "Connection": "close"}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token.reveal()}"
        t0, why = time.monotonic(), None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(BACKOFF * 2 ** (attempt - 1), MAX_BACKOFF))
            conn = DeadlineConnection(self.host, self.port, time.monotonic() + self.timeout)
            try:
                conn.request(method, self.prefix + path, body=body, headers=headers)
                answer = conn.getresponse()
                status, kind = answer.status, answer.getheader("content-type", "")
                data = read_at_most(answer, limit if status == 200 else MAX_SMALL)
            except TimeoutError:  # socket.timeout too
                return None, None, None, (f"no whole answer within {self.timeout:g} s "
                                          "(--reward-timeout): the server hangs, trickles or is "
                                          "overloaded")
            except (OSError, http.client.IncompleteRead) as e:  # no connection, or gone mid-answer
                why = one_line(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
                continue
            except TooLarge as e:
                return None, None, None, f"{e}; not a reward server's answer"
            except (http.client.HTTPException, ValueError) as e:  # a status line or header
                return None, None, None, one_line(f"not an HTTP answer ({type(e).__name__}: {e})")
            finally:
                conn.close()
            if status not in RETRY_STATUS:
                return status, kind, data, None
            why = f"HTTP {status} {error_of(data)}"
        tries = self.retries + 1
        return None, None, None, (f"no answer after {tries} tr{'ies' if tries > 1 else 'y'} in "
                                  f"{time.monotonic() - t0:.1f} s (the last: {why})")

    def score(self, images, prompts, metadata):
        """images (B, 3, H, W) on the 8-bit grid (Reward.__call__), B prompts, B metadata dicts.
        Returns (scores (B,), info) as rewards.WeightedSum's: components, means, weights, extras."""
        B, names = images.shape[0], [name for name, _ in self.items]
        finite = torch.isfinite(images.flatten(1)).all(1)                             # (B,)
        if bool(finite.all()):
            got = self.send(names, images, prompts, metadata)
        else:  # the images that can be sent are; the others score NaN (per-image extras are left out)
            keep = finite.nonzero().flatten().tolist()
            got = {name: (torch.full((B,), math.nan), {}) for name in names}
            if keep:
                sent = self.send(names, images[keep], [prompts[b] for b in keep], [metadata[b] for b in keep])
                for name, (scores, _) in sent.items():
                    got[name][0][keep] = scores
        return WeightedSum.combine([(name, weight, *got[name]) for name, weight in self.items])

    def send(self, names, images, prompts, metadata):
        """POST /score of one batch. Returns {name: (scores (b,) float32, info)}."""
        try:
            body = wire.encode_request(names, images, prompts, metadata)
        except ValueError as e:
            raise RewardFailed(self.said(str(e))) from None
        if len(body) > self.max_body:
            raise RewardFailed(self.said(
                f"a batch of {len(prompts)} images of {images.shape[2]}×{images.shape[3]} is "
                f"{len(body) / 2**20:.1f} MiB as sent, over the server's limit of "
                f"{self.max_body / 2**20:.1f} MiB (its --max-body-mb; or fewer images a process: "
                "--grad-accum)"))
        status, kind, data, reason = self.request("POST", "/score", body, MAX_ANSWER)
        if reason is not None:
            raise RewardFailed(self.said(f"{reason}; checkpoints so far are intact, `--resume` "
                                         "continues once the server answers"))
        failed = reward_error(kind, data) if status in (422, 500) else None
        if failed is not None:  # a reward refused or failed on this batch: said as in process
            raise ValueError(self.redacted(f"{failed} (on the reward server {one_line(self.url)})"))
        if status != 200:
            what = "a redirect, not followed" if 300 <= status < 400 else error_of(data)
            raise RewardFailed(self.said(f"the server refused the batch: HTTP {status} ({what})"))
        try:
            json_type(kind)
            return wire.decode_answer(data, names, len(prompts))
        except ValueError as e:
            raise RewardFailed(self.said(f"not a reward server's answer to {len(prompts)} images: "
                                         f"{e}")) from None


def json_type(kind):
    """A ValueError unless `kind` (a Content-Type) is JSON's."""
    if kind.split(";")[0].strip().lower() != "application/json":
        shown = one_line(kind, 60) or "none given"
        raise ValueError(f"a body of type {shown}, not application/json")


def reward_error(kind, body):
    """The reason of a reward server's own 422 / 500 answer ({"error": "..."} as JSON), escaped to
    one line; None if the body is not one (a proxy's page, say)."""
    try:
        json_type(kind)
        text = json.loads(body)["error"]
    except (ValueError, TypeError, KeyError, RecursionError):
        return None
    return one_line(text) if isinstance(text, str) else None


def error_of(body):
    """The reason of an error answer's body ({"error": ...}, else its first bytes) as one line."""
    try:
        text = json.loads(body)["error"]
    except (ValueError, TypeError, KeyError, RecursionError):
        text = body or b""
    text = text if isinstance(text, (str, bytes)) else json.dumps(text)
    return one_line(text.strip()) or "(no reason given)"
