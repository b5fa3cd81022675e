"""Processes, devices and seeded randomness of a run: one place that knows about ranks (DDP under
torchrun, NCCL on CUDA, gloo on CPU), the device, autocast, how every random draw is seeded, and
how a run ends (`cli`: one line per failure; `Parser`: bad flags as one line; `StopRequests`:
SIGINT / SIGTERM stop at a step boundary).

The single-process path is the distributed path: `Ctx` reads RANK from the environment as nanoGPT
does; rank 0 alone prints and writes; scalars are all-reduced before they are logged.
"""

import argparse
import contextlib
import datetime
import os
import re
import signal
import sys
import threading
import traceback

import numpy as np
import torch
import torch.distributed as dist


# The seed stages: every seeded draw of the project is seeded by (--seed, its stage, ...), so no two
# kinds of draw share a random stream. numpy streams: np.random.default_rng([seed, stage, ...]).
SEED_STAGES = dict(
    pretrain_data=1,   # demo/pretrain.py: the rendered images of a step (numpy), per rank
    pretrain=2,        # demo/pretrain.py: the MAE masks and the diffusion loss's noise
    train_steps=3,     # train.py: which AR and diffusion steps a rollout records
    rollout=4,         # train.py: the rollouts' generation orders and head noise
    mte=5,             # train.py: MTE's S head trajectories
    evaluation=6,      # evaluate.py: every evaluation image, per batch
    prompts=7,         # models/prompts.py: a step's prompts (numpy)
    eval_prompts=8,    # models/prompts.py: the evaluated shapes prompts of a split (numpy)
)


def seeded(device, *parts):
    """A torch.Generator on `device`, seeded by a tuple of ints (seed, stage, step, rank). The one
    way this script makes seeded randomness: the generator lives where the draws happen (a CUDA
    draw needs a CUDA generator), so CPU and GPU runs are each reproducible but not equal."""
    gen = torch.Generator(device=device)
    return gen.manual_seed(int(np.random.SeedSequence(list(parts)).generate_state(1)[0]))


# How long a collective waits for the slowest rank before the run fails. The longest work one rank
# does while the others wait is rank 0 writing a checkpoint: the trained parameters and their AdamW
# state, 12 bytes a parameter (Harmon-1.5B trains 0.79 B: ~9.5 GB; NOVA-d48w1024 0.61 B: ~7.3 GB), a
# minute on a local disk and up to a quarter of an hour on a network filesystem at 10 MB/s; NCCL's
# own default is 10 minutes.
TIMEOUT = datetime.timedelta(minutes=60)


PRECISIONS = ("bf16", "fp32")  # what --precision takes (infra/flags.py; demo/pretrain.py)


def autocast(precision, device):
    """The forward passes' context of a run in `precision` on `device` (a torch.device), as a
    factory to call for each forward pass: bf16 is torch.autocast to bfloat16 (matmuls,
    convolutions and attention in bf16; the weights, their gradients, AdamW's state and the
    backward pass stay fp32, and the diffusion head runs in fp32 under it: diffloss.py,
    models/nova_heads.py), fp32 is no autocast. The same on every device."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision}: choose from {', '.join(PRECISIONS)}")
    if precision == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def use_tf32(precision):
    """CUDA's fp32 matmuls and convolutions (the head's, the losses') in TF32, 10 mantissa bits, for
    a bf16 run, whose transformer computes in 8; in true fp32 for an fp32 run, the reference a bf16
    run's NaNs or recorded-versus-recomputed gaps are checked against. Process-wide settings."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision == "bf16"


class Ctx:
    """Process-wide facts: rank, world size, device, the forward passes' precision (`autocast`),
    whether this is the master process."""

    def __init__(self, args):
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available (use --device cpu or auto)")
        self.ddp = int(os.environ.get("RANK", -1)) != -1
        want_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        if self.ddp:
            dist.init_process_group(backend="nccl" if want_cuda else "gloo", timeout=TIMEOUT)
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world = 0, 1
        self.device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if want_cuda else "cpu")
        # --precision (default: bf16 on CUDA, fp32 on the CPU), written back so that what records
        # the flags (config.json, a checkpoint's args) records the precision the run computed in
        self.precision = getattr(args, "precision", None) or ("bf16" if want_cuda else "fp32")
        if hasattr(args, "precision"):
            args.precision = self.precision
        if want_cuda:
            torch.cuda.set_device(self.device)
            use_tf32(self.precision)
        if args.threads:
            torch.set_num_threads(args.threads)
        self.master = self.rank == 0
        self.seed = args.seed
        # the forward passes' context (backward runs outside it, as PyTorch advises)
        self.autocast = autocast(self.precision, self.device)

    def generator(self, *parts, shard=None):
        """The generator of (stage, step, ...) on the run's device, for this rank's data, or for
        `shard`, one of the world × micro-batches slices of a step's batch (train.py, --grad-accum):
        shard r·A + m on rank r is what rank r·A + m of a world of world·A processes draws, so
        gradient accumulation reproduces more processes exactly."""
        return seeded(self.device, self.seed, *parts, self.rank if shard is None else shard)

    def print0(self, *a, **k):
        if self.master:
            print(*a, **k, flush=True)

    def mean(self, values):
        """All-reduce a dict of floats or 0-dim tensors to their mean over ranks (every rank calls it)."""
        return self.reduce(values, dist.ReduceOp.SUM, 1 / self.world)

    def max(self, values):
        """All-reduce a dict of floats or 0-dim tensors to their maximum over ranks (every rank calls it)."""
        return self.reduce(values, dist.ReduceOp.MAX)

    def reduce(self, values, op, scale=1.0):
        keys = sorted(values)
        t = torch.stack([torch.as_tensor(values[k], dtype=torch.float64, device=self.device).reshape(()) for k in keys])
        if self.ddp:
            dist.all_reduce(t, op=op)
        return dict(zip(keys, (t * scale).tolist()))  # .tolist() syncs with the GPU

    def barrier(self):
        if self.ddp:
            dist.barrier(device_ids=[self.device.index] if self.device.type == "cuda" else None)


