"""Tests for demo/shapes.py: grammar, split, tokenizer, renderer, verifier (CPU, seeded, seconds)."""
import itertools
import json

import numpy as np
import pytest
import torch

from demo import shapes
from demo import verifier


def _batch(images, rng=None, sigma=0.0):
    """(B, H, W, 3) uint8 -> (B, 3, H, W) float in [0, 1], optionally with Gaussian pixel noise."""
    x = images.transpose(0, 3, 1, 2).astype(np.float32) / 255  # (B, 3, H, W)
    if sigma:
        x = np.clip(x + sigma * rng.standard_normal(x.shape).astype(np.float32), 0, 1)
    return x


# ------------------------------------------------------------------ grammar and split

def test_parse_prompt_round_trip_and_tolerance():
    metas = shapes.all_prompts("all")
    assert len(metas) == 12 + 132 + 48 + 528
    assert len({m["prompt"] for m in metas}) == len(metas)
    for m in metas:
        assert shapes.parse_prompt(m["prompt"]) == m
        json.dumps(m)
    assert shapes.parse_prompt("  A   Red CIRCLE ") == shapes.parse_prompt("a red circle")
    blue_square = [{"color": "blue", "shape": "square", "count": 1}]
    assert shapes.parse_prompt("an blue square")["objects"] == blue_square
    assert shapes.parse_prompt("one red circle")["category"] == "counting"
    m = shapes.parse_prompt("three yellow triangles")
    assert m["category"] == "counting" and m["objects"][0]["count"] == 3
    m = shapes.parse_prompt("a green square left of a red circle")
    assert m["relation"] == "left of" and [o["shape"] for o in m["objects"]] == ["square", "circle"]
    for bad in ["", "a purple circle", "two red circle", "one red circles", "five red circles",
                "a red circle and a red circle", "a red circle near a blue square",
                "a red circle left a blue square", "red circle", "a red circle and two blue squares"]:
        with pytest.raises(ValueError, match="cannot parse shapes prompt"):
            shapes.parse_prompt(bad)


def test_heldout_split_is_disjoint_and_uses_training_words():
    train, held = shapes.all_prompts("train"), shapes.all_prompts("heldout")
    train_prompts = {m["prompt"] for m in train}
    assert not train_prompts & {m["prompt"] for m in held}
    assert len(train) + len(held) == len(shapes.all_prompts("all"))
    assert all(not shapes.is_heldout(m) for m in train) and all(shapes.is_heldout(m) for m in held)
    # No held-out composition appears in training, in any category or phrasing.
    for m in train:
        for o in m["objects"]:
            assert (o["color"], o["shape"]) not in shapes.HELDOUT_COLOR_SHAPE
        if m["category"] == "spatial":
            subj, ref = (o["shape"] for o in m["objects"])
            mirror = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
            assert (subj, m["relation"], ref) not in shapes.HELDOUT_SPATIAL
            assert (ref, mirror[m["relation"]], subj) not in shapes.HELDOUT_SPATIAL
    assert shapes.is_heldout(shapes.parse_prompt("two blue triangles"))
    assert shapes.is_heldout(shapes.parse_prompt("a red square below a green circle"))
    assert not shapes.is_heldout(shapes.parse_prompt("a red square above a green circle"))
    # Held-out prompts use only words seen in training; every category has held-out prompts.
    train_words = {w for m in train for w in m["prompt"].split()}
    assert {w for m in held for w in m["prompt"].split()} <= train_words
    assert {m["category"] for m in held} == set(shapes.CATEGORIES)


def test_sample_prompts_split_categories_and_determinism():
    a = shapes.sample_prompts(200, np.random.default_rng(3), "heldout")
    b = shapes.sample_prompts(200, np.random.default_rng(3), "heldout")
    assert a == b and all(shapes.is_heldout(m) for m in a)
    counts = {c: sum(m["category"] == c for m in a) for c in shapes.CATEGORIES}
    assert min(counts.values()) > 30  # categories are drawn uniformly, not by pool size
    spatial = shapes.sample_prompts(50, np.random.default_rng(0), "train", categories=("spatial",))
    assert all(m["category"] == "spatial" and not shapes.is_heldout(m) for m in spatial)
    with pytest.raises(ValueError):
        shapes.sample_prompts(4, np.random.default_rng(0), "test")
    with pytest.raises(ValueError):
        shapes.sample_prompts(4, np.random.default_rng(0), "train", categories=("colors",))


