"""MAR-GRPO training: one script from a CPU laptop to `torchrun --nproc_per_node=8`.

    python train.py                      # the demo: pretrain a small MAR on the shapes world (cached),
                                         # MAR-GRPO on shapes prompts, held-out evaluation before/after
    python train.py --preset smoke       # the whole pipeline at toy size (tests, CI)
    torchrun --nproc_per_node=8 train.py --preset mar_base --init mar_base.pth --vae kl16.ckpt \\
        --reward hpsv2 --reward-ckpt hpsv2=HPS_v2.1_compressed.pt
    python train.py --eval-only --init CKPT --prompts FILE --out DIR

Stages: `--stage pretrain` (a base MAR on the shapes world), `--stage grpo` (RL from `--init`),
`--stage all` (the default: pretrain unless `--init` or a cached base exists, then GRPO, then
held-out evaluation of base and tuned models). The single-process path is the distributed path:
DDP is used when torchrun sets RANK; rank 0 alone logs and writes. Every random draw of a step is
seeded by (seed, step, rank), so a resumed run continues exactly as an uninterrupted one.

When things go wrong (README, "When things go wrong"): flags and files are checked, and models,
rewards and prompts loaded, before anything is written (`check_inputs`); a bad one is one line
`error: ...` and exit status 2. A non-finite reward, advantage, loss or gradient skips that update
and is counted; `--max-bad-steps` of them in a row stop the run (exit status 1). Checkpoints are
written to a temporary file and renamed, so a crash never leaves a half-written one; `--resume`
takes the newest readable one, and a torchrun relaunch after a failure resumes by itself (run
torchrun --max-restarts with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: pytorch/pytorch#135712).
"""

import argparse
import contextlib
import copy
import json
import math
import os
import shutil
import signal
import sys
import time
import traceback
from dataclasses import fields

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import diffloss
import grpo
import mar
import masks
import mte
import policy
import rewards
import shapes

# -----------------------------------------------------------------------------
# Configuration: one flat block of defaults; a preset replaces some of them; flags win.

DEFAULTS = dict(
    # run
    preset="demo", stage="all", out=None, init=None, resume="no", eval_only=False, seed=0,
    device="auto", threads=0, wandb=False,
    # model: "small" is built from the size flags (pixel tokens, prompt conditioning);
    # mar_base / mar_large / mar_huge are the official models (KL-16 latents, class labels)
    model="small", img_size=32, patch_size=4, embed_dim=128, depth=3, heads=4, head_depth=3, head_width=128,
    vae=None,
    # sampling
    num_iter=8, num_sampling_steps=16, cfg=3.0, cfg_schedule="linear", temperature=0.5,
    # pretraining (shapes world)
    pretrain_steps=2000, pretrain_batch=32, pretrain_lr=1e-3, ema=0.999, diffusion_batch_mul=1,
    # GRPO (SPEC §6–§8)
    method="mar-grpo", steps=40, prompts_per_step=8, group_size=6, lr=1e-4, weight_decay=0.0, max_grad_norm=1.0,
    train_ar_steps=2, train_diff_steps=6, min_diff_step=1, beta=None, kl=None, clip_eps=None, inner_epochs=None, train_cfg=None,
    mte_seeds=None, top_k=None, mte_positions=None, tau=None, train_head=None,
    # rewards and prompts
    reward="shapes", reward_ckpt=[], prompts=None, split="train",
    # evaluation, logging, checkpoints
    eval_prompts=96, eval_images_per_prompt=1, eval_temperature=None, sample_every=20, save_every=20, keep_last=2, max_bad_steps=5,
)

PRESETS = {
    # python train.py: about 10 minutes on 2 CPU cores in all. Two choices differ from the method's
    # defaults, both measured on this world (README, "Findings" and "The study"): MTE only on the
    # tokens written at the trained step (the released placement drove the reward down), and no
    # training of the last noisy diffusion step (its tiny σ dominates the gradient)
    "demo": dict(mte_positions="predicted", min_diff_step=2, lr=1e-5, cfg=6.0),
    # the whole pipeline at toy size, under a minute on 2 CPU cores
    "smoke": dict(embed_dim=32, depth=1, heads=2, head_depth=1, head_width=32, num_iter=4, num_sampling_steps=8,
                  pretrain_steps=20, pretrain_batch=16, steps=3, prompts_per_step=2, group_size=2,
                  train_ar_steps=2, train_diff_steps=3, eval_prompts=4, sample_every=2, save_every=2,
                  diffusion_batch_mul=1),
    # official MAR-B at 256 px on 8 GPUs, with the released MAR-GRPO hyperparameters (SPEC §8):
    # 1 prompt × G = 4 images per GPU, 64 AR steps, 12 AR × 10 diffusion steps trained, β = 0.01,
    # constant LR, 1200 steps, a checkpoint every 50, HPS v2.1 reward. CFG 3.0 and 100 diffusion
    # steps are MAR-B's own sampling settings; lr 2e-6 is the NOVA run's.
    "mar_base": dict(model="mar_base", img_size=256, num_iter=64, num_sampling_steps=100, cfg=3.0, temperature=1.0,
                     steps=1200, prompts_per_step=8, group_size=4, lr=2e-6, train_ar_steps=12, train_diff_steps=10,
                     reward="hpsv2", save_every=50, sample_every=50, eval_prompts=0),
}

