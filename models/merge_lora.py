"""A checkpoint of `train.py --lora` written as one whole checkpoint: the base it names with the
adapters merged into its weights, W + (α / R) B A (infra/lora.merged_state_dict), for tools that read
a plain model. train.py (--init) and the paper's table (--ckpt) read the adapters' checkpoint as it is.

    python -m models.merge_lora RUN/ckpt/latest.pt merged.pt
"""

import argparse
import os
import sys

from infra import checkpoints, lora
from infra.processes import cli
from models import loading

FLAG = "python -m models.merge_lora"


def merge(path, out, flag=FLAG):
    """Read a LoRA checkpoint of train.py (`path`), load its base with the adapters on (with the run's
    own flags, which the checkpoint holds) and write the merged model to `out` as a whole checkpoint
    ({"model", "config"}, as a base of this project). Everything is read and checked before `out`
    is written. Returns out."""
    ckpt = checkpoints.read_checkpoint(path, flag)
    if not isinstance(ckpt, dict) or not ckpt.get("lora") or not isinstance(ckpt.get("args"), dict):
        raise ValueError(f"{flag} {path}: not a LoRA checkpoint of train.py (no adapters in it: nothing to merge)")
    if os.path.isdir(out):
        raise ValueError(f"{flag} OUT {out}: a folder; give the file to write")
    checkpoints.check_writable(os.path.dirname(os.path.abspath(out)), f"{flag} OUT")
    model = loading.load_policy(argparse.Namespace(**ckpt["args"]), path, flag)
    checkpoints.atomic_save({"model": lora.merged_state_dict(model), "config": model.config, "stage": "merged",
                             "merged_from": os.path.abspath(path)}, out)
    return out


def main(argv=None):
    """`python -m models.merge_lora CKPT OUT`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) != 2:
        raise ValueError(f"usage: {FLAG} CKPT OUT (CKPT: a checkpoint of train.py --lora)")
    print(f"merged: {merge(*argv)}")


if __name__ == "__main__":
    sys.exit(cli(main))
