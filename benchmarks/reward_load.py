"""The reward server under load, and the reward time of a GRPO step in process against served.

    python -m benchmarks.reward_load                    # shapes at the demo's size: 16 px, G = 6, 48 images a step
    python -m benchmarks.reward_load --reward jpeg_incompressibility --size 256 --images 4 --step-images 32

Starts `python -m scorers.server --reward R` on a free loopback port (its own process), or with
`--url URL` measures a server already running there (its token from MARGRPO_REWARD_TOKEN), then
1. load: for each N of --clients, N clients (threads of this process, each its own
   scorers.remote.RemoteReward) send --requests batches of --images images each, all at once;
   throughput (images/s, requests/s over the wall time of all requests) and the latency of one
   request (p50, p99: from sending the batch to its scores, the client's encoding included);
2. step: the reward time of one GRPO step's batch (--step-images images; the demo's 8 prompts ×
   G = 6), the same batch scored by the reward in this process and by the server, interleaved,
   median over --repeats after a warm-up.
Images are shapes-world renders with noise (any reward can score them; shapes rewards read their
prompts). Client and server share this machine's cores: the figures are the loopback transport's
cost plus the reward's own, not a network's.
"""

import argparse
import json
import os
import statistics
import sys
import threading
import time

import numpy as np
import torch

from demo import shapes
from infra import checkpoints, flags, processes
from scorers import auth, registry, remote, server


def batch(n, size, seed):
    """n shapes renders (n, 3, size, size) in [0, 1], with their prompts and metas."""
    rng = np.random.default_rng(seed)
    metas = shapes.sample_prompts(n, rng)
    pixels = np.stack([shapes.render(m, size=size, rng=rng) for m in metas])                   # (n, H, W, 3)
    images = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255
    images = (images + 0.02 * torch.randn(images.shape, generator=torch.Generator().manual_seed(seed))).clamp(0, 1)
    return images, [m["prompt"] for m in metas], metas


def client(url):
    """The `server` settings of registry.build_reward for `url`, the token from MARGRPO_REWARD_TOKEN
    (scorers/auth.py: checked, never printed)."""
    return dict(url=url, token=auth.read(None, "--token-file"))


def percentile(values, q):
    return float(np.percentile(np.asarray(values), q))


def load(url, reward, clients, requests, images, size):
    """`clients` threads × `requests` calls of a batch of `images` images of `size` px. Returns the figures (dict)."""
    fns = [registry.build_reward(reward, server=client(url)) for _ in range(clients)]
    batches = [batch(images, size, seed) for seed in range(clients)]
    latencies, start = [[] for _ in range(clients)], threading.Barrier(clients + 1)

    def run(k):
        fns[k](*batches[k])  # a warm-up call, untimed
        start.wait()
        for _ in range(requests):
            t = time.perf_counter()
            fns[k](*batches[k])
            latencies[k].append(time.perf_counter() - t)
    threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    every = [x for per in latencies for x in per]
    return dict(clients=clients, requests=requests, images=images, wall_s=wall, requests_per_s=len(every) / wall,
                images_per_s=len(every) * images / wall, p50_ms=1e3 * percentile(every, 50), p99_ms=1e3 * percentile(every, 99))


def step(url, reward, n, size, repeats):
    """Median seconds to score one step's n images of `size` px, in process and served."""
    images, prompts, metas = batch(n, size, 100)
    fns = {"in process": registry.build_reward(reward), "served": registry.build_reward(reward, server=client(url))}
    times = {k: [] for k in fns}
    for _ in range(1 + repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn(images, prompts, metas)
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v[1:]) for k, v in times.items()}


def parse_args(argv):
    p = processes.Parser(prog="python -m benchmarks.reward_load", description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--url", default=None, help="measure the reward server at this URL (default: start one on a free loopback port)")
    a("--reward", default="shapes", help="the reward served (one name; no weight files: shapes, jpeg_*)")
    a("--clients", default="1,2,4,8", help="numbers of concurrent clients, comma-separated")
    a("--requests", type=flags.POS_INT, default=40, help="requests per client")
    a("--images", type=flags.POS_INT, default=6, help="images per request (G)")
    a("--size", type=flags.POS_INT, default=16, help="image side in pixels")
    a("--step-images", type=flags.POS_INT, default=48, help="images of one GRPO step (the demo: 8 prompts × 6)")
    a("--repeats", type=flags.POS_INT, default=50, help="timed repeats of the step figure")
    a("--threads", type=flags.NONNEG_INT, default=1, help="torch threads of this process, the clients' and the in-process "
      "reward's (0: torch's default; on a shared machine, more than 1 makes small tensor operations wait for busy cores)")
    a("--server-threads", type=flags.NONNEG_INT, default=1, help="the server's torch threads (0: torch's default)")
    a("--json", default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    try:
        args.clients = [int(c) for c in args.clients.split(",")]
        assert all(c >= 1 for c in args.clients)
    except (ValueError, AssertionError):
        raise ValueError(f"--clients {args.clients}: positive integers, comma-separated") from None
    if ":" in args.reward or "," in args.reward:
        raise ValueError(f"--reward {args.reward}: one reward name")
    if args.url is not None:
        remote.parse_url(args.url)
    registry.build_reward(args.reward)  # an unknown name, or one that needs weight files, fails now
    if args.json:
        checkpoints.check_writable(os.path.dirname(os.path.abspath(args.json)), "--json")
    return args


def main(argv=None):
    """Run both figures and print them as markdown tables. Returns the figures."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    proc, url = (None, args.url) if args.url else server.launch(["--reward", args.reward, "--port", "0",
                                                                  "--threads", args.server_threads])
    try:
        rows = [load(url, args.reward, n, args.requests, args.images, args.size) for n in args.clients]
        per_step = step(url, args.reward, args.step_images, args.size, args.repeats)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    print(f"\n{args.reward}, {args.size}×{args.size} px, {args.images} images a request, {args.requests} requests a client; "
          f"torch {torch.__version__}, {os.cpu_count()} CPU cores, "
          f"{args.threads or 'default'} / {args.server_threads or 'default'} torch threads in the clients / the server\n")
    print("| clients | images/s | requests/s | p50 ms | p99 ms |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['images_per_s']:.0f} | {r['requests_per_s']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} |")
    print(f"\nreward time of a step's {args.step_images} images (median of {args.repeats}): "
          + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in per_step.items()))
    figures = dict(args=vars(args), load=rows, step_seconds=per_step)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return figures


if __name__ == "__main__":
    sys.exit(processes.cli(main))