HELP = dict(
    preset="named group of defaults: demo (default), smoke, mar_base", stage="pretrain | grpo | all",
    out="output folder (default runs/<preset>)", init="base checkpoint: ours or an official MAR .pth",
    resume="continue from the newest readable checkpoint in --out/ckpt: --resume (one must exist), --resume auto "
           "(if one exists; a torchrun relaunch after a failure does this by itself), or no (default: a fresh run, "
           "which replaces a previous run's checkpoints and metrics in --out)",
    eval_only="generate for --prompts and score, then exit",
    seed="global seed; every step's randomness derives from (seed, step, rank)", device="auto | cpu | cuda",
    threads="torch CPU threads (0: torch's default)", wandb="also log to Weights & Biases (if installed)",
    model="small | mar_base | mar_large | mar_huge", img_size="image size in pixels (small model)",
    patch_size="pixels per token side (small model)", embed_dim="transformer width (small model)",
    depth="encoder and decoder blocks each (small model)", heads="attention heads (small model)",
    head_depth="diffusion-head residual blocks (small model)", head_width="diffusion-head width (small model)",
    vae="KL-16 VAE .ckpt (LDM format) for the official models",
    num_iter="AR steps N per image", num_sampling_steps="diffusion steps T of the head", cfg="guidance w",
    cfg_schedule="linear | constant", temperature="τ of the head's noise",
    pretrain_steps="optimizer steps of base pretraining", pretrain_batch="images per pretraining step (global)",
    pretrain_lr="pretraining peak learning rate", ema="EMA decay of the pretrained base",
    diffusion_batch_mul="official diffusion_batch_mul for pretraining",
    method="grpo | grpo-fixed-head | mar-grpo (SPEC §7); component flags override it",
    steps="GRPO steps", prompts_per_step="prompts per GRPO step (global; divides by the world size)",
    group_size="images per prompt G", lr="GRPO learning rate (constant)", weight_decay="AdamW weight decay",
    max_grad_norm="gradient clipping", train_ar_steps="AR steps trained per rollout",
    train_diff_steps="diffusion steps trained per AR step",
    min_diff_step="lowest sampling step k trained (1: all of diffloss.trainable_steps); the last steps' σ is tiny, "
                  "so their log-probability gradients dominate an update", beta="KL weight β (0.01)",
    kl="gaussian | k3 | mean-k3", clip_eps="PPO clip ε (used when --inner-epochs > 1)",
    inner_epochs="optimizer steps per rollout (1 = released)", train_cfg="rollout | 1 (released)",
    mte_seeds="S trajectories for MTE (0 = off)", top_k="fraction of tokens with MTE",
    mte_positions="unknown (released: all uncertain unknown tokens) | predicted (only those written at the step)",
    tau="consistency threshold τ, or 'off'", train_head="train the diffusion head: yes | no",
    reward="reward spec, e.g. shapes or hpsv2:1.0,pickscore:0.5",
    reward_ckpt="reward weights, KEY=PATH (repeatable), e.g. hpsv2=HPS_v2.1_compressed.pt",
    prompts="prompt file, one per line (shapes prompts, or class indices for official models)",
    split="shapes prompts to train on: train | all", eval_prompts="held-out prompts to evaluate (0 = skip)",
    eval_images_per_prompt="images per evaluated prompt",
    eval_temperature="τ for evaluation images (default: --temperature)", sample_every="write a sample grid every N steps",
    save_every="checkpoint every N steps", keep_last="checkpoints kept (0 = all)",
    max_bad_steps="consecutive non-finite steps (skipped updates) before the run stops",
)

