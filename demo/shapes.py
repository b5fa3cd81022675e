"""A small compositional text-to-image world with an exact verifier (verifier.py).

The pretraining data, the RL prompts and the verifiable reward of the default CPU run. It plays the
role GenEval / T2I-CompBench play for the real models: prompts test colour binding, counting and
spatial relations, and a program (not a learned model) checks the image.

World. Black canvas, flat objects of one pure colour each (COLORS: red, green, blue, yellow, all
at RGB distance >= 255 from each other and from black), shapes circle, square, triangle (apex up),
axis-aligned with a square bounding box, never overlapping (bounding boxes at least `margin`
pixels apart), drawn without anti-aliasing so every pixel has an exact colour. Object sides are
drawn at random from `_side_range(size)` (7..12 px at 32 px, 14..23 px at 64 px), positions at
random; a spatial prompt's subject and reference are placed so that their centroid offset along
the relation's axis exceeds 1.5 x the offset across it plus one pixel. `render` is deterministic
given its numpy Generator; it is the pretraining data (`make_dataset`).

Grammar (finite: 720 prompts; `all_prompts("all")` lists them). OBJ = "a COLOR SHAPE".
    single       OBJ                            "a red circle"
    two_objects  OBJ "and" OBJ                  "a red circle and a blue square"
    counting     NUM COLOR SHAPE[s]             "three yellow triangles"  (NUM: one .. four)
    spatial      OBJ REL OBJ                    "a green square left of a red circle"
REL is "left of" | "right of" | "above" | "below"; in two_objects and spatial prompts the two
objects differ in colour or shape. Metadata: {"prompt", "category", "objects": [{"color",
"shape", "count"}], "relation"}; for spatial prompts objects[0] is the subject, objects[1] the
reference ("subject REL reference").

Held-out split (never used for pretraining or RL; `is_heldout`). A prompt is held out if
  1. any object is a colour-shape pairing in HELDOUT_COLOR_SHAPE ("blue triangle", "yellow
     circle"), in any category; or
  2. it is spatial and (subject shape, relation, reference shape) is in HELDOUT_SPATIAL
     ("circle above square", "triangle left of square") or is the mirror of one ("square below
     circle", "square right of triangle": the same picture), whatever the colours.
Every word, every pairing's colour and shape, and every relation still occur in training, so the
held-out set (268 prompts; 452 train) measures composition of known parts, not new vocabulary.

Verifier: verifier.py (detection of the drawn objects and the score of an image against its
prompt), the exact reward of the shapes world.
"""
import functools
import itertools

import numpy as np

COLORS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0)}
SHAPES = ("circle", "square", "triangle")
RELATIONS = ("left of", "right of", "above", "below")
CATEGORIES = ("single", "two_objects", "counting", "spatial")
SPLITS = ("train", "heldout", "all")
NUMBERS = ("one", "two", "three", "four")  # counting prompts: 1 .. 4 objects
HELDOUT_COLOR_SHAPE = (("blue", "triangle"), ("yellow", "circle"))
HELDOUT_SPATIAL = (("circle", "above", "square"), ("triangle", "left of", "square"))
_MIRROR = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}

# ------------------------------------------------------------------ grammar


def _phrase(color, shape, count, det):
    """'a red circle' (det=True) or 'three red circles'."""
    if det:
        return f"a {color} {shape}"
    return f"{NUMBERS[count - 1]} {color} {shape}{'s' if count > 1 else ''}"


def _make_meta(category, objects, relation=None):
    """Build the metadata dict (and its prompt) from objects [(color, shape, count), ...]."""
    if category == "counting":
        prompt = _phrase(*objects[0], det=False)
    elif category == "single":
        prompt = _phrase(*objects[0], det=True)
    else:  # two_objects: "OBJ and OBJ"; spatial: "OBJ REL OBJ"
        joiner = "and" if category == "two_objects" else relation
        prompt = f"{_phrase(*objects[0], det=True)} {joiner} {_phrase(*objects[1], det=True)}"
    return {"prompt": prompt, "category": category,
            "objects": [{"color": c, "shape": s, "count": n} for c, s, n in objects],
            "relation": relation}


