"""Which reward a name builds: the name -> scorer table, the `--reward` / `--reward-ckpt` flags
parsed and checked, and `build_reward`'s choice of scoring in this process or on a reward server.

"Released" is the MAR-GRPO code, GitHub `AMAP-ML/mar-grpo@fcb7969`: its runs
scripts/debug_entry_{nova,harmon,nova_mix}.py (`--reward_funcs hps` with HPS_v2.1_compressed.pt;
nova_mix adds `git` and `gdino`), the prompt records they train on (read in
src/grpo/src/open_r1/grpo_v1.py) and its scorers src/grpo/src/utils/reward_hps.py,
reward_git.py and reward_gdino.py.

`build_reward("hpsv2:1.0,pickscore:0.5", weights={...})` parses the `--reward` spec and returns the
weighted sum of its rewards (rewards.WeightedSum). The released runs use HPS v2.1 (docs/method.md
§8, the released hyperparameters: reward HPS v2.1, β = 0.01, G = 4 images per prompt, 12 AR × 10
diffusion steps trained per rollout). `build_reward(spec, server={"url": ...})` returns the same
reward scored by a reward server (`python -m scorers.server`; the client is scorers/remote.py,
docs/reward_server.md).

The rewards: `shapes` and `shapes_partial` (the demo's verifier), `jpeg_compressibility` and
`jpeg_incompressibility` (DDPO's JPEG size, rewards.py) need no weights; `clip_score`, `hpsv2`,
`pickscore` and `aesthetic` (CLIP models), `imagereward` (BLIP), and `gdino`, `gdino_released` and
`git_vqa` (GroundingDINO, GIT; these also need `--prompts FILE.jsonl`) read local weight files,
given by `weights` key as `build_reward(..., weights={key: path})` or `--reward-ckpt key=PATH`
(scorers/weights.py holds the keys and their files). What each scores, its keys and files, and
where each file is published: docs/real_models.md, "Rewards and their weight files".

A reward of another file is imported when it is first built (`built_from`: a module of this folder
or the demo world's verifier, named in `REWARDS` below), so `import scorers.registry` pulls in
none of their libraries (open_clip, BLIP, GroundingDINO, GIT): the verifier in demo/verifier.py,
the model-based rewards in scorers/clip.py, scorers/imagereward.py and scorers/composition.py.

Weight files are read locally, never downloaded, and loaded strictly at construction: a missing
file raises a one-line FileNotFoundError naming `--reward-ckpt` and the expected file, a file that
does not fit raises a one-line ValueError naming the file and the first mismatched keys. The
accepted file formats and where each reward departs from its official scorer are listed at the top
of scorers/clip.py and scorers/imagereward.py.
"""

import importlib

from infra import prompt_records
from rewards import REWARD_FLAG, JpegReward, WeightedSum, parse_reward_spec
from scorers.weights import CKPT_FLAG, WEIGHT_FILES

# rewards that read the released prompt records
METADATA_REWARDS = ("gdino", "gdino_released", "git_vqa")


def built_from(module, cls_name):
    """A factory that imports `module` (this folder's, or demo.verifier) when the reward is first
    built: the scorers pull in open_clip / transformers, the shapes reward the demo's world."""
    def factory(**kwargs):
        return getattr(importlib.import_module(module), cls_name)(**kwargs)
    factory.__qualname__ = f"{module}.{cls_name}"
    return factory


def jpeg(sign):
    """The JPEG reward of `sign` (rewards.JpegReward), built as the others are."""
    def factory(device="cpu"):
        return JpegReward(sign, device)
    return factory


# name -> (factory(device=..., **weight paths, **options), weights keys, accepted options)
_CLIP_OPTIONS = {"model_name", "dtype", "batch_size"}
REWARDS = {
    "shapes": (built_from("demo.verifier", "ShapesReward"), (), set()),
    "shapes_partial": (built_from("demo.verifier", "ShapesPartialReward"), (), set()),
    "jpeg_compressibility": (jpeg(-1.0), (), set()),
    "jpeg_incompressibility": (jpeg(+1.0), (), set()),
    "clip_score": (built_from("scorers.clip", "ClipScoreReward"), ("clip_score",), _CLIP_OPTIONS),
    "hpsv2": (built_from("scorers.clip", "HPSv2Reward"), ("hpsv2",), _CLIP_OPTIONS),
    "pickscore": (built_from("scorers.clip", "PickScoreReward"), ("pickscore",), _CLIP_OPTIONS),
    "aesthetic": (built_from("scorers.clip", "AestheticReward"), ("aesthetic", "aesthetic_clip"),
                  _CLIP_OPTIONS),
    "imagereward": (built_from("scorers.imagereward", "ImageRewardReward"),
                    ("imagereward", "imagereward_tokenizer"), {"arch", "dtype", "batch_size"}),
    "gdino": (built_from("scorers.composition", "GDinoReward"), ("gdino",), set()),
    "gdino_released": (built_from("scorers.composition", "GDinoReleasedReward"), ("gdino",),
                       set()),
    "git_vqa": (built_from("scorers.composition", "GitVqaReward"), ("git_vqa",), set()),
}


def parse_spec(spec):
    """The (name, weight) items of a `--reward` spec whose names are this table's
    (rewards.parse_reward_spec)."""
    return parse_reward_spec(spec, REWARDS)


