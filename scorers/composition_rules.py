"""How the released GroundingDINO reward scores a detection against a prompt's metadata.

The released reward (AMAP-ML/mar-grpo, `src/grpo/src/utils/reward_gdino.py`) asks GroundingDINO
for the prompt's nouns and scores what it finds, by the record's task type (infra/prompt_records.py):

    spatial   0.2 for each of obj1, obj2 found; when both are, + position(box1, box2) / 2 with
              each object's most confident box (so at most 0.9)
    numeracy  sum over items of 1/#items × (1 if the count after NMS at IoU 0.5 equals num,
              0.2 if some are found but not num, 0 if none is)
    others    (color, shape, texture, complex, non, object) the fraction of nouns found
    no nouns  1

    position, with c1, c2 the box centres and (dx, dy) = c2 − c1 (image y grows downwards):
      left of, on the left of        dx > 0 and |dx| > |dy|  ->  1 if IoU < 0.1 else 0.1 / IoU
      right of, on the right of      dx < 0 and |dx| > |dy|  ->  the same
      below, on the bottom of        dy < 0 and |dy| > |dx|  ->  the same
      on the top of (and above, on top of: see 1.)   dy > 0 and |dy| > |dx|  ->  the same
      near, next to, on side of      1 if |dx| < D or |dy| < D else D / max(|dx|, |dy|)
      otherwise 0

A detection is what `detector.py` returns for one image: `Detections(boxes, scores, labels)`,
boxes (n, 4) as GroundingDINO predicts them (cx, cy, w, h, normalised to the image), one row per
(noun, query) pair whose score passed the box threshold, labelled with the noun's phrase.

Where the released code is inconsistent, `FIXED` (what the `gdino` reward uses) departs from it;
`RELEASED` (the `gdino_released` reward) keeps each behaviour, and agrees with the released
functions to 1e-6 on 688 box configurations (tests/test_composition.py, fixtures/gdino_released_scores.json):
1. `above` (364 released spatial prompts) and `on top of` have no branch: they score 0, so an
   "above" prompt can reach 0.4 only, while `on the top of` is scored. FIXED scores them as it.
2. The `near` threshold D = 150 is compared with normalised distances (at most about 1), so near,
   next to and on side of always score 1. FIXED takes D as 150 px of the released 512-px images:
   150/512 of the image side.
3. Numeracy's NMS reads the (cx, cy, w, h) rows as corners (x1, y1, x2, y2), so its IoU is not the
   boxes' IoU. FIXED converts them to corners first.
4. A pair of the same noun ("a cup left of a cup") raises inside the released code and scores 0.
   FIXED uses the two most confident boxes of that noun, in the order that scores higher.
5. A noun of three or more words is asked for by its first and last word and labelled "first
   last", so it is never found. FIXED asks for the whole noun and labels it with the noun
   (detector.py reads `whole_nouns`).
"""

from dataclasses import dataclass

import torch
from torchvision.ops import nms

IOU_THRESHOLD = 0.1         # position: boxes overlapping more than this lose score
NMS_IOU = 0.5               # numeracy: duplicates suppressed above this IoU
NEAR_DISTANCE_PX = 150.0    # near: the released distance threshold, in pixels of its 512-px images
RELEASED_IMAGE_SIZE = 512


@dataclass(frozen=True)
class Rules:
    """Which released behaviours to keep (the module docstring's items 1-5)."""
    score_above: bool           # 1. above / on top of scored as on the top of
    near_distance: float        # 2. D, in the units of the normalised boxes
    nms_on_corners: bool        # 3. NMS on (x1, y1, x2, y2)
    same_noun_pairs: bool       # 4. obj1 == obj2 scored from two boxes
    whole_nouns: bool           # 5. detector.py: a noun's whole text, labelled with the noun


RELEASED = Rules(score_above=False, near_distance=NEAR_DISTANCE_PX, nms_on_corners=False, same_noun_pairs=False,
                 whole_nouns=False)
FIXED = Rules(score_above=True, near_distance=NEAR_DISTANCE_PX / RELEASED_IMAGE_SIZE, nms_on_corners=True,
              same_noun_pairs=True, whole_nouns=True)


@dataclass
class Detections:
    """What the detector found in one image: boxes (n, 4) cx, cy, w, h normalised; scores (n,);
    labels, n phrases (the noun each box was found for)."""
    boxes: torch.Tensor
    scores: torch.Tensor
    labels: list

    def of(self, label):
        """Indices of the boxes found for `label`, in order."""
        return [i for i, lab in enumerate(self.labels) if lab == label]


