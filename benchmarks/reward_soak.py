"""The reward server soaked for a while by clients that come and go: most of them normal, some
silent, some trickling, some oversize, some without the token, now and then a batch of the largest
size. Prints the latency of the normal requests (p50, p99), how many failed (each normal request is
tried once: no retry hides a refusal), what the other peers got, and the server's resident memory.

    python -m benchmarks.reward_soak                       # 10 minutes
    python -m benchmarks.reward_soak --seconds 60 --normal 2

Starts `python -m scorers.server --reward shapes,jpeg_incompressibility --max-connections N`
(N: --connections, fewer than the clients' connections, so that room must be made) with a fresh
token on a free loopback port (its own process). The clients are threads of this process:
- normal (--normal): scores a demo batch (6 shapes images of 16 px) again and again, a new client
  (GET /info and all) every 20 requests;
- silent (--silent): opens a connection and sends nothing until the server closes it or it leaves
  (after 1 to 20 s), and comes back 0.2 to 2 s later;
- slow (--slow): a request head a byte every 0.5 s; a body after a head without the token; a body
  with it, each trickled until the server closes the connection;
- oversize (--oversize): a Content-Length over the limit, or a chunked body that grows past it;
- wrong token (--wrong-token): a request with a wrong token;
- large: every --large-every seconds, one batch of 512-px images just under --max-body-mb (jpeg).
The server's VmRSS is read every second from /proc/PID/status; its VmHWM (peak) at the end.
"""

import argparse
import json
import math
import os
import random
import secrets
import shlex
import socket
import sys
import threading
import time

import numpy as np
import torch

from benchmarks import reward_load, reward_memory
from infra import checkpoints, flags, processes
from scorers import registry, remote, server, wire


class Soak:
    """What the clients share: the server's URL and token, a stop flag and the tallies."""

    def __init__(self, url, token, max_body, seconds):
        self.url, self.token, self.max_body = url, token, max_body
        self.host, self.port, _ = remote.parse_url(url)
        self.end = time.monotonic() + seconds
        self.lock = threading.Lock()
        self.latencies, self.failures, self.counts = [], [], {}

    def running(self):
        return time.monotonic() < self.end

    def count(self, what):
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def connect(self):
        return socket.create_connection((self.host, self.port), timeout=30)

    def head(self, token=None, length=None, chunked=False):
        """The bytes of a request head."""
        lines = ["POST /score HTTP/1.1", "Host: soak"]
        lines += [f"Authorization: Bearer {token}"] if token else []
        lines += [f"Content-Length: {length}"] if length is not None else []
        lines += ["Transfer-Encoding: chunked"] if chunked else []
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    def reward(self, name):
        """A client of the reward `name` that never tries a request again."""
        return registry.build_reward(name, server=dict(url=self.url, token=self.token, timeout=120,
                                                      retries=0))


def status_of(data):
    """The status of the first answer in `data` (bytes), '-' if none (closed without one)."""
    return data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.1 ") else "-"


def until_closed(sock, soak, seconds):
    """Read `sock` until the server closes it, `seconds` pass or the soak ends. Returns (what was
    read, whether the server closed it)."""
    data, end = b"", min(time.monotonic() + seconds, soak.end)
    while time.monotonic() < end:
        sock.settimeout(max(0.01, min(1.0, end - time.monotonic())))
        try:
            part = sock.recv(1 << 16)
        except (TimeoutError, socket.timeout):
            continue
        except OSError:
            return data, True
        if not part:
            return data, True
        data += part
    return data, False


def trickle(sock, data, every, soak):
    """Send `data` a byte every `every` s until it is sent, the server closes or the soak ends.
    Returns True if the server closed the connection."""
    for i in range(len(data)):
        if not soak.running():
            return False
        try:
            sock.sendall(data[i:i + 1])
        except OSError:
            return True
        time.sleep(every)
    return False


