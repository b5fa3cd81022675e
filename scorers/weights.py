"""The weight files of the model-based rewards: where a `--reward-ckpt KEY=PATH` must point
(rewards.WEIGHT_FILES), and strict loading whose mismatch is one line naming the file."""

from pathlib import Path

from infra import checkpoints
from rewards import CKPT_FLAG, FOLDER_KEYS, WEIGHT_FILES


def check_file(path, key):
    """The path of weights key `key` as a Path (a folder for FOLDER_KEYS), or a one-line
    FileNotFoundError naming the flag and the expected file."""
    expected, where = WEIGHT_FILES[key]
    if not path:
        raise FileNotFoundError(f"{CKPT_FLAG} {key}=PATH is required: expected {expected} (from {where})")
    path = Path(path).expanduser()
    if not (path.is_dir() if key in FOLDER_KEYS else path.is_file()):
        what = "no such folder" if key in FOLDER_KEYS else "no such file"
        raise FileNotFoundError(f"{CKPT_FLAG} {key}={path}: {what}; expected {expected} (from {where})")
    return path


def load_strict(module, state_dict, path, what):
    """module.load_state_dict(state_dict, strict=True), but a mismatch is one line naming the file.

    what: short description of the expected content, e.g. "open_clip 'ViT-H-14'".
    """
    problems = checkpoints.state_dict_mismatch(module.state_dict(), state_dict)
    if problems:
        raise ValueError(f"weights in {path} do not fit {what}: {problems}")
    module.load_state_dict(state_dict, strict=True)
