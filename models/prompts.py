"""Prompts and their condition inputs, for every model train.py drives.

A run's prompts are "items": shapes-world metadata dicts (the small MAR; demo/shapes.py), ImageNet
class indices (official MAR), or text lines (Harmon, NOVA). `Prompts` turns a batch of items into
the model's condition inputs (the `inputs` of rollout.py's policy interface), the texts a reward
reads, and the metadata a verifier reads. A prompt file is one prompt per line, or for Harmon and
NOVA a `.jsonl` file of the released prompt metadata (prompt_records.py: the prompt and what the
compositional rewards check); it is parsed when the run starts, so a typo fails before any work.
"""

import os

import numpy as np
import torch
from torchvision.models._meta import _IMAGENET_CATEGORIES

from demo import shapes
from infra import prompt_records
from infra.processes import SEED_STAGES


def read_prompt_file(path, kind, num_classes=0, flag="--prompts"):
    """Prompt lines of a file: kind "shapes" (parsed), "class" (an index, then anything), "text"
    (a line, or for a .jsonl / .json file a released metadata record, prompt_records.py); errors
    name `flag`."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag}: no such file: {path}")
    if prompt_records.is_record_file(path):
        if kind != "text":
            raise ValueError(f"{flag} {path}: the released prompt metadata (.jsonl) is for text-conditioned models "
                             "(--model harmon or nova)")
        return prompt_records.read_records(path)
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(i + 1, line.strip()) for i, line in enumerate(f) if line.strip()]
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path}: not a UTF-8 text file") from None
    if not lines:
        raise ValueError(f"{flag} {path}: the file has no prompts")
    items = []
    for no, line in lines:
        if kind == "shapes":
            try:
                items.append(shapes.parse_prompt(line))
            except ValueError as e:
                raise ValueError(f"{flag} {path}:{no}: {e}") from None
        elif kind == "class":
            head = line.split()[0]
            if not head.isdigit() or not 0 <= int(head) < num_classes:
                raise ValueError(f"{flag} {path}:{no}: expected a class index in 0 … {num_classes - 1}, got {line!r}")
            items.append(int(head))
        else:
            items.append(line)
    return items


def prompt_text(item):
    """The prompt of a text item: the line itself, or a released record's "prompt"."""
    return item["prompt"] if isinstance(item, dict) else item


class Prompts:
    """The prompts of a run and how a batch of them conditions the model.

    kind: "shapes" (prompt ids of the shapes vocabulary), "class" (ImageNet labels), or "text"
    (`encode(list of str, device) -> inputs dict`, given by the model's adapter: Harmon's
    tokenizer, NOVA's precomputed prompt embeddings); items: the prompt list (None: the shapes
    grammar's split `split`, of the prompt `categories`, sampled fresh; for "text", strings or
    prompt_records dicts); num_classes: for "class".
    """

    def __init__(self, kind, items=None, split="train", num_classes=0, encode=None, categories=shapes.CATEGORIES):
        self.kind, self.items, self.split, self.encode = kind, items, split, encode
        self.categories = tuple(categories)
        if kind == "class" and items is None:
            self.items = list(range(num_classes))
        if kind == "text" and (items is None or encode is None):
            raise ValueError("--prompts: text-conditioned models need a prompt file")

    @property
    def is_shapes(self):
        return self.kind == "shapes"

    def sample(self, n, seed, step):
        """n prompts for one step, identical on every rank (one seeded draw, then sliced)."""
        rng = np.random.default_rng([seed, SEED_STAGES["prompts"], step])
        if self.items is None:
            return shapes.sample_prompts(n, rng, split=self.split, categories=self.categories)
        return [self.items[i] for i in rng.integers(0, len(self.items), n)]

    def condition(self, items, device):
        """The model's condition inputs for a batch of items (rollout.py's `inputs`)."""
        if self.kind == "shapes":
            return dict(prompt_ids=torch.from_numpy(shapes.tokenize([m["prompt"] for m in items])).to(device))
        if self.kind == "class":
            return dict(labels=torch.tensor([int(c) for c in items], device=device))
        return self.encode(self.texts(items), device)

    def texts(self, items):
        """What a learned reward reads for each item."""
        if self.kind == "shapes":
            return [m["prompt"] for m in items]
        if self.kind == "class":
            return [f"a photo of a {_IMAGENET_CATEGORIES[int(c)]}" for c in items]
        return [prompt_text(it) for it in items]

    def metas(self, items):
        """What a verifier reads (the shapes reward; the released records for the compositional
        rewards), one dict per item."""
        if self.kind == "shapes" or (self.kind == "text" and items and isinstance(items[0], dict)):
            return list(items)
        return [{"class": int(c)} if self.kind == "class" else {"prompt": t} for c, t in zip(items, self.texts(items))]

    def eval_items(self, n, seed, split="heldout"):
        """Evaluation prompts: the prompt file, or for the shapes world n prompts of `split` with the
        same number from each category (the held-out split is mostly spatial prompts, and has only
        two single-object ones, so a uniform sample would measure little else; small categories
        repeat)."""
        if not self.is_shapes or self.items is not None:
            return self.items
        rng = np.random.default_rng([seed, SEED_STAGES["eval_prompts"], shapes.SPLITS.index(split)])
        per_cat = -(-n // len(self.categories))  # ceil
        items = []
        for cat in self.categories:
            pool = [m for m in shapes.all_prompts(split) if m["category"] == cat]
            order = np.concatenate([rng.permutation(len(pool)) for _ in range(-(-per_cat // len(pool)))])
            items += [pool[i] for i in order[:per_cat]]
        return items
