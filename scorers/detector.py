"""GroundingDINO through transformers: which of a prompt's nouns an image shows, and where.

The released GroundingDINO reward (AMAP-ML/mar-grpo, `reward_gdino.py`, after IDEA-Research's
GroundingDINO demo) asks the detector for all nouns of a prompt at once and reads one score per
(noun, query) pair:

    caption   "n1 . n2 . n3."  (the nouns joined by " . ", a final "."; lower-cased)
    spans     each noun's character span -> its BERT tokens; the positive map P (nouns, tokens)
              marks them, each row divided by (its sum + 1e-6)
    score     s[noun, query] = P @ sigmoid(logits[query, token])^T, the mean over the noun's tokens
              of the query's token probability
    kept      every query with s[noun, query] > 0.3 is a detection of that noun (so one query can
              be found for two nouns), in query order, noun after noun

`Detector.detect` returns that as composition_rules.Detections per image (boxes as predicted:
cx, cy, w, h normalised to the image). The released code asks for a noun of three or more words by
its first and last word only and labels it "first last"; with `whole_nouns` (composition_rules
FIXED) the span is the whole noun and the label the noun.

Weights: a local folder in the Hugging Face layout, e.g. the transformers conversion of
`groundingdino_swint_ogc` (HF `IDEA-Research/grounding-dino-tiny`: config.json, model.safetensors,
preprocessor and tokenizer files); its processor resizes to 800 px on the short side (at most 1333),
as the released transform does.
"""

import torch

from scorers import hf_folders
from scorers.composition_rules import Detections

BOX_THRESHOLD = 0.3   # released: a (noun, query) score must exceed this (strictly)
EXPECTED = "a GroundingDINO folder in the Hugging Face layout (HF IDEA-Research/grounding-dino-tiny)"


def caption_and_spans(nouns, whole_nouns):
    """The detector's caption for `nouns` and each noun's character spans and label.

    Returns (caption, spans, labels): spans[k] a list of (begin, end) character ranges of noun k,
    labels[k] the phrase its detections are labelled with. Released: a noun of several words is
    the span of its first word and of its last word, labelled with those two words."""
    caption = " . ".join(nouns) + "."
    spans, labels, start = [], [], 0
    for noun in nouns:
        words = noun.strip().split(" ")
        end = start + len(noun)
        if whole_nouns or len(words) == 1:
            spans.append([(start, end)])
            labels.append(noun if whole_nouns else caption[start:end])
        else:
            first, last = (start, start + len(words[0])), (end - len(words[-1]), end)
            spans.append([first, last])
            labels.append(" ".join(caption[b:e] for b, e in (first, last)))
        start = end + 3  # " . "
    return caption, spans, labels


def positive_map(encoding, row, spans, length):
    """(nouns, length) float: each noun's tokens marked, rows divided by (sum + 1e-6), as the
    released `create_positive_map_from_span` (a span end that falls between tokens moves inwards)."""
    pmap = torch.zeros(len(spans), length)
    for k, noun_spans in enumerate(spans):
        for begin, end in noun_spans:
            first = next((t for c in (begin, begin + 1, begin + 2) if (t := encoding.char_to_token(row, c)) is not None), None)
            last = next((t for c in (end - 1, end - 2, end - 3) if (t := encoding.char_to_token(row, c)) is not None), None)
            if first is not None and last is not None:
                pmap[k, first:last + 1] = 1
    return pmap / (pmap.sum(-1, keepdim=True) + 1e-6)


def detections_from_scores(phrase_scores, boxes, labels, threshold=BOX_THRESHOLD):
    """Detections of one image. phrase_scores (nouns, queries); boxes (queries, 4) cx, cy, w, h;
    labels: one per noun. Every (noun, query) with a score above `threshold`, noun after noun."""
    rows, scores, names = [], [], []
    for k, label in enumerate(labels):
        keep = (phrase_scores[k] > threshold).nonzero().flatten()              # (kept,)
        rows.append(boxes[keep])
        scores.append(phrase_scores[k, keep])
        names += [label] * len(keep)
    if not rows:
        return Detections(torch.zeros(0, 4), torch.zeros(0), [])
    return Detections(torch.cat(rows).float().cpu(), torch.cat(scores).float().cpu(), names)


class Detector:
    """GroundingDINO from a local folder (`--reward-ckpt gdino=FOLDER`), frozen.

    detect(images (B, 3, H, W) in [0, 1], nouns: B lists of str) -> B composition_rules.Detections.
    """

    def __init__(self, folder, flag, device="cpu", whole_nouns=True, threshold=BOX_THRESHOLD):
        from transformers import GroundingDinoForObjectDetection, GroundingDinoProcessor
        self.model = hf_folders.load_model(GroundingDinoForObjectDetection, folder, flag, EXPECTED,
                                           "grounding-dino").to(device)
        self.processor = hf_folders.load_processor(GroundingDinoProcessor, folder, flag, EXPECTED)
        self.device, self.whole_nouns, self.threshold = device, whole_nouns, threshold

    @torch.no_grad()
    def detect(self, images, nouns):
        out = [None] * len(nouns)
        asked = [b for b, n in enumerate(nouns) if n]  # an image with no nouns has nothing to find
        if not asked:
            return [Detections(torch.zeros(0, 4), torch.zeros(0), []) for _ in nouns]
        captions, spans, labels = zip(*(caption_and_spans(nouns[b], self.whole_nouns) for b in asked))
        text = self.processor.tokenizer([c.lower() for c in captions], padding="longest", return_tensors="pt")
        vision = self.processor.image_processor(hf_folders.pixel_arrays(images[asked]), return_tensors="pt")
        outputs = self.model(pixel_values=vision["pixel_values"].to(self.device),
                             pixel_mask=vision["pixel_mask"].to(self.device),
                             **{k: v.to(self.device) for k, v in text.items()})
        probs = outputs.logits.float().sigmoid()                                # (b, queries, max_text_len)
        for row, b in enumerate(asked):
            pmap = positive_map(text, row, spans[row], probs.shape[-1]).to(probs.device)  # (nouns, max_text_len)
            out[b] = detections_from_scores(pmap @ probs[row].T, outputs.pred_boxes[row], labels[row], self.threshold)
        empty = Detections(torch.zeros(0, 4), torch.zeros(0), [])
        return [d if d is not None else empty for d in out]

