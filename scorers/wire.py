"""The reward server's wire format, both ways: what scorers/remote.py sends and scorers/server.py reads.
Nothing on the wire carries code: images are an NPY array (read without pickle, its header checked
against the bytes before anything is allocated), everything else is JSON.

    GET  URL/info    -> {"protocol": 1, "rewards": [names served], "max_body_bytes": N}
    POST URL/score      Authorization: Bearer TOKEN when the server has one; the body is one line of
                        JSON, a newline, then an NPY file (no base64: 512-px batches are tens of MB):
        {"rewards": ["hpsv2", "gdino"], "prompts": [B strings], "metadata": [B objects or null]}\n
        NPY (format 1.0 or 2.0) of uint8 (B, 3, H, W), C order: round(255 x) of the images
    200  -> {"scores": {name: [B numbers]}, "info": {name: {key: JSON value}}}
            (NaN and ±Infinity written as the literals NaN, Infinity, -Infinity, which Python's json reads)
    4xx / 5xx -> {"error": "one line"}

"rewards" names what the server serves, each once; "metadata" is each image's prompt record (a
shapes meta, a released record). A request the server cannot take raises `Refused(status,
one-line reason)`: 400 malformed (no JSON line, not an NPY of uint8 (B, 3, H, W), lengths that
differ, an unknown reward), 401 token, 413 body over the limit, 422 a reward refused the input,
500 a reward failed.
"""

import io
import json
import math

import numpy as np
import torch

PROTOCOL = 1
TOKEN_ENV = "MARGRPO_REWARD_TOKEN"  # the environment variable of the shared token, for server and clients
MAX_HEADER = 10_000  # bytes of an NPY header (numpy's own default limit)


class Refused(Exception):
    """A request refused, with its HTTP status and a one-line reason."""

    def __init__(self, status, reason):
        super().__init__(reason)
        self.status = status


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
    """The bytes of an NPY file -> uint8 tensor (B, 3, H, W). Refused(400) for anything else: not NPY,
    another dtype or shape, or bytes that do not match its header."""
    fp = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(fp)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if read_header is None:
            raise ValueError(f"NPY format {version}")
        shape, fortran, dtype = read_header(fp, max_header_size=MAX_HEADER)
    except (ValueError, SyntaxError, TypeError, EOFError):
        raise Refused(400, "images: not an NPY array (after the JSON line, an NPY file of uint8 (B, 3, H, W))") from None
    if dtype != np.uint8 or fortran or len(shape) != 4 or shape[1] != 3 or min(shape) < 1:
        raise Refused(400, f"images: an NPY array of {dtype} {tuple(shape)}{' in Fortran order' if fortran else ''}; "
                           "expected uint8 (B, 3, H, W) in C order")
    count = math.prod(shape)
    if len(raw) - fp.tell() != count:  # checked before any array is made from the header's shape
        raise Refused(400, f"images: {len(raw) - fp.tell()} bytes of pixels for a uint8 array of shape {tuple(shape)}")
    pixels = np.frombuffer(raw, dtype=np.uint8, count=count, offset=fp.tell()).reshape(shape)
    return torch.from_numpy(pixels.copy())  # (B, 3, H, W), writable


# -----------------------------------------------------------------------------
# Requests and answers

def encode_request(names, images, prompts, metadata):
    """The body of POST /score: names of the rewards, images (B, 3, H, W) on the 8-bit grid, B
    prompts, B metadata dicts (or None). Returns bytes: a JSON line, then an NPY file."""
    head = json.dumps({"rewards": list(names), "prompts": list(prompts),
                       "metadata": None if metadata is None else list(metadata)})  # one line: json.dumps escapes newlines
    return head.encode() + b"\n" + encode_images(images)


def decode_request(body, served):
    """The body of POST /score -> (names, images uint8 (B, 3, H, W), prompts, metadata); `served`:
    the names this server serves. Refused(400) with the first problem found."""
    head, newline, npy = body.partition(b"\n")
    try:
        request = json.loads(head) if newline else None
    except (ValueError, RecursionError):
        request = None
    if not isinstance(request, dict):
        raise Refused(400, "the body must be a line of JSON {rewards, prompts, metadata}, a newline, then an NPY file")
    names = request.get("rewards")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise Refused(400, "rewards: expected a non-empty list of reward names")
    unknown = [n for n in names if n not in served]
    if unknown:
        raise Refused(400, f"unknown reward {unknown[0][:100]!r}: this server serves {', '.join(served)}")  # repr: one line
    if len(set(names)) != len(names):
        raise Refused(400, "rewards: a name appears twice")
    prompts = request.get("prompts")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise Refused(400, "prompts: expected a list of strings")
    metadata = request.get("metadata")
    if metadata is not None and (not isinstance(metadata, list) or not all(m is None or isinstance(m, dict) for m in metadata)):
        raise Refused(400, "metadata: expected a list of objects (or null)")
    images = decode_images(npy)
    B = images.shape[0]
    if len(prompts) != B or (metadata is not None and len(metadata) != B):
        raise Refused(400, f"{B} images, {len(prompts)} prompts and {'no' if metadata is None else len(metadata)} "
                           "metadata: one of each per image")
    return names, images, prompts, metadata


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


def decode_answer(body, names, B):
    """The body of a 200 answer -> {name: (scores (B,) float32 tensor, info dict)} for the asked
    `names`; a ValueError if it does not hold them."""
    answer = json.loads(body)
    out = {}
    for name in names:
        scores = answer["scores"][name]
        if len(scores) != B:
            raise ValueError(f"the reward server sent {len(scores)} scores of {name} for {B} images")
        out[name] = (torch.tensor(scores, dtype=torch.float32), answer.get("info", {}).get(name, {}))
    return out
