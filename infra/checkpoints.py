"""Checkpoint files: reading them safely, checking a state dict against a model in one line, and
writing them so that a crash never leaves a half-written one (docs/faults.md).

Every model file (models/), the rewards and train.py read and check
weights through these functions, so a missing, truncated or mismatched file always fails the same
way: one line naming the flag and the file, before anything is written.

A training checkpoint is a plain dict (`torch.load(weights_only=True)` reads it): the trained
parameters (frozen ones stay in the base), the absolute path of the base they were trained from
("base"), the policy's config, the optimizer state, the step, the flags, and the count of skipped
steps. loading.load_policy reads it as a model (base, then the trained parameters).
"""

import argparse
import contextlib
import hashlib
import json
import os
import pickle
import shutil
import socket
import sys
import warnings
import zipfile

import torch
from safetensors.torch import load_file

from infra import fsdp


def read_checkpoint(path, flag="--init", mmap=False):
    """torch.load(weights_only=True) on the CPU, with `argparse.Namespace` allowed (official MAR
    files pickle their args); a missing, cut short or foreign file raises a one-line error naming
    `flag` and path and saying why (`unreadable`)."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: a folder, not a checkpoint file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag}: no such file: {path}")
    try:
        with torch.serialization.safe_globals([argparse.Namespace]), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns of pickle protocols before it refuses a file
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # cut short, or not a torch file
        raise ValueError(f"{flag} {path}: cannot read checkpoint: {unreadable(path, e)}") from None


def unreadable(path, error):
    """Why torch.load could not read `path`, whole and in this project's words (torch's own
    messages run to paragraphs)."""
    with open(path, "rb") as f:
        head = f.read(4)
    if not head:
        return "the file is empty"
    if head == b"PK\x03\x04" and not zipfile.is_zipfile(path):
        return "a zip archive (as torch.save writes) cut short: a copy or a write that stopped part-way"
    if isinstance(error, pickle.UnpicklingError) and (zipfile.is_zipfile(path) or head[:1] == b"\x80"):
        return ("it holds Python objects besides tensors and plain containers (a module, a class instance), "
                "which a safe load refuses: save the model's state_dict() instead")
    if isinstance(error, (pickle.UnpicklingError, KeyError, EOFError, UnicodeDecodeError)):
        return "not a PyTorch checkpoint (neither a torch.save zip archive nor a pickle of tensors)"
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def read_state_dict(path, flag=None, unwrap=("state_dict",), where=None):
    """The tensors of a weights file or folder, on the CPU: a folder of `.safetensors` files (a
    sharded Hugging Face checkpoint), a safetensors file, a TorchScript archive (OpenAI CLIP), or a
    torch file read as `read_checkpoint` does (memory-mapped when it is a zip archive, as torch.save
    writes since 1.6), whose dict may wrap the state dict under a key of
    `unwrap`; a DDP `module.` prefix is stripped, non-tensor entries dropped. A missing or unreadable
    file is one line naming `where` (default: `flag` and the path, or the path alone)."""
    where = where or (f"{flag} {path}" if flag else str(path))
    path = str(path)
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"{where}: folder holds no .safetensors files")
    elif not os.path.isfile(path):
        raise FileNotFoundError(f"{flag}: no such file: {path}" if flag else f"no such file: {path}")
    else:
        files = [path]
    sd = {}
    for file in files:
        try:
            if file.endswith(".safetensors") or _is_safetensors(file):
                obj = load_file(file, device="cpu")
            elif _is_torchscript(file):
                with warnings.catch_warnings():  # torch.jit.load is deprecated, still the OpenAI format
                    warnings.simplefilter("ignore")
                    obj = torch.jit.load(file, map_location="cpu").state_dict()
            else:
                with torch.serialization.safe_globals([argparse.Namespace]):  # mapped, not read: loading a
                    # model's weights into it then needs their bytes once, not twice (the file's pages are cache)
                    obj = torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
        except Exception as e:  # cut short, or not a weights file
            member = "" if file == path else f" (its file {os.path.basename(file)})"
            raise ValueError(f"{where}: cannot read weights{member}: {unreadable(file, e)}") from None
        for key in unwrap:
            if isinstance(obj, dict) and isinstance(obj.get(key), dict):
                obj = obj[key]
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: not a state dict ({type(obj).__name__})")
        sd.update({k: v for k, v in obj.items() if torch.is_tensor(v)})
    if not sd:
        raise ValueError(f"{where}: not a state dict (no tensors)")
    if all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return sd


def _is_safetensors(path):
    """A safetensors file starts with an 8-byte little-endian header length, then a JSON '{'."""
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < os.path.getsize(path)


def _is_torchscript(path):
    """A TorchScript archive is a zip holding a 'constants.pkl' (a torch.save zip holds none)."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as z:
        return any(name.endswith("constants.pkl") for name in z.namelist())


