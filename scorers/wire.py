"""The reward server's wire format, both ways: what scorers/remote.py sends and scorers/server.py reads.
Nothing on the wire carries code: images are an NPY array (read without pickle, its header checked
against the bytes before anything is allocated), everything else is JSON.

    GET  URL/info    -> {"protocol": 1, "rewards": [names served], "max_body_bytes": N}
    POST URL/score      Authorization: Bearer TOKEN when the server has one; the body is one line of
                        JSON, a newline, then an NPY file (no base64: 512-px batches are tens of MB):
        {"rewards": ["hpsv2", "gdino"], "prompts": [B strings], "metadata": [B objects or null]}\n
        NPY (format 1.0 or 2.0) of uint8 (B, 3, H, W), C order: round(255 x) of the images
    200  -> {"scores": {name: [B finite numbers]}, "info": {name: {key: JSON value}}}
            (info["details"], the shapes verifier's, is a list of B objects)
    4xx / 5xx -> {"error": "one line"}

"rewards" names what the server serves, each once; "metadata" is each image's prompt record (a
shapes meta, a released record); the JSON line is at most MAX_HEAD bytes. A request the server
cannot take raises `Refused(status, one-line reason)`: 400 malformed (no JSON line, not an NPY of
uint8 (B, 3, H, W), lengths that differ, an unknown reward), 401 token, 408 too slow, 413 too
large, 422 a reward refused the input, 500 a reward failed (or gave a non-finite score), 503
busy. The client takes an answer only as exactly this shape (`decode_info`, `decode_answer`):
finite float32 scores, B of each reward asked, and says what else it got in one line (`one_line`).
"""

import io
import json
import math

import numpy as np
import torch

PROTOCOL = 1
TOKEN_ENV = "MARGRPO_REWARD_TOKEN"  # the environment variable of the shared token, for server and clients
MAX_HEADER = 10_000  # bytes of an NPY header (numpy's own default limit)
MAX_HEAD = 2 << 20   # bytes of a request's JSON line (prompts and records: ~1 KB an image)
FLOAT32_MAX = float(np.finfo(np.float32).max)
DETAIL_FLAGS = {"present": bool, "color": bool, "shape": bool, "count": bool, "correct": bool,
                "extra_objects": int, "relation": (bool, type(None))}  # read by evaluate.py


class Refused(Exception):
    """A request refused, with its HTTP status and a one-line reason."""

    def __init__(self, status, reason):
        super().__init__(reason)
        self.status = status


