"""The compositional rewards of the released NOVA mix run: GroundingDINO (`gdino`) and GIT-VQA (`git_vqa`).

Both read each prompt's released metadata (infra/prompt_records.py; `--prompts FILE.jsonl`), so they
score what the prompt asks for rather than how the image looks:

- `gdino` (and `gdino_released`): detector.py finds the prompt's nouns, composition_rules.py
  scores the detections by task type (spatial relation, count, or the nouns present), in [0, 1].
  `gdino` uses the rules with the released code's inconsistencies fixed (composition_rules FIXED),
  `gdino_released` keeps them (RELEASED), for a run that reproduces the released reward exactly.
- `git_vqa` (AMAP-ML/mar-grpo `reward_git.py`): GIT answers "<phrase>?" for each attribute phrase
  of the prompt (`attr_nouns`, or the `nouns` when it has none),

      r = mean over phrases of P(yes) / (P(yes) + P(no)),

  P the softmax over the vocabulary of the next token after [CLS] <phrase> ? (no [SEP]), read at
  the last text position; 0 for spatial and numeracy prompts (the detector scores those), 1 for a
  prompt without phrases. Departure: an empty `attr_nouns` list falls back to the nouns (the
  released code averages an empty list, NaN).

Weights: local folders in the Hugging Face layout (`--reward-ckpt gdino=FOLDER`, `git_vqa=FOLDER`),
loaded strictly by hf_folders.py: GroundingDINO as detector.py says; GIT `GitForCausalLM` with its
processor, the released run's HF `microsoft/git-large-vqav2`.
"""

import torch

from rewards import Reward
from scorers import composition_rules, detector, hf_folders
from scorers.weights import CKPT_FLAG

GIT_EXPECTED = "a GIT folder in the Hugging Face layout (HF microsoft/git-large-vqav2)"
UNCHECKED_TASKS = ("spatial", "numeracy")  # git_vqa scores these 0


def records(name, metadata):
    """The released records of a batch, or a one-line ValueError: these rewards need them."""
    for meta in metadata:
        if not meta or "task_type" not in meta or "nouns" not in meta:
            raise ValueError(f"the {name} reward reads the released prompt metadata (task_type, nouns, ...): "
                             "give --prompts FILE.jsonl (infra/prompt_records.py)")
    return metadata


class GDinoReward(Reward):
    """composition_rules.gdino_score of detector.Detector's detections, per image."""

    name, rules = "gdino", composition_rules.FIXED

    def __init__(self, gdino=None, device="cpu"):
        self.detector = detector.Detector(gdino, f"{CKPT_FLAG} gdino", device, whole_nouns=self.rules.whole_nouns)

    def score(self, images, prompts, metadata):
        recs = records(self.name, metadata)
        found = self.detector.detect(images, [r["nouns"] for r in recs])
        scores = [composition_rules.gdino_score(r, det, self.rules) for r, det in zip(recs, found)]
        return torch.tensor(scores, dtype=torch.float32), {}


class GDinoReleasedReward(GDinoReward):
    """`gdino` with the released scoring rules, inconsistencies kept (composition_rules RELEASED)."""

    name, rules = "gdino_released", composition_rules.RELEASED


def git_phrases(record):
    """The phrases git_vqa asks about (None: the prompt is scored 0)."""
    if record["task_type"] in UNCHECKED_TASKS:
        return None
    return record.get("attr_nouns") or record["nouns"]


class GitVqaReward(Reward):
    """Mean over the prompt's phrases of GIT's P(yes) / (P(yes) + P(no)) for "<phrase>?"."""

    name = "git_vqa"

    def __init__(self, git_vqa=None, device="cpu"):
        from transformers import GitForCausalLM, GitProcessor
        flag = f"{CKPT_FLAG} git_vqa"
        self.model = hf_folders.load_model(GitForCausalLM, git_vqa, flag, GIT_EXPECTED, "git").to(device)
        self.processor = hf_folders.load_processor(GitProcessor, git_vqa, flag, GIT_EXPECTED)
        tok = self.processor.tokenizer
        answers = [tok(word, add_special_tokens=False).input_ids for word in ("yes", "no")]
        if any(len(ids) != 1 or ids[0] == tok.unk_token_id for ids in answers):
            raise ValueError(f"{flag}={git_vqa}: the tokenizer does not spell 'yes' and 'no' as one token each")
        (self.yes,), (self.no,) = answers
        self.device = device

    def p_yes(self, pixel_values, questions):
        """P(yes) / (P(yes) + P(no)) for each (image, question) pair: pixel_values (n, 3, h, w),
        questions n strings, asked in batches of equal token length (no padding). Returns (n,)."""
        tok = self.processor.tokenizer
        ids = [[tok.cls_token_id] + tok(q, add_special_tokens=False).input_ids for q in questions]
        out = torch.zeros(len(ids))
        for length in sorted({len(i) for i in ids}):
            rows = [k for k, i in enumerate(ids) if len(i) == length]
            logits = self.model(pixel_values=pixel_values[rows].to(self.device),
                                input_ids=torch.tensor([ids[k] for k in rows], device=self.device)).logits[:, -1]
            probs = logits.float().softmax(-1)                               # (rows, vocab)
            out[rows] = (probs[:, self.yes] / (probs[:, self.yes] + probs[:, self.no])).cpu()
        return out

    def score(self, images, prompts, metadata):
        phrases = [git_phrases(r) for r in records(self.name, metadata)]
        pairs = [(b, f"{p}?") for b, ps in enumerate(phrases) if ps for p in ps]
        scores = torch.tensor([0.0 if ps is None else 1.0 for ps in phrases])  # no phrase: 1; spatial, numeracy: 0
        if pairs:
            pixel_values = self.processor.image_processor(hf_folders.pixel_arrays(images), return_tensors="pt")["pixel_values"]
            p = self.p_yes(pixel_values[[b for b, _ in pairs]], [q for _, q in pairs])   # (pairs,)
            for b in {b for b, _ in pairs}:
                scores[b] = p[[k for k, (c, _) in enumerate(pairs) if c == b]].mean()
        return scores, {}
