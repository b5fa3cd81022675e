"""The reward server: the reward models loaded once, scoring the batches that every training and
evaluation process sends it (scorers/remote.py), over HTTP with FastAPI on uvicorn.

    python -m scorers.server --reward hpsv2,git_vqa,gdino --reward-ckpt hpsv2=HPS_v2.1_compressed.pt \\
        --reward-ckpt git_vqa=git-large-vqav2 --reward-ckpt gdino=grounding-dino-tiny --port 8100
    torchrun --nproc_per_node=8 train.py --preset nova_mix ... --reward-url http://127.0.0.1:8100

The wire format is scorers/wire.py's (NPY images and JSON, nothing that carries code). Each
request names the rewards to run; each reward scores the images exactly as in a training process
(rewards.Reward on the same uint8 pixels, moved to this server's device), so a served score equals
the in-process one. One batch is scored at a time (a lock around the models); requests are read
and checked concurrently.

Safe by default: it listens on 127.0.0.1; on any other address it refuses to start without a
shared token (MARGRPO_REWARD_TOKEN or --token-file, 16 or more printable ASCII characters), which
every request must then send as `Authorization: Bearer TOKEN` (compared in constant time). A body
over --max-body-mb, a malformed or wrongly shaped request, a missing or wrong token, or an unknown
reward is a 4xx answer with a one-line reason, and the server goes on serving. The token travels
in clear over plain HTTP: beyond one machine, use a private network or an SSH tunnel
(docs/reward_server.md).
"""

import argparse
import hmac
import ipaddress
import logging
import os
import socket
import subprocess
import sys
import threading

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

import rewards
from infra import processes
from scorers import wire

TOKEN_ENV = wire.TOKEN_ENV
MIN_TOKEN = 16                      # characters
READY = "reward server: serving"    # the start of the line printed once the models are loaded


# -----------------------------------------------------------------------------
# The application

