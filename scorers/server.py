"""The reward server: the reward models loaded once, scoring the batches that every training and
evaluation process sends it (scorers/remote.py), over HTTP with FastAPI on uvicorn.

    python -m scorers.server --reward hpsv2,git_vqa,gdino --reward-ckpt hpsv2=HPS_v2.1_compressed.pt \\
        --reward-ckpt git_vqa=git-large-vqav2 --reward-ckpt gdino=grounding-dino-tiny --port 8100
    torchrun --nproc_per_node=8 train.py --preset nova_mix ... --reward-url http://127.0.0.1:8100

The wire format is scorers/wire.py's (NPY images and JSON, nothing that carries code). Each
request names the rewards to run; each reward scores the images exactly as in a training process
(rewards.Reward on the same uint8 pixels, moved to this server's device), so a served score equals
the in-process one. Bodies are read concurrently; one batch at a time is decoded, scored and
answered (a lock around the models).

Safe by default: it listens on 127.0.0.1; on any other address it refuses to start without a
shared token (MARGRPO_REWARD_TOKEN or --token-file, scorers/auth.py), which every request must
then send as `Authorization: Bearer TOKEN` (compared in constant time, on the request's head,
before its body is read). A body over --max-body-mb, a malformed or wrongly shaped request, a
missing or wrong token, or an unknown reward is a 4xx answer with a one-line reason (logged with
the peer's bytes escaped), and the server goes on serving. Idle, trickling and oversize peers are
bounded (scorers/limits.py): a request head within --header-timeout, a body within
--body-timeout, --max-connections open at once (room made by closing the idlest), and request
bodies held in memory within --max-inflight-mb, so that the peak memory is the models', one
batch's scoring and --max-inflight-mb (docs/reward_server.md, "Memory"). The token travels in
clear over plain HTTP: beyond one machine, use a private network or an SSH tunnel
(docs/reward_server.md).
"""

import argparse
import asyncio
import ipaddress
import logging
import os
import socket
import subprocess
import sys
import threading
import traceback

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from infra import processes
from scorers import auth, limits, registry, wire

TOKEN_ENV = wire.TOKEN_ENV
MIN_TOKEN = auth.MIN_TOKEN          # characters
READY = "reward server: serving"    # the start of the line printed once the models are loaded
one_line = wire.one_line


# -----------------------------------------------------------------------------
# The application

def declared_size(request, limit):
    """The bytes a request's body will hold, from its head: its Content-Length, `limit` for a
    chunked body (its size is known only once read), 0 without either. Refused(413) over `limit`."""
    declared = request.headers.get("content-length")
    if declared is None:
        return limit if "chunked" in request.headers.get("transfer-encoding", "").lower() else 0
    if not declared.isdigit() or int(declared) > limit:
        raise wire.Refused(413, f"body of {one_line(declared, 40)} bytes over the server's limit "
                                f"of {limit} (--max-body-mb)")
    return int(declared)


async def read_body(request, size, limit):
    """The request's body in one bytearray, each byte copied once from the connection: `size` bytes
    (declared_size) when it has a Content-Length, else gathered and refused (413) beyond `limit`.
    Whatever stops the read, the bytes read are let go then, not kept by its traceback."""
    if request.headers.get("content-length") is not None:
        body, filled = bytearray(size), 0
        try:
            async for chunk in request.stream():
                if filled + len(chunk) > size:
                    raise wire.Refused(400, "body longer than its Content-Length")
                body[filled:filled + len(chunk)] = chunk
                filled += len(chunk)
        except BaseException:
            body = None
            raise
        if filled != size:
            raise ClientDisconnect()
        return body
    chunks, total = [], 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise wire.Refused(413, f"body over the server's limit of {limit} bytes "
                                        "(--max-body-mb)")
            chunks.append(chunk)
    except BaseException:
        chunks = None
        raise
    body, filled = bytearray(total), 0
    for i, chunk in enumerate(chunks):  # each chunk let go once copied: the body is held once
        chunks[i] = None
        body[filled:filled + len(chunk)] = chunk
        filled += len(chunk)
    return body