def parse_prompt(text):
    """Inverse of the grammar: prompt text -> metadata dict (see module docstring).

    Case and whitespace tolerant; "a"/"an" introduce one object, "one".."four" a counting prompt.
    Raises ValueError for anything outside the grammar.
    """
    words = str(text).lower().split()

    def fail(reason):
        raise ValueError(f"cannot parse shapes prompt {text!r}: {reason}")

    def obj(ws):  # "a COLOR SHAPE" -> (color, shape, 1)
        if len(ws) != 3 or ws[0] not in ("a", "an"):
            fail(f"expected 'a COLOR SHAPE', got {' '.join(ws)!r}")
        if ws[1] not in COLORS or ws[2] not in SHAPES:
            fail(f"unknown colour or shape in {' '.join(ws)!r}")
        return ws[1], ws[2], 1

    if len(words) == 3 and words[0] in NUMBERS:  # counting: singular after "one", else plural
        count = NUMBERS.index(words[0]) + 1
        shape = {s + ("s" if count > 1 else ""): s for s in SHAPES}.get(words[2])
        if words[1] not in COLORS or shape is None:
            fail(f"expected 'NUMBER COLOR SHAPE(s)', got {' '.join(words)!r}")
        return _make_meta("counting", [(words[1], shape, count)])
    if len(words) == 3:
        return _make_meta("single", [obj(words)])
    middle = " ".join(words[3:-3])
    if len(words) in (7, 8) and (middle == "and" or middle in RELATIONS):
        a, b = obj(words[:3]), obj(words[-3:])
        if a == b:
            fail("the two objects must differ in colour or shape")
        if middle == "and":
            return _make_meta("two_objects", [a, b])
        return _make_meta("spatial", [a, b], middle)
    fail("not a single, two-object, counting or spatial prompt")


def is_heldout(meta):
    """True if the prompt belongs to the held-out split (module docstring, 'Held-out split')."""
    pairs = {(o["color"], o["shape"]) for o in meta["objects"]}
    if pairs & set(HELDOUT_COLOR_SHAPE):
        return True
    if meta["category"] != "spatial":
        return False
    subj, ref = (o["shape"] for o in meta["objects"])
    return ((subj, meta["relation"], ref) in HELDOUT_SPATIAL
            or (ref, _MIRROR[meta["relation"]], subj) in HELDOUT_SPATIAL)


