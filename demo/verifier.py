"""The exact verifier of the shapes world (shapes.py): which objects an image shows, and how
well they match its prompt; and the reward of the demo built on it (`ShapesReward`, `--reward shapes`).

Verifier. Each pixel goes to the nearest of {black} + COLORS (Euclidean in RGB); connected
components (8-connected, `scipy.ndimage.label`) per colour; components smaller than
`max(4, H*W // 128)` pixels are specks and dropped. A component's shape comes from its extent
e = area / bbox area (square 1, circle ~pi/4, triangle ~1/2; measured on this renderer for sides
7..44: circle 0.755..0.852, triangle 0.500..0.571):
    square e >= 0.92,  circle 0.66 <= e < 0.92,  triangle 0.35 <= e < 0.66,
    "other" if e < 0.35 or the bbox aspect ratio exceeds 1.5.
Per requested object j (colour c_j, shape s_j, count n_j), with D the detected objects:
    color_j = some object in D has colour c_j          shape_j = some object in D has shape s_j
    found_j = #{d in D : colour c_j and shape s_j}     present_j = found_j >= 1
    count_j = found_j == n_j
    o_j     = (color_j + shape_j + present_j + count_j) / 4      (booleans count as 0 / 1)
The category's pass criterion (as in GenEval) is the key check k: single present_0; two_objects
present_0 and present_1; counting count_0; spatial relation, which compares the pixel centroids
of the largest subject and reference instances by the rule the renderer places them by: "left of"
holds iff dx < 0 and |dx| > 1.5 |dy| + 1 (dx, dy = subject - reference in pixels, y down;
shapes.RELATION_RATIO and RELATION_GAP), and likewise for the other relations, so a diagonal pair
of cells holds no relation (`relation_chance`: the rate of random placement). Then
    score = ( mean_j o_j + k ) / 2  /  (1 + n_extra)
with n_extra the detected objects whose (colour, shape) was not requested (wrong-colour objects,
"other" blobs). score == 1 iff every check passes and nothing extra is there ("correct").
"""

import itertools

import numpy as np
import torch
from scipy import ndimage

from demo.shapes import COLORS, _patch, _relation_holds, parse_prompt
from rewards import Reward

EXTENT_SQUARE, EXTENT_CIRCLE, EXTENT_TRIANGLE, MAX_ASPECT = 0.92, 0.66, 0.35, 1.5

_PALETTE = np.array([(0, 0, 0), *COLORS.values()], dtype=np.float32) / 255  # (1 + K, 3), 0 = black
_COLOR_NAMES = list(COLORS)


def nearest_colour(images):
    """(..., 3) float in [0, 1] -> (...) index of the nearest of black (0) and COLORS (1..K)."""
    dist = (_PALETTE ** 2).sum(-1) - 2 * images @ _PALETTE.T  # argmin |x - p|^2 = argmin (|p|^2 - 2 x.p)
    return dist.argmin(-1)


