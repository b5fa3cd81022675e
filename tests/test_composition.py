"""The compositional rewards' rules and records: the released prompt metadata, and the scoring rules
of the GroundingDINO reward against the released code and hand computations.

- composition_rules RELEASED agrees with the released reward_gdino.py on 688 detections
  (fixtures/gdino_released_scores.json: the released scoring functions run on random and edge-case
  boxes with the detector stubbed); FIXED with it wherever no fix applies, and with hand-computed
  scores for every locality, numeracy and each fix.
- scorers/detector.py's post-processing and thresholding against the table.
- The released records' checks; the min-max combination of the released mix.
The models themselves (tiny folders in the Hugging Face layout) are tests/test_composition_models.py's.
"""

import json
import re

import pytest
import torch

import grpo
from infra import prompt_records
from scorers import composition_rules as cr
from scorers import detector
from tests.helpers import FIXTURES


TABLE = json.loads((FIXTURES / "gdino_released_scores.json").read_text())["cases"]


def detections(d):
    return cr.Detections(torch.tensor(d["boxes"], dtype=torch.float32).reshape(-1, 4),
                         torch.tensor(d["scores"], dtype=torch.float32), list(d["labels"]))


def fix_applies(case):
    """True where a FIXED rule changes what is asked or how it is scored (module docstring 1-5)."""
    r = case["record"]
    spatial = r.get("spatial_info") if r["task_type"] == "spatial" else None
    return (r["task_type"] == "numeracy" or any(len(n.split()) > 2 for n in r["nouns"])
            or (spatial is not None and (spatial["obj1"] == spatial["obj2"]
                                         or spatial["locality"] in ("above", "on top of", "near", "next to", "on side of"))))


def test_released_rules_agree_with_the_released_code():
    assert len(TABLE) >= 600 and {c["record"]["task_type"] for c in TABLE} == set(prompt_records.TASK_TYPES)
    assert {c["record"]["spatial_info"]["locality"] for c in TABLE if c["record"]["task_type"] == "spatial"} >= set(
        prompt_records.LOCALITIES) - {"on top of"}
    for case in TABLE:
        got = cr.gdino_score(case["record"], detections(case["detections"]), cr.RELEASED)
        assert got == pytest.approx(case["score"], abs=1e-6), case["case"]


def test_fixed_rules_agree_where_no_fix_applies():
    kept = [c for c in TABLE if not fix_applies(c)]
    assert len(kept) > 200
    for case in kept:
        assert cr.gdino_score(case["record"], detections(case["detections"]), cr.FIXED) == pytest.approx(case["score"], abs=1e-6)


def test_detector_post_processing_agrees_with_the_released_code():
    for case in TABLE:
        nouns = case["record"]["nouns"]
        if not nouns:
            continue
        caption, spans, labels = detector.caption_and_spans(nouns, whole_nouns=False)
        assert caption == case["det_prompt"]["text_prompt"]
        assert [[list(s) for s in noun] for noun in spans] == case["det_prompt"]["token_spans"]
        raw = case["raw"]
        det = detector.detections_from_scores(torch.tensor(raw["logits_for_phrases"]).reshape(len(labels), -1), torch.tensor(raw["boxes_cxcywh_norm"]).reshape(-1, 4),
                                              labels)
        want = detections(case["detections"])
        assert det.labels == want.labels and torch.equal(det.boxes, want.boxes) and torch.equal(det.scores, want.scores)


def test_the_box_threshold_is_strict():
    boxes = torch.tensor([box(0.1, 0.1), box(0.5, 0.5), box(0.9, 0.9)])
    det = detector.detections_from_scores(torch.tensor([[0.3, 0.31, 0.2], [0.9, 0.3, 0.29]]), boxes, ["cat", "dog"])
    assert det.labels == ["cat", "dog"] and torch.equal(det.boxes, boxes[[1, 0]]) and det.scores.tolist() == pytest.approx([0.31, 0.9])