def make_app(served, token=None, max_body=64 << 20, device="cpu", body_timeout=60.0,
             max_inflight=None):
    """The FastAPI application serving `served` ({name: rewards.Reward}) on `device`.

    token: the shared token every request must send (an auth.Secret, or a str checked as one; None:
    none asked); max_body: bytes a request's body may hold; body_timeout: seconds a body may take
    to arrive, and at most to wait for room first; max_inflight: bytes of bodies held at once
    (default 2 × max_body). Serve it with `config` for the limits on connections."""
    if isinstance(token, str):
        token = auth.check(token, "the token")
    app = FastAPI(title="MAR-GRPO reward server", docs_url=None, redoc_url=None, openapi_url=None)
    lock = threading.Lock()  # one batch at a time on the reward models, from its JSON to its answer
    budget = limits.ByteBudget(max_inflight or 2 * max_body)
    log = logging.getLogger("uvicorn.error")

    def refuse(request, e):
        client = f"{request.client.host}:{request.client.port}" if request.client else "?"
        said = f"refused {request.method} {request.url.path} from {client}: {e.status} {e}"
        log.warning(one_line(said, 500))
        headers = {401: {"WWW-Authenticate": "Bearer"}, 408: {"Connection": "close"}}.get(e.status)
        return JSONResponse({"error": str(e)}, status_code=e.status, headers=headers)

    def check_token(request):
        if token is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise wire.Refused(401, "missing token: send the header Authorization: Bearer TOKEN")
        if not token.matches(given.strip().encode("utf-8", "replace")):
            raise wire.Refused(401, "wrong token")

    def answer(body):
        """Decode, score and encode one request's body, one at a time: the JSON's objects and the
        rewards' float copies of the images exist for one batch at once. Returns a Response, or
        (status, reason): not raised, so that no traceback keeps the body's frames alive."""
        try:
            with lock:
                names, images, prompts, metadata = wire.decode_request(body, served)
                del body
                results = score_batch(names, images.to(device), prompts, metadata)
                return Response(wire.encode_answer(results), media_type="application/json")
        except wire.Refused as e:
            return e.status, str(e)

    def score_batch(names, images, prompts, metadata):
        """{name: (scores, info)} of the rewards `names` on a decoded batch; Refused(422 / 500)."""
        results = {}
        for name in names:
            try:
                results[name] = scores, _ = served[name](images, prompts, metadata)
            except ValueError as e:  # the reward refuses this input (a prompt or a record)
                raise wire.Refused(422, one_line(f"{name}: {str(e).strip()}")) from None
            except Exception as e:
                at = traceback.extract_tb(e.__traceback__)[-1]
                failed = f"{name} failed: {type(e).__name__}: {str(e).strip()}"
                log.error(one_line(f"{failed} (at {at.filename}:{at.lineno} in {at.name})", 1000))
                raise wire.Refused(500, one_line(failed)) from None
            bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
            if bad:
                raise wire.Refused(500, f"{name} gave a non-finite score ({float(scores[bad[0]])}) "
                                        f"to image {bad[0]}")
        return results

    @app.get("/info")
    def info(request: Request):
        try:
            check_token(request)
        except wire.Refused as e:
            return refuse(request, e)
        return {"protocol": wire.PROTOCOL, "rewards": list(served), "max_body_bytes": max_body}

    @app.post("/score")
    async def score(request: Request):
        taken = 0
        try:
            try:
                check_token(request)  # on the head: without the token, no room and no body read
                size = declared_size(request, max_body)
                if not await budget.take(size, body_timeout):
                    raise wire.Refused(503, f"busy: {budget.total / 2**20:g} MiB of requests in "
                                            "memory (--max-inflight-mb); try again")
                taken = size
                try:
                    body = await asyncio.wait_for(read_body(request, size, max_body), body_timeout)
                except asyncio.TimeoutError:
                    raise wire.Refused(408, f"the body did not arrive within {body_timeout:g} s "
                                            "(--body-timeout)") from None
                done = await run_in_threadpool(answer, body)
                del body
                return done if isinstance(done, Response) else refuse(request, wire.Refused(*done))
            except wire.Refused as e:
                return refuse(request, e)
            except ClientDisconnect:  # the client went away mid-body: nobody to answer
                return Response(status_code=400)
        finally:  # the room goes back once the body is gone, with any traceback that held it
            budget.give(taken)

    return app


