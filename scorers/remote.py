"""The reward server's client: a rewards.Reward whose component scores come from `python -m
scorers.server` (scorers/server.py), summed with the spec's weights here exactly as
rewards.WeightedSum sums them in-process. train.py and evaluate.py build it with
`rewards.build_reward(spec, server=settings(args))` when `--reward-url URL` is given.

Each call sends the batch once (scorers/wire.py: the 8-bit pixels as NPY, the prompts and each
image's metadata as JSON) and asks for every component of the spec. What the network can do to a
call, and what the run sees:
- no connection (refused, reset, the server killed mid-request), or 502 / 503 / 504: tried again
  `retries` times, waiting 0.5 s, 1 s, 2 s, ... (at most 15 s) between tries; then the run stops in
  one line naming the URL (rewards.RewardFailed, exit status 1); its checkpoints are intact and
  `--resume` continues once the server answers;
- no answer within `timeout` seconds (a server that hangs): the run stops at once in one line (a
  request that timed out may still be running on the server: sending it again would pile up work);
- 4xx / 5xx: the server's one-line reason (422 and 500, a reward that refused or failed on the
  batch, are said as an in-process reward's failure, with the batch's prompts).
At construction GET /info checks that the server answers, accepts the token and serves every name
of the spec: if not, a one-line ValueError naming --reward-url (exit status 2, nothing written).
Images with a non-finite pixel cannot be sent as 8-bit: they get NaN scores (the update is then
skipped, as for any non-finite reward) and are not sent.
"""

import http.client
import json
import math
import os
import socket
import time
import urllib.parse

import torch

from rewards import Reward, RewardFailed, WeightedSum
from scorers import wire

FLAG = "--reward-url"
RETRY_STATUS = (502, 503, 504)      # a proxy or the server itself saying: try again later
BACKOFF, MAX_BACKOFF = 0.5, 15.0    # seconds before the first retry, and at most between two


def parse_url(url):
    """'http://HOST[:PORT][/PATH]' -> (host, port, path prefix); a one-line ValueError naming --reward-url."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port or 80
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None or parts.query or parts.fragment:
        raise ValueError(f"{FLAG} {url}: write http://HOST:PORT (python -m scorers.server prints it); "
                         "for TLS, tunnel the port (docs/reward_server.md)")
    return parts.hostname, port, parts.path.rstrip("/")


def settings(args):
    """The `server` argument of rewards.build_reward for a run's flags: None without --reward-url, else
    {"url", "token", "timeout", "retries"}, the token read from --reward-token-file or MARGRPO_REWARD_TOKEN."""
    if args.reward_url is None:
        return None
    token = os.environ.get(wire.TOKEN_ENV, "")
    if args.reward_token_file is not None:
        with open(args.reward_token_file, encoding="utf-8") as f:
            token = f.read()
    return dict(url=args.reward_url, token=token.strip() or None, timeout=args.reward_timeout, retries=args.reward_retries)


class RemoteReward(Reward):
    """sum_k w_k r_k with every r_k scored by the reward server at `url`.

    items: [(name, weight)] of the spec; token: the server's shared token or None; timeout: seconds
    to wait for an answer; retries: tries after the first when there is no connection.
    """

    name = "served"

    def __init__(self, items, url, token=None, timeout=120.0, retries=8):
        self.items, self.url, self.token, self.timeout, self.retries = list(items), url, token, timeout, retries
        self.host, self.port, self.prefix = parse_url(url)
        status, body, reason = self.request("GET", "/info", None)
        if reason is not None:
            raise ValueError(f"{FLAG} {url}: {reason}; start it with python -m scorers.server")
        if status == 401:
            raise ValueError(f"{FLAG} {url}: the server refused the token ({error_of(body)}); set {wire.TOKEN_ENV} "
                             "or --reward-token-file to the server's token")
        try:
            info = json.loads(body) if status == 200 else None
            served, self.max_body = list(info["rewards"]), int(info["max_body_bytes"])
        except (ValueError, TypeError, KeyError):
            raise ValueError(f"{FLAG} {url}: not a reward server (GET /info answered {status})") from None
        missing = [name for name, _ in self.items if name not in served]
        if missing:
            raise ValueError(f"{FLAG} {url}: the server serves {', '.join(served)}, not {', '.join(missing)} "
                             "(--reward); start it with them")

    def request(self, method, path, body):
        """One HTTP request, tried again while there is no connection. Returns (status, body, None),
        or (None, None, why): the tries spent, or no answer within the timeout (not tried again)."""
        headers = {"Content-Type": "application/octet-stream", "Connection": "close"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        t0, why = time.time(), None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(BACKOFF * 2 ** (attempt - 1), MAX_BACKOFF))
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                conn.request(method, self.prefix + path, body=body, headers=headers)
                answer = conn.getresponse()
                status, data = answer.status, answer.read()
            except (TimeoutError, socket.timeout):
                return None, None, f"no answer within {self.timeout:g} s (--reward-timeout): the server hangs or is overloaded"
            except (OSError, http.client.HTTPException) as e:
                why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                continue
            finally:
                conn.close()
            if status not in RETRY_STATUS:
                return status, data, None
            why = f"HTTP {status} {error_of(data)}"
        tries = self.retries + 1
        return None, None, f"no answer after {tries} tr{'ies' if tries > 1 else 'y'} in {time.time() - t0:.1f} s (the last: {why})"

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
        body = wire.encode_request(names, images, prompts, metadata)
        if len(body) > self.max_body:
            raise RewardFailed(f"{FLAG} {self.url}: a batch of {len(prompts)} images of {images.shape[2]}×{images.shape[3]} "
                               f"is {len(body) / 2**20:.1f} MiB as sent, over the server's limit of "
                               f"{self.max_body / 2**20:.1f} MiB (its --max-body-mb; or fewer images a process: --grad-accum)")
        status, data, reason = self.request("POST", "/score", body)
        if reason is not None:
            raise RewardFailed(f"{FLAG} {self.url}: {reason}; checkpoints so far are intact, `--resume` continues once "
                               "the server answers")
        if status in (422, 500):  # a reward refused or failed on this batch: said as an in-process reward's failure
            raise ValueError(f"{error_of(data)} (on the reward server {self.url})")
        if status != 200:
            raise RewardFailed(f"{FLAG} {self.url}: the server refused the batch: {status} {error_of(data)}")
        try:
            return wire.decode_answer(data, names, len(prompts))
        except (ValueError, TypeError, KeyError) as e:
            raise RewardFailed(f"{FLAG} {self.url}: not a reward server's answer ({type(e).__name__}: {e})") from None


def error_of(body):
    """The one-line reason of an error answer's body ({"error": ...}, else its first line)."""
    try:
        text = str(json.loads(body)["error"])
    except (ValueError, TypeError, KeyError):
        text = (body or b"").decode("utf-8", "replace")
    lines = text.strip().splitlines()
    return lines[0][:300] if lines else "(no reason given)"