def detect_objects(images):
    """Find the objects in a batch of images.

    images: (B, H, W, 3) float in [0, 1]. Returns, per image, a list of dicts {"color", "shape",
    "area", "extent", "x", "y"} (x, y: pixel centroid, y down), specks removed (module docstring).
    """
    B, H, W, _ = images.shape  # batch, height, width, RGB
    classes = nearest_colour(images)  # (B, H, W), 0 = background
    onehot = classes[None] == np.arange(1, len(_PALETTE))[:, None, None, None]  # (K, B, H, W)
    structure = np.zeros((3, 3, 3, 3), dtype=bool)
    structure[1, 1] = True  # 8-connected within an image's colour plane, never across planes
    labels, n = ndimage.label(onehot, structure=structure)  # (K, B, H, W) int, 0 = none
    out = [[] for _ in range(B)]
    if n == 0:
        return out
    flat = np.flatnonzero(labels)  # flat indices of labelled pixels
    lab = labels.ravel()[flat]
    area = np.bincount(lab, minlength=n + 1)[1:]  # (n,) pixels per component
    cy = np.bincount(lab, weights=flat // W % H, minlength=n + 1)[1:] / area  # centroid row
    cx = np.bincount(lab, weights=flat % W, minlength=n + 1)[1:] / area  # centroid column
    slices = ndimage.find_objects(labels)
    color = np.array([s[0].start for s in slices])  # (n,)
    batch = np.array([s[1].start for s in slices])
    bh = np.array([s[2].stop - s[2].start for s in slices])
    bw = np.array([s[3].stop - s[3].start for s in slices])
    extent = area / (bh * bw)
    aspect = np.maximum(bh, bw) / np.minimum(bh, bw)
    shape = np.select([aspect > MAX_ASPECT, extent >= EXTENT_SQUARE, extent >= EXTENT_CIRCLE,
                       extent >= EXTENT_TRIANGLE], ["other", "square", "circle", "triangle"], "other")
    for i in np.flatnonzero(area >= max(4, H * W // 128)).tolist():  # drop specks
        out[int(batch[i])].append({
            "color": _COLOR_NAMES[color[i]], "shape": str(shape[i]), "area": int(area[i]),
            "extent": round(float(extent[i]), 4), "x": round(float(cx[i]), 2), "y": round(float(cy[i]), 2)})
    return out


def _score(found, meta):
    """Score one image's detected objects against its metadata (formula in the module docstring)."""
    per_object, o_scores = [], []
    for o in meta["objects"]:
        same = [d for d in found if d["color"] == o["color"] and d["shape"] == o["shape"]]
        checks = {"color_ok": any(d["color"] == o["color"] for d in found),
                  "shape_ok": any(d["shape"] == o["shape"] for d in found),
                  "present_ok": len(same) >= 1, "count_ok": len(same) == o["count"]}
        per_object.append({**o, "found": len(same), **checks})
        o_scores.append(sum(checks.values()) / 4)
    relation = None
    if meta["category"] == "spatial":
        relation = False
        tops = [max((d for d in found if (d["color"], d["shape"]) == (o["color"], o["shape"])),
                    key=lambda d: d["area"], default=None) for o in meta["objects"]]
        if None not in tops:
            s, r = tops
            relation = _relation_holds(s["y"] - r["y"], s["x"] - r["x"], meta["relation"])
    key = {"single": per_object[0]["present_ok"],
           "two_objects": all(p["present_ok"] for p in per_object),
           "counting": per_object[0]["count_ok"], "spatial": relation}[meta["category"]]
    requested = {(o["color"], o["shape"]) for o in meta["objects"]}
    n_extra = sum((d["color"], d["shape"]) not in requested for d in found)
    score = (float(np.mean(o_scores)) + float(key)) / 2 / (1 + n_extra)
    details = {name: all(p[name + "_ok"] for p in per_object)
               for name in ("present", "color", "shape", "count")}
    details.update(relation=relation, extra_objects=n_extra, correct=score == 1.0,
                   objects=per_object, detected=found)
    return score, details


def _as_float(images):
    """uint8 or float array -> float32 in [0, 1]."""
    images = np.asarray(images)
    if images.dtype == np.uint8:
        return images.astype(np.float32) / 255
    images = np.clip(images.astype(np.float32), 0.0, 1.0)
    images[np.isnan(images)] = 0.0  # NaN pixels count as background
    return images


def verify(image, meta):
    """Check one image against its prompt's metadata.

    image: (H, W, 3) uint8, or float in [0, 1]; meta: metadata dict. Returns (score in [0, 1],
    details): details holds "present", "color", "shape", "count" (bool, all requested objects),
    "relation" (bool, or None if not spatial), "extra_objects" (int), "correct" (bool),
    "objects" (per requested object) and "detected"; JSON serialisable.
    """
    image = _as_float(image)
    if image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(f"verify expects an (H, W, 3) image, got shape {image.shape}")
    return _score(detect_objects(image[None])[0], meta)


def verify_batch(images, metas):
    """Check a batch of generator outputs.

    images: torch tensor or numpy array (B, 3, H, W), float in [0, 1] (uint8 also accepted);
    metas: B metadata dicts. Returns (scores (B,) float32, details: list of B dicts as `verify`).
    """
    if hasattr(images, "detach"):  # torch tensor, without importing torch in this file
        images = images.detach().float().cpu().numpy()
    images = _as_float(images)
    if images.ndim != 4 or images.shape[1] != 3 or len(metas) != images.shape[0]:
        raise ValueError(f"verify_batch expects (B, 3, H, W) images and B metas, "
                         f"got shape {images.shape} and {len(metas)} metas")
    found = detect_objects(np.ascontiguousarray(images.transpose(0, 2, 3, 1)))  # (B, H, W, 3)
    results = [_score(f, m) for f, m in zip(found, metas)]
    return np.array([s for s, _ in results], dtype=np.float32), [d for _, d in results]


def relation_chance(metas, size=16, cell=8):
    """The relation's rate under random placement, as the verifier scores it: for each spatial meta,
    every ordered pair of distinct cells for subject and reference is drawn and verified; the mean
    over metas of the share whose relation holds. On a 2 × 2 grid with the verifier's rule (the
    renderer's) a relation holds for 2 of the 12 placements: 1/6."""
    n, rates = size // cell, []
    for meta in metas:
        holds = []
        for a, b in itertools.permutations(range(n * n), 2):
            image = np.zeros((size, size, 3), dtype=np.uint8)  # (H, W, RGB)
            for o, c in zip(meta["objects"], (a, b)):
                y, x = c // n * cell, c % n * cell
                image[y:y + cell - 1, x:x + cell - 1][_patch(o["shape"], cell - 1)] = COLORS[o["color"]]
            holds.append(verify(image, meta)[1]["relation"] is True)
        rates.append(np.mean(holds))
    return float(np.mean(rates))


# How an image fails its prompt: every image is exactly one of these ("correct": the score 1)
FAILURES = ("correct", "missing object", "wrong count", "extra object", "wrong relation")


def failure(details):
    """How an image fails its prompt, the first that applies of FAILURES, from `verify`'s details:
    a requested object missing (or in another colour or shape), a wrong count, an unrequested
    object, a wrong relation (the objects exactly right, their placement not); else "correct"."""
    if details["correct"]:
        return "correct"
    if not details["present"]:
        return "missing object"
    if not details["count"]:
        return "wrong count"
    return "extra object" if details["extra_objects"] else "wrong relation"


class ShapesReward(Reward):
    """The verifiable reward of the shapes world (`--reward shapes`): `verify_batch` on the images and
    the prompts' metas (metadata[i] when it is a shapes meta, else `shapes.parse_prompt(prompts[i])`).
    info["details"]: the verifier's per-image check results."""

    name = "shapes"

    def __init__(self, device="cpu"):  # a program, not a model: nothing to load or place
        self.device = device

    def metas(self, prompts, metadata):
        """The shapes metas of a batch: metadata[i] when it is one, else parsed from prompts[i]."""
        metas = []
        for prompt, meta in zip(prompts, metadata):
            if meta and "objects" in meta:  # a shapes meta dict (shapes.sample_prompts / parse_prompt)
                metas.append(meta)
                continue
            try:
                metas.append(parse_prompt(prompt))
            except ValueError as e:
                raise ValueError(f"{self.name} reward: '{prompt}' is not a shapes prompt ({e})") from None
        return metas

    def score(self, images, prompts, metadata):
        scores, details = verify_batch(images.cpu(), self.metas(prompts, metadata))
        return torch.as_tensor(np.asarray(scores, dtype=np.float32)), {"details": list(details)}


class ShapesPartialReward(ShapesReward):
    """A reward that pays a partly right image more than an empty one and nothing for copies
    (`--reward shapes_partial`): half for the requested objects, each drawn exactly as many times as
    asked, half for the whole image right (the verifier's "correct"),

        r = 1/2 · mean_j 1[found_j = n_j]  +  1/2 · 1[correct]

    For a spatial prompt: 0 for an empty canvas, 0.25 for one of its objects, 0.5 for both drawn once
    with the relation wrong (or with an extra object), 1 for the right image. The verifier's own score
    (`shapes`) pays a copy three quarters of an object, which RL exploits (experiments/study.md); a
    0/1 reward on the whole image pays a missing object like a wrong relation, which RL exploits by
    dropping objects. info["details"]: the verifier's per-image check results."""

    name = "shapes_partial"

    def score(self, images, prompts, metadata):
        _, details = verify_batch(images.cpu(), self.metas(prompts, metadata))
        r = [0.5 * float(np.mean([o["count_ok"] for o in d["objects"]])) + 0.5 * float(d["correct"])
             for d in details]
        return torch.tensor(r, dtype=torch.float32), {"details": list(details)}