def config(app, max_connections=64, header_timeout=10.0, log_level="info"):
    """The uvicorn.Config serving `app` with the limits on connections of scorers/limits.py:
    `max_connections` open at once, a whole request head within `header_timeout` seconds."""
    guard = limits.Guard(max_connections, header_timeout)
    return uvicorn.Config(app, http=limits.guarded_protocol(guard), log_level=log_level,
                          access_log=False, timeout_graceful_shutdown=5)


# -----------------------------------------------------------------------------
# The command line

def is_loopback(host):
    """True if every address `host` names is a loopback address (127.0.0.0/8, ::1)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except socket.gaierror as e:
        raise ValueError(f"--host {one_line(host)}: {e.strerror}") from None
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def parse_args(argv=None):
    p = processes.Parser(prog="python -m scorers.server", description=__doc__.split("\n\n")[0],
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--reward", required=True, help="the rewards to serve, names comma-separated (scorers/registry.py), e.g. hpsv2,git_vqa,gdino")
    a("--reward-ckpt", action="append", default=[], help="reward weights KEY=PATH (repeatable), as train.py's")
    a("--host", default="127.0.0.1", help="address to listen on (beyond loopback only with a token)")
    a("--port", type=bounded(int, 0, 65535), default=8100, help="port (0: a free one, printed)")
    a("--token-file", default=None, help=f"a file holding the shared token (default: the {TOKEN_ENV} variable)")
    a("--max-body-mb", type=bounded(float, 1e-3, 1 << 20), default=64.0,
      help="largest request body in MiB (64: ~85 images of 512 px)")
    a("--max-inflight-mb", type=bounded(float, 1e-3, 1 << 20), default=None,
      help="MiB of request bodies held at once (default: twice --max-body-mb); more wait for room "
           "(docs/reward_server.md, 'Memory')")
    a("--max-connections", type=bounded(int, 1, 1 << 16), default=64,
      help="connections open at once; one more closes the one longest without a request in "
           "progress, or is answered 503 (its client tries again) if all have one")
    a("--header-timeout", type=bounded(float, 1e-3, 1 << 20), default=10.0,
      help="seconds a connection has to send a whole request head, from its opening or its last "
           "answer")
    a("--body-timeout", type=bounded(float, 1e-3, 1 << 20), default=60.0,
      help="seconds a request's body has to arrive once read, and at most to wait for room first")
    a("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the reward models run")
    a("--threads", type=bounded(int, 0, 1 << 10), default=0, help="torch CPU threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.max_inflight_mb is not None and args.max_inflight_mb < args.max_body_mb:
        raise ValueError(f"--max-inflight-mb {args.max_inflight_mb:g}: under --max-body-mb "
                         f"{args.max_body_mb:g}, a request of the largest size could never be read")
    if ":" in args.reward:
        raise ValueError(f"--reward {one_line(args.reward)}: the server serves rewards by name; "
                         "the weights are the client's (train.py --reward name:weight)")
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
    names = [name for name, _ in registry.parse_spec(args.reward)]
    weights = registry.parse_reward_ckpt(args.reward_ckpt, args.reward)
    token = auth.read(args.token_file, "--token-file")
    if not is_loopback(args.host) and token is None:  # also checks that --host resolves
        raise ValueError(f"--host {one_line(args.host)}: beyond loopback the server needs a shared "
                         f"token ({TOKEN_ENV} or --token-file); every client then sends it")
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
        raise ValueError(f"--port {args.port}: cannot listen on {one_line(args.host)}:{args.port} "
                         f"({e.strerror})") from None
    reward = registry.build_reward(",".join(names), device=device, weights=weights)
    served = {name: fn for name, _, fn in reward.components}
    max_body = int(args.max_body_mb * (1 << 20))
    max_inflight = int(args.max_inflight_mb * (1 << 20)) if args.max_inflight_mb else 2 * max_body
    app = make_app(served, token, max_body, device, args.body_timeout, max_inflight)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"{READY} {', '.join(served)} on http://{host}:{sock.getsockname()[1]} ({device}; "
          f"{'token required' if token else 'no token, loopback only'}); Ctrl-C stops it", flush=True)
    uvicorn.Server(config(app, args.max_connections, args.header_timeout)).run(sockets=[sock])


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