def one_line(text, limit=300):
    """`text` (str; bytes are read as UTF-8, bad bytes replaced) as one printable line of at most
    `limit` characters (then '...'): control, format and line-separator characters escaped as Python
    writes them (\\n, \\r, \\x1b, \\u2028), so that no peer's bytes can break or colour a line."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = bytes(text[:4 * limit + 4]).decode("utf-8", "replace")
    text = str(text)[:limit + 1]
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                  for c in text)
    return out if len(out) <= limit else out[:limit] + "..."


# -----------------------------------------------------------------------------
# Images: uint8 (B, 3, H, W) as NPY

def encode_images(images):
    """images: (B, 3, H, W) float in [0, 1] already on the 8-bit grid (rewards.to_8bit), any device.
    Returns the bytes of an NPY file of uint8 (B, 3, H, W)."""
    pixels = images.detach().mul(255).round().to(torch.uint8).cpu().numpy()  # exact: 255 x is an integer already
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(pixels), allow_pickle=False)
    return buffer.getvalue()


def decode_images(raw):
    """The bytes of an NPY file (bytes, bytearray or a memoryview of one) -> uint8 tensor
    (B, 3, H, W) on those bytes, not a copy of them (a copy if they are read-only). Refused(400)
    for anything else: not NPY, another dtype or shape, or bytes that do not match its header."""
    fp = io.BytesIO(bytes(memoryview(raw)[:MAX_HEADER + 16]))  # the magic and header, not pixels
    try:
        version = np.lib.format.read_magic(fp)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if read_header is None:
            raise ValueError(f"NPY format {version}")
        shape, fortran, dtype = read_header(fp, max_header_size=MAX_HEADER)
    except (ValueError, SyntaxError, TypeError, EOFError):
        raise Refused(400, "images: not an NPY array (after the JSON line, an NPY file of uint8 (B, 3, H, W))") from None
    if dtype != np.uint8 or fortran or len(shape) != 4 or shape[1] != 3 or min(shape) < 1:
        order = " in Fortran order" if fortran else ""
        raise Refused(400, one_line(f"images: an NPY array of {dtype} {tuple(shape)}{order}; "
                                    "expected uint8 (B, 3, H, W) in C order"))
    count, offset = math.prod(shape), fp.tell()
    if len(raw) - offset != count:  # checked before any array is made from the header's shape
        raise Refused(400, f"images: {len(raw) - offset} bytes of pixels for a uint8 array of "
                           f"shape {tuple(shape)}")
    pixels = np.frombuffer(raw, dtype=np.uint8, count=count, offset=offset).reshape(shape)
    return torch.from_numpy(pixels if pixels.flags.writeable else pixels.copy())  # (B, 3, H, W)


# -----------------------------------------------------------------------------
# Requests

def encode_request(names, images, prompts, metadata):
    """The body of POST /score: names of the rewards, images (B, 3, H, W) on the 8-bit grid, B
    prompts, B metadata dicts (or None). Returns bytes: a JSON line, then an NPY file. A ValueError
    if the JSON line is over MAX_HEAD bytes."""
    head = json.dumps({"rewards": list(names), "prompts": list(prompts),  # one line: \n escaped
                       "metadata": None if metadata is None else list(metadata)}).encode()
    if len(head) > MAX_HEAD:
        raise ValueError(f"the prompts and records of {len(prompts)} images are "
                         f"{len(head) / 2**20:.1f} MiB of JSON, over the reward server's limit of "
                         f"{MAX_HEAD / 2**20:g} MiB (fewer images a process: --grad-accum)")
    return head + b"\n" + encode_images(images)


def decode_request(body, served):
    """The body of POST /score (bytes or bytearray; the pixels stay in it, uncopied) -> (names,
    images uint8 (B, 3, H, W), prompts, metadata); `served`: the names this server serves.
    Refused(400 / 413) with the first problem found."""
    end = body.find(b"\n", 0, MAX_HEAD + 1)
    if end < 0 and len(body) > MAX_HEAD:
        raise Refused(413, f"the JSON line is over the limit of {MAX_HEAD} bytes")
    try:
        request = json.loads(bytes(body[:end])) if end >= 0 else None
    except (ValueError, RecursionError):
        request = None
    if not isinstance(request, dict):
        raise Refused(400, "the body must be a line of JSON {rewards, prompts, metadata}, a newline, then an NPY file")
    names = request.get("rewards")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise Refused(400, "rewards: expected a non-empty list of reward names")
    unknown = [n for n in names if n not in served]
    if unknown:
        raise Refused(400, f"unknown reward {one_line(repr(unknown[0][:100]))}: this server serves "
                           f"{', '.join(served)}")
    if len(set(names)) != len(names):
        raise Refused(400, "rewards: a name appears twice")
    prompts = request.get("prompts")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise Refused(400, "prompts: expected a list of strings")
    metadata = request.get("metadata")
    if metadata is not None and (not isinstance(metadata, list) or not all(m is None or isinstance(m, dict) for m in metadata)):
        raise Refused(400, "metadata: expected a list of objects (or null)")
    images = decode_images(memoryview(body)[end + 1:])
    B = images.shape[0]
    if len(prompts) != B or (metadata is not None and len(metadata) != B):
        raise Refused(400, f"{B} images, {len(prompts)} prompts and {'no' if metadata is None else len(metadata)} "
                           "metadata: one of each per image")
    return names, images, prompts, metadata


# -----------------------------------------------------------------------------
# Answers

def _plain(value):
    """A reward's info value as JSON-able Python (tensors and numpy values to lists and numbers)."""
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def encode_answer(results):
    """{name: (scores (B,) tensor, info dict)} -> the body of a 200 answer (bytes)."""
    return json.dumps({"scores": {name: scores.tolist() for name, (scores, _) in results.items()},
                       "info": {name: _plain(info) for name, (_, info) in results.items()}}).encode()