def all_finite(ctx, *values):
    """True on every rank iff every value (tensors, floats, lists of them) is finite on every rank.
    Every rank must call it: one all-reduce, one sync with the GPU."""
    flat = [v for value in values for v in (value if isinstance(value, (list, tuple)) else [value])]
    ok = torch.stack([torch.isfinite(torch.as_tensor(v, dtype=torch.float32, device=ctx.device)).all() for v in flat])
    ok = ok.all().float()
    if ctx.ddp:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok)  # syncs with the GPU


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is a one-line ValueError (reported by `cli`), not the usage block."""

    def error(self, message):
        # "argument --lr: 'nan' must be ..." -> "--lr nan: must be ..."
        raise ValueError(re.sub(r"^argument (--[\w-]+): '([^']*)' ", r"\1 \2: ", message))


class Interrupted(RuntimeError):
    """The run was asked to stop (SIGINT, SIGTERM) and did at a step boundary; `cli` prints the
    message as one line and exits with 128 + the signal's number, as a shell reports a signal."""

    def __init__(self, message, signum):
        super().__init__(message)
        self.signum = signum


class StopRequests:
    """SIGINT and SIGTERM ask a training loop to stop at its next step boundary (`requested`); a
    second signal stops at once (KeyboardInterrupt). A context manager; only the main thread can
    install handlers, elsewhere it does nothing."""

    def __init__(self, print0):
        self.signum, self.print0, self.old = None, print0, {}

    def handle(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        self.print0(f"{signal.Signals(signum).name}: stopping after this step (send it again to stop at once)",
                    file=sys.stderr)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.old = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, handler in self.old.items():
            signal.signal(s, handler)

    @property
    def requested(self):
        return float(self.signum or 0)  # 0, or the signal's number (reduced over ranks with Ctx.max)


class Stop(RuntimeError):
    """The run stops on purpose (repeated non-finite steps, a failing reward): `cli` prints the
    reason as one line, after the traceback of the code that caused it, and exits with status 1.
    An exception class of a file that cannot import this one (rewards.RewardFailed) says the same
    with a class attribute `stops_the_run = True`."""

    stops_the_run = True


def cli(entry, argv=None):
    """Run `entry(argv)` (train.main, the table's main) with failures said in one line on stderr
    (`error: ...`, or `error (rank N): ...` from rank N > 0 under torchrun). Bad flags and files: no
    traceback, exit status 2. A deliberate stop (an exception whose class sets `stops_the_run`: Stop,
    rewards.RewardFailed for a reward that failed) or a failed write (OSError): exit status 1.
    SIGINT / SIGTERM: 128 + the signal's number. Anything else is a bug and keeps Python's
    traceback. Returns the exit status."""
    where = f" (rank {os.environ['RANK']})" if int(os.environ.get("RANK", 0)) > 0 else ""
    try:
        entry(argv)
        return 0
    except (ValueError, FileNotFoundError, PermissionError) as e:
        print(f"error{where}: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"error{where}: {e}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print(f"error{where}: interrupted at once (a second signal, or one before training started): "
              "checkpoints written so far are intact", file=sys.stderr)
        return 128 + signal.SIGINT
    except OSError as e:  # a write failed: disk full, a folder gone (checkpoints.writing names the file)
        print(f"error{where}: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        if not getattr(e, "stops_the_run", False):
            raise  # a bug: Python's traceback
        if e.__cause__ is not None:  # e.g. the reward's own traceback: where it failed
            traceback.print_exception(e.__cause__)
        print(f"error{where}: {e}", file=sys.stderr)
        return 1
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