# ------------------------------------------------------------------ tokenizer

def test_tokenizer_round_trip_and_errors():
    prompts = [m["prompt"] for m in shapes.all_prompts("all")]
    assert shapes.VOCAB[0] == "<pad>" and len(set(shapes.VOCAB)) == len(shapes.VOCAB)
    assert shapes.MAX_PROMPT_TOKENS == max(len(p.split()) for p in prompts) == 8
    ids = shapes.tokenize(prompts)
    assert ids.dtype == np.int64 and ids.shape == (len(prompts), shapes.MAX_PROMPT_TOKENS)
    assert shapes.detokenize(ids) == prompts
    lengths = (ids != 0).sum(1)
    assert (lengths == [len(p.split()) for p in prompts]).all()
    padding = np.arange(shapes.MAX_PROMPT_TOKENS)[None] >= lengths[:, None]  # (B, L)
    assert (ids[padding] == 0).all()  # right-padded
    assert (shapes.tokenize(["A  RED circle"], 5) == shapes.tokenize(["a red circle"], 5)).all()
    with pytest.raises(ValueError, match="'purple'"):
        shapes.tokenize(["a purple circle"])
    with pytest.raises(ValueError):
        shapes.tokenize(["a red circle left of a blue square"], max_len=4)


# ------------------------------------------------------------------ renderer

def test_render_is_deterministic_and_draws_the_prompt():
    meta = shapes.parse_prompt("four green triangles")
    a = shapes.render(meta, 32, np.random.default_rng(7))
    b = shapes.render(meta, 32, np.random.default_rng(7))
    c = shapes.render(meta, 32, np.random.default_rng(8))
    assert a.shape == (32, 32, 3) and a.dtype == np.uint8
    assert (a == b).all() and (a != c).any()
    colours = {tuple(p) for p in a.reshape(-1, 3).tolist()}
    assert colours == {(0, 0, 0), shapes.COLORS["green"]}
    imgs1, metas1 = shapes.make_dataset(16, 32, np.random.default_rng(5))
    imgs2, metas2 = shapes.make_dataset(16, 32, np.random.default_rng(5))
    assert imgs1.shape == (16, 32, 32, 3) and imgs1.dtype == np.uint8
    assert (imgs1 == imgs2).all() and metas1 == metas2
    # Objects scale with the canvas.
    area = lambda img: (img.sum(-1) > 0).mean()
    m = shapes.parse_prompt("a red square")
    a32 = np.mean([area(shapes.render(m, 32, np.random.default_rng(s))) for s in range(20)])
    a64 = np.mean([area(shapes.render(m, 64, np.random.default_rng(s))) for s in range(20)])
    assert abs(a32 - a64) < 0.05
    with pytest.raises(ValueError):
        shapes.render(m, 32)


@pytest.mark.parametrize("size", [32, 64])
def test_verifier_accepts_every_rendering_clean_and_noisy(size):
    rng = np.random.default_rng(size)
    images, metas = shapes.make_dataset(300, size, rng, split="all")
    scores, details = verifier.verify_batch(_batch(images), metas)
    assert scores.dtype == np.float32 and scores.shape == (300,)
    assert (scores == 1.0).all() and all(d["correct"] for d in details)
    scores, details = verifier.verify_batch(_batch(images, rng, sigma=0.05), metas)  # mild pixel noise
    assert (scores == 1.0).all(), [m["prompt"] for m, s in zip(metas, scores) if s < 1]
    json.dumps(details)
    score, d = verifier.verify(images[0], metas[0])  # single uint8 (H, W, 3) image
    assert score == 1.0 and d["correct"]


def test_verifier_accepts_small_canvas_and_torch_input():
    images, metas = shapes.make_dataset(100, 16, np.random.default_rng(1), split="all")
    x = _batch(images)
    scores, _ = verifier.verify_batch(torch.from_numpy(x), metas)
    assert (scores == 1.0).all()
    assert (scores == verifier.verify_batch(x, metas)[0]).all()