def box(cx, cy, w=0.1, h=0.1):
    return [cx, cy, w, h]


def spatial(locality, b1, b2, obj1="cat", obj2="dog", s1=0.9, s2=0.8):
    record = {"prompt": "p", "task_type": "spatial", "nouns": [obj1, obj2],
              "spatial_info": {"obj1": obj1, "obj2": obj2, "locality": locality}}
    det = cr.Detections(torch.tensor([b1, b2]), torch.tensor([s1, s2]), [obj1, obj2])
    return {rules: cr.gdino_score(record, det, rules) for rules in ("RELEASED", "FIXED") for rules in [getattr(cr, rules)]}


@pytest.mark.parametrize("locality, b1, b2, released, fixed", [
    # obj1 left of obj2, apart (IoU 0): 0.4 + 1/2
    ("left of", box(0.2, 0.5), box(0.8, 0.5), 0.9, 0.9), ("on the left of", box(0.2, 0.5), box(0.8, 0.5), 0.9, 0.9),
    ("left of", box(0.8, 0.5), box(0.2, 0.5), 0.4, 0.4),                  # the other way round: presence only
    ("right of", box(0.8, 0.5), box(0.2, 0.5), 0.9, 0.9), ("on the right of", box(0.2, 0.5), box(0.8, 0.5), 0.4, 0.4),
    ("below", box(0.5, 0.8), box(0.5, 0.2), 0.9, 0.9), ("on the bottom of", box(0.5, 0.2), box(0.5, 0.8), 0.4, 0.4),
    ("on the top of", box(0.5, 0.2), box(0.5, 0.8), 0.9, 0.9),
    ("above", box(0.5, 0.2), box(0.5, 0.8), 0.4, 0.9),                     # fix 1: released never scores 'above'
    ("on top of", box(0.5, 0.2), box(0.5, 0.8), 0.4, 0.9),
    ("above", box(0.5, 0.8), box(0.5, 0.2), 0.4, 0.4),
    ("left of", box(0.2, 0.5), box(0.8, 0.9), 0.9, 0.9),                   # |dx| 0.6 > |dy| 0.4
    ("left of", box(0.2, 0.2), box(0.6, 0.8), 0.4, 0.4),                   # |dx| 0.4 < |dy| 0.6: mostly below
    ("left of", box(0.2, 0.2), box(0.6, 0.6), 0.4, 0.4),                   # |dx| == |dy|: strict, no direction
    # overlapping: (0.4, 0.5, 0.4, 0.4) and (0.6, 0.5, 0.4, 0.4): IoU = 0.08·... = 1/3 -> 0.1/(1/3) = 0.3
    ("left of", box(0.4, 0.5, 0.4, 0.4), box(0.6, 0.5, 0.4, 0.4), 0.4 + 0.3 / 2, 0.4 + 0.3 / 2),
    # near: released D = 150 on normalised units is always met; fixed D = 150/512 of the side
    ("near", box(0.1, 0.1), box(0.9, 0.9), 0.9, 0.4 + (150 / 512) / 0.8 / 2),
    ("next to", box(0.1, 0.5), box(0.9, 0.6), 0.9, 0.9),                   # |dy| 0.1 < D
    ("on side of", box(0.1, 0.1), box(0.5, 0.5), 0.9, 0.9),                # |dx| 0.4 ≥ D, but... see below
])
def test_every_locality_by_hand(locality, b1, b2, released, fixed):
    if locality == "on side of":  # |dx| = |dy| = 0.4 > 150/512 = 0.293: D / 0.4
        fixed = 0.4 + (150 / 512) / 0.4 / 2
    got = spatial(locality, b1, b2)
    assert got[cr.RELEASED] == pytest.approx(released, abs=1e-6) and got[cr.FIXED] == pytest.approx(fixed, abs=1e-6)