def state_dict_mismatch(own, sd, ignore=(), display=str):
    """One line naming how state dict `sd` differs from `own` (a state dict or {key: shape}):
    "missing k1, k2, k3 (+N more); unexpected …; wrong shape (file vs model) k (a, b) vs (c, d)",
    or "" when they fit. ignore: key prefixes that may be missing; display: key -> shown name."""
    shape = lambda v: tuple(v.shape) if hasattr(v, "shape") else tuple(v)
    missing = [display(k) for k in own if k not in sd and not any(k.startswith(p) for p in ignore)]
    unexpected = [display(k) for k in sd if k not in own]
    wrong = [f"{display(k)} {shape(sd[k])} vs {shape(own[k])}" for k in own if k in sd and shape(sd[k]) != shape(own[k])]
    return "; ".join(f"{label} {', '.join(items[:3])}" + (f" (+{len(items) - 3} more)" if len(items) > 3 else "")
                     for label, items in (("missing", missing), ("unexpected", unexpected),
                                          ("wrong shape (file vs model)", wrong)) if items)


def model_state(ckpt, path, flag="--init", ema=True):
    """The state dict of a MAR checkpoint's contents: 'model_ema' where `ema` and the file has it
    (the official default), else 'model'; a one-line ValueError naming `flag` for anything else."""
    if not isinstance(ckpt, dict) or not ("model" in ckpt or "model_ema" in ckpt):
        raise ValueError(f"{flag} {path}: not a MAR checkpoint (expected a dict with 'model' or 'model_ema')")
    return ckpt["model_ema"] if ema and "model_ema" in ckpt else ckpt.get("model", ckpt.get("model_ema"))


def load_weights(model, sd, path, flag="--init"):
    """`sd` loaded into `model`, strictly, after `check_state_dict`. Returns the model."""
    check_state_dict(model, sd, path, flag)
    model.load_state_dict(sd, strict=True)
    return model


def check_state_dict(model, sd, path, flag="--init", ignore=()):
    """Raise a one-line ValueError naming `flag`, `path` and the first keys where `sd` does not fit
    `model` (missing, unexpected, wrong shape). `ignore`: key prefixes that may be missing."""
    problems = state_dict_mismatch(model.state_dict(), sd, ignore)
    if problems:
        raise ValueError(f"{flag} {path}: checkpoint does not fit the model: {problems}")


@contextlib.contextmanager
def writing(path):
    """Writes to `path` inside this block that fail (disk full, a folder removed, torch's zip writer)
    raise one OSError naming the file: `cannot write PATH: reason` (processes.cli prints it)."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise OSError(f"cannot write {path}: {reason}") from None


def atomic_save(obj, path):
    """torch.save to a temporary file in the same folder, then rename: never a half-written file.
    A write killed by SIGKILL leaves only the temporary file, which `prune_checkpoints` removes; a
    failed write (disk full) removes it and raises one OSError naming `path`."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with writing(path):
            torch.save(obj, tmp)
            os.replace(tmp, path)
    except BaseException:  # an error or Ctrl-C mid-write: leave no temporary file behind
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