def test_shape_classification_by_extent_for_all_rendered_sides():
    sides = [(32, side) for side in range(7, 25)] + [(64, side) for side in range(14, 48)]
    for size, side in sides:  # covers shapes._side_range at 16, 32 and 64 px and beyond
        for shape in shapes.SHAPES:
            img = np.zeros((1, size, size, 3), np.float32)  # (B, H, W, 3)
            img[0, 4:4 + side, 4:4 + side][shapes._patch(shape, side)] = 1.0  # white -> nearest: yellow
            found = verifier.detect_objects(img)[0]
            assert [d["shape"] for d in found] == [shape], (shape, side)


# ------------------------------------------------------------------ verifier: wrong images

def test_verifier_score_formula_on_hand_made_cases():
    rng = np.random.default_rng(0)
    two = shapes.render(shapes.parse_prompt("two red circles"), 32, rng)
    score, d = verifier.verify(two, shapes.parse_prompt("a red circle"))  # count fails: o = 3/4, key = 1
    assert score == pytest.approx((0.75 + 1) / 2) and not d["count"] and d["present"]
    pair = shapes.render(shapes.parse_prompt("a red circle and a blue square"), 32, rng)
    score, d = verifier.verify(pair, shapes.parse_prompt("a red circle"))  # one extra object halves it
    assert score == pytest.approx(0.5) and d["extra_objects"] == 1 and not d["correct"]
    swapped = shapes.parse_prompt("a red square and a blue circle")  # binding swapped: 2 extras
    score, d = verifier.verify(pair, swapped)
    assert d["color"] and d["shape"] and not d["present"]
    assert score == pytest.approx((0.5 + 0) / 2 / 3)


def test_verifier_rejects_swapped_relations_wrong_colours_and_counts():
    rng = np.random.default_rng(11)
    mirror = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
    for meta in shapes.sample_prompts(40, rng, "all", categories=("spatial",)):
        image = shapes.render(meta, 32, rng)
        wrong = shapes.parse_prompt(meta["prompt"].replace(meta["relation"], mirror[meta["relation"]]))
        score, d = verifier.verify(image, wrong)
        assert d["relation"] is False and score <= 0.5
    for meta in shapes.sample_prompts(40, rng, "all", categories=("single", "two_objects")):
        image = shapes.render(meta, 32, rng)
        used = {o["color"] for o in meta["objects"]}
        new = next(c for c in shapes.COLORS if c not in used)
        wrong = shapes.parse_prompt(meta["prompt"].replace(meta["objects"][0]["color"], new, 1))
        score, d = verifier.verify(image, wrong)
        assert not d["color"] and score <= 0.25
    for meta in shapes.sample_prompts(40, rng, "all", categories=("counting",)):
        image = shapes.render(meta, 32, rng)
        n = meta["objects"][0]["count"]
        wrong = dict(meta, objects=[dict(meta["objects"][0], count=n % 4 + 1)])
        score, d = verifier.verify(image, wrong)
        assert not d["count"] and d["objects"][0]["found"] == n and score <= 0.375


def test_verifier_pays_a_relation_exactly_where_the_renderer_draws_one():
    """The verifier's relation rule is the renderer's (|along| > 1.5 |across| + 1): in the cell world
    a pair of cells in one row or column is paid, a diagonal pair is paid for no relation, and the
    rule's edge sits where stated."""
    meta = shapes.parse_prompt("a red square left of a green circle")
    subject, reference = shapes._patch("square", 7), shapes._patch("circle", 7)
    paid = {}
    for (rs, cs), (rr, cr) in itertools.permutations(itertools.product(range(2), range(2)), 2):
        image = np.zeros((16, 16, 3), dtype=np.uint8)
        image[rs * 8:rs * 8 + 7, cs * 8:cs * 8 + 7][subject] = shapes.COLORS["red"]
        image[rr * 8:rr * 8 + 7, cr * 8:cr * 8 + 7][reference] = shapes.COLORS["green"]
        paid[(rs, cs), (rr, cr)] = verifier.verify(image, meta)[1]["relation"]
    assert {k for k, v in paid.items() if v} == {((0, 0), (0, 1)), ((1, 0), (1, 1))}
    assert paid[(1, 0), (0, 1)] is False and paid[(0, 0), (1, 1)] is False  # diagonals: not paid
    holds = shapes._relation_holds
    assert holds(0, -7.1, "left of") and not holds(4, -7.0, "left of")  # 7.0 = 1.5 * 4 + 1: not beyond the edge
    assert holds(-7.1, 0, "above") and not holds(-6.9, 4, "above") and not holds(7.1, 0, "above")
    rng = np.random.default_rng(5)
    for meta in shapes.sample_prompts(60, rng, "all", categories=("spatial",)):
        for cell in (0, 8):
            assert verifier.verify(shapes.render(meta, 16, rng, cell=cell), meta)[1]["relation"] is True