def test_spatial_presence_confidence_and_same_noun_pairs():
    record = lambda o1, o2, loc="left of": {"prompt": "p", "task_type": "spatial", "nouns": [o1, o2],
                                           "spatial_info": {"obj1": o1, "obj2": o2, "locality": loc}}
    one = cr.Detections(torch.tensor([box(0.2, 0.5)]), torch.tensor([0.9]), ["cat"])
    assert cr.gdino_score(record("cat", "dog"), one, cr.FIXED) == pytest.approx(0.2)
    assert cr.gdino_score(record("cat", "dog"), cr.Detections(torch.zeros(0, 4), torch.zeros(0), []), cr.FIXED) == 0
    # the most confident box of each object decides: cat's 0.95 box is right of the dog
    three = cr.Detections(torch.tensor([box(0.1, 0.5), box(0.9, 0.5), box(0.5, 0.5)]), torch.tensor([0.5, 0.95, 0.6]),
                          ["cat", "cat", "dog"])
    assert cr.gdino_score(record("cat", "dog"), three, cr.RELEASED) == pytest.approx(0.4)
    assert cr.gdino_score(record("cat", "dog", "right of"), three, cr.RELEASED) == pytest.approx(0.9)
    # "a cat left of a cat": released 0 (its code raises), fixed: the two most confident cats, either order
    cats = cr.Detections(torch.tensor([box(0.8, 0.5), box(0.2, 0.5), box(0.5, 0.9)]), torch.tensor([0.9, 0.8, 0.4]),
                         ["cat"] * 3)
    assert cr.gdino_score(record("cat", "cat"), cats, cr.RELEASED) == 0
    assert cr.gdino_score(record("cat", "cat"), cats, cr.FIXED) == pytest.approx(0.9)
    assert cr.gdino_score(record("cat", "cat", "below"), cats, cr.FIXED) == pytest.approx(0.4)  # the 0.4 cat is not used
    assert cr.gdino_score(record("cat", "cat"), one, cr.FIXED) == pytest.approx(0.4)


def test_numeracy_and_object_scores_by_hand():
    rec = {"prompt": "p", "task_type": "numeracy", "nouns": ["car", "book", "bird"],
           "numeracy_info": [{"obj_name": "car", "num": 2}, {"obj_name": "book", "num": 1}, {"obj_name": "bird", "num": 2}]}
    # two cars apart (a count of 2: 1/3), three books of which two coincide (NMS: 2 ≠ 1: 0.2/3), no bird (0)
    det = cr.Detections(torch.tensor([box(0.2, 0.2), box(0.8, 0.8), box(0.5, 0.5), box(0.5, 0.5), box(0.1, 0.9)]),
                        torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5]), ["car", "car", "book", "book", "book"])
    assert cr.numeracy_score(det, rec["numeracy_info"], cr.FIXED) == pytest.approx(1 / 3 + 0.2 / 3)
    assert cr.gdino_score(rec, det, cr.FIXED) == pytest.approx(1 / 3 + 0.2 / 3)
    # two cars 0.1 wide at (0.2, 0.2) and (0.21, 0.21): IoU 0.0081 / 0.0119 = 0.68 > 0.5, one car; the released NMS reads
    # (cx, cy, w, h) as corners (x1, y1, x2, y2) = (0.2, 0.2, 0.1, 0.1): reversed boxes that do not meet, two "cars"
    pair = cr.Detections(torch.tensor([box(0.2, 0.2), box(0.21, 0.21)]), torch.tensor([0.9, 0.8]), ["car", "car"])
    one_car = [{"obj_name": "car", "num": 1}]
    assert cr.numeracy_score(pair, one_car, cr.FIXED) == pytest.approx(1.0)
    assert cr.numeracy_score(pair, one_car, cr.RELEASED) == pytest.approx(0.2)
    obj = {"prompt": "p", "task_type": "color", "nouns": ["car", "book", "bird", "car"], "attr_nouns": ["red car"]}
    assert cr.gdino_score(obj, det, cr.FIXED) == pytest.approx(0.75)             # car twice, book, not bird
    assert cr.gdino_score(dict(obj, nouns=[]), det, cr.FIXED) == 1.0