async def read_body(request, limit):
    """The request's body, refused (413) as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise wire.Refused(413, f"body of {declared} bytes over the server's limit of {limit} (--max-body-mb)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise wire.Refused(413, f"body over the server's limit of {limit} bytes (--max-body-mb)")
        chunks.append(chunk)
    return b"".join(chunks)


def make_app(served, token=None, max_body=64 << 20, device="cpu"):
    """The FastAPI application serving `served` ({name: rewards.Reward}) on `device`; `token`: the
    shared token every request must send (None: none asked); `max_body`: bytes a request may hold."""
    app = FastAPI(title="MAR-GRPO reward server", docs_url=None, redoc_url=None, openapi_url=None)
    lock = threading.Lock()  # one batch at a time on the reward models
    log = logging.getLogger("uvicorn.error")

    def refuse(request, e):
        client = f"{request.client.host}:{request.client.port}" if request.client else "?"
        log.warning(f"refused {request.method} {request.url.path} from {client}: {e.status} {e}")
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse({"error": str(e)}, status_code=e.status, headers=headers)

    def check_token(request):
        if token is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise wire.Refused(401, "missing token: send the header Authorization: Bearer TOKEN")
        if not hmac.compare_digest(given.strip().encode("utf-8", "replace"), token.encode()):
            raise wire.Refused(401, "wrong token")

    def answer(body):
        names, images, prompts, metadata = wire.decode_request(body, served)
        images = images.to(device)
        results = {}
        with lock:
            for name in names:
                try:
                    results[name] = served[name](images, prompts, metadata)
                except ValueError as e:  # the reward refuses this input (a prompt or record it cannot read)
                    raise wire.Refused(422, f"{name}: {first_line(e)}") from None
                except Exception as e:
                    log.exception(f"{name} failed")
                    raise wire.Refused(500, f"{name} failed: {type(e).__name__}: {first_line(e)}") from None
        return Response(wire.encode_answer(results), media_type="application/json")

    @app.get("/info")
    def info(request: Request):
        try:
            check_token(request)
        except wire.Refused as e:
            return refuse(request, e)
        return {"protocol": wire.PROTOCOL, "rewards": list(served), "max_body_bytes": max_body}

    @app.post("/score")
    async def score(request: Request):
        try:
            check_token(request)  # before the body is read
            body = await read_body(request, max_body)
            return await run_in_threadpool(answer, body)
        except wire.Refused as e:
            return refuse(request, e)
        except ClientDisconnect:  # the client went away mid-body: nobody to answer
            return Response(status_code=400)

    return app


def first_line(e):
    return (str(e).strip().splitlines() or [""])[0]


# -----------------------------------------------------------------------------
# The command line

def is_loopback(host):
    """True if every address `host` names is a loopback address (127.0.0.0/8, ::1)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: {e.strerror}") from None
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def read_token(args):
    """The shared token from --token-file or MARGRPO_REWARD_TOKEN (None if neither), checked."""
    if args.token_file is not None:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise FileNotFoundError(f"--token-file {args.token_file}: cannot read it ({getattr(e, 'strerror', e)})") from None
        where = f"--token-file {args.token_file}"
    else:
        token, where = os.environ.get(TOKEN_ENV, "").strip(), TOKEN_ENV
    if not token:
        return None
    if len(token) < MIN_TOKEN or not all(33 <= ord(c) < 127 for c in token):
        raise ValueError(f"{where}: the token must be {MIN_TOKEN} or more printable ASCII characters without spaces "
                         "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return token


def parse_args(argv=None):
    p = processes.Parser(prog="python -m scorers.server", description=__doc__.split("\n\n")[0],
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--reward", required=True, help="the rewards to serve, names comma-separated (rewards.py), e.g. hpsv2,git_vqa,gdino")
    a("--reward-ckpt", action="append", default=[], help="reward weights KEY=PATH (repeatable), as train.py's")
    a("--host", default="127.0.0.1", help="address to listen on (beyond loopback only with a token)")
    a("--port", type=bounded(int, 0, 65535), default=8100, help="port (0: a free one, printed)")
    a("--token-file", default=None, help=f"a file holding the shared token (default: the {TOKEN_ENV} variable)")
    a("--max-body-mb", type=bounded(float, 1e-3, 1 << 20), default=64.0,
      help="largest request body in MiB (64: ~85 images of 512 px)")
    a("--max-connections", type=bounded(int, 1, 1 << 16), default=64,
      help="requests in flight at once; more are answered 503 and the clients retry")
    a("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the reward models run")
    a("--threads", type=bounded(int, 0, 1 << 10), default=0, help="torch CPU threads (0: torch's default)")
    args = p.parse_args(argv)
    if ":" in args.reward:
        raise ValueError(f"--reward {args.reward}: the server serves rewards by name; the weights are the client's "
                         "(train.py --reward name:weight)")
    return args


def bounded(kind, low, high):
    """An argparse type: an int or float in [low, high]."""
    def parse(text):
        value = kind(text)
        if not low <= value <= high:  # also false for NaN
            raise argparse.ArgumentTypeError(f"{text!r} must be a number in [{low:g}, {high:g}]")
        return value
    parse.__name__ = kind.__name__
    return parse


def main(argv=None):
    """Check the flags, bind the port, load the rewards, then serve until SIGINT / SIGTERM."""
    args = parse_args(argv)
    names = [name for name, _ in rewards.parse_reward_spec(args.reward)]
    weights = rewards.parse_reward_ckpt(args.reward_ckpt, args.reward)
    token = read_token(args)
    if token is None and not is_loopback(args.host):
        raise ValueError(f"--host {args.host}: beyond loopback the server needs a shared token "
                         f"({TOKEN_ENV} or --token-file); every client then sends it")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    family = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:  # the port is taken before the models load; clients that come meanwhile wait in the backlog
        sock.bind((args.host, args.port))
        sock.listen(2048)
    except OSError as e:
        raise ValueError(f"--port {args.port}: cannot listen on {args.host}:{args.port} ({e.strerror})") from None
    reward = rewards.build_reward(",".join(names), device=device, weights=weights)
    served = {name: fn for name, _, fn in reward.components}
    app = make_app(served, token, int(args.max_body_mb * (1 << 20)), device)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"{READY} {', '.join(served)} on http://{host}:{sock.getsockname()[1]} ({device}; "
          f"{'token required' if token else 'no token, loopback only'}); Ctrl-C stops it", flush=True)
    config = uvicorn.Config(app, log_level="info", access_log=False, limit_concurrency=args.max_connections,
                            timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])


def launch(argv, env=None, log=None):
    """`python -m scorers.server ARGV` in a new process, returned once it has printed that it serves
    (its models loaded, its port bound). Returns (Popen, url). log: a file for the server's stderr
    (default: this process's). A server that exits first raises RuntimeError."""
    proc = subprocess.Popen([sys.executable, "-m", "scorers.server", *map(str, argv)], stdout=subprocess.PIPE,
                            stderr=log, text=True, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for line in proc.stdout:
        if line.startswith(READY):
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its later output flowing
            return proc, line.split(" on ", 1)[1].split()[0]
    raise RuntimeError(f"the reward server did not start (exit status {proc.wait()}): python -m scorers.server {' '.join(map(str, argv))}")


if __name__ == "__main__":
    sys.exit(processes.cli(main))