def test_relation_chance_is_one_sixth_in_the_two_by_two_cell_world(monkeypatch):
    """verifier.relation_chance: under the verifier's rule a relation holds for 2 of the 12 ordered
    placements of two objects in distinct cells of 2 × 2 (never diagonally), on both splits; the
    looser rule |along| > |across| pays for diagonals and gives more."""
    for split in ("train", "heldout"):
        metas = shapes.sample_prompts(12, np.random.default_rng(0), split, categories=("spatial",))
        assert verifier.relation_chance(metas) == pytest.approx(1 / 6)
    monkeypatch.setattr(verifier, "_relation_holds", lambda dy, dx, rel: shapes._relation_holds(dy, dx, rel, 1.0, 0.0))
    assert verifier.relation_chance(metas) > 0.19


def test_relation_p_keeps_the_relation_with_that_probability_and_changes_nothing_at_one():
    """make_dataset(relation_p=p): a spatial prompt's image keeps its relation with probability p
    (plus chance otherwise); other categories are untouched; p = 1 with every category is the clean
    world, draw for draw; categories restricts the prompts drawn."""
    def rate(p, seed):
        imgs, metas = shapes.make_dataset(600, 16, np.random.default_rng(seed), cell=8, relation_p=p)
        spatial = [(i, m) for i, m in zip(imgs, metas) if m["category"] == "spatial"]
        return np.mean([verifier.verify(i, m)[1]["relation"] is True for i, m in spatial]), len(spatial)

    assert rate(1.0, 0)[0] == 1.0
    r0, n = rate(0.0, 1)
    assert abs(r0 - 1 / 6) < 3 * np.sqrt(1 / 6 * 5 / 6 / n)  # random distinct cells: 2 of 12 placements hold
    r_half, n = rate(0.5, 2)
    assert abs(r_half - (0.5 + 0.5 / 6)) < 3 * np.sqrt(0.25 / n)
    a = shapes.make_dataset(40, 16, np.random.default_rng(3), cell=8)
    b = shapes.make_dataset(40, 16, np.random.default_rng(3), cell=8, relation_p=1.0)
    assert np.array_equal(a[0], b[0]) and a[1] == b[1]
    c = shapes.make_dataset(40, 16, np.random.default_rng(3), cell=8, categories=shapes.CATEGORIES)
    assert np.array_equal(a[0], c[0]) and a[1] == c[1]
    assert {m["category"] for m in shapes.make_dataset(40, 16, np.random.default_rng(3), categories=("spatial",))[1]} == {"spatial"}
    imgs0, metas0 = shapes.make_dataset(200, 16, np.random.default_rng(4), cell=8, relation_p=0.0)
    scores = [verifier.verify(i, m)[0] for i, m in zip(imgs0, metas0) if m["category"] != "spatial"]
    assert scores and min(scores) == 1.0


def test_mirror_p_draws_the_mirrored_relation_with_that_probability_and_changes_nothing_at_zero():
    """make_dataset(mirror_p=q): a spatial prompt's image shows the mirrored relation ("left of" drawn
    as "right of") with probability q and its own otherwise, never anything else; q = 0 is the
    clean world, draw for draw; other categories stay right."""
    mirror = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}

    def outcomes(q, seed):
        imgs, metas = shapes.make_dataset(600, 16, np.random.default_rng(seed), cell=8, mirror_p=q)
        own, mirrored, other = 0, 0, []
        for image, m in zip(imgs, metas):
            if m["category"] != "spatial":
                other.append(verifier.verify(image, m)[0])
                continue
            holds = verifier.verify(image, m)[1]["relation"] is True
            flipped = verifier.verify(image, {**m, "relation": mirror[m["relation"]]})[1]["relation"] is True
            own, mirrored = own + holds, mirrored + flipped
            assert holds != flipped  # one of the two, always
        return own, mirrored, other

    own, mirrored, other = outcomes(0.3, 5)
    n = own + mirrored
    assert abs(mirrored / n - 0.3) < 3 * np.sqrt(0.3 * 0.7 / n) and min(other) == 1.0
    assert outcomes(1.0, 6)[0] == 0
    a = shapes.make_dataset(40, 16, np.random.default_rng(3), cell=8)
    b = shapes.make_dataset(40, 16, np.random.default_rng(3), cell=8, mirror_p=0.0)
    assert np.array_equal(a[0], b[0]) and a[1] == b[1]