def kind(value):
    """What a JSON value is, in words, for an error line."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    return {str: "a string", list: "a list", dict: "an object"}.get(type(value), "a number")


def _json_object(body, fields, required):
    """`body` (bytes) as a JSON object with only `fields`, `required` among them; a ValueError."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise ValueError("not JSON") from None
    if not isinstance(value, dict):
        raise ValueError(f"{kind(value)}, not a JSON object")
    extra = [k for k in value if k not in fields]
    if extra:
        raise ValueError(f"an unexpected field {one_line(repr(extra[0]), 60)}")
    missing = [k for k in required if k not in value]
    if missing:
        raise ValueError(f"no field {missing[0]!r}")
    return value


def decode_info(body):
    """The body of GET /info -> (names served, max_body_bytes); a one-line ValueError saying what is
    wrong if it is not {"protocol": 1, "rewards": [names], "max_body_bytes": N ≥ 1}."""
    fields = ("protocol", "rewards", "max_body_bytes")
    info = _json_object(body, fields, fields)
    if type(info["protocol"]) is not int or info["protocol"] != PROTOCOL:
        said = one_line(json.dumps(info["protocol"]), 40)
        raise ValueError(f"protocol {said}, where this client speaks {PROTOCOL}")
    names = info["rewards"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"rewards: {kind(names)}, not a list of names")
    size = info["max_body_bytes"]
    if type(size) is not int or size < 1:
        raise ValueError(f"max_body_bytes: {one_line(json.dumps(size), 40)}, not a positive whole "
                         "number")
    return names, size


def _scores(values, name, B):
    """A reward's scores in an answer -> (B,) float32; a ValueError unless B finite float32s."""
    if not isinstance(values, list):
        raise ValueError(f"scores of {name}: {kind(values)}, not a list of {B} numbers")
    if len(values) != B:
        raise ValueError(f"{len(values)} scores of {name} for {B} images")
    floats = []
    for i, v in enumerate(values):
        if type(v) not in (int, float):  # not bool, str, list, dict, None
            raise ValueError(f"score {i} of {name}: {kind(v)}, not a number")
        try:
            x = float(v)
        except OverflowError:
            x = math.inf
        if not abs(x) <= FLOAT32_MAX:  # also false for NaN
            raise ValueError(f"score {i} of {name}: {one_line(repr(v), 40)}, not a finite float32")
        floats.append(x)
    return torch.tensor(floats, dtype=torch.float32)


def _details(details, name, B):
    """The shapes verifier's per-image details: a list of B objects whose flags have their types."""
    if not isinstance(details, list) or len(details) != B:
        raise ValueError(f"info of {name}: details must be a list of {B} objects")
    for i, d in enumerate(details):
        if not isinstance(d, dict):
            raise ValueError(f"info of {name}: detail {i} is {kind(d)}, not an object")
        for key, types in DETAIL_FLAGS.items():
            wrong = not isinstance(d.get(key), types) or (types is int and isinstance(d[key], bool))
            if key in d and wrong:
                raise ValueError(f"info of {name}: detail {i}'s {key} is {kind(d[key])}")


def decode_answer(body, names, B):
    """The body of a 200 answer to a request of `names` on B images -> {name: (scores (B,) float32
    tensor, info dict)}. A one-line ValueError saying what is wrong unless it holds exactly that:
    an object of "scores" ({name: B finite numbers} for each name asked, no other) and "info"
    ({name: object} for names asked)."""
    answer = _json_object(body, ("scores", "info"), ("scores",))
    scores, info = answer["scores"], answer.get("info", {})
    if not isinstance(scores, dict):
        raise ValueError(f"scores: {kind(scores)}, not an object")
    if not isinstance(info, dict):
        raise ValueError(f"info: {kind(info)}, not an object")
    for what, got in (("scores", scores), ("info", info)):
        unasked = [k for k in got if k not in names]
        if unasked:
            raise ValueError(f"{what} of {one_line(repr(unasked[0]), 60)}, a reward not asked for")
    out = {}
    for name in names:
        if name not in scores:
            raise ValueError(f"no scores of {name}")
        extra = info.get(name, {})
        if not isinstance(extra, dict):
            raise ValueError(f"info of {name}: {kind(extra)}, not an object")
        if "details" in extra:
            _details(extra["details"], name, B)
        out[name] = (_scores(scores[name], name, B), extra)
    return out