class RunLock:
    """One writer per run folder: `acquire` creates `<out>/.lock` holding this process's id and host,
    or refuses in one line when a live process holds it (a lock left by a killed process, whose id no
    longer runs on this host, is taken over). `release` removes it if it is ours."""

    def __init__(self, out):
        self.path = os.path.join(out, ".lock")
        self.mine = f"{os.getpid()} {socket.gethostname()}"
        self.held = self.made_folder = False

    def holder(self):
        """(pid, host) of the lock's holder if it is alive (or on another host), else None."""
        try:
            with open(self.path) as f:
                pid, host = f.read().split()
            pid = int(pid)
        except (OSError, ValueError):  # gone meanwhile, or half-written by a killed process
            return None
        if host != socket.gethostname():
            return pid, host  # cannot tell: assume it runs
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # alive, another user's
            pass
        return pid, host

    def acquire(self, flag="--out"):
        self.made_folder = not os.path.isdir(os.path.dirname(self.path))
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                held = self.holder()
                if held is not None:
                    raise ValueError(f"{flag} {os.path.dirname(self.path)}: another run (process {held[0]} on {held[1]}) "
                                     "is writing this folder; wait for it, stop it, or choose another --out") from None
                with contextlib.suppress(FileNotFoundError):  # a killed run's lock
                    os.remove(self.path)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(self.mine + "\n")
            self.held = True
            return self
        raise ValueError(f"{flag} {os.path.dirname(self.path)}: cannot take {self.path} (another run keeps taking it)")

    def release(self):
        """Remove the lock if it is ours, and the folder too if acquire made it and nothing was written."""
        if self.held:
            with contextlib.suppress(OSError), open(self.path) as f:
                if f.read().strip() == self.mine:
                    os.remove(self.path)
            if self.made_folder:
                with contextlib.suppress(OSError):  # not empty: the run wrote
                    os.rmdir(os.path.dirname(self.path))
            self.held = False


def take_run_folder(out, ctx):
    """Rank 0 locks `out` for this run (RunLock); every rank learns whether it could, so a refused
    run stops on every rank. Returns the lock (release it when the run ends)."""
    lock, refused = RunLock(out), None
    if ctx.master:
        try:
            lock.acquire()
        except ValueError as e:
            refused = e
    if ctx.max({"refused": float(refused is not None)})["refused"]:
        raise refused or ValueError(f"--out {out}: rank 0 could not take the run folder")
    return lock


def atomic_link(src, dst):
    """Make `dst` name the same file as `src` (a hard link; a copy where the filesystem has none),
    atomically: `dst` is always either the old file or the new one."""
    tmp = f"{dst}.tmp.{os.getpid()}"
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def checkpoint_names(ckpt_dir):
    """The step_XXXXXX.pt files of ckpt_dir, oldest first (none if the folder does not exist)."""
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(f for f in os.listdir(ckpt_dir) if f.startswith("step_") and f.endswith(".pt"))


def prune_checkpoints(ckpt_dir, keep_last):
    """Delete all but the newest `keep_last` step files (0 keeps all) and any temporary file a
    killed write left behind (rank 0, while no write is in flight)."""
    old = checkpoint_names(ckpt_dir)[:-keep_last] if keep_last > 0 else []
    stray = [f for f in os.listdir(ckpt_dir) if ".tmp." in f]
    for name in old + stray:
        os.remove(os.path.join(ckpt_dir, name))


def save_step(ckpt_dir, step, state, keep_last):
    """Write a training state as step_XXXXXX.pt (atomically), point latest.pt at it, prune."""
    path = os.path.join(ckpt_dir, f"step_{step:06d}.pt")
    atomic_save(state, path)
    atomic_link(path, os.path.join(ckpt_dir, "latest.pt"))
    prune_checkpoints(ckpt_dir, keep_last)
    return path


def newest_training_state(ckpt_dir, warn, mmap=False):
    """(path, state) of the newest readable step_*.pt in ckpt_dir, or None. Unreadable files
    (atomic writes leave none, but disks and copies fail) are skipped with `warn(message)`.
    mmap: map the tensors instead of reading them (to check readability cheaply)."""
    for name in reversed(checkpoint_names(ckpt_dir)):
        path = os.path.join(ckpt_dir, name)
        try:
            state = read_checkpoint(path, "--resume", mmap)
            if not isinstance(state, dict) or not {"model", "optimizer", "step"} <= state.keys():
                raise ValueError(f"--resume {path}: not a checkpoint of this script (no model, optimizer, step)")
        except ValueError as e:
            warn(f"warning: skipping unreadable checkpoint: {e}")
            continue
        return path, state
    return None