def test_verifier_gives_blank_and_noise_images_low_scores():
    rng = np.random.default_rng(2)
    metas = shapes.sample_prompts(64, rng, "all")
    scores, details = verifier.verify_batch(np.zeros((64, 3, 32, 32), np.float32), metas)
    assert (scores == 0).all() and not any(d["correct"] for d in details)
    scores, details = verifier.verify_batch(rng.random((64, 3, 32, 32), dtype=np.float32), metas)
    assert scores.max() < 0.1 and not any(d["correct"] for d in details)
    with pytest.raises(ValueError):
        verifier.verify_batch(np.zeros((2, 32, 32, 3), np.float32), metas[:2])


def test_cell_layout_aligns_objects_to_the_grid_and_verifies():
    """render(..., cell=8): every object fills the top-left 7×7 pixels of its own 8-px cell (so
    neighbours never touch), and the unchanged verifier accepts every rendering."""
    rng = np.random.default_rng(3)
    images, metas = shapes.make_dataset(200, 32, rng, split="all", cell=8)
    scores, _ = verifier.verify_batch(torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255, metas)
    assert (scores == 1).all()
    coloured = images.max(-1) > 0  # (n, H, W)
    assert not coloured[:, 7::8, :].any() and not coloured[:, :, 7::8].any()  # the last row/column of each cell
    cells = coloured.reshape(200, 4, 8, 4, 8).any(axis=(2, 4))  # (n, 4, 4) cells holding an object
    counts = [sum(o["count"] for o in m["objects"]) for m in metas]
    assert cells.reshape(200, 16).sum(1).tolist() == counts  # one object per cell, each in its own
    with pytest.raises(ValueError, match="do not fit"):
        shapes.render(shapes.parse_prompt("four red squares"), size=16, rng=rng, cell=16)


@pytest.mark.parametrize("size,cell", [(16, 8), (32, 0)])
def test_unmentioned_objects_are_one_extra_object_the_verifier_counts(size, cell):
    """make_dataset(..., unmentioned=1): every image with room shows its prompt exactly (every check
    passes, the spatial relation included) plus one object of a pair the prompt does not request, so
    the verifier finds one extra object and scores 1/2; an image without room (four objects) stays
    exact. At 0 the images and metadata are the clean world's, draw for draw."""
    images, metas = shapes.make_dataset(120, size, np.random.default_rng(5), split="all", cell=cell, unmentioned=1.0)
    scores, details = verifier.verify_batch(torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255, metas)
    full = np.array([sum(o["count"] for o in m["objects"]) == 4 for m in metas])
    assert 0 < full.sum() < len(metas)
    assert [d["extra_objects"] for d in details] == (~full).astype(int).tolist()
    assert np.allclose(scores, np.where(full, 1.0, 0.5))
    assert all(d["present"] and d["count"] and d["relation"] is not False for d in details)
    rng = np.random.default_rng(5)  # the clean world by hand: prompts, then one render after another
    clean_metas = shapes.sample_prompts(120, rng, "all")
    clean = np.stack([shapes.render(m, size, rng, cell) for m in clean_metas])
    same = shapes.make_dataset(120, size, np.random.default_rng(5), split="all", cell=cell, unmentioned=0.0)
    assert (same[0] == clean).all() and same[1] == clean_metas
    half = shapes.make_dataset(400, size, np.random.default_rng(6), split="train", cell=cell, unmentioned=0.5)
    _, details = verifier.verify_batch(torch.from_numpy(half[0]).permute(0, 3, 1, 2).float() / 255, half[1])
    room = [sum(o["count"] for o in m["objects"]) < 4 for m in half[1]]
    extra = [d["extra_objects"] for d, r in zip(details, room) if r]
    assert set(extra) == {0, 1} and 0.4 < np.mean(extra) < 0.6  # binomial sd 0.026 at ~370 images