# flags with a fixed set of values; anything else is refused when the flags are parsed
CHOICES = dict(
    stage=["pretrain", "grpo", "all"], model=["small", "mar_base", "mar_large", "mar_huge"], device=["auto", "cpu", "cuda"],
    cfg_schedule=["linear", "constant"], method=list(grpo.PRESETS), mte_positions=["unknown", "predicted"], kl=list(grpo.KL_KINDS), split=["train", "all"],
    resume=["no", "yes", "auto"],
)


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is a one-line ValueError (reported by `cli`), not the usage block."""

    def error(self, message):
        raise ValueError(message)


def flag(name):
    """The command-line flag of an args field: "max_bad_steps" -> "--max-bad-steps"."""
    return "--" + name.replace("_", "-")


def parse_args(argv=None):
    """Flags over preset over DEFAULTS. Returns an argparse.Namespace."""
    pre = Parser(add_help=False)
    pre.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    preset = pre.parse_known_args(argv)[0].preset
    defaults = {**DEFAULTS, **PRESETS[preset], "preset": preset}
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, value in defaults.items():
        kw = dict(default=value, help=HELP[name], choices=CHOICES.get(name))
        if name == "resume":  # "--resume" alone means "yes"
            p.add_argument(flag(name), nargs="?", const="yes", **kw)
        elif isinstance(value, bool):
            p.add_argument(flag(name), action="store_true", default=value, help=HELP[name])
        elif isinstance(value, list):
            p.add_argument(flag(name), action="append", default=list(value), help=HELP[name])
        elif name in ("beta", "clip_eps", "top_k", "eval_temperature"):
            p.add_argument(flag(name), type=float, **kw)
        elif name in ("mte_seeds", "inner_epochs"):
            p.add_argument(flag(name), type=int, **kw)
        else:
            p.add_argument(flag(name), type=type(value) if value is not None else str, **kw)
    args = p.parse_args(argv)
    args.out = args.out or os.path.join("runs", preset)
    if args.resume == "no" and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
        args.resume = "auto"  # torchrun relaunched the job after a failure: continue, do not start over
    return args


def grpo_config(args):
    """The method preset (SPEC §7) with every component flag that was given on top."""
    if args.method not in grpo.PRESETS:
        raise ValueError(f"--method {args.method!r}: choose from {', '.join(grpo.PRESETS)}")
    cfg = grpo.GRPOConfig(**grpo.PRESETS[args.method])
    for f in fields(grpo.GRPOConfig):
        value = getattr(args, f.name)
        if value is None:
            continue
        if f.name == "tau":
            value = None if str(value).lower() == "off" else float(value)
        if f.name == "train_head":
            if str(value).lower() not in ("yes", "no"):
                raise ValueError(f"--train-head {value!r}: choose yes or no")
            value = str(value).lower() == "yes"
        setattr(cfg, f.name, value)
    return cfg.validate()


def check_inputs(args, world):
    """Every flag and file that can be checked without loading a model, before any work: a bad one
    raises a one-line ValueError / FileNotFoundError / PermissionError naming it. Reads, never
    writes. The contents of --init, --vae, --reward-ckpt and the prompts of a loaded model are
    checked next, by loading them (main), still before the first write. Returns the GRPO config.

    world: the number of processes (ranks) the run is spread over.
    """
    cfg = grpo_config(args)  # --method and its component flags (e.g. MTE with S < 2)
    for name in ("steps", "num_iter", "save_every", "sample_every", "max_bad_steps", "prompts_per_step",
                 "pretrain_batch", "train_ar_steps", "train_diff_steps", "eval_images_per_prompt"):
        if getattr(args, name) < 1:
            raise ValueError(f"{flag(name)} {getattr(args, name)}: must be >= 1")
    for name in ("keep_last", "pretrain_steps", "eval_prompts", "threads"):
        if getattr(args, name) < 0:
            raise ValueError(f"{flag(name)} {getattr(args, name)}: must be >= 0")
    if args.num_sampling_steps < 3:
        raise ValueError(f"--num-sampling-steps {args.num_sampling_steps}: must be >= 3 (RL trains steps 1 … T-2)")
    if args.group_size < 2:
        raise ValueError(f"--group-size {args.group_size}: GRPO needs at least 2 images per prompt")
    if not train_diff_candidates(args):
        raise ValueError(f"--min-diff-step {args.min_diff_step}: no trainable step left among 1 … "
                         f"{args.num_sampling_steps - 2}")
    if args.prompts_per_step % world:
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} must divide by the world size {world} "
                         "(each prompt's group is generated on one rank)")

    # --- what runs: pretraining happens unless a base model is given or cached
    if args.stage == "pretrain" and args.init is not None:
        raise ValueError("--stage pretrain trains a base model from scratch: drop --init (or use --stage grpo)")
    if (args.eval_only or args.stage == "grpo") and args.init is None:
        raise ValueError(f"{'--eval-only' if args.eval_only else '--stage grpo'} needs --init CKPT")
    if will_pretrain(args) and args.pretrain_batch % world:
        raise ValueError(f"--pretrain-batch {args.pretrain_batch} must divide by the world size {world}")
    if will_pretrain(args) and args.model != "small":
        raise ValueError(f"--model {args.model}: pretraining builds the small shapes model; give --init for {args.model}")

    # --- files: they must exist now (their contents are checked when they are loaded)
    for name in ("init", "prompts", "vae"):
        path = getattr(args, name)
        if path is not None and not os.path.isfile(path):
            raise FileNotFoundError(f"{flag(name)}: no such file: {path}")
    if args.model != "small" and args.vae is None:
        raise ValueError(f"--vae: --model {args.model} needs the KL-16 VAE checkpoint (kl16.ckpt)")
    if args.prompts is not None and args.init is None:  # the model will be a shapes model: parse now
        read_prompt_file(args.prompts, text_conditioned=True, num_classes=0)
    if args.stage != "pretrain" or args.eval_only:
        reward_names = [name for name, _ in rewards.parse_reward_spec(args.reward)]  # unknown names fail here
        rewards.parse_reward_ckpt(args.reward_ckpt, args.reward)  # the weight files are checked when built
        if "shapes" in reward_names and args.model != "small":
            raise ValueError(f"--reward shapes scores shapes-world prompts; --model {args.model} takes ImageNet "
                             "class prompts: choose another --reward")

    # --- the output folder: resumable when --resume asks for it, writable in any case
    ckpt_dir = os.path.join(args.out, "ckpt")
    if args.resume == "yes" and not checkpoint_names(ckpt_dir):
        raise FileNotFoundError(f"--resume: no checkpoint in {ckpt_dir} (use --resume auto to start fresh if none)")
    check_writable(args.out, "--out")
    return cfg


def train_diff_candidates(args):
    """The sampling steps a rollout may record: diffloss.trainable_steps from --min-diff-step on."""
    return [k for k in diffloss.trainable_steps(args.num_sampling_steps) if k >= args.min_diff_step]


def will_pretrain(args):
    """True when this run trains the base model itself (no --init, no cached <out>/base.pt)."""
    if args.eval_only or args.init is not None:
        return False
    return args.stage == "pretrain" or (args.stage == "all" and not os.path.exists(os.path.join(args.out, "base.pt")))


def check_writable(path, name):
    """Raise a one-line error naming flag `name` unless `path` is a writable folder or can be created
    as one. Creates nothing."""
    p = os.path.abspath(path)
    while not os.path.exists(p):  # the nearest existing ancestor will hold the new folders
        p = os.path.dirname(p)
    if not os.path.isdir(p):
        raise ValueError(f"{name} {path}: {p} is a file, not a folder")
    if not os.access(p, os.W_OK | os.X_OK):
        raise PermissionError(f"{name} {path}: {p} is not writable")


# -----------------------------------------------------------------------------
# Distributed setup and rank-0 I/O

class Ctx:
    """Process-wide facts: rank, world size, device, whether this is the master process."""

    def __init__(self, args):
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available (use --device cpu or auto)")
        self.ddp = int(os.environ.get("RANK", -1)) != -1
        want_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        if self.ddp:
            dist.init_process_group(backend="nccl" if want_cuda else "gloo")
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            local = int(os.environ.get("LOCAL_RANK", 0))
        else:
            self.rank, self.world, local = 0, 1, 0
        self.device = torch.device(f"cuda:{local}" if want_cuda else "cpu")
        if want_cuda:
            torch.cuda.set_device(self.device)
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        if args.threads:
            torch.set_num_threads(args.threads)
        self.master = self.rank == 0
        # bf16 autocast on CUDA, fp32 on CPU; the diffusion head always runs in fp32 (diffloss.py)
        self.autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if want_cuda else contextlib.nullcontext

    def print0(self, *a, **k):
        if self.master:
            print(*a, **k, flush=True)

    def mean(self, values):
        """All-reduce a dict of floats to their mean over ranks (every rank must call it)."""
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
        if self.ddp:
            dist.all_reduce(t)
            t /= self.world
        return dict(zip(keys, t.tolist()))  # .tolist() syncs with the GPU

    def barrier(self):
        if self.ddp:
            dist.barrier(device_ids=[self.device.index] if self.device.type == "cuda" else None)


def seeded(*parts):
    """A torch.Generator seeded by a tuple of ints (seed, stage, step, rank)."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence(list(parts)).generate_state(1)[0]))


def all_finite(ctx, *values):
    """True on every rank iff every value (tensors, floats, lists of floats) is finite on every rank.
    Every rank must call it: one all-reduce, one sync with the GPU."""
    ok = torch.stack([torch.isfinite(torch.as_tensor(v, dtype=torch.float32, device=ctx.device)).all() for v in values])
    ok = ok.all().float()
    if ctx.ddp:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok)  # syncs with the GPU


class Stop(RuntimeError):
    """The run stops on purpose (repeated non-finite steps, a failing reward): `cli` prints the
    reason as one line, after the traceback of the code that caused it, and exits with status 1."""


# -----------------------------------------------------------------------------
# Checkpoint files: written atomically, found by name, pruned