def test_three_word_nouns_are_asked_whole_when_fixed():
    caption, spans, labels = detector.caption_and_spans(["roll of paper towel", "red car"], whole_nouns=False)
    assert caption == "roll of paper towel . red car." and spans == [[(0, 4), (14, 19)], [(22, 25), (26, 29)]]
    assert labels == ["roll towel", "red car"]  # released: never equal to the noun
    caption, spans, labels = detector.caption_and_spans(["roll of paper towel", "red car"], whole_nouns=True)
    assert spans == [[(0, 19)], [(22, 29)]] and labels == ["roll of paper towel", "red car"]


# -----------------------------------------------------------------------------
# The released records

def write_lines(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


@pytest.mark.parametrize("change, words", [
    (lambda r: r.pop("task_type"), ["'task_type'"]),
    (lambda r: r.update(task_type="counting"), ["'task_type'", "'counting'"]),
    (lambda r: r.pop("nouns"), ["'nouns'"]),
    (lambda r: r["spatial_info"].update(locality="behind"), ["'spatial_info.locality'", "'behind'"]),
    (lambda r: r["spatial_info"].update(obj2="horse"), ["'spatial_info.obj2'", "'horse'"]),
    (lambda r: r.pop("spatial_info"), ["'spatial_info'"]),
    (lambda r: r.update(prompt=""), ["'prompt'"]),
])
def test_a_bad_record_names_file_line_and_field(tmp_path, change, words):
    records = [json.loads(line) for line in (FIXTURES / "composition_prompts.jsonl").read_text().splitlines()]
    assert prompt_records.read_records(FIXTURES / "composition_prompts.jsonl") == records
    change(records[1])
    path = write_lines(tmp_path / "p.jsonl", records)
    with pytest.raises(ValueError) as e:
        prompt_records.read_records(path)
    assert str(e.value).startswith(f"--prompts {path}:2: ") and all(w in str(e.value) for w in words), str(e.value)
    assert "\n" not in str(e.value)


def test_numeracy_and_attribute_records(tmp_path):
    good = {"prompt": "two cars", "task_type": "numeracy", "nouns": ["car"], "numeracy_info": [{"obj_name": "car", "num": 2}]}
    for bad, field in [({"numeracy_info": []}, "'numeracy_info'"), ({"numeracy_info": [{"obj_name": "car", "num": 0}]},
                       "'numeracy_info[0].num'"), ({"numeracy_info": [{"obj_name": "bus", "num": 2}]}, "'numeracy_info[0].obj_name'"),
                       ({"task_type": "color"}, "'attr_nouns'")]:
        path = write_lines(tmp_path / "p.jsonl", [good, dict(good, **bad)])
        with pytest.raises(ValueError, match=rf"p.jsonl:2: field {re.escape(field)}"):
            prompt_records.read_records(path)
    with pytest.raises(ValueError, match=r"p.jsonl:1: not a JSON object"):
        prompt_records.read_records(write_lines(tmp_path / "p.jsonl", ["a red car"]))



# -----------------------------------------------------------------------------
# The released combination

def test_min_max_combination_by_hand():
    components = {"hps": torch.tensor([0.20, 0.30, 0.25, 0.25, 0.1, 0.1]), "gdino": torch.tensor([0.0, 0.4, 0.9, 0.4, 0.5, 0.5])}
    weights = {"hps": 1.0, "gdino": 2.0}
    got = grpo.min_max_combined(components, weights, group_size=2)
    # group 1: hps (0, 1), gdino (0, 1); group 2: hps constant -> 0, gdino (1, 0); group 3: all constant -> 0
    want = torch.tensor([0 + 2 * 0, 1 + 2 * 1, 0 + 2 * 1, 0 + 2 * 0, 0.0, 0.0])
    assert torch.allclose(got, want, atol=1e-6)


