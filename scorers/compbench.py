"""T2I-CompBench's scores, per image, by the category of its prompt (the released records' task type).

T2I-CompBench (Huang et al.; GitHub Karine-Huang/T2I-CompBench) scores each category with its own
evaluator, a plain mean over the images (10 per prompt there):

    color, shape, texture  BLIP-VQA: the product over the prompt's noun phrases of
                           P(yes) / (P(yes) + P(no)) for "<phrase>?", P the decoder's first-token
                           softmax after [DEC] (its `vqa_prob`)
    spatial                a detector: both objects found with confidences s1, s2:
                           0.25 (s1 + s2) + position / 2, else 0.25 s of the one found; below 0.5 -> 0
                           (position: composition_rules.position_score, IoU 0.1, distance 150 px)
    numeracy               a detector: per object kind, 0.5/N if found + 0.5/N if its count (boxes of
                           that name, a box dropped when one kept before it covers > 90 % of it or
                           of itself, or IoU > 0.9) equals the number asked
    non-spatial            CLIP ViT-B/32: cos(image, prompt), raw (not ×100, not clipped)
    complex                "3-in-1": the mean of the BLIP-VQA score and, for a prompt with a spatial
                           relation, the spatial score, otherwise the CLIP score

`CompBench` is a rewards.Reward whose score of an image is its category's; `python -m tables.paper
--compbench` prints the table (rows checkpoints, columns categories). Where this departs from the benchmark
(`DEPARTURES`, printed under the table): the questions, objects and counts come from the records
(infra/prompt_records.py) instead of spaCy's parse of the prompt; the detector is GroundingDINO (the
benchmark's UniDet has no maintained package); BLIP runs at its processor's size (384 px for HF
Salesforce/blip-vqa-base, the same weights as the benchmark's model_base_vqa_capfilt_large.pth,
which it feeds at 480 px).

Weights (`--compbench-ckpt KEY=PATH`): `blip_vqa` a BLIP-VQA folder in the HF layout (HF
Salesforce/blip-vqa-base); `gdino` as detector.py; `clip` OpenAI's ViT-B-32.pt (or an open_clip
file of the same model).
"""

import os

import torch

from rewards import Reward
from scorers import clip as clip_rewards
from scorers import composition_rules, detector, hf_folders
from scorers.composition import records

FLAG = "--compbench-ckpt"
CATEGORIES = {"color": "Color", "shape": "Shape", "texture": "Texture", "spatial": "Spatial", "non": "Non-spatial",
              "complex": "Complex", "numeracy": "Numeracy"}  # task_type -> the paper's column; `object` is GenEval's
WEIGHT_KEYS = {"blip_vqa": "a BLIP-VQA folder in the HF layout (HF Salesforce/blip-vqa-base)",
               "gdino": detector.EXPECTED, "clip": "OpenAI CLIP ViT-B-32.pt (or an open_clip file of ViT-B-32)"}
DEPARTURES = [
    "questions, objects and counts read from the prompt records (the benchmark parses the prompt with spaCy); "
    "BLIP-VQA asks the record's attribute phrases, without the article a spaCy noun chunk keeps",
    "spatial and numeracy by GroundingDINO at box threshold 0.3 (the benchmark: UniDet at 0.5)",
    "BLIP-VQA at its processor's image size (384 px for HF blip-vqa-base; the benchmark: 480 px)",
    "complex: BLIP-VQA with the spatial score where the record has a relation, else with CLIP on the whole prompt "
    "(the benchmark: by its three sub-lists, CLIP without adjectives)",
]
SPATIAL_CUTOFF = 0.5          # a spatial score below this counts 0
DUPLICATE_OVERLAP = 0.9       # numeracy: a box this much inside (or IoU with) a kept one of its name is dropped
DETECTOR_FRAME_PX = 479       # the benchmark's detector sees 512-px images resized to 479 px; 150 px of that
RULES = composition_rules.Rules(score_above=True, near_distance=150 / DETECTOR_FRAME_PX, nms_on_corners=True,
                                same_noun_pairs=False, whole_nouns=True)


def phrases(record):
    """BLIP-VQA's questions of a record: its attribute phrases, or its nouns."""
    return record.get("attr_nouns") or record["nouns"]