def corners(boxes):
    """(n, 4) cx, cy, w, h -> (n, 4) x1, y1, x2, y2."""
    cx, cy, w, h = boxes.unbind(-1)
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)


def position_score(locality, box1, box2, rules):
    """How well box1 (obj1) stands `locality` to box2 (obj2), in [0, 1] (module docstring).
    box1, box2: (4,) x1, y1, x2, y2 in normalised image units."""
    x1a, y1a, x2a, y2a = [float(v) for v in box1]
    x1b, y1b, x2b, y2b = [float(v) for v in box2]
    dx = (x1b + x2b) / 2 - (x1a + x2a) / 2
    dy = (y1b + y2b) / 2 - (y1a + y2a) / 2
    inter = max(0.0, min(x2a, x2b) - max(x1a, x1b)) * max(0.0, min(y2a, y2b) - max(y1a, y1b))
    union = (x2a - x1a) * (y2a - y1a) + (x2b - x1b) * (y2b - y1b) - inter
    iou = inter / union if union > 0 else 0.0  # degenerate (zero-area) boxes: no overlap
    apart = 1.0 if iou < IOU_THRESHOLD else IOU_THRESHOLD / iou
    if locality in ("next to", "on side of", "near"):
        d = rules.near_distance
        return 1.0 if abs(dx) < d or abs(dy) < d else d / max(abs(dx), abs(dy))
    upwards = ("on the top of", "top of") + (("above", "on top of") if rules.score_above else ())
    holds = {("on the right of", "right of"): dx < 0 and abs(dx) > abs(dy),
             ("on the left of", "left of"): dx > 0 and abs(dx) > abs(dy),
             ("on the bottom of", "below"): dy < 0 and abs(dy) > abs(dx),
             upwards: dy > 0 and abs(dy) > abs(dx)}
    for names, direction in holds.items():
        if locality in names:
            return apart if direction else 0.0
    return 0.0


def most_confident(det, label, count=1):
    """The `count` most confident boxes found for `label` as (count, 4) corners (ties: the first found)."""
    idx = det.of(label)
    order = sorted(idx, key=lambda i: -float(det.scores[i]))[:count]  # stable: the first of equal scores
    return corners(det.boxes[order])


def spatial_score(det, spatial_info, rules):
    """0.2 per object found, + position / 2 when both are (module docstring)."""
    obj1, obj2, locality = spatial_info["obj1"], spatial_info["obj2"], spatial_info["locality"]
    score = 0.2 * (obj1 in det.labels) + 0.2 * (obj2 in det.labels)
    if score != 0.4:
        return score
    if obj1 != obj2:
        return score + position_score(locality, most_confident(det, obj1)[0], most_confident(det, obj2)[0], rules) / 2
    if not rules.same_noun_pairs:
        return 0.0  # released: the second object's box list is empty and the score falls to 0
    pair = most_confident(det, obj1, 2)
    if len(pair) < 2:
        return score
    return score + max(position_score(locality, pair[0], pair[1], rules),
                       position_score(locality, pair[1], pair[0], rules)) / 2


def numeracy_score(det, numeracy_info, rules):
    """Sum over items of 1/#items × (1 if the NMS count is num, 0.2 if it is not, 0 if none found)."""
    weight, score = 1 / len(numeracy_info), 0
    for item in numeracy_info:
        idx = det.of(item["obj_name"])
        if not idx:
            continue
        boxes = det.boxes[idx].float()                                     # (k, 4)
        kept = nms(corners(boxes) if rules.nms_on_corners else boxes, det.scores[idx].float(), NMS_IOU)
        score += weight * (1 if len(kept) == item["num"] else 0.2)
    return score


def object_score(det, nouns):
    """The fraction of the nouns found (a noun listed twice counts twice)."""
    return sum(1 / len(nouns) for noun in nouns if noun in det.labels)


def gdino_score(record, det, rules):
    """The released reward of one image: `record` a prompt_records record, `det` its Detections."""
    if not record["nouns"]:
        return 1.0
    if record["task_type"] == "spatial":
        return spatial_score(det, record["spatial_info"], rules)
    if record["task_type"] == "numeracy":
        return numeracy_score(det, record["numeracy_info"], rules)
    return object_score(det, record["nouns"])