def atomic_save(obj, path):
    """torch.save to a temporary file in the same folder, then rename: never a half-written file.
    A write killed by SIGKILL leaves only the temporary file, which `prune_checkpoints` removes."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        torch.save(obj, tmp)
        if os.environ.get("MARGRPO_TEST_SLOW_SAVE"):  # test hook: widen the window for a kill
            time.sleep(float(os.environ["MARGRPO_TEST_SLOW_SAVE"]))
        os.replace(tmp, path)
    except BaseException:  # an error or Ctrl-C mid-write: leave no temporary file behind
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def atomic_link(src, dst):
    """Make `dst` name the same file as `src` (a hard link; a copy where the filesystem has none),
    atomically: `dst` is always either the old file or the new one."""
    tmp = f"{dst}.tmp.{os.getpid()}"
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def checkpoint_names(ckpt_dir):
    """The step_XXXXXX.pt files of ckpt_dir, oldest first (none if the folder does not exist)."""
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(f for f in os.listdir(ckpt_dir) if f.startswith("step_") and f.endswith(".pt"))


def prune_checkpoints(ckpt_dir, keep_last):
    """Delete all but the newest `keep_last` step files (0 keeps all) and any temporary file a
    killed write left behind (rank 0, while no write is in flight)."""
    old = checkpoint_names(ckpt_dir)[:-keep_last] if keep_last > 0 else []
    stray = [f for f in os.listdir(ckpt_dir) if ".tmp." in f]
    for name in old + stray:
        os.remove(os.path.join(ckpt_dir, name))


# -----------------------------------------------------------------------------
# Test hooks: environment variables that only the tests set, to inject faults

def hook_steps(name):
    """The steps listed in environment variable `name` (e.g. MARGRPO_TEST_NAN_REWARD_STEPS="1,2")."""
    return {int(s) for s in os.environ.get(name, "").split(",") if s.strip()}


def hook_kill(step, ctx):
    """MARGRPO_TEST_KILL_AT_STEP=N: the last rank SIGKILLs itself as step N starts, on the first
    launch only (torchrun's relaunch then runs normally)."""
    if (os.environ.get("MARGRPO_TEST_KILL_AT_STEP") == str(step) and ctx.rank == ctx.world - 1
            and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0):
        os.kill(os.getpid(), signal.SIGKILL)


# -----------------------------------------------------------------------------
# Models, codecs, prompts

def small_mar_config(args):
    return dict(img_size=args.img_size, vae_stride=1, patch_size=args.patch_size, vae_embed_dim=3,
                encoder_embed_dim=args.embed_dim, encoder_depth=args.depth, encoder_num_heads=args.heads,
                decoder_embed_dim=args.embed_dim, decoder_depth=args.depth, decoder_num_heads=args.heads,
                mlp_ratio=4.0, norm_eps=1e-6, class_num=1, buffer_size=shapes.MAX_PROMPT_TOKENS,
                diffloss_d=args.head_depth, diffloss_w=args.head_width,
                num_sampling_steps=str(args.num_sampling_steps), attn_dropout=0.0, proj_dropout=0.0,
                diffusion_batch_mul=args.diffusion_batch_mul, text_vocab_size=len(shapes.VOCAB), clip_denoised=True)


def load_policy(args, path):
    """A MAR from a checkpoint (ours, or official with --model mar_*), with the run's sampler steps."""
    if args.model == "small":
        return mar.load_checkpoint(path, num_sampling_steps=str(args.num_sampling_steps))
    factory = getattr(mar, args.model)
    model = factory(**mar.OFFICIAL_HEADS[args.model], img_size=args.img_size, num_sampling_steps=str(args.num_sampling_steps))
    return mar.load_checkpoint(path, model=model)


def make_codec(args, model):
    """Pixels for the small model; the KL-16 VAE (--vae) for official models."""
    if model.config["vae_stride"] == 1:
        return mar.PixelCodec()
    if not args.vae:
        raise ValueError("--vae: the official MAR models need the KL-16 VAE checkpoint (kl16.ckpt)")
    import vae
    return vae.VAECodec(vae.load_vae(args.vae))


class Prompts:
    """Prompts and their conditioning. Shapes prompts (metadata dicts) for prompt-conditioned
    models; ImageNet class indices for class-conditioned ones (text = "a photo of a <class>")."""

    def __init__(self, model, path=None, split="train"):
        self.text_conditioned = model.config.get("text_vocab_size", 0) > 0
        self.items = None
        if path is not None:
            self.items = read_prompt_file(path, self.text_conditioned, model.num_classes)
        elif not self.text_conditioned:
            self.items = list(range(model.num_classes))
        self.split = split

    def sample(self, n, seed, step):
        """n prompts for one step, identical on every rank (one seeded draw, then sliced)."""
        rng = np.random.default_rng([seed, 7, step])
        if self.items is None:
            return shapes.sample_prompts(n, rng, split=self.split)
        return [self.items[i] for i in rng.integers(0, len(self.items), n)]

    def condition(self, items, device):
        """dict(prompt_ids=(B, S)) or dict(labels=(B,)) for MAR."""
        if self.text_conditioned:
            return dict(prompt_ids=torch.from_numpy(shapes.tokenize([m["prompt"] for m in items])).to(device))
        return dict(labels=torch.tensor([int(c) for c in items], device=device))

    def texts(self, items):
        if self.text_conditioned:
            return [m["prompt"] for m in items]
        from torchvision.models._meta import _IMAGENET_CATEGORIES
        return [f"a photo of a {_IMAGENET_CATEGORIES[int(c)]}" for c in items]

    def metas(self, items):
        return list(items) if self.text_conditioned else [{"class": int(c)} for c in items]


def read_prompt_file(path, text_conditioned, num_classes):
    """Prompt lines: shapes prompts (parsed, so a typo fails now) or class indices."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--prompts: no such file: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(i + 1, line.strip()) for i, line in enumerate(f) if line.strip()]
    except UnicodeDecodeError:
        raise ValueError(f"--prompts {path}: not a UTF-8 text file") from None
    if not lines:
        raise ValueError(f"--prompts {path}: the file has no prompts")
    items = []
    for no, line in lines:
        if text_conditioned:
            try:
                items.append(shapes.parse_prompt(line))
            except ValueError as e:
                raise ValueError(f"--prompts {path}:{no}: {e}") from None
        else:
            head = line.split()[0]
            if not head.isdigit() or not 0 <= int(head) < num_classes:
                raise ValueError(f"--prompts {path}:{no}: expected a class index in 0 … {num_classes - 1}, got {line!r}")
            items.append(int(head))
    return items


def make_reward(args, ctx):
    """The --reward spec with its --reward-ckpt weights; missing or mismatched weights fail here."""
    return rewards.build_reward(args.reward, device=ctx.device, weights=rewards.parse_reward_ckpt(args.reward_ckpt, args.reward))


def score(reward_fn, spec, images, texts, metas):
    """reward_fn(images, texts, metas); a reward that raises stops the run (Stop) with the reward's
    name and the batch's prompts, its own traceback kept as the cause."""
    try:
        return reward_fn(images, texts, metas)
    except Exception as e:
        unique = list(dict.fromkeys(texts))
        shown = unique[:8] + ([f"... {len(unique)} prompts in all"] if len(unique) > 8 else [])
        reason = (str(e).strip().splitlines() or [""])[0]
        raise Stop(f"--reward {spec!r} failed on the prompts {shown}: {type(e).__name__}: {reason}") from e


# -----------------------------------------------------------------------------
# Writing images, grids and plots

def save_grid(images, captions, path, scale=4):
    """A grid of images (B, 3, H, W) in [0, 1] with a caption under each."""
    from PIL import Image, ImageDraw
    b, _, h, w = images.shape
    cols = min(8, b)
    rows = math.ceil(b / cols)
    cw, ch = max(w * scale, 160), h * scale + 28
    grid = Image.new("RGB", (cols * cw, rows * ch), "white")
    draw = ImageDraw.Draw(grid)
    arr = (images.clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).cpu().numpy()
    for i in range(b):
        x, y = (i % cols) * cw, (i // cols) * ch
        grid.paste(Image.fromarray(arr[i]).resize((w * scale, h * scale), Image.NEAREST), (x, y))
        text = captions[i]
        draw.text((x + 2, y + h * scale + 2), text[:26], fill="black")
        draw.text((x + 2, y + h * scale + 14), text[26:52], fill="black")
    grid.save(path)


def plot_curves(metrics_path, out_path):
    """Reward and gradient norm over steps, from metrics.jsonl."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(metrics_path)]
    if not rows:
        return
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
    steps = [r["step"] for r in rows]
    ax[0].plot(steps, [r["reward_mean"] for r in rows])
    ax[0].set(xlabel="step", ylabel="reward (mean)")
    ax[1].plot(steps, [r["grad_norm"] for r in rows])
    ax[1].set(xlabel="step", ylabel="grad norm (before clipping)")
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)


# -----------------------------------------------------------------------------
# Stage 1: pretrain a small MAR on the shapes world (the demo's base model)

def pretrain(args, ctx):
    """MAE-style diffusion-loss training with EMA; writes <out>/base.pt (the EMA weights). A step
    with a non-finite loss or gradient changes nothing (no optimizer step, no EMA update);
    --max-bad-steps of them in a row stop the run before base.pt is written."""
    local_batch = args.pretrain_batch // ctx.world  # divisibility: check_inputs
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = mar.build_mar(small_mar_config(args)).to(ctx.device)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    model.class_emb.requires_grad_(False)  # prompt-conditioned: the class table is unused
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.pretrain_lr,
                            betas=(0.9, 0.95), weight_decay=0.02)
    net = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None) if ctx.ddp else model
    codec = mar.PixelCodec()
    ctx.print0(f"pretraining a {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter MAR "
               f"for {args.pretrain_steps} steps of {args.pretrain_batch} images")
    nan_steps = hook_steps("MARGRPO_TEST_NAN_LOSS_STEPS")  # test hook: these steps' loss is NaN
    bad_steps = bad_total = 0
    for step in tqdm(range(args.pretrain_steps), disable=not ctx.master, desc="pretrain"):
        # --- data: fresh renders of train-split prompts, a different slice on every rank
        rng = np.random.default_rng([args.seed, 1, step, ctx.rank])
        imgs, metas = shapes.make_dataset(local_batch, args.img_size, rng, split="train")
        x = codec.encode(torch.from_numpy(imgs).permute(0, 3, 1, 2).float().div(255).to(ctx.device))
        ids = torch.from_numpy(shapes.tokenize([m["prompt"] for m in metas])).to(ctx.device)
        # --- update: linear warm-up, then cosine decay to 10%
        frac = step / max(1, args.pretrain_steps)
        lr = args.pretrain_lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        with ctx.autocast():
            loss = net(x, prompt_ids=ids, generator=seeded(args.seed, 2, step, ctx.rank))
        if step in nan_steps:
            loss = loss * float("nan")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not all_finite(ctx, loss, grad_norm):  # skip: no optimizer step, no EMA update
            bad_steps, bad_total = bad_steps + 1, bad_total + 1
            if ctx.master:
                tqdm.write(f"pretrain step {step}: non-finite loss or gradient; update skipped ({bad_steps} in a row)")
            if bad_steps >= args.max_bad_steps:
                raise Stop(f"pretraining: {bad_steps} non-finite steps in a row (--max-bad-steps {args.max_bad_steps}); "
                           "stopped before writing base.pt")
            continue
        bad_steps = 0
        opt.step()
        with torch.no_grad():  # EMA with a short warm-up
            decay = min(args.ema, (1 + step) / (10 + step))
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.lerp_(pm, 1 - decay)
        if step % 50 == 0:  # once in a while: the loss averaged over ranks
            loss_mean = ctx.mean({"loss": loss.item()})["loss"]  # .item() syncs with the GPU
            if ctx.master:
                tqdm.write(f"pretrain step {step}: loss {loss_mean:.4f}")
    path = os.path.join(args.out, "base.pt")
    if ctx.master:
        os.makedirs(args.out, exist_ok=True)
        atomic_save({"model": ema.state_dict(), "config": ema.config, "args": vars(args), "stage": "pretrain"}, path)
        ctx.print0(f"base model: {path}" + (f" ({bad_total} non-finite steps skipped)" if bad_total else ""))
    ctx.barrier()
    return path


# -----------------------------------------------------------------------------
# Stage 2: GRPO

class PolicyLoss(nn.Module):
    """The policy as a module whose forward is one AR step's GRPO loss, so DDP can wrap it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ref, record, j, condition, adv, cfg, seeds=None, uncertain=None, old=None):
        return policy.rollout_loss(self.model, ref, record, j, condition, adv, cfg, seeds, uncertain, old)


def backward_rollout(loss_module, ddp, ref, record, condition, adv, cfg, seeds, uncertain, olds):
    """Backward through every trained AR step, one at a time (each graph is freed before the
    next); DDP's all-reduce happens once, on the last. Returns (stats list, olds); each stats dict
    has the step's "loss"."""
    steps = record["steps"]
    stats, new_olds = [], []
    for j in range(len(steps)):
        sync = not ddp or j == len(steps) - 1
        with contextlib.nullcontext() if sync else loss_module.no_sync():
            loss, s, old = loss_module(ref, record, j, condition, adv, cfg, seeds, uncertain, olds[j])
            (loss / len(steps)).backward()
        stats.append({**s, "loss": loss.item()})  # .item() syncs with the GPU
        new_olds.append(old)
    return stats, new_olds


def grpo_train(args, ctx, cfg, base, codec, prompts, reward_fn):
    """RL from the base policy `base` (a MAR on ctx.device; it stays frozen as the reference of the
    KL); checkpoints, samples and metrics under args.out. Returns the final checkpoint path.

    cfg: grpo.GRPOConfig; codec: latents <-> images; prompts: Prompts; reward_fn: a rewards.Reward.
    A step whose reward, advantage, loss or gradient is not finite on some rank changes nothing (no
    optimizer step on any rank); --max-bad-steps of them in a row stop the run (Stop).
    """
    local_prompts = args.prompts_per_step // ctx.world  # divisibility: check_inputs
    ref = base  # the frozen reference of the KL
    model = copy.deepcopy(base).requires_grad_(True)
    model.eval()  # no dropout: recomputed log-probabilities must equal the recorded ones
    model.diffloss.requires_grad_(cfg.train_head)
    (model.class_emb if prompts.text_conditioned else getattr(model, "text_emb", nn.Identity())).requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay)
    loss_module = PolicyLoss(model)
    if ctx.ddp:
        loss_module = DDP(loss_module, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)

    ckpt_dir = os.path.join(args.out, "ckpt")
    start, bad_total = 0, 0
    if args.resume != "no":
        resumed = resume_from(ckpt_dir, model, opt, ctx, required=args.resume == "yes")
        if resumed is not None:
            start, bad_total = resumed
            ctx.print0(f"resumed from step {start}")
    metrics_path = prepare_out(args, ctx, cfg, start)  # the stage's first write
    ctx.print0(f"GRPO ({args.method}): {args.steps} steps × {args.prompts_per_step} prompts × G={args.group_size}, "
               f"world size {ctx.world}; {cfg}")
    nan_steps = hook_steps("MARGRPO_TEST_NAN_REWARD_STEPS")  # test hook: a NaN reward at these steps

    G, B = args.group_size, local_prompts * args.group_size
    bad_steps = 0  # non-finite steps in a row
    for step in tqdm(range(start, args.steps), disable=not ctx.master, desc="grpo", initial=start, total=args.steps):
        last_step = step == args.steps - 1
        hook_kill(step, ctx)
        t0 = time.time()
        # --- rollout: this rank's prompts, G images each, recording the chosen steps
        items = prompts.sample(args.prompts_per_step, args.seed, step)[ctx.rank * local_prompts:(ctx.rank + 1) * local_prompts]
        items = [it for it in items for _ in range(G)]  # each prompt's group stays together
        condition = prompts.condition(items, ctx.device)
        plan_ar, plan_diff = grpo.choose_train_steps(args.num_iter, args.train_ar_steps,
                                                     train_diff_candidates(args),
                                                     args.train_diff_steps, seeded(args.seed, 3, step, ctx.rank))
        plan = mar.RolloutPlan(ar_steps=plan_ar, diff_steps=plan_diff.to(ctx.device))
        gen = seeded(args.seed, 4, step, ctx.rank)
        with ctx.autocast():
            latents, record = model.sample_tokens(B, num_iter=args.num_iter, cfg=args.cfg, cfg_schedule=args.cfg_schedule,
                                                  temperature=args.temperature, generator=gen, plan=plan, **condition)
            images = codec.decode(latents.float())
        t_rollout = time.time() - t0

        # --- reward and advantages
        t1 = time.time()
        scores, info = score(reward_fn, args.reward, images, prompts.texts(items), prompts.metas(items))
        if step in nan_steps:
            scores = scores.clone()
            scores[0] = float("nan")
        scores = scores.to(ctx.device)
        adv = grpo.group_advantages(scores, G)
        t_reward = time.time() - t1

        # --- multi-trajectory expectation: S head trajectories from z_final, per-token uncertainty
        t2 = time.time()
        seeds = uncertain = None
        if cfg.mte_seeds >= 2:
            seeds = mte.sample_trajectories(model.diffloss, record["z_final"], record.get("z_final_null"),
                                            record["cfg_final"], args.temperature, cfg.mte_seeds, plan.diff_steps,
                                            seeded(args.seed, 5, step, ctx.rank))
            uncertain = masks.top_k_mask(masks.token_uncertainty(seeds["x0"]), cfg.top_k)

        # --- policy update: E inner epochs, one backward per trained AR step; anything non-finite
        #     on any rank skips the optimizer step on every rank
        olds = [None] * len(record["steps"])
        skipped = False
        for epoch in range(cfg.inner_epochs):
            with ctx.autocast():
                step_stats, olds = backward_rollout(loss_module, ctx.ddp, ref, record, condition, adv, cfg,
                                                    seeds, uncertain, olds)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            if all_finite(ctx, scores, adv, [s["loss"] for s in step_stats], grad_norm):
                opt.step()
            else:
                skipped = True
            opt.zero_grad(set_to_none=True)
        t_update = time.time() - t2
        bad_steps = bad_steps + 1 if skipped else 0
        bad_total += skipped

        # --- logging: scalars are averaged over ranks before rank 0 writes them
        local = dict(reward_mean=scores.mean().item(), reward_std=scores.std().item() if len(scores) > 1 else 0.0,
                     adv_abs_mean=adv.abs().mean().item(), adv_max=adv.max().item(), grad_norm=float(grad_norm),
                     diversity=group_diversity(images, G), t_rollout=t_rollout, t_reward=t_reward, t_update=t_update)
        for key in step_stats[0]:
            local[key] = float(np.mean([s.get(key, 0.0) for s in step_stats]))
        for name, value in info.get("means", {}).items():
            local[f"reward/{name}"] = value
        row = {"step": step, **ctx.mean(local), "skipped": int(skipped), "bad_steps_total": bad_total}
        if ctx.master:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            if args.wandb:
                import wandb
                wandb.log(row, step=step)
        if skipped:
            ctx.print0(f"step {step}: non-finite reward, advantage, loss or gradient; update skipped "
                       f"({bad_steps} in a row, {bad_total} in all)")
            if bad_steps >= args.max_bad_steps:
                names = checkpoint_names(ckpt_dir)
                last = os.path.join(ckpt_dir, names[-1]) if names else "none yet (the policy is still --init)"
                raise Stop(f"{bad_steps} non-finite steps in a row (--max-bad-steps {args.max_bad_steps}); "
                           f"the last good checkpoint: {last}")

        # --- once in a while: a sample grid, a checkpoint
        if ctx.master and (step % args.sample_every == 0 or last_step):
            save_grid(images[:16], [f"{t} ({s:.2f})" for t, s in zip(prompts.texts(items), scores.tolist())][:16],
                      os.path.join(args.out, "samples", f"step_{step:06d}.png"))
        if (step + 1) % args.save_every == 0 or last_step:
            save_checkpoint(ckpt_dir, step + 1, model, opt, args, cfg, ctx, bad_total)
    if ctx.master and os.path.exists(metrics_path):
        plot_curves(metrics_path, os.path.join(args.out, "curves.png"))
    return os.path.join(ckpt_dir, "latest.pt")


def group_diversity(images, G):
    """Mean pairwise RMS pixel distance between the images of a group (a collapse detector)."""
    x = images.flatten(1).reshape(-1, G, images[0].numel())  # (#prompts, G, 3·H·W)
    d = torch.cdist(x.float(), x.float()) / math.sqrt(x.shape[-1])  # (#prompts, G, G)
    return (d.sum() / (d.shape[0] * G * (G - 1))).item()


def prepare_out(args, ctx, cfg, start):
    """The GRPO stage's first writes (rank 0): folders and config.json. A fresh run (start 0)
    removes the previous run's checkpoints and metrics from --out; a resumed one keeps the metrics
    rows of the steps before `start` (the others will be redone). Returns the metrics path."""
    ckpt_dir = os.path.join(args.out, "ckpt")
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    if ctx.master:
        os.makedirs(os.path.join(args.out, "samples"), exist_ok=True)
        os.makedirs(ckpt_dir, exist_ok=True)
        if start == 0:
            old = [os.path.join(ckpt_dir, f) for f in checkpoint_names(ckpt_dir) + ["latest.pt"]] + [metrics_path]
            old = [path for path in old if os.path.exists(path)]
            if old:
                print(f"a fresh run in {args.out}: removing the previous run's checkpoints and metrics "
                      "(--resume continues a run instead)", flush=True)
            for path in old:
                os.remove(path)
        elif os.path.exists(metrics_path):
            keep = []
            for line in open(metrics_path):
                with contextlib.suppress(ValueError):  # a line cut short by a crash is dropped
                    if json.loads(line)["step"] < start:
                        keep.append(line)
            with open(metrics_path + ".tmp", "w") as f:
                f.writelines(keep)
            os.replace(metrics_path + ".tmp", metrics_path)
        prune_checkpoints(ckpt_dir, args.keep_last)  # also the temporary file of a killed write
        with open(os.path.join(args.out, "config.json"), "w") as f:
            json.dump({**vars(args), "grpo": vars(cfg), "world_size": ctx.world}, f, indent=1)
    ctx.barrier()
    return metrics_path


def save_checkpoint(ckpt_dir, step, model, opt, args, cfg, ctx, bad_total):
    """Policy, optimizer and step as plain dicts (weights_only=True loads them), written
    atomically by rank 0 as step_XXXXXX.pt, with latest.pt naming the same file; step files
    beyond --keep-last are pruned. The reference policy is rebuilt from --init, not stored. Every
    step's randomness derives from (seed, step, rank), so the step is the sampler position and the
    only RNG state needed to continue identically."""
    ctx.barrier()
    if ctx.master:
        state = {"model": model.state_dict(), "config": model.config, "optimizer": opt.state_dict(), "step": step,
                 "args": vars(args), "grpo": vars(cfg), "torch_rng": torch.get_rng_state(), "bad_steps_total": bad_total}
        path = os.path.join(ckpt_dir, f"step_{step:06d}.pt")
        atomic_save(state, path)
        atomic_link(path, os.path.join(ckpt_dir, "latest.pt"))
        prune_checkpoints(ckpt_dir, args.keep_last)
    ctx.barrier()


def resume_from(ckpt_dir, model, opt, ctx, required):
    """Load the newest readable step_*.pt of ckpt_dir into model and optimizer. Unreadable files
    (atomic writes leave none, but disks and copies fail) are skipped with a warning. Returns
    (step, non-finite steps so far), or None when there is no readable one and not `required`."""
    for name in reversed(checkpoint_names(ckpt_dir)):
        path = os.path.join(ckpt_dir, name)
        try:
            state = mar.read_checkpoint(path, "--resume")
            if not isinstance(state, dict) or not {"model", "optimizer", "step"} <= state.keys():
                raise ValueError(f"--resume {path}: not a checkpoint of this script (no model, optimizer, step)")
        except ValueError as e:
            ctx.print0(f"warning: skipping unreadable checkpoint: {e}", file=sys.stderr)
            continue
        mar.check_state_dict(model, state["model"], path, "--resume")
        model.load_state_dict(state["model"])
        try:
            opt.load_state_dict(state["optimizer"])
        except ValueError as e:
            raise ValueError(f"--resume {path}: its optimizer state does not fit this run's trained parameters "
                             f"(another --method or --train-head?): {e}") from None
        if "torch_rng" in state:
            torch.set_rng_state(state["torch_rng"])
        return int(state["step"]), int(state.get("bad_steps_total", 0))
    if required:
        raise FileNotFoundError(f"--resume: no readable checkpoint in {ckpt_dir}")
    return None


# -----------------------------------------------------------------------------
# Evaluation: generate for prompts, score, write images and one JSON line per image

@torch.no_grad()
def evaluate(args, ctx, model, codec, items, prompts, reward_fn, out_dir, tag):
    """Every rank generates a slice; rank 0 gathers and writes. Returns a summary dict."""
    model.eval()
    n = args.eval_images_per_prompt
    jobs = [(i, it) for i, it in enumerate(items) for _ in range(n)]
    mine = jobs[ctx.rank::ctx.world]
    rows = []
    batch = 64
    if ctx.master:
        os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    for b0 in tqdm(range(0, len(mine), batch), disable=not ctx.master, desc=f"eval {tag}"):
        chunk = mine[b0:b0 + batch]
        its = [it for _, it in chunk]
        with ctx.autocast():
            latents = model.sample_tokens(len(its), num_iter=args.num_iter, cfg=args.cfg, cfg_schedule=args.cfg_schedule,
                                          temperature=args.temperature if args.eval_temperature is None else args.eval_temperature,
                                          generator=seeded(args.seed, 6, b0, ctx.rank),
                                          **prompts.condition(its, ctx.device))
            images = codec.decode(latents.float())
        scores, info = score(reward_fn, args.reward, images, prompts.texts(its), prompts.metas(its))
        details = info.get("details", [{}] * len(its))
        for k, ((i, it), img) in enumerate(zip(chunk, images)):
            rows.append(dict(index=i, prompt=prompts.texts([it])[0], reward=float(scores[k]),
                             category=it.get("category") if isinstance(it, dict) else None,
                             details=details[k], image=img.cpu()))
    if ctx.ddp:
        gathered = [None] * ctx.world
        dist.all_gather_object(gathered, rows)
        rows = [r for part in gathered for r in part]
    summary = {}
    if ctx.master:
        from PIL import Image
        rows.sort(key=lambda r: r["index"])
        with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
            for k, r in enumerate(rows):
                name = f"images/{k:05d}.png"
                arr = (r.pop("image").clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
                Image.fromarray(arr).save(os.path.join(out_dir, name))
                f.write(json.dumps({"prompt": r["prompt"], "file": name, "reward": r["reward"],
                                    "category": r["category"], "details": r["details"]}) + "\n")
        summary = summarize(rows)
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    ctx.barrier()
    return summary


def summarize(rows):
    """Mean reward, and for shapes prompts the accuracy (all checks pass) by category."""
    out = {"n": len(rows), "reward_mean": float(np.mean([r["reward"] for r in rows]))}
    correct = [r for r in rows if "correct" in (r["details"] or {})]
    if correct:
        out["accuracy"] = float(np.mean([r["details"]["correct"] for r in correct]))
        for cat in shapes.CATEGORIES:
            sel = [r for r in correct if r["category"] == cat]
            if sel:
                out[f"accuracy/{cat}"] = float(np.mean([r["details"]["correct"] for r in sel]))
                out[f"reward/{cat}"] = float(np.mean([r["reward"] for r in sel]))
    return out


def eval_items(args, model, prompts, split="heldout"):
    """The evaluation prompts: --prompts if given, else shapes prompts of `split`, the same number
    from each category (the held-out split is mostly spatial prompts, and has only two single-
    object ones, so a uniform sample would measure little else; small categories repeat)."""
    if args.prompts is not None or not prompts.text_conditioned:
        return prompts.items
    rng = np.random.default_rng([args.seed, 8, shapes.SPLITS.index(split)])
    per_cat = -(-args.eval_prompts // len(shapes.CATEGORIES))  # ceil
    items = []
    for cat in shapes.CATEGORIES:
        pool = [m for m in shapes.all_prompts(split) if m["category"] == cat]
        order = np.concatenate([rng.permutation(len(pool)) for _ in range(-(-per_cat // len(pool)))])
        items += [pool[i] for i in order[:per_cat]]
    return items


# -----------------------------------------------------------------------------

def load_base(args, ctx, init):
    """The base policy from `init` (on ctx.device, frozen), its codec and the prompts; a missing,
    corrupt or mismatched checkpoint, VAE or prompt file fails here, before anything is written."""
    base = load_policy(args, init).to(ctx.device).requires_grad_(False)
    codec = make_codec(args, base)
    prompts = Prompts(base, args.prompts, args.split)
    return base, codec, prompts


def main(argv=None):
    """The whole run: check the inputs, load what they name, and only then write. Returns the
    evaluation summary, or None."""
    args = parse_args(argv)
    ctx = Ctx(args)
    cfg = check_inputs(args, ctx.world)

    # --- load what the run needs; a bad file fails here, and nothing has been written yet
    reward_fn = make_reward(args, ctx) if args.stage != "pretrain" or args.eval_only else None
    init = args.init
    if init is None and args.stage == "all" and not will_pretrain(args):
        init = os.path.join(args.out, "base.pt")
        ctx.print0(f"reusing the cached base model {init}")
    base = codec = prompts = None
    if init is not None:
        base, codec, prompts = load_base(args, ctx, init)
    if args.wandb and ctx.master:
        import wandb
        wandb.init(project="mar-grpo", config=vars(args))

    if args.eval_only:
        summary = evaluate(args, ctx, base, codec, eval_items(args, base, prompts), prompts, reward_fn, args.out, "eval")
        ctx.print0(json.dumps(summary, indent=1))
        ctx.print0(f"results: {os.path.join(args.out, 'results.jsonl')}")
        return summary

    if base is None:  # --stage pretrain, or --stage all without a cached base
        init = pretrain(args, ctx)
        if args.stage == "pretrain":
            return None
        base, codec, prompts = load_base(args, ctx, init)
    final = grpo_train(args, ctx, cfg, base, codec, prompts, reward_fn)

    if args.stage == "all" and args.eval_prompts > 0:
        # --- evaluation of the base and the tuned model on the same prompts and seeds: held-out
        # compositions (eval/base, eval/tuned) and, for shapes prompts, the training split too
        # (eval/base_train, eval/tuned_train: the prompts RL saw, with fresh seeds)
        tuned = load_policy(args, final).to(ctx.device)
        splits = ["heldout", "train"] if args.prompts is None and prompts.text_conditioned else ["heldout"]
        report = {}
        for split in splits:
            items = eval_items(args, base, prompts, split)
            suffix = "" if split == "heldout" else "_" + split
            for tag, model in (("base", base), ("tuned", tuned)):
                report[tag + suffix] = evaluate(args, ctx, model, codec, items, prompts, reward_fn,
                                                os.path.join(args.out, "eval", tag + suffix), tag + suffix)
        if ctx.master:
            with open(os.path.join(args.out, "eval", "summary.json"), "w") as f:
                json.dump(report, f, indent=1)
            print_report(args, report)
        return report
    return None


def print_report(args, report):
    titles = {"": "held-out prompts (never seen in pretraining or RL)", "_train": "training prompts, fresh seeds"}
    for suffix, title in titles.items():
        before, after = report.get("base" + suffix), report.get("tuned" + suffix)
        if before is None:
            continue
        print(f"\n{title}, {before['n']} images:")
        print(f"  {'metric':<26}{'base':>8}{'tuned':>8}")
        for k in [k for k in before if k.startswith("accuracy") or k.startswith("reward")]:
            print(f"  {k:<26}{before[k]:>8.3f}{after.get(k, float('nan')):>8.3f}")
    print(f"\nfiles: {args.out}/ (metrics.jsonl, curves.png, samples/, ckpt/, eval/)")


def cli(argv=None):
    """`python train.py ...`: main(), with failures said in one line on stderr (`error: ...`, or
    `error (rank N): ...` from rank N > 0 under torchrun). Bad flags and files: no traceback, exit
    status 2. A deliberate stop (Stop): exit status 1. Anything else is a bug and keeps Python's
    traceback. Returns the exit status."""
    where = f" (rank {os.environ['RANK']})" if int(os.environ.get("RANK", 0)) > 0 else ""
    try:
        main(argv)
        return 0
    except (ValueError, FileNotFoundError, PermissionError) as e:
        print(f"error{where}: {e}", file=sys.stderr)
        return 2
    except Stop as e:
        if e.__cause__ is not None:  # e.g. the reward's own traceback: where it failed
            traceback.print_exception(e.__cause__)
        print(f"error{where}: {e}", file=sys.stderr)
        return 1
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(cli())