@functools.lru_cache(maxsize=None)
def _prompt_table(split):
    """category -> tuple of metas of a split (cached; callers get copies)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    pairs = list(itertools.product(COLORS, SHAPES))  # 12 (color, shape)
    ordered = [(a, b) for a, b in itertools.product(pairs, pairs) if a != b]  # 132
    metas = ([_make_meta("single", [(c, s, 1)]) for c, s in pairs]
             + [_make_meta("two_objects", [(*a, 1), (*b, 1)]) for a, b in ordered]
             + [_make_meta("counting", [(c, s, n)]) for c, s in pairs for n in range(1, 5)]
             + [_make_meta("spatial", [(*a, 1), (*b, 1)], r) for a, b in ordered for r in RELATIONS])
    keep = {"train": lambda m: not is_heldout(m), "heldout": is_heldout, "all": lambda m: True}[split]
    return {cat: tuple(m for m in metas if m["category"] == cat and keep(m)) for cat in CATEGORIES}


def _copy(meta):
    return {**meta, "objects": [dict(o) for o in meta["objects"]]}


def all_prompts(split="all"):
    """Every prompt of a split ("train", "heldout" or "all"), as metadata dicts, in a fixed order."""
    return [_copy(m) for cat in CATEGORIES for m in _prompt_table(split)[cat]]


def sample_prompts(n, rng, split="train", categories=CATEGORIES):
    """n metadata dicts: a category uniformly from `categories`, then a prompt uniformly within it.

    rng: numpy.random.Generator (the only randomness). Returns a list of n dicts.
    """
    table = _prompt_table(split)
    bad = [c for c in categories if c not in CATEGORIES or not table[c]]
    if bad or not categories:
        raise ValueError(f"categories must be non-empty, from {CATEGORIES}, got {categories!r}")
    cats = rng.integers(len(categories), size=n)
    return [_copy(table[categories[c]][rng.integers(len(table[categories[c]]))]) for c in cats]

# ------------------------------------------------------------------ tokenizer

VOCAB = (["<pad>", "a", "an", *NUMBERS, "and", "left", "right", "of", "above", "below"]
         + list(COLORS) + list(SHAPES) + [s + "s" for s in SHAPES])
_WORD_ID = {w: i for i, w in enumerate(VOCAB)}
MAX_PROMPT_TOKENS = max(len(m["prompt"].split()) for m in all_prompts("all"))  # 8


def tokenize(prompts, max_len=MAX_PROMPT_TOKENS):
    """Prompts -> word ids (B, max_len) int64, lower-cased, split on whitespace, right-padded with 0.

    Raises ValueError naming an unknown word or a prompt longer than max_len.
    """
    ids = np.zeros((len(prompts), max_len), dtype=np.int64)  # (B, max_len)
    for b, prompt in enumerate(prompts):
        words = prompt.lower().split()
        if len(words) > max_len:
            raise ValueError(f"prompt {prompt!r} has {len(words)} words, more than max_len={max_len}")
        for t, w in enumerate(words):
            if w not in _WORD_ID:
                raise ValueError(f"unknown word {w!r} in prompt {prompt!r} (not in shapes.VOCAB)")
            ids[b, t] = _WORD_ID[w]
    return ids


def detokenize(ids):
    """Word ids (B, L) -> prompts (padding dropped); the inverse of `tokenize` on grammar prompts."""
    return [" ".join(VOCAB[i] for i in row if i != 0) for row in np.asarray(ids).tolist()]

# ------------------------------------------------------------------ renderer


@functools.lru_cache(maxsize=None)
def _patch(shape, side):
    """Boolean (side, side) mask of a shape; a pixel is in if its centre is inside the shape."""
    c = np.arange(side) + 0.5 - side / 2  # pixel centres, origin at the patch centre
    x, y = c[None, :], c[:, None]  # (1, side), (side, 1)
    if shape == "square":
        return np.ones((side, side), dtype=bool)
    if shape == "circle":
        return x ** 2 + y ** 2 <= (side / 2) ** 2
    return np.abs(x) <= (y + side / 2) / 2  # triangle: apex at top centre, base on the bottom row


def _centroid(shape, y, x, side):
    ys, xs = np.nonzero(_patch(shape, side))
    return y + ys.mean(), x + xs.mean()


def _side_range(size):
    """Object side lengths in pixels: 7..12 at 32 px, 14..23 at 64 px."""
    lo = max(7, round(0.22 * size))
    return lo, max(lo, round(0.36 * size))


# A relation holds clearly: the subject-minus-reference centroid offset along the relation's axis
# exceeds 1.5 x the offset across it plus one pixel. The renderer places spatial prompts so, and the
# verifier checks the same rule (a diagonal pair of cells is neither drawn nor paid for).
RELATION_RATIO, RELATION_GAP = 1.5, 1.0


def _relation_holds(dy, dx, relation, ratio=RELATION_RATIO, gap=RELATION_GAP):
    """Subject-minus-reference centroid offset (dy, dx; y down) satisfies `relation`:
    the offset along the relation's axis has the right sign and |along| > ratio * |across| + gap."""
    along, across = {"left of": (-dx, dy), "right of": (dx, dy),
                     "above": (-dy, dx), "below": (dy, dx)}[relation]
    return along > 0 and along > ratio * abs(across) + gap


