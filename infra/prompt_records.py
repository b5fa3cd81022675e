"""The released prompt metadata: one JSON object a line, what the compositional rewards read.

The released MAR-GRPO runs train on `data/geneval_and_t2i_data_final.json` (AMAP-ML/mar-grpo; JSON
Lines despite its name, 7,223 records): GenEval-style and T2I-CompBench-style prompts, each with
what a detector or a VQA model needs to check it,

    {"prompt": "a photo of a car below a zebra", "task_type": "spatial", "nouns": ["car", "zebra"],
     "spatial_info": {"obj1": "car", "obj2": "zebra", "locality": "below"}}
    {"prompt": "a photo of four coasters", "task_type": "numeracy", "nouns": ["coaster"],
     "numeracy_info": [{"obj_name": "coaster", "num": 4}]}
    {"prompt": "a blue bird and a brown chair", "task_type": "color", "nouns": ["bird", "chair"],
     "attr_nouns": ["blue bird", "brown chair"]}

Every record has `prompt`, `task_type` and `nouns` (the objects, singular, as the detector is asked
for them). By task type:
- spatial:  `spatial_info` {obj1, obj2, locality}: "obj1 <locality> obj2", locality in LOCALITIES;
- numeracy: `numeracy_info` [{obj_name, num}], one item per object kind, num ≥ 1;
- color, shape, texture: `attr_nouns`, the attribute-noun phrases ("purple elephant");
- complex, non (T2I-CompBench's non-spatial), object (GenEval's two objects): nouns only;
  a complex record may carry `spatial_info` too (185 of the released ones do).
Released task types per record count: spatial 2195, numeracy 1172, color 879, complex 700, non 700,
texture 695, shape 682, object 200.

`read_records(path)` checks every line before any work: a bad record stops the run in one line
naming file:line and the field. The records reach every reward as the `metadata` of rewards.py.
"""

import json

TASK_TYPES = ("spatial", "numeracy", "color", "shape", "texture", "complex", "non", "object")
ATTRIBUTE_TYPES = ("color", "shape", "texture")
# the released vocabulary of spatial relations (reward_gdino.py's `vocab_spatial`); how each is
# scored: composition_rules.position_score
LOCALITIES = ("left of", "right of", "above", "below", "on the left of", "on the right of", "on the top of",
              "on the bottom of", "on top of", "next to", "near", "on side of")


def is_record_file(path):
    """True for a prompt file in the released metadata format (by its extension)."""
    return str(path).endswith((".jsonl", ".json"))


def _strings(value):
    return isinstance(value, list) and all(isinstance(v, str) and v.strip() for v in value)


def check_record(record):
    """None for a good record, else the problem in a few words, naming the field."""
    if not isinstance(record, dict):
        return "expected a JSON object"
    if not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
        return "field 'prompt': missing or not a non-empty string"
    task = record.get("task_type")
    if task not in TASK_TYPES:
        return f"field 'task_type': {task!r} is not one of {', '.join(TASK_TYPES)}"
    if not _strings(record.get("nouns")):
        return "field 'nouns': missing or not a list of non-empty strings"
    nouns = record["nouns"]
    spatial = record.get("spatial_info")
    if task == "spatial" or spatial is not None:
        if not isinstance(spatial, dict):
            return "field 'spatial_info': missing or not an object {obj1, obj2, locality}"
        for key in ("obj1", "obj2"):
            if not isinstance(spatial.get(key), str) or spatial[key] not in nouns:
                return f"field 'spatial_info.{key}': {spatial.get(key)!r} is not one of the nouns {nouns}"
        if spatial.get("locality") not in LOCALITIES:
            return f"field 'spatial_info.locality': {spatial.get('locality')!r} is not one of {', '.join(LOCALITIES)}"
    if task == "numeracy":
        items = record.get("numeracy_info")
        if not isinstance(items, list) or not items:
            return "field 'numeracy_info': missing or not a non-empty list of {obj_name, num}"
        for k, item in enumerate(items):
            if not isinstance(item, dict) or not isinstance(item.get("obj_name"), str) or item["obj_name"] not in nouns:
                return f"field 'numeracy_info[{k}].obj_name': not one of the nouns {nouns}"
            num = item.get("num")
            if isinstance(num, bool) or not isinstance(num, int) or num < 1:
                return f"field 'numeracy_info[{k}].num': {num!r} is not a whole number ≥ 1"
    if task in ATTRIBUTE_TYPES and not _strings(record.get("attr_nouns")):
        return f"field 'attr_nouns': missing or not a list of non-empty strings (task_type {task})"
    if task not in ATTRIBUTE_TYPES and record.get("attr_nouns") is not None and not _strings(record["attr_nouns"]):
        return "field 'attr_nouns': not a list of non-empty strings"
    return None


def read_records(path, flag="--prompts"):
    """The records of a released-format file (list of dicts), every line checked: a line that is
    not JSON or a record `check_record` refuses raises a one-line ValueError naming path:line."""
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(no, line) for no, line in enumerate(f, 1) if line.strip()]
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path}: not a UTF-8 text file") from None
    if not lines:
        raise ValueError(f"{flag} {path}: the file has no prompts")
    for no, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} {path}:{no}: not a JSON object ({e.msg}); the file holds one record a line") from None
        problem = check_record(record)
        if problem:
            raise ValueError(f"{flag} {path}:{no}: {problem}")
        records.append(record)
    return records