def resume_training(ckpt_dir, model, opt, base, required, warn):
    """Load the newest readable checkpoint of ckpt_dir (the trained parameters, over `base`, the
    absolute path of this run's --init) into model and optimizer (sharded or not: fsdp.load_state;
    every rank calls it). Every step's randomness derives
    from (seed, step, rank), so the step is the only sampler state needed to continue identically.
    Returns (step, non-finite steps so far); (0, 0) if there is none and not `required`."""
    found = newest_training_state(ckpt_dir, warn)
    if found is None:
        if required:
            raise FileNotFoundError(f"--resume: no readable checkpoint in {ckpt_dir}")
        return 0, 0
    path, state = found
    if state.get("base") != base:
        raise ValueError(f"--resume {path}: it was trained from {state.get('base')}, but --init is {base}")
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    problems = state_dict_mismatch(trained, state["model"])
    if problems:
        raise ValueError(f"--resume {path}: checkpoint does not fit this run's trained parameters "
                         f"(another --method, --train-head or --lora?): {problems}")
    try:  # whole tensors, sharded again where the run shards them (--fsdp)
        fsdp.load_state(model, opt, state["model"], state["optimizer"])
    except ValueError as e:
        raise ValueError(f"--resume {path}: its optimizer state does not fit this run's trained parameters "
                         f"(another --method or --train-head?): {e}") from None
    return int(state["step"]), int(state.get("bad_steps_total", 0))


def start_run_folder(out, start, keep_last, config):
    """A training stage's first writes (rank 0 only): folders and config.json. A fresh run (start
    0) removes the previous run's checkpoints and metrics from `out`; a resumed one keeps the
    metrics rows of the steps before `start` (the others will be redone)."""
    ckpt_dir, metrics_path = os.path.join(out, "ckpt"), os.path.join(out, "metrics.jsonl")
    os.makedirs(os.path.join(out, "samples"), exist_ok=True)
    os.makedirs(ckpt_dir, exist_ok=True)
    if start == 0:
        old = [os.path.join(ckpt_dir, f) for f in checkpoint_names(ckpt_dir) + ["latest.pt"]] + [metrics_path]
        old = [path for path in old if os.path.exists(path)]
        if old:
            print(f"a fresh run in {out}: removing the previous run's checkpoints and metrics "
                  "(--resume continues a run instead)", flush=True)
        for path in old:
            os.remove(path)
    elif os.path.exists(metrics_path):
        keep = []
        for line in open(metrics_path):
            with contextlib.suppress(ValueError):  # a line cut short by a crash is dropped
                if json.loads(line)["step"] < start:
                    keep.append(line)
        with open(metrics_path + ".tmp", "w") as f:
            f.writelines(keep)
        os.replace(metrics_path + ".tmp", metrics_path)
    prune_checkpoints(ckpt_dir, keep_last)  # also the temporary file of a killed write
    with writing(os.path.join(out, "config.json")), open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def check_writable(path, name):
    """Raise a one-line error naming flag `name` unless `path` is a writable folder or can be created
    as one: its nearest existing ancestor is a folder where a file can be created (tried, and
    removed again: permission bits alone pass /proc and read-only mounts)."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    if not os.path.isdir(p):
        raise ValueError(f"{name} {path}: {p} is a file, not a folder")
    if not os.access(p, os.W_OK | os.X_OK):
        raise PermissionError(f"{name} {path}: {p} is not writable")
    with contextlib.suppress(OSError):  # a folder that says it is writable but is not (e.g. /proc, a read-only mount)
        probe = os.path.join(p, f".write_probe.{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
        return
    raise PermissionError(f"{name} {path}: cannot create files in {p}")


def sha256(path):
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def export_half(src, dst):
    """Write a base checkpoint of train.py (`base.pt`) with its weights in float16: the form in which
    a pretrained demo base is committed (half the bytes; loading casts back to float32)."""
    ckpt = read_checkpoint(src, "export")
    ckpt["model"] = {k: v.half() if v.is_floating_point() else v for k, v in ckpt["model"].items()}
    atomic_save({k: ckpt[k] for k in ("model", "config", "args", "stage") if k in ckpt}, dst)
    return sha256(dst)


if __name__ == "__main__":  # python -m infra.checkpoints half runs/demo_base/base.pt demo/base.pt
    if len(sys.argv) != 4 or sys.argv[1] != "half":
        sys.exit("usage: python -m infra.checkpoints half SRC.pt DST.pt")
    print(f"{sys.argv[3]} sha256 {export_half(sys.argv[2], sys.argv[3])}")
