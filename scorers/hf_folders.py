"""Models and processors from local Hugging Face folders, loaded strictly, one-line errors.

The compositional scorers (GroundingDINO, GIT, BLIP-VQA) are transformers models published as
folders in the Hugging Face layout: config.json, weights (model.safetensors or
pytorch_model.bin), and the processor's files (preprocessor_config.json, tokenizer files). A run
names each folder by flag; nothing is fetched from a hub. `from_pretrained` alone would start from
random weights for every tensor the folder lacks and print a warning; `load_model` refuses such a
folder instead, so a reward never scores with half-initialised weights.
"""

from pathlib import Path

WEIGHT_NAMES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def pixel_arrays(images):
    """(B, 3, H, W) in [0, 1] -> B arrays (H, W, 3) uint8: the images as the processors read a PIL image."""
    pixels = (images.float().clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1)  # (B, H, W, 3)
    return list(pixels.cpu().numpy())


def first_line(error):
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def check_folder(path, flag, expected):
    """`path` as a Path to a folder holding config.json and weights, or a one-line
    FileNotFoundError naming `flag` (e.g. "--reward-ckpt gdino") and what was `expected`."""
    if not path:
        raise FileNotFoundError(f"{flag}=FOLDER is required: expected {expected}")
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"{flag}={folder}: no such folder; expected {expected}")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{flag}={folder}: no config.json; expected {expected}")
    if not any((folder / name).is_file() for name in WEIGHT_NAMES):
        raise FileNotFoundError(f"{flag}={folder}: no weights ({' or '.join(WEIGHT_NAMES[::2])}); expected {expected}")
    return folder


def load_model(cls, folder, flag, expected, model_type):
    """cls.from_pretrained(folder) in eval mode, or a one-line ValueError naming `flag`, the folder
    and the problem: a config of another `model_type`, weights that do not load, or any tensor the
    model has and the folder lacks (or the reverse), or of another shape."""
    import transformers
    folder = check_folder(folder, flag, expected)
    config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    if config.model_type != model_type:
        raise ValueError(f"{flag}={folder}: config.json is a {config.model_type!r} model, expected {model_type!r} ({expected})")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the problems are raised below, in one line
    transformers.utils.logging.disable_progress_bar()
    try:
        model, info = cls.from_pretrained(str(folder), local_files_only=True, output_loading_info=True)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise ValueError(f"{flag}={folder}: cannot load {cls.__name__}: {first_line(e)}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.utils.logging.enable_progress_bar()
    problems = [f"{kind} {sorted(map(str, info[key]))[:3]}" for key, kind in
                (("missing_keys", "missing"), ("unexpected_keys", "unexpected"), ("mismatched_keys", "wrong shape"))
                if info.get(key)]
    if problems:
        raise ValueError(f"{flag}={folder}: the weights do not fit its config.json ({cls.__name__}): {'; '.join(problems)}")
    return model.eval().requires_grad_(False)


TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")


def load_processor(cls, folder, flag, expected):
    """cls.from_pretrained(folder), or a one-line ValueError naming `flag` (a folder without the
    processor's or tokenizer's files: transformers would build an empty tokenizer without them)."""
    if not any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{flag}={folder}: no tokenizer files ({' or '.join(TOKENIZER_FILES)}); expected {expected}")
    try:
        return cls.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{flag}={folder}: cannot load {cls.__name__} (its processor and tokenizer files): "
                         f"{first_line(e)}") from None