def normal(soak, k):
    images, prompts, metas = reward_load.batch(6, 16, seed=k)
    while soak.running():
        try:
            fn = soak.reward("shapes")
            for _ in range(20):
                t = time.perf_counter()
                fn(images, prompts, metas)
                soak.latencies.append(time.perf_counter() - t)
                if not soak.running():
                    return
                time.sleep(random.uniform(0, 0.02))
        except Exception as e:  # noqa: BLE001 (a failed normal request is the figure)
            soak.failures.append(wire.one_line(f"{type(e).__name__}: {e}"))
            time.sleep(0.5)


def peer(fn):
    """A misbehaving client's loop: `fn(soak, k)` again and again until the soak ends; a connection
    the server resets or refuses is counted, not fatal."""
    def run(soak, k):
        while soak.running():
            try:
                fn(soak, k)
            except OSError as e:
                soak.count(f"{fn.__name__}: {type(e).__name__}")
            k += 1
    run.__name__ = fn.__name__
    return run


@peer
def silent(soak, k):
    with soak.connect() as s:
        data, closed = until_closed(s, soak, random.uniform(1, 20))
        soak.count(f"silent: closed by the server ({status_of(data)})" if closed
                   else "silent: left")
    time.sleep(random.uniform(0.2, 2))  # and comes back


@peer
def slow(soak, k):
    kind = ["head", "body without the token", "body with the token"][k % 3]
    with soak.connect() as s:
        if kind == "head":
            closed = trickle(s, soak.head(soak.token, 1000), 0.5, soak)
            data = until_closed(s, soak, 2)[0] if closed else b""
        else:
            s.sendall(soak.head(soak.token if kind.endswith("with the token") else None, 1 << 20))
            closed = trickle(s, b"x" * (1 << 20), 0.5, soak)
            data = until_closed(s, soak, 5)[0]
        soak.count(f"slow {kind}: {status_of(data)}, closed by the server" if closed
                   else f"slow {kind}: left")


