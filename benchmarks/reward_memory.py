"""The reward server's peak memory under N concurrent requests of the largest size it takes.

    python -m benchmarks.reward_memory                  # jpeg, 512 px, 64 MiB bodies
    python -m benchmarks.reward_memory --concurrent 1,4,16 --server-flags "--max-inflight-mb 320"

For each N of --concurrent: a fresh `python -m scorers.server --reward R --max-body-mb M` on a free
loopback port (its own process), then N clients (threads of this process) each send one batch of
as many --size px images as fit in the body limit, all at once, and wait for the scores. Reported
from the server's /proc/PID/status: its resident memory once serving (VmRSS, the models loaded,
nothing asked yet) and its peak (VmHWM) once every request is answered; the difference is what the
requests cost, bodies, their copies and the reward's own working set of a batch together.
"""

import argparse
import http.client
import json
import os
import shlex
import sys
import threading
import time

import torch

from infra import checkpoints, flags, processes
from scorers import auth, remote, server, wire


def vm(pid, key):
    """A figure of /proc/PID/status in MiB (VmRSS: resident now; VmHWM: the peak of VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def largest_body(reward, max_body, size):
    """The body of the largest batch of `size` px noise images under `max_body` bytes, and how
    many images it holds."""
    count = max(1, (max_body - (64 << 10)) // (3 * size * size))
    pixels = torch.randint(0, 256, (count, 3, size, size), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    images = pixels.float() / 255
    return wire.encode_request([reward], images, ["a red circle"] * count, None), count


def post(url, body, token, out):
    """POST /score `body`; appends (status, seconds) to `out`."""
    host, port, _ = remote.parse_url(url)
    conn = http.client.HTTPConnection(host, port, timeout=3600)
    t = time.perf_counter()
    headers = {"Authorization": f"Bearer {token.reveal()}"} if token else {}
    conn.request("POST", "/score", body=body, headers=headers)
    answer = conn.getresponse()
    answer.read()
    out.append((answer.status, time.perf_counter() - t))
    conn.close()


def measure(args, n, body):
    """One fresh server, n concurrent requests of `body`. Returns the figures (dict)."""
    argv = ["--reward", args.reward, "--port", 0, "--threads", args.server_threads,
            "--max-body-mb", args.max_body_mb, *shlex.split(args.server_flags)]
    proc, url = server.launch(argv, log=open(os.devnull, "w"))
    try:
        ready = vm(proc.pid, "VmRSS")
        answers = []
        threads = [threading.Thread(target=post, args=(url, body, args.token, answers))
                   for _ in range(n)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        peak, end = vm(proc.pid, "VmHWM"), vm(proc.pid, "VmRSS")
    finally:
        proc.terminate()
        proc.wait()
    return dict(concurrent=n, ready_mib=ready, peak_mib=peak, end_mib=end, grown_mib=peak - ready,
                wall_s=wall, statuses=sorted(s for s, _ in answers))


def parse_args(argv):
    p = processes.Parser(prog="python -m benchmarks.reward_memory", description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--reward", default="jpeg_incompressibility", help="the reward served (no weight files)")
    a("--size", type=flags.POS_INT, default=512, help="image side in pixels")
    a("--max-body-mb", type=flags.POS_FLOAT, default=64.0,
      help="the server's --max-body-mb; the bodies are just under it")
    a("--concurrent", default="1,2,4,8",
      help="numbers of concurrent requests, comma-separated (a fresh server each)")
    a("--server-flags", default="", help="more flags of the server, e.g. '--max-inflight-mb 320'")
    a("--server-threads", type=flags.NONNEG_INT, default=1,
      help="the server's torch threads (0: torch's default)")
    a("--json", default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    try:
        counts = [int(c) for c in args.concurrent.split(",")]
        assert all(c >= 1 for c in counts)
        args.concurrent = counts
    except (ValueError, AssertionError):
        raise ValueError(f"--concurrent {args.concurrent}: positive integers, comma-separated") \
            from None
    if not os.path.exists("/proc/self/status"):
        raise ValueError("this benchmark reads /proc/PID/status (Linux)")
    if args.json:
        checkpoints.check_writable(os.path.dirname(os.path.abspath(args.json)), "--json")
    args.token = auth.read(None, "")  # MARGRPO_REWARD_TOKEN, for the server and its clients alike
    return args


def main(argv=None):
    """Measure each N and print a markdown table. Returns the figures."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    body, count = largest_body(args.reward, int(args.max_body_mb * (1 << 20)), args.size)
    rows = [measure(args, n, body) for n in args.concurrent]
    server_flags = f" {args.server_flags}" if args.server_flags else ""
    print(f"\n{args.reward}: {count} images of {args.size} px a request, bodies of "
          f"{len(body) / 2**20:.1f} MiB (--max-body-mb {args.max_body_mb:g}{server_flags}); "
          f"torch {torch.__version__}, {os.cpu_count()} CPU cores\n")
    print("| concurrent | RSS serving MiB | peak RSS MiB | peak - serving MiB | per request MiB "
          "| statuses | wall s |\n|---|---|---|---|---|---|---|")
    for r in rows:
        statuses = ",".join(map(str, sorted(set(r["statuses"]))))
        print(f"| {r['concurrent']} | {r['ready_mib']:.0f} | {r['peak_mib']:.0f} "
              f"| {r['grown_mib']:.0f} | {r['grown_mib'] / r['concurrent']:.0f} | {statuses} "
              f"| {r['wall_s']:.1f} |")
    figures = dict(args={k: v for k, v in vars(args).items() if k != "token"}, body_bytes=len(body),
                   images=count, rows=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return figures


if __name__ == "__main__":
    sys.exit(processes.cli(main))