def spatial_score(det, spatial_info):
    """The benchmark's 2-D spatial score of one image (module docstring)."""
    found = {}
    for name in (spatial_info["obj1"], spatial_info["obj2"]):
        idx = det.of(name)
        if idx:
            best = max(idx, key=lambda i: float(det.scores[i]))
            found[name] = (float(det.scores[best]), composition_rules.corners(det.boxes[best]))
    if len(found) < 2 or spatial_info["obj1"] == spatial_info["obj2"]:
        score = 0.25 * sum(s for s, _ in found.values())
    else:
        (s1, b1), (s2, b2) = found[spatial_info["obj1"]], found[spatial_info["obj2"]]
        score = 0.25 * (s1 + s2) + composition_rules.position_score(spatial_info["locality"], b1, b2, RULES) / 2
    return score if score >= SPATIAL_CUTOFF else 0.0


def count(det, name):
    """Boxes found for `name`, most confident first, less those a kept one covers (module docstring)."""
    kept = []
    for i in sorted(det.of(name), key=lambda i: -float(det.scores[i])):
        x1, y1, x2, y2 = composition_rules.corners(det.boxes[i]).tolist()
        area = max((x2 - x1) * (y2 - y1), 1e-12)                      # a degenerate box divides by no zero
        duplicate = False
        for a1, b1, a2, b2 in kept:
            inter = max(0.0, min(x2, a2) - max(x1, a1)) * max(0.0, min(y2, b2) - max(y1, b1))
            other = max((a2 - a1) * (b2 - b1), 1e-12)
            if max(inter / (area + other - inter), inter / area, inter / other) > DUPLICATE_OVERLAP:
                duplicate = True
                break
        if not duplicate:
            kept.append((x1, y1, x2, y2))
    return len(kept)


def numeracy_score(det, numeracy_info):
    """The benchmark's numeracy score of one image (module docstring)."""
    weight = 1.0 / len(numeracy_info)
    score = 0.0
    for item in numeracy_info:
        n = count(det, item["obj_name"])
        score += (0.5 * weight if n else 0.0) + (0.5 * weight if n == item["num"] else 0.0)
    return score


def parse_weights(values, wanted):
    """['blip_vqa=DIR', ...] -> {"blip_vqa": "DIR", ...}; one-line errors naming --compbench-ckpt."""
    weights = {}
    for value in values:
        key, sep, path = value.partition("=")
        if not sep or key not in WEIGHT_KEYS:
            raise ValueError(f"--compbench-ckpt {value!r}: write KEY=PATH with KEY in {', '.join(WEIGHT_KEYS)}")
        if not os.path.exists(path):
            raise FileNotFoundError(f"--compbench-ckpt {key}={path}: no such file or folder ({WEIGHT_KEYS[key]})")
        weights[key] = path
    if weights and not wanted:
        raise ValueError("--compbench-ckpt: the weights of the T2I-CompBench table; add --compbench")
    missing = [k for k in WEIGHT_KEYS if k not in weights]
    if wanted and missing:
        raise FileNotFoundError(f"--compbench-ckpt {missing[0]}=PATH is required: {WEIGHT_KEYS[missing[0]]}")
    return weights


def table_columns(items):
    """The T2I-CompBench table's columns: one per category the prompt records hold, in the paper's order."""
    tasks = {it["task_type"] for it in items}
    return [dict(key="compbench", task=task, id=f"compbench/{task}", reward="compbench", label=label, scale=1.0, decimals=4)
            for task, label in CATEGORIES.items() if task in tasks]