@peer
def oversize(soak, k):
    kind = "declared" if k % 2 == 0 else "chunked"
    with soak.connect() as s:
        if kind == "declared":  # over the limit: refused on the head
            s.sendall(soak.head(soak.token, soak.max_body + 1) + b"x" * (1 << 20))
        else:  # chunked, growing past the limit
            s.sendall(soak.head(soak.token, chunked=True))
            block = b"x" * (1 << 20)
            try:
                for _ in range(soak.max_body // len(block) + 2):
                    s.sendall(b"%x\r\n%s\r\n" % (len(block), block))
            except OSError:  # refused (413) and closed as it sends
                pass
        soak.count(f"oversize ({kind}): {status_of(until_closed(s, soak, 10)[0])}")
    time.sleep(random.uniform(0.5, 2))


@peer
def wrong_token(soak, k):
    with soak.connect() as s:
        s.sendall(soak.head("wrong-" + secrets.token_urlsafe(16), 10) + b"x" * 10)
        soak.count(f"wrong token: {status_of(until_closed(s, soak, 1)[0])}")
    time.sleep(random.uniform(0.1, 1))


def large(soak, every):
    count = max(1, (soak.max_body - (64 << 10)) // (3 * 512 * 512))
    images = torch.rand(count, 3, 512, 512, generator=torch.Generator().manual_seed(1))
    while soak.running():
        time.sleep(min(every, max(0.0, soak.end - time.monotonic())))
        if soak.running():
            try:
                soak.reward("jpeg_incompressibility")(images, ["a photo"] * count, None)
                soak.count(f"large ({count} images of 512 px): 200")
            except Exception as e:  # noqa: BLE001
                soak.failures.append(wire.one_line(f"large: {type(e).__name__}: {e}"))


def parse_args(argv):
    p = processes.Parser(prog="python -m benchmarks.reward_soak", description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--seconds", type=flags.POS_FLOAT, default=600.0, help="how long the soak runs")
    a("--normal", type=flags.NONNEG_INT, default=4, help="normal clients")
    a("--silent", type=flags.NONNEG_INT, default=12, help="silent connections at once")
    a("--slow", type=flags.NONNEG_INT, default=6, help="trickling clients")
    a("--oversize", type=flags.NONNEG_INT, default=1, help="clients over the body limit")
    a("--wrong-token", type=flags.NONNEG_INT, default=1, help="clients with a wrong token")
    a("--large-every", type=flags.POS_FLOAT, default=30.0,
      help="seconds between two batches of the largest size")
    a("--connections", type=flags.POS_INT, default=16, help="the server's --max-connections")
    a("--max-body-mb", type=flags.POS_FLOAT, default=64.0, help="the server's --max-body-mb")
    a("--server-flags", default="", help="more flags of the server, e.g. '--header-timeout 5'")
    a("--json", default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    if args.json:
        checkpoints.check_writable(os.path.dirname(os.path.abspath(args.json)), "--json")
    return args


def main(argv=None):
    """Run the soak and print its figures. Returns them (dict)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    token = secrets.token_urlsafe(32)
    argv = ["--reward", "shapes,jpeg_incompressibility", "--port", 0, "--threads", 1,
            "--max-connections", args.connections, "--max-body-mb", args.max_body_mb,
            *shlex.split(args.server_flags)]
    proc, url = server.launch(argv, env=dict(os.environ, **{wire.TOKEN_ENV: token}),
                              log=open(os.devnull, "w"))
    try:
        soak = Soak(url, token, int(args.max_body_mb * (1 << 20)), args.seconds)
        soak.reward("shapes")(*reward_load.batch(6, 16, seed=0))  # a warm-up, untimed
        rss = [reward_memory.vm(proc.pid, "VmRSS")]
        plan = [(normal, args.normal), (silent, args.silent), (slow, args.slow),
                (oversize, args.oversize), (wrong_token, args.wrong_token)]
        threads = [threading.Thread(target=fn, args=(soak, k), daemon=True)
                   for fn, n in plan for k in range(n)]
        threads.append(threading.Thread(target=large, args=(soak, args.large_every), daemon=True))
        t0 = time.monotonic()
        for t in threads:
            t.start()
        while soak.running():
            time.sleep(min(1.0, max(0.0, soak.end - time.monotonic())))
            rss.append(reward_memory.vm(proc.pid, "VmRSS"))
        for t in threads:
            t.join(60)
        wall = time.monotonic() - t0
        rss.append(reward_memory.vm(proc.pid, "VmRSS"))
        peak, alive = reward_memory.vm(proc.pid, "VmHWM"), proc.poll() is None
    finally:
        proc.terminate()
        proc.wait()
    ms = 1e3 * np.asarray(soak.latencies or [math.nan])
    figures = dict(seconds=wall, normal_requests=len(soak.latencies), failed=len(soak.failures),
                   failures=soak.failures[:20], p50_ms=float(np.percentile(ms, 50)),
                   p99_ms=float(np.percentile(ms, 99)), max_ms=float(ms.max()),
                   rss_start_mib=rss[0], rss_end_mib=rss[-1], rss_max_mib=max(rss), peak_mib=peak,
                   server_alive=alive,
                   others=dict(sorted(soak.counts.items())), args=vars(args))
    print(f"\nsoak of {wall:.0f} s: {args.normal} normal, {args.silent} silent, {args.slow} slow, "
          f"{args.oversize} oversize, {args.wrong_token} wrong-token clients, a batch of the "
          f"largest size every {args.large_every:g} s; server --max-connections {args.connections} "
          f"--max-body-mb {args.max_body_mb:g} {args.server_flags}; torch {torch.__version__}, "
          f"{os.cpu_count()} CPU cores")
    print(f"normal requests: {figures['normal_requests']}, failed {figures['failed']}; p50 "
          f"{figures['p50_ms']:.1f} ms, p99 {figures['p99_ms']:.1f} ms, max "
          f"{figures['max_ms']:.0f} ms")
    print(f"server RSS: {rss[0]:.0f} MiB at the start (after a warm-up), {rss[-1]:.0f} MiB at the "
          f"end, {max(rss):.0f} MiB the most sampled, {peak:.0f} MiB peak (VmHWM); still serving: "
          f"{alive}")
    for what, n in figures["others"].items():
        print(f"  {what}: {n}")
    for line in soak.failures[:5]:
        print(f"  failed: {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return figures


if __name__ == "__main__":
    sys.exit(processes.cli(main))