def _layout(shapes, size, rng, relation):
    """Top-left corners and sides [(y, x, side)] for objects of `shapes`, non-overlapping with a
    margin; for spatial prompts (relation given) shapes[0] is the subject, shapes[1] the reference,
    placed so that the relation holds clearly (|along| >= 1.5 |across| + 1 pixel)."""
    lo, hi = _side_range(size)
    margin = max(2, size // 16)
    apart = lambda a, b: max(b[0] - a[0] - a[2], a[0] - b[0] - b[2],
                             b[1] - a[1] - a[2], a[1] - b[1] - b[2]) >= margin
    for attempt in range(100):
        top = max(lo, hi - attempt // 10)  # crowded canvas: shrink the objects slowly
        boxes = []
        for side in rng.integers(lo, top + 1, size=len(shapes)).tolist():
            for _ in range(20):
                y, x = rng.integers(0, size - side + 1, size=2).tolist()
                if all(apart((y, x, side), b) for b in boxes):
                    boxes.append((y, x, side))
                    break
        if len(boxes) < len(shapes):
            continue
        if relation is not None:
            (ys, xs), (yr, xr) = (_centroid(s, *b) for s, b in zip(shapes[:2], boxes[:2]))
            if not _relation_holds(ys - yr, xs - xr, relation):
                continue
        return boxes
    # Deterministic fallback: smallest objects on a grid, or at both ends of the relation's axis.
    # Never reached at 32 or 64 px in 2000 samples; ~10% of prompts at 16 px (crowded canvas).
    if relation is not None:
        mid, end = (size - lo) // 2, size - lo
        horizontal = relation in ("left of", "right of")
        first, second = ((mid, 0), (mid, end)) if horizontal else ((0, mid), (end, mid))
        subj, ref = (first, second) if relation in ("left of", "above") else (second, first)
        return [(*subj, lo), (*ref, lo)]
    k = int(np.ceil(np.sqrt(len(shapes))))
    cells = np.linspace(0, size - lo, k).round().astype(int).tolist()
    return [(cells[i // k], cells[i % k], lo) for i in range(len(shapes))]


def _cell_layout(shapes, size, rng, relation, cell):
    """Objects aligned to a grid of cell × cell pixels: each object fills one cell (side cell − 1,
    so objects in neighbouring cells never touch), in distinct random cells; a spatial prompt's
    cells are drawn until its relation holds as clearly as in `_layout`."""
    n = size // cell
    if len(shapes) > n * n:
        raise ValueError(f"{len(shapes)} objects do not fit a {n}×{n} grid of {cell}-px cells")
    for _ in range(1000):
        cells = rng.choice(n * n, size=len(shapes), replace=False).tolist()
        boxes = [(c // n * cell, c % n * cell, cell - 1) for c in cells]
        if relation is None:
            return boxes
        (ys, xs), (yr, xr) = (_centroid(s, *b) for s, b in zip(shapes[:2], boxes[:2]))
        if _relation_holds(ys - yr, xs - xr, relation):
            return boxes
    raise ValueError(f"no {cell}-px cell layout of {shapes} satisfies {relation!r}")


def render(meta, size=32, rng=None, cell=0, unmentioned=(), follow_relation=True):
    """Draw a prompt: (size, size, 3) uint8 RGB, black background.

    meta: metadata dict (see module docstring); size: canvas side in pixels (>= 16); rng:
    numpy.random.Generator deciding object sizes and positions (same state -> same image);
    cell: 0 for free sizes and positions, or a cell size in pixels to align every object to a
    grid of cells (`_cell_layout`; `python -m demo.pretrain --cell`: with 2-pixel tokens, objects
    aligned to 8-px cells are what a small base learns to draw); unmentioned: (colour, shape) pairs
    drawn besides the prompt's objects (an under-captioned image, `make_dataset`), placed after them;
    follow_relation: False places a spatial prompt's two objects as any two objects (a caption whose
    relation the image does not keep, `make_dataset`'s relation_p).
    """
    if rng is None:
        raise ValueError("render needs rng: a numpy.random.Generator")
    if not isinstance(size, (int, np.integer)) or size < 16:
        raise ValueError(f"size must be an int >= 16, got {size!r}")
    items = []  # one (color, shape) per drawn object
    for o in meta["objects"]:
        if o["color"] not in COLORS or o["shape"] not in SHAPES:
            raise ValueError(f"unknown colour or shape in meta object {o!r}")
        items += [(o["color"], o["shape"])] * int(o["count"])
    if meta.get("relation") is not None and len(items) != 2:
        raise ValueError(f"a spatial meta needs two single objects, got {meta['objects']!r}")
    items += list(unmentioned)  # after the prompt's objects: a spatial prompt's pair stays first
    image = np.zeros((size, size, 3), dtype=np.uint8)  # (H, W, RGB)
    shapes_ = [s for _, s in items]
    relation = meta.get("relation") if follow_relation else None
    boxes = _cell_layout(shapes_, size, rng, relation, cell) if cell else _layout(shapes_, size, rng, relation)
    for (color, shape), (y, x, side) in zip(items, boxes):
        image[y:y + side, x:x + side][_patch(shape, side)] = COLORS[color]
    return image


def unmentioned_object(meta, size, rng, cell=0):
    """One random (colour, shape) pair that `meta` does not request, or None where no object fits
    beside the prompt's (a full cell grid, or four objects already on a free canvas)."""
    drawn = sum(int(o["count"]) for o in meta["objects"])
    room = (size // cell) ** 2 if cell else 4
    if drawn >= room:
        return None
    requested = {(o["color"], o["shape"]) for o in meta["objects"]}
    pairs = [p for p in itertools.product(COLORS, SHAPES) if p not in requested]
    return pairs[rng.integers(len(pairs))]


def make_dataset(n, size, rng, split="train", cell=0, unmentioned=0.0, relation_p=1.0, mirror_p=0.0,
                 categories=CATEGORIES):
    """n rendered prompts of a split: images (n, size, size, 3) uint8 and their metadata dicts.

    unmentioned: the probability that an image also shows one object its prompt does not mention
    (`unmentioned_object`), as web images show more than their captions say; the verifier counts
    such an object as an error, so a base pretrained on these data makes an error that RL can remove
    (`python -m demo.pretrain --unmentioned`). relation_p: the probability that a spatial prompt's
    image keeps its relation; otherwise its two objects lie anywhere (a caption that is only partly
    reliable, so a base learns the relation as a tendency RL can strengthen); mirror_p: the probability
    that a spatial prompt's image (one that keeps a relation) shows the mirrored one instead, "left of"
    drawn as "right of" (a caption written from the other side, so a base learns the relation's axis
    but not its direction, which no sampling temperature can fix); categories: the prompt categories
    drawn (`sample_prompts`). At unmentioned 0, relation_p 1, mirror_p 0 and every category the images
    and the random stream are those of the clean world.
    """
    metas = sample_prompts(n, rng, split, categories)
    images = np.zeros((n, size, size, 3), dtype=np.uint8)  # (n, H, W, RGB)
    for i, meta in enumerate(metas):
        extra = unmentioned_object(meta, size, rng, cell) if unmentioned and rng.random() < unmentioned else None
        spatial = meta["category"] == "spatial"
        follow = relation_p >= 1 or not spatial or rng.random() < relation_p
        drawn = meta
        if spatial and follow and mirror_p > 0 and rng.random() < mirror_p:  # the caption's other side
            drawn = {**meta, "relation": _MIRROR[meta["relation"]]}
        images[i] = render(drawn, size, rng, cell, unmentioned=[extra] if extra else (), follow_relation=follow)
    return images, metas
