"""Checkpoint files: reading them safely, checking a state dict against a model in one line, and
writing them so that a crash never leaves a half-written one (DESIGN.md, "Bad input").

Every model file (mar.py, vae.py, harmon.py, nova.py), the rewards and train.py read and check
weights through these functions, so a missing, truncated or mismatched file always fails the same
way: one line naming the flag and the file, before anything is written.

A training checkpoint is a plain dict (`torch.load(weights_only=True)` reads it): the policy's
state dict and config, the optimizer state, the step, the flags, and the count of skipped steps.
"""

import argparse
import contextlib
import os
import shutil

import torch


def read_checkpoint(path, flag="--init"):
    """torch.load(weights_only=True) on the CPU, with `argparse.Namespace` allowed (official MAR
    files pickle their args); a missing, truncated or foreign file raises a one-line error naming
    `flag` and path."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag}: no such file: {path}")
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt, truncated, or not a torch file
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ValueError(f"{flag} {path}: cannot read checkpoint ({type(e).__name__}: {reason})") from None


def check_state_dict(model, sd, path, flag="--init", ignore=()):
    """Raise a one-line ValueError naming the first keys where `sd` does not fit `model` (missing,
    unexpected, wrong shape). `ignore`: key prefixes that may be missing (e.g. a VAE loaded apart)."""
    own = model.state_dict()
    missing = [k for k in own if k not in sd and not any(k.startswith(prefix) for prefix in ignore)]
    unexpected = [k for k in sd if k not in own]
    wrong = [f"{k} {tuple(sd[k].shape)} vs {tuple(own[k].shape)}" for k in own
             if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or wrong:
        parts = [f"{name} {items[:3]}" for name, items in
                 (("missing", missing), ("unexpected", unexpected), ("wrong shape (file vs model)", wrong)) if items]
        raise ValueError(f"{flag} {path}: checkpoint does not fit the model: " + "; ".join(parts))


def atomic_save(obj, path):
    """torch.save to a temporary file in the same folder, then rename: never a half-written file.
    A write killed by SIGKILL leaves only the temporary file, which `prune_checkpoints` removes."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:  # an error or Ctrl-C mid-write: leave no temporary file behind
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


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


def newest_training_state(ckpt_dir, warn):
    """(path, state) of the newest readable step_*.pt in ckpt_dir, or None. Unreadable files
    (atomic writes leave none, but disks and copies fail) are skipped with `warn(message)`."""
    for name in reversed(checkpoint_names(ckpt_dir)):
        path = os.path.join(ckpt_dir, name)
        try:
            state = read_checkpoint(path, "--resume")
            if not isinstance(state, dict) or not {"model", "optimizer", "step"} <= state.keys():
                raise ValueError(f"--resume {path}: not a checkpoint of this script (no model, optimizer, step)")
        except ValueError as e:
            warn(f"warning: skipping unreadable checkpoint: {e}")
            continue
        return path, state
    return None