class BlipVqa:
    """BLIP-VQA from a local folder: `p_yes(images, questions)` as the benchmark's `vqa_prob`."""

    def __init__(self, folder, device="cpu"):
        from transformers import BlipForQuestionAnswering, BlipProcessor
        flag = f"{FLAG} blip_vqa"
        self.model = hf_folders.load_model(BlipForQuestionAnswering, folder, flag, WEIGHT_KEYS["blip_vqa"], "blip").to(device)
        self.processor = hf_folders.load_processor(BlipProcessor, folder, flag, WEIGHT_KEYS["blip_vqa"])
        tok = self.processor.tokenizer
        self.yes, self.no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
        enc = tok.convert_tokens_to_ids("[ENC]")  # BLIP's question encoder starts with [ENC], not [CLS]
        self.enc = None if enc in (None, tok.unk_token_id) else enc
        self.device = device

    @torch.no_grad()
    def p_yes(self, images, questions):
        """images (n, 3, H, W) in [0, 1], n questions -> (n,) P(yes) / (P(yes) + P(no))."""
        batch = self.processor(images=hf_folders.pixel_arrays(images), text=questions, return_tensors="pt",
                               padding="longest", truncation=True, max_length=35)
        ids, mask = batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)
        if self.enc is not None:
            ids[:, 0] = self.enc
        vision = self.model.vision_model(pixel_values=batch["pixel_values"].to(self.device)).last_hidden_state
        question = self.model.text_encoder(input_ids=ids, attention_mask=mask, encoder_hidden_states=vision,
                                           encoder_attention_mask=torch.ones(vision.shape[:-1], dtype=torch.long,
                                                                             device=self.device)).last_hidden_state
        start = torch.full((len(questions), 1), self.model.decoder_start_token_id, device=self.device)
        logits = self.model.text_decoder(input_ids=start, encoder_hidden_states=question,
                                         encoder_attention_mask=mask).logits[:, 0]   # (n, vocab)
        probs = logits.float().softmax(-1)
        return (probs[:, self.yes] / (probs[:, self.yes] + probs[:, self.no])).cpu()


class CompBench(Reward):
    """Each image's T2I-CompBench score by its record's task type (NaN for `object`, no category).
    weights: {"blip_vqa": folder, "gdino": folder, "clip": file}; clip_model: the open_clip name."""

    name = "compbench"

    def __init__(self, weights, device="cpu", clip_model="ViT-B-32-quickgelu"):
        missing = [k for k in WEIGHT_KEYS if not weights.get(k)]
        if missing:
            raise FileNotFoundError(f"{FLAG} {missing[0]}=PATH is required for --compbench: {WEIGHT_KEYS[missing[0]]}")
        self.blip = BlipVqa(weights["blip_vqa"], device)
        self.detector = detector.Detector(weights["gdino"], f"{FLAG} gdino", device, whole_nouns=True)
        try:
            self.clip = clip_rewards.ClipScoreReward(device=device, clip_score=weights["clip"], model_name=clip_model)
        except (FileNotFoundError, ValueError) as e:
            raise type(e)(str(e).replace("--reward-ckpt clip_score", f"{FLAG} clip")) from None

    def score(self, images, prompts, metadata):
        recs = records("compbench", metadata)
        scores = torch.full((len(recs),), float("nan"))
        tasks = [r["task_type"] for r in recs]
        # BLIP-VQA: the product over each image's phrases (color, shape, texture, complex)
        asked = [(b, f"{p}?") for b, r in enumerate(recs) if tasks[b] in ("color", "shape", "texture", "complex")
                 for p in phrases(r)]
        attribute = {}
        if asked:
            p = self.blip.p_yes(images[[b for b, _ in asked]], [q for _, q in asked])      # (questions,)
            for k, (b, _) in enumerate(asked):
                attribute[b] = attribute.get(b, 1.0) * float(p[k])
        detected = [b for b, t in enumerate(tasks) if t in ("spatial", "numeracy")
                    or (t == "complex" and recs[b].get("spatial_info"))]
        found = dict(zip(detected, self.detector.detect(images[detected], [recs[b]["nouns"] for b in detected]))) \
            if detected else {}
        clipped = [b for b, t in enumerate(tasks) if t == "non" or (t == "complex" and not recs[b].get("spatial_info"))]
        cos = dict(zip(clipped, (self.clip(images[clipped], [prompts[b] for b in clipped])[0] / 100).tolist())) \
            if clipped else {}
        for b, (task, rec) in enumerate(zip(tasks, recs)):
            if task in ("color", "shape", "texture"):
                scores[b] = attribute[b]
            elif task == "spatial":
                scores[b] = spatial_score(found[b], rec["spatial_info"])
            elif task == "numeracy":
                scores[b] = numeracy_score(found[b], rec["numeracy_info"])
            elif task == "non":
                scores[b] = cos[b]
            elif task == "complex":
                other = spatial_score(found[b], rec["spatial_info"]) if b in found else cos[b]
                scores[b] = (attribute[b] + other) / 2
        return scores, {"category": tasks}