def parse_reward_ckpt(values, spec):
    """Turn `--reward-ckpt` values into the `weights` dict of `build_reward`.

    values: list of strings (or one string), each 'key=PATH' (comma-separated lists allowed), or a
            single bare PATH when the spec needs exactly one weight file.
    spec:   the `--reward` spec, to know which keys are needed.
    """
    if values is None:
        return {}
    values = [values] if isinstance(values, str) else list(values)
    needed = [key for name, _ in parse_spec(spec) for key in REWARDS[name][1]]
    weights = {}
    for value in values:
        for item in value.split(","):
            item = item.strip()
            key, sep, path = item.partition("=")
            if sep and key in WEIGHT_FILES:
                weights[key] = path
            elif len(values) == 1 and "," not in value and len(needed) == 1:
                weights[needed[0]] = item
            elif item:
                raise ValueError(f"{CKPT_FLAG} '{item}': write key=PATH with key in "
                                 f"{', '.join(WEIGHT_FILES)}")
    unused = [key for key in weights if key not in needed]
    if unused:  # a file given for a reward that is not in use would be silently ignored
        raise ValueError(f"{CKPT_FLAG} {unused[0]}={weights[unused[0]]}: {REWARD_FLAG} '{spec}' "
                         f"uses no {unused[0]} weights"
                         + (f" (it takes {', '.join(needed)})" if needed else ""))
    return weights


def check_reward_flags(args):
    """Before anything is loaded: the --reward spec parses, its rewards fit the model (the shapes
    rewards score shapes-world prompts) and the prompt file (the composition rewards read the
    released records), and --reward-ckpt parses (the files are checked when built). One-line
    errors naming the flag. Returns the spec's names."""
    names = [name for name, _ in parse_spec(args.reward)]
    shapes_rewards = [n for n in names if n.startswith("shapes")]
    if shapes_rewards and args.model != "small":
        raise ValueError(f"--reward {shapes_rewards[0]} scores shapes-world prompts; --model "
                         f"{args.model} does not draw them")
    needs_records = [n for n in names if n in METADATA_REWARDS]
    if needs_records and not (args.prompts and prompt_records.is_record_file(args.prompts)):
        raise ValueError(f"--reward {needs_records[0]} reads the released prompt metadata: give "
                         "--prompts FILE.jsonl (one JSON record a line, infra/prompt_records.py)"
                         + ("" if args.prompts is None else f", not {args.prompts}"))
    parse_reward_ckpt(args.reward_ckpt, args.reward)
    return names


def build_reward(spec, *, device="cpu", weights=None, options=None, server=None, **kwargs):
    """Build the weighted reward of a `--reward` spec.

    spec:    'name' or 'name:weight' items, comma-separated (e.g. 'hpsv2:1.0,pickscore:0.5').
    device:  where the reward models run (images are moved there after preprocessing).
    weights: weights key -> local file, e.g. {"hpsv2": ".../HPS_v2.1_compressed.pt",
             "pickscore": ".../model.safetensors", "clip_score": ".../ViT-L-14.pt",
             "aesthetic": ".../sac+logos+ava1-l14-linearMSE.pth",
             "aesthetic_clip": ".../ViT-L-14.pt", "imagereward": ".../ImageReward.pt",
             "imagereward_tokenizer": ".../bert-base-uncased"} (the tokenizer key names a
             folder). Keys of rewards not in the spec are ignored.
    options: per-reward keyword arguments, {name: {kwarg: value}}, over `kwargs`.
    kwargs:  keyword arguments given to every reward of the spec that takes them (e.g.
             `model_name` for the CLIP-based rewards, `arch` for imagereward, `dtype`,
             `batch_size`).
    server:  None (the reward models run in this process), or {"url", "token", "timeout",
             "retries"}: a reward server (`python -m scorers.server`) that serves every name of
             the spec scores the images and this process sums them (scorers/remote.py
             `RemoteReward`); the weight files and options are then the server's.
    Returns a rewards.WeightedSum (also for a single reward, so info always has means and
    components), or with `server` a RemoteReward whose info has the same keys.
    """
    items = parse_spec(spec)
    if server is not None:
        if weights or options or kwargs:
            raise ValueError(f"{CKPT_FLAG} and reward options "
                             f"{sorted({**(weights or {}), **(options or {}), **kwargs})}: "
                             "the reward server loads the models "
                             "(python -m scorers.server --reward-ckpt KEY=PATH)")
        return built_from("scorers.remote", "RemoteReward")(items=items, **server)
    weights = dict(weights or {})
    for key in weights:
        if key not in WEIGHT_FILES:
            raise ValueError(f"{CKPT_FLAG}: unknown weights key '{key}'; "
                             f"choose from {', '.join(WEIGHT_FILES)}")
    options = dict(options or {})
    for name in options:
        if name not in REWARDS:
            raise ValueError(f"unknown reward '{name}' in options; "
                             f"choose from {', '.join(REWARDS)}")
    components = []
    for name, w in items:
        factory, keys, accepted = REWARDS[name]
        opts = {k: v for k, v in kwargs.items() if k in accepted}
        opts.update(options.get(name, {}))
        paths = {key: weights.get(key) for key in keys}
        components.append((name, w, factory(device=device, **paths, **opts)))
    used = set().union(*(REWARDS[n][2] for n, _ in items))
    unused = [k for k in kwargs if k not in used]
    if unused:
        raise ValueError(f"reward options {unused} are taken by none of the rewards in '{spec}'")
    return WeightedSum(components)


def server_settings(args):
    """build_reward's `server` for a run's flags: None without --reward-url, else what
    scorers/remote.py's `settings` reads (imported only by the runs that name a server)."""
    if getattr(args, "reward_url", None) is None:
        return None
    return importlib.import_module("scorers.remote").settings(args)


def build_run_reward(args, device):
    """The reward of a run's flags: --reward with --reward-ckpt's weight files on `device`, or
    scored by the reward server of --reward-url."""
    weights = parse_reward_ckpt(args.reward_ckpt, args.reward)
    return build_reward(args.reward, device=device, weights=weights, server=server_settings(args))
