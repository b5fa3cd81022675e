"""The weight files of the model-based rewards: where a `--reward-ckpt KEY=PATH` must point
(`WEIGHT_FILES`), and strict loading whose mismatch is one line naming the file."""

from pathlib import Path

from infra import checkpoints

CKPT_FLAG = "--reward-ckpt"   # the weights flag, `--reward-ckpt key=PATH`, named in errors

# weights key -> (expected file, where it is published); the table of docs/real_models.md,
# "Rewards and their weight files".
WEIGHT_FILES = {
    "hpsv2": ("HPS_v2.1_compressed.pt or HPS_v2_compressed.pt", "HF xswu/HPSv2"),
    "pickscore": ("model.safetensors", "HF yuvalkirstain/PickScore_v1"),
    "clip_score": ("ViT-L-14.pt (or the open_clip checkpoint of model_name)",
                   "OpenAI CLIP release / HF openai/clip-vit-large-patch14"),
    "aesthetic": ("sac+logos+ava1-l14-linearMSE.pth",
                  "GitHub christophschuhmann/improved-aesthetic-predictor"),
    "aesthetic_clip": ("ViT-L-14.pt", "OpenAI CLIP release / HF openai/clip-vit-large-patch14"),
    "imagereward": ("ImageReward.pt", "HF THUDM/ImageReward"),
    "imagereward_tokenizer": ("a folder with the bert-base-uncased vocab.txt",
                              "HF google-bert/bert-base-uncased"),
    "gdino": ("a GroundingDINO folder in the HF layout", "HF IDEA-Research/grounding-dino-tiny"),
    "git_vqa": ("a GIT folder in the HF layout", "HF microsoft/git-large-vqav2"),
}
# weights keys that name a folder, not a file
FOLDER_KEYS = {"imagereward_tokenizer", "gdino", "git_vqa"}


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
