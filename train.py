"""MAR-GRPO training: one script from a CPU laptop to `torchrun --nproc_per_node=8`.

    python train.py                      # the demo: MAR-GRPO from the shipped small MAR (bases/demo.pt)
                                         # on shapes prompts, evaluation before/after
    python train.py --preset smoke       # the whole pipeline at toy size (tests, CI)
    torchrun --nproc_per_node=8 train.py --preset mar_base --init mar_base.pth --vae kl16.ckpt \\
        --reward hpsv2 --reward-ckpt hpsv2=HPS_v2.1_compressed.pt
    python train.py --eval-only --init CKPT --prompts FILE --out DIR

Stages: `--stage pretrain` (a base MAR on the shapes world), `--stage grpo` (RL from `--init`),
`--stage all` (default: pretrain unless `--init` or a cached base exists, GRPO, then evaluation of
base and tuned models; the demo's `--init` is its shipped base, `--init scratch` pretrains instead).
The single-process path is the distributed path: DDP when torchrun sets RANK; rank 0 alone logs and
writes. Every random draw of a step comes from a generator seeded by (seed, stage, step, shard) on the
run's device, a shard being a rank's micro-batch (the rank itself without --grad-accum), so a resumed
run continues exactly and 1 process with --grad-accum A draws what A processes draw.

When things go wrong: flags are checked when parsed (ranges, finiteness), cross-flag rules and
files in `check_inputs`, then models, rewards and prompts are loaded, all before anything is
written; a bad one is one line `error: ...`, exit status 2. A non-finite reward, advantage, loss or
gradient skips that update; `--max-bad-steps` in a row stop the run (exit status 1). Checkpoints
are written atomically (checkpoints.py); a torchrun relaunch after a failure resumes by itself
(with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: pytorch/pytorch#135712).
"""

import argparse
import copy
import json
import math
import os
import re
import sys
import time
import traceback
from dataclasses import fields

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import checkpoints
import evaluate
import grpo
import mar
import masks
import models
import mte
import policy
import rewards
import rollout
import shapes
from processes import Ctx, Stop, all_finite
from prompts import read_prompt_file

# -----------------------------------------------------------------------------
# Configuration: every flag with its default and meaning; a preset replaces some defaults; flags win.

# The demo's base, committed in float16 (3.5 MB; `python checkpoints.py half runs/demo_base/base.pt
# bases/demo.pt`), pretrained in three runs: 2000 + 6000 steps in the world of token-aligned objects
# (--cell 8) with clean captions, then 1500 steps on under-captioned images (--unmentioned 0.5: half the
# images also show one object their prompt does not mention; docs/research_log.md, "Under-captioned
# pretraining data"), each from the last one's EMA weights with a fresh optimizer and new data draws:
#     python train.py --stage pretrain --out runs/cell2k --unmentioned 0 --pretrain-steps 2000 --threads 2   (5 min)
#     python train.py --stage pretrain --out runs/cell8k --unmentioned 0 --pretrain-steps 6000 \
#         --pretrain-from runs/cell2k/base.pt --pretrain-lr 5e-4 --seed 1 --threads 1          (24 min beside other runs)
#     python train.py --stage pretrain --out runs/demo_base --pretrain-steps 1500 \
#         --pretrain-from runs/cell8k/base.pt --pretrain-lr 5e-4 --seed 2 --threads 2          (4 min)
# `python train.py --init scratch` pretrains one run of --pretrain-steps (8000) in the demo's world
# (under-captioned from the start) instead of loading it.
DEMO_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bases", "demo.pt")
DEMO_BASE_SHA256 = "3e0bf98753f1390403dd5216ec6c6267ab074af9138f8c7a5b2b18aef4b4f472"
# The demo's base until 2026-12-01 and the base of docs/study.md (preset free16): free sizes and
# positions, clean captions; 8000 steps, then 8000 more at half the learning rate on new data draws:
#     python train.py --preset free16 --stage pretrain --out runs/free_base --threads 2        (43 min here)
#     python train.py --preset free16 --stage pretrain --out runs/free_base2 \
#         --pretrain-from runs/free_base/base.pt --pretrain-lr 5e-4 --seed 1                   (66 min at --threads 1 beside other jobs)
#     python checkpoints.py half runs/free_base2/base.pt bases/free16.pt
FREE16_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bases", "free16.pt")
FREE16_BASE_SHA256 = "a60207e9f2a68321a025568539d959753f182ded1fbbd46c7c83627d96cd36ee"

PRESETS = {
    # python train.py: a small MAR with a local prior (mar.py item 4: without it the base does not read
    # its canvas) on 16×16 shapes images of 64 two-pixel tokens, objects aligned to 8-px cells (with free
    # positions RL did not visibly teach a base that draws: docs/research_log.md), from the shipped base,
    # whose pretraining images were under-captioned; 16 AR steps sampled from the policy itself (no
    # guidance, τ = 1); MAR-GRPO as released (MTE on the uncertain unknown tokens) without the last noisy
    # diffusion step (its tiny σ dominates a gradient: docs/research_log.md)
    "demo": dict(init=DEMO_BASE, img_size=16, patch_size=2, local_conv=3, cell=8, unmentioned=0.5, pretrain_steps=8000,
                 num_iter=16, min_diff_step=2, lr=1e-4, cfg=1.0, temperature=1.0, eval_images_per_prompt=2),
    # the demo until 2026-12-01 and the base of docs/study.md: free object sizes and positions, clean
    # captions, CFG 6, τ 0.5, lr 1e-5
    "free16": dict(init=FREE16_BASE, img_size=16, patch_size=2, local_conv=3, pretrain_steps=8000, num_iter=16,
                   min_diff_step=2, lr=1e-5, cfg=6.0),
    # the whole pipeline at toy size, under a minute on 2 CPU cores
    "smoke": dict(embed_dim=32, depth=1, heads=2, head_depth=1, head_width=32, num_iter=4, num_sampling_steps=8,
                  pretrain_steps=20, pretrain_batch=16, steps=3, prompts_per_step=2, group_size=2,
                  train_ar_steps=2, train_diff_steps=3, eval_prompts=4, sample_every=2, save_every=2),
    # official MAR-B at 256 px on 8 GPUs with the released MAR-GRPO settings (SPEC §8); CFG 3 and 100
    # diffusion steps are MAR-B's own sampling settings, lr 2e-6 the NOVA run's
    "mar_base": dict(model="mar_base", img_size=256, num_iter=64, num_sampling_steps=100, cfg=3.0, temperature=1.0,
                     steps=1200, prompts_per_step=8, group_size=4, lr=2e-6, train_ar_steps=12, train_diff_steps=10,
                     reward="hpsv2", save_every=50, sample_every=50, eval_prompts=0),
    # the released Harmon-1.5B run (AMAP-ML/mar-grpo: scripts/debug_entry_harmon.py, trainer
    # grpo_trainer_harmon_v1_2.py): 512 px (the config's 32×32 grid), CFG 3 constant, S = 5; only the
    # MAR trains (models.set_trainable); T = 25, as the run's name ("25diff") says
    "harmon": dict(model="harmon", model_config="harmon_1.5b", num_iter=64, num_sampling_steps=25, cfg=3.0,
                   cfg_schedule="constant", temperature=1.0, steps=1200, prompts_per_step=8, group_size=4, lr=1e-6,
                   train_ar_steps=12, train_diff_steps=10, mte_seeds=5, reward="hpsv2", save_every=50,
                   sample_every=50, eval_prompts=0),
    # the released NOVA run (scripts/debug_entry_nova.py, grpo_trainer_nova_v1_2.py): d48w1024-sd512,
    # CFG 5 constant, 25 diffusion steps, S = 3; all but the diffusion MLP trains (models.set_trainable)
    "nova": dict(model="nova", num_iter=64, num_sampling_steps=25, cfg=5.0, cfg_schedule="constant", temperature=1.0,
                 steps=1200, prompts_per_step=8, group_size=4, lr=2e-6, train_ar_steps=12, train_diff_steps=10,
                 mte_seeds=3, reward="hpsv2", save_every=50, sample_every=50, eval_prompts=0),
    # the Harmon and NOVA pipelines at toy size, for tests on a tiny model built from a config
    "adapter_smoke": dict(num_iter=4, num_sampling_steps=6, cfg_schedule="constant", temperature=1.0, steps=2,
                          prompts_per_step=2, group_size=2, train_ar_steps=2, train_diff_steps=2, mte_seeds=2,
                          reward="jpeg_incompressibility", eval_prompts=2, sample_every=1, save_every=1, lr=1e-4),
}


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is a one-line ValueError (reported by `cli`), not the usage block."""

    def error(self, message):
        # "argument --lr: 'nan' must be ..." -> "--lr nan: must be ..."
        raise ValueError(re.sub(r"^argument (--[\w-]+): '([^']*)' ", r"\1 \2: ", message))


def number(kind, low=-math.inf, high=math.inf, low_open=False, high_open=False):
    """An argparse type: a finite int or float in [low, high] (open ends where asked)."""
    def parse(text):
        value = kind(text)
        if not math.isfinite(value) or value < low or value > high or (low_open and value == low) or (high_open and value == high):
            lo = ("(" if low_open or low == -math.inf else "[") + f"{low:g}"
            hi = f"{high:g}" + (")" if high_open or high == math.inf else "]")
            raise argparse.ArgumentTypeError(f"{text!r} must be a finite number in {lo}, {hi}")
        return value
    parse.__name__ = kind.__name__
    return parse


def optional_tau(text):
    return "off" if text.lower() == "off" else number(float)(text)


POS_INT, NONNEG_INT = number(int, 1), number(int, 0)
POS_FLOAT, NONNEG_FLOAT, FRACTION = number(float, 0, low_open=True), number(float, 0), number(float, 0, 1, low_open=True)


def build_parser():
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    # run
    a("--preset", default="demo", choices=sorted(PRESETS), help="named group of defaults")
    a("--stage", default="all", choices=["pretrain", "grpo", "all"], help="what to run")
    a("--out", default=None, help="output folder (default runs/<preset>)")
    a("--init", default=None, help="base checkpoint: ours, an official MAR .pth, harmon_*.pth, or a NOVA pipeline folder; "
                                   "'scratch': pretrain the small shapes model here (the demo starts from DEMO_BASE)")
    a("--resume", nargs="?", const="yes", default="no", choices=["no", "yes", "auto"],
      help="continue from the newest readable checkpoint in --out/ckpt: --resume (one must exist), --resume auto "
           "(if one exists; a torchrun relaunch does this by itself), or no (a fresh run replaces --out's checkpoints)")
    a("--eval-only", action="store_true", help="generate for --prompts and score, then exit")
    a("--seed", type=NONNEG_INT, default=0, help="global seed; every step's randomness derives from (seed, step, rank)")
    a("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run")
    a("--threads", type=NONNEG_INT, default=0, help="torch CPU threads (0: torch's default)")
    a("--wandb", action="store_true", help="also log to Weights & Biases (if installed)")
    # model: "small" is built from the size flags (pixel tokens, prompt conditioning);
    # mar_base / mar_large / mar_huge are the official models (KL-16 latents, class labels)
    a("--model", default="small", choices=models.MODELS, help="which policy (models.py)")
    a("--model-config", default="harmon_1.5b", help="Harmon: a released config name or a JSON config file")
    a("--tokenizer", default=None, help="Harmon: the Qwen2.5 tokenizer folder (local)")
    a("--prompt-embeds", default=None, help="NOVA: the prompts' Phi-2 embeddings (python prompts.py embed-nova)")
    a("--img-size", type=POS_INT, default=32, help="image size in pixels")
    a("--patch-size", type=POS_INT, default=4, help="pixels per token side (small model)")
    a("--embed-dim", type=POS_INT, default=128, help="transformer width (small model)")
    a("--depth", type=POS_INT, default=3, help="encoder and decoder blocks each (small model)")
    a("--heads", type=POS_INT, default=4, help="attention heads (small model)")
    a("--head-depth", type=POS_INT, default=3, help="diffusion-head residual blocks (small model)")
    a("--head-width", type=POS_INT, default=128, help="diffusion-head width (small model)")
    a("--local-conv", type=NONNEG_INT, default=0, help="k×k conv over the decoder's token grid (small model; 0 = official; mar.py item 4)")
    a("--cell", type=NONNEG_INT, default=0,
      help="shapes images of pretraining and the probes: objects aligned to cells of this many pixels (0 = free)")
    a("--unmentioned", type=number(float, 0, 1), default=0.0,
      help="pretraining images: probability of one more object than the prompt says (shapes.make_dataset)")
    a("--mask-schedule", default="official", choices=["official", "cosine"],
      help="pretraining mask ratios: official truncated normal, or cos(π/2·u) (small model; mar.py item 5)")
    a("--mask-ratio-min", type=FRACTION, default=0.7, help="lowest MAE mask ratio of pretraining (the official 0.7)")
    a("--vae", default=None, help="KL-16 VAE .ckpt (LDM format) for MAR and Harmon; NOVA: its vae/ folder (default: beside --init)")
    # sampling
    a("--num-iter", type=POS_INT, default=8, help="AR steps N per image")
    a("--num-sampling-steps", type=number(int, 3), default=16, help="diffusion steps T of the head")
    a("--cfg", type=NONNEG_FLOAT, default=3.0, help="guidance w (1 = none)")
    a("--cfg-schedule", default="linear", choices=["linear", "constant"], help="guidance over the AR steps")
    a("--temperature", type=POS_FLOAT, default=0.5, help="τ of the head's noise")
    # pretraining (shapes world)
    a("--pretrain-steps", type=NONNEG_INT, default=2000, help="optimizer steps of base pretraining")
    a("--pretrain-batch", type=POS_INT, default=32, help="images per pretraining step (global)")
    a("--pretrain-lr", type=POS_FLOAT, default=1e-3, help="pretraining peak learning rate")
    a("--pretrain-from", default=None, help="start pretraining from this base's weights (ours, same size flags) instead of "
                                         "a random model: a new optimizer and lr schedule, e.g. to pretrain a base longer")
    a("--ema", type=number(float, 0, 1, high_open=True), default=0.999, help="EMA decay of the pretrained base")
    a("--diffusion-batch-mul", type=POS_INT, default=1, help="official diffusion_batch_mul for pretraining")
    # GRPO (SPEC §6–§8); the component flags (default: the --method's) override the method
    a("--method", default="mar-grpo", choices=list(grpo.METHODS), help="the paper's variant (SPEC §7)")
    a("--steps", type=POS_INT, default=40, help="GRPO steps")
    a("--prompts-per-step", type=POS_INT, default=8, help="prompts per step (global; divides by the world size)")
    a("--group-size", type=number(int, 2), default=6, help="images per prompt G")
    a("--grad-accum", type=POS_INT, default=1, help="micro-batches per rank and step, gradients accumulated: the "
                                                    "same step as world × this many processes")
    a("--lr", type=POS_FLOAT, default=1e-4, help="GRPO learning rate (constant)")
    a("--weight-decay", type=NONNEG_FLOAT, default=0.0, help="AdamW weight decay")
    a("--max-grad-norm", type=POS_FLOAT, default=1.0, help="gradient clipping")
    a("--train-ar-steps", type=POS_INT, default=2, help="AR steps trained per rollout")
    a("--train-diff-steps", type=POS_INT, default=6, help="diffusion steps trained per AR step")
    a("--min-diff-step", type=POS_INT, default=1, help="lowest diffusion step trained (the last steps' tiny σ dominates a gradient)")
    a("--beta", type=NONNEG_FLOAT, default=None, help="KL weight β (0.01)")
    a("--kl", default=None, choices=list(grpo.KL_KINDS), help="KL estimator (grpo.py)")
    a("--clip-eps", type=POS_FLOAT, default=None, help="PPO clip ε (with --inner-epochs > 1)")
    a("--inner-epochs", type=POS_INT, default=None, help="optimizer steps per rollout (1 = released)")
    a("--train-cfg", default=None, choices=["rollout", "1"], help="recompute ℓ with the rollout's guidance, or 1 (released)")
    a("--mte-seeds", type=NONNEG_INT, default=None, help="S trajectories for MTE (0 = off)")
    a("--top-k", type=FRACTION, default=None, help="fraction of tokens with MTE")
    a("--policy-positions", default=None, choices=["unknown", "predicted"],
      help="policy term on U_i (released) or only on P_i, the tokens written at the trained step")
    a("--mte-positions", default=None, choices=["unknown", "predicted"], help="MTE on uncertain U_i (released) or P_i only")
    a("--tau", type=optional_tau, default=None, help="consistency threshold τ, or 'off'")
    a("--train-head", default=None, choices=["yes", "no"], help="train the diffusion head")
    # rewards and prompts
    a("--reward", default="shapes", help="reward spec, e.g. shapes or hpsv2:1.0,pickscore:0.5")
    a("--reward-ckpt", action="append", default=[], help="reward weights KEY=PATH (repeatable)")
    a("--prompts", default=None, help="prompt file, one per line (shapes prompts, class indices, or text)")
    a("--split", default="train", choices=["train", "all"], help="shapes prompts to train on")
    # evaluation, logging, checkpoints
    a("--eval-prompts", type=NONNEG_INT, default=96, help="shapes prompts evaluated per split (0 = skip)")
    a("--eval-images-per-prompt", type=POS_INT, default=1, help="images per evaluated prompt")
    a("--eval-temperature", type=POS_FLOAT, default=None, help="τ for evaluation images (default: --temperature)")
    a("--sample-every", type=POS_INT, default=20, help="write a sample grid every N steps")
    a("--save-every", type=POS_INT, default=20, help="checkpoint every N steps")
    a("--keep-last", type=NONNEG_INT, default=2, help="checkpoints kept (0 = all)")
    a("--max-bad-steps", type=POS_INT, default=5, help="non-finite steps in a row before the run stops")
    return p


def parse_args(argv=None):
    """Flags over preset over the parser's defaults. Returns an argparse.Namespace."""
    p = build_parser()
    preset = p.parse_known_args(argv)[0].preset
    p.set_defaults(**PRESETS[preset])
    args = p.parse_args(argv)
    args.out = args.out or os.path.join("runs", preset)
    if args.init == "scratch" or (args.stage == "pretrain" and args.init == PRESETS[preset].get("init")):
        args.init = None  # pretrain here (or reuse <out>/base.pt), not the preset's shipped base
    if args.resume == "no" and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
        args.resume = "auto"  # torchrun relaunched the job after a failure: continue, do not start over
    return args


def grpo_config(args):
    """The method's settings (SPEC §7) with every component flag that was given on top."""
    cfg = grpo.GRPOConfig(**grpo.METHODS[args.method])
    for f in fields(grpo.GRPOConfig):
        value = getattr(args, f.name)
        if value is not None:
            setattr(cfg, f.name, {"off": None}.get(value, value) if f.name == "tau" else
                    (value == "yes") if f.name == "train_head" else value)
    return cfg.validate()


def check_inputs(args, world):
    """Cross-flag rules and files, before any work: a bad one raises a one-line ValueError /
    FileNotFoundError / PermissionError naming it. Reads, never writes. (Single flags were checked
    when parsed; file contents are checked next, by loading them, still before the first write.)
    world: the number of processes. Returns the GRPO config."""
    cfg = grpo_config(args)
    if args.min_diff_step >= args.num_sampling_steps - 1:  # the head's own trainable steps are checked in grpo_train
        raise ValueError(f"--min-diff-step {args.min_diff_step}: no diffusion step left below T − 1 = {args.num_sampling_steps - 1}")
    if args.prompts_per_step % (world * args.grad_accum):
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} must divide by the world size {world} × "
                         f"--grad-accum {args.grad_accum} (each prompt's group is generated in one micro-batch)")
    if args.stage == "pretrain" and args.init is not None:
        raise ValueError("--stage pretrain trains a base model from scratch: drop --init (or use --stage grpo)")
    if (args.eval_only or args.stage == "grpo") and args.init is None:
        raise ValueError(f"{'--eval-only' if args.eval_only else '--stage grpo'} needs --init CKPT")
    if will_pretrain(args) and args.pretrain_batch % world:
        raise ValueError(f"--pretrain-batch {args.pretrain_batch} must divide by the world size {world}")
    if will_pretrain(args) and args.model != "small":
        raise ValueError(f"--model {args.model}: pretraining builds the small shapes model; give --init for {args.model}")
    if args.pretrain_from is not None and not will_pretrain(args):
        why = f"it starts from --init {args.init}" if args.init else f"it reuses {os.path.join(args.out, 'base.pt')}"
        raise ValueError(f"--pretrain-from: this run does not pretrain ({why}); use --stage pretrain or --init scratch")
    for name in ("init", "prompts", "vae", "tokenizer", "prompt_embeds", "pretrain_from"):
        path = getattr(args, name)
        if path is not None and not os.path.exists(path):
            raise FileNotFoundError(f"--{name.replace('_', '-')}: no such file: {path}")
    if args.model not in ("small", "nova") and args.vae is None:
        raise ValueError(f"--vae: --model {args.model} needs the KL-16 VAE checkpoint (kl16.ckpt)")
    if args.prompts is not None and args.init is None:  # the model will be a shapes model: parse now
        read_prompt_file(args.prompts, "shapes")
    if args.stage != "pretrain" or args.eval_only:
        reward_names = [name for name, _ in rewards.parse_reward_spec(args.reward)]  # unknown names fail here
        rewards.parse_reward_ckpt(args.reward_ckpt, args.reward)  # the weight files are checked when built
        if "shapes" in reward_names and args.model != "small":
            raise ValueError(f"--reward shapes scores shapes-world prompts; --model {args.model} does not draw them")
    if args.resume == "yes" and not checkpoints.checkpoint_names(os.path.join(args.out, "ckpt")):
        raise FileNotFoundError(f"--resume: no checkpoint in {os.path.join(args.out, 'ckpt')} (--resume auto starts fresh if none)")
    checkpoints.check_writable(args.out, "--out")
    return cfg


def will_pretrain(args):
    """True when this run trains the base model itself (no --init, no cached <out>/base.pt)."""
    if args.eval_only or args.init is not None:
        return False
    return args.stage == "pretrain" or (args.stage == "all" and not os.path.exists(os.path.join(args.out, "base.pt")))


# -----------------------------------------------------------------------------
# Models, codecs, prompts, rewards

def load_base(args, ctx, init):
    """The base policy from `init` (on ctx.device, frozen), its codec and the prompts; a missing,
    corrupt or mismatched checkpoint, VAE or prompt file fails here, before anything is written."""
    base = models.load_policy(args, init).to(ctx.device).requires_grad_(False)
    return base, models.load_codec(args, base, ctx.device), models.load_prompts(args, base)


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
# Stage 1: pretrain a small MAR on the shapes world (the demo's base model)

def pretrain(args, ctx):
    """MAE-style diffusion-loss training with EMA; writes <out>/base.pt (the EMA weights). A step
    with a non-finite loss or gradient changes nothing (no optimizer step, no EMA update);
    --max-bad-steps of them in a row stop the run before base.pt is written."""
    local_batch = args.pretrain_batch // ctx.world  # divisibility: check_inputs
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = mar.build_mar(models.small_mar_config(args))
    if args.pretrain_from is not None:  # continue a base: its (EMA) weights, strict shapes, a fresh optimizer
        model = models.load_checkpoint(args.pretrain_from, model=model, flag="--pretrain-from").train()
    model = model.to(ctx.device)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    model.class_emb.requires_grad_(False)  # prompt-conditioned: the class table is unused
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.pretrain_lr,
                            betas=(0.9, 0.95), weight_decay=0.02)
    net = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None) if ctx.ddp else model
    codec = mar.PixelCodec()
    ctx.print0(f"pretraining a {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter MAR "
               f"for {args.pretrain_steps} steps of {args.pretrain_batch} images"
               + (f", from {args.pretrain_from}" if args.pretrain_from else ""))
    bad_steps = bad_total = 0
    for step in tqdm(range(args.pretrain_steps), disable=not ctx.master, desc="pretrain"):
        # --- data: fresh renders of train-split prompts, a different slice on every rank
        rng = np.random.default_rng([args.seed, 1, step, ctx.rank])
        imgs, metas = shapes.make_dataset(local_batch, args.img_size, rng, split="train", cell=args.cell,
                                          unmentioned=args.unmentioned)
        x = codec.encode(torch.from_numpy(imgs).permute(0, 3, 1, 2).float().div(255).to(ctx.device))
        ids = torch.from_numpy(shapes.tokenize([m["prompt"] for m in metas])).to(ctx.device)
        # --- update: linear warm-up, then cosine decay to 10%
        frac = step / max(1, args.pretrain_steps)
        lr = args.pretrain_lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        with ctx.autocast():
            loss = net(x, prompt_ids=ids, generator=ctx.generator(2, step))
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
        if step % 50 == 0:  # once in a while: the loss averaged over ranks (every rank joins)
            loss_mean = ctx.mean({"loss": loss.detach()})["loss"]
            if ctx.master:
                tqdm.write(f"pretrain step {step}: loss {loss_mean:.4f}")
    path = os.path.join(args.out, "base.pt")
    if ctx.master:
        os.makedirs(args.out, exist_ok=True)
        checkpoints.atomic_save({"model": ema.state_dict(), "config": ema.config, "args": vars(args), "stage": "pretrain"}, path)
        ctx.print0(f"base model: {path}" + (f" ({bad_total} non-finite steps skipped)" if bad_total else ""))
    ctx.barrier()
    return path


# -----------------------------------------------------------------------------
# Stage 2: GRPO

# The recorded ℓ of a fresh rollout and the ℓ the update recomputes should agree to float rounding
# (~1e-5 nats in fp32; the tests hold them to 1e-4). A larger gap means the update does not
# evaluate the policy that sampled (a bf16 recompute, a canvas fed differently): at 0.1 nats a
# token's ratio ρ is off by 10%, half of PPO's clip range ε = 0.2, before any update has happened.
PARITY_WARN = 0.1
# per-step statistics logged as their maximum over trained AR steps, micro-batches and ranks (an
# outlier is what they exist to show); every other statistic is a mean
MAX_STATS = ("logp_parity_err", "ratio_max_dev")


def collect(args, ctx, cfg, model, codec, prompts, reward_fn, step, shard, diff_candidates):
    """One micro-batch of a GRPO step: the prompts of `shard` (of world × --grad-accum), G rollouts
    each recording the chosen steps, their rewards and advantages, and the MTE trajectories.
    Returns a dict (inputs, record, images, texts, scores, info, adv, seeds, uncertain, times)."""
    per_shard = args.prompts_per_step // (ctx.world * args.grad_accum)  # divisibility: check_inputs
    t0 = time.time()
    items = prompts.sample(args.prompts_per_step, args.seed, step)[shard * per_shard:(shard + 1) * per_shard]
    items = [it for it in items for _ in range(args.group_size)]  # each prompt's group stays together
    inputs = prompts.condition(items, ctx.device)
    plan_ar, plan_diff = grpo.choose_train_steps(len(model.ar_schedule(args.num_iter, model.seq_len)), args.train_ar_steps,
                                                 diff_candidates, args.train_diff_steps, ctx.generator(3, step, shard=shard))
    plan = rollout.RolloutPlan(ar_steps=plan_ar, diff_steps=plan_diff)
    with ctx.autocast():
        tokens, record = rollout.record_rollout(model, inputs, args.num_iter, args.cfg, args.cfg_schedule,
                                                args.temperature, plan, ctx.generator(4, step, shard=shard))
        images = codec.decode(model.unpatchify(tokens).float())
    t1 = time.time()
    texts = prompts.texts(items)
    scores, info = score(reward_fn, args.reward, images, texts, prompts.metas(items))
    scores = scores.to(ctx.device)
    adv = grpo.group_advantages(scores, args.group_size)
    t2 = time.time()
    # multi-trajectory expectation: S head trajectories from z_final, per-token uncertainty
    seeds = uncertain = None
    if cfg.mte_seeds >= 2:
        seeds = mte.sample_trajectories(model.diffloss, record.z_final, record.z_final_null, record.cfg_final,
                                        args.temperature, cfg.mte_seeds, plan.diff_steps, ctx.generator(5, step, shard=shard))
        uncertain = masks.top_k_mask(masks.token_uncertainty(seeds["x0"]), cfg.top_k)
    return dict(inputs=inputs, record=record, images=images, texts=texts, scores=scores, info=info, adv=adv,
                seeds=seeds, uncertain=uncertain, olds=[None] * len(record.steps),
                t_rollout=t1 - t0, t_reward=t2 - t1, t_mte=time.time() - t2)


def grpo_train(args, ctx, cfg, base, base_path, codec, prompts, reward_fn):
    """RL from the base policy `base` (on ctx.device; it stays frozen as the reference of the KL,
    and the policy shares its frozen parameters); checkpoints (the trained parameters over
    `base_path`), samples and metrics under args.out. Returns the final checkpoint path.

    cfg: grpo.GRPOConfig; codec: latents <-> images; prompts: Prompts; reward_fn: a rewards.Reward.
    Each rank's share of a step's prompts runs as --grad-accum micro-batches whose gradients add up
    before the one optimizer step, drawn exactly as world × --grad-accum processes would draw them.
    A step whose reward, advantage, loss or gradient is not finite on some rank changes nothing (no
    optimizer step on any rank); --max-bad-steps of them in a row stop the run (Stop).
    """
    ref = base  # the frozen reference of the KL
    guided = args.cfg != 1.0 and cfg.train_cfg == "rollout"  # the loss reads the null condition
    model = models.policy_copy(base, models.trainable_names(args, base, cfg.train_head, guided))
    model.eval()  # no dropout: recomputed log-probabilities must equal the recorded ones
    params = [p for p in model.parameters() if p.requires_grad]
    diff_candidates = [k for k in model.diffloss.trainable_steps() if k >= args.min_diff_step]  # what a rollout may record
    if not diff_candidates:
        raise ValueError(f"--min-diff-step {args.min_diff_step}: the head trains steps {list(model.diffloss.trainable_steps())}")
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay)
    loss_module = policy.PolicyLoss(model)
    if ctx.ddp:
        loss_module = DDP(loss_module, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)

    ckpt_dir, metrics_path = os.path.join(args.out, "ckpt"), os.path.join(args.out, "metrics.jsonl")
    base_path = os.path.abspath(base_path)
    start, bad_total = 0, 0
    if args.resume != "no":
        start, bad_total = checkpoints.resume_training(ckpt_dir, model, opt, base_path, args.resume == "yes",
                                                       lambda msg: ctx.print0(msg, file=sys.stderr))
        if start:
            ctx.print0(f"resumed from step {start}")
    if ctx.master:  # the stage's first write
        checkpoints.start_run_folder(args.out, start, args.keep_last, {**vars(args), "grpo": vars(cfg), "world_size": ctx.world})
    ctx.barrier()
    ctx.print0(f"GRPO ({args.method}): {args.steps} steps × {args.prompts_per_step} prompts × G={args.group_size}, "
               f"world size {ctx.world}" + (f" × {args.grad_accum} micro-batches" if args.grad_accum > 1 else "")
               + f"; {sum(p.numel() for p in params) / 1e6:.2f}M trained parameters; {cfg}")

    A, G = args.grad_accum, args.group_size
    bad_steps, parity_warned = 0, False  # non-finite steps in a row
    for step in tqdm(range(start, args.steps), disable=not ctx.master, desc="grpo", initial=start, total=args.steps):
        last_step = step == args.steps - 1
        # --- rollouts, rewards, MTE: this rank's micro-batches
        batches = [collect(args, ctx, cfg, model, codec, prompts, reward_fn, step, ctx.rank * A + m, diff_candidates)
                   for m in range(A)]

        # --- policy update: E inner epochs, one backward per trained AR step (DDP all-reduces on the
        #     last micro-batch's last step); anything non-finite on any rank skips the optimizer step
        t2 = time.time()
        skipped = False
        for epoch in range(cfg.inner_epochs):
            step_stats = []
            for m, b in enumerate(batches):
                stats, b["olds"] = policy.backward_rollout(loss_module, ctx.ddp, ref, b["record"], b["inputs"], b["adv"], cfg,
                                                           b["seeds"], b["uncertain"], b["olds"], ctx.autocast,
                                                           scale=1 / A, sync=m == A - 1)
                step_stats += stats
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            if all_finite(ctx, [b["scores"] for b in batches], [b["adv"] for b in batches],
                          [s["loss"] for s in step_stats], grad_norm):
                opt.step()
            else:
                skipped = True
            opt.zero_grad(set_to_none=True)
        t_update = time.time() - t2
        bad_steps = bad_steps + 1 if skipped else 0
        bad_total += skipped

        # --- logging: scalars (tensors until here) are reduced over ranks, one sync each for the
        #     means and the maxima
        scores, adv = torch.cat([b["scores"] for b in batches]), torch.cat([b["adv"] for b in batches])
        images, texts = torch.cat([b["images"] for b in batches]), [t for b in batches for t in b["texts"]]
        reward_means = [b["info"].get("means", {}) for b in batches]
        local = dict(reward_mean=scores.mean(), reward_std=scores.std() if len(scores) > 1 else 0.0,
                     adv_abs_mean=adv.abs().mean(), adv_max=adv.max(), grad_norm=grad_norm,
                     diversity=evaluate.group_diversity(images, G),
                     **{key: sum(b[key] for b in batches) for key in ("t_rollout", "t_reward")},
                     t_update=t_update + sum(b["t_mte"] for b in batches),
                     **{key: torch.stack([s[key] for s in step_stats if key in s]).float().mean()
                        for key in step_stats[0] if key not in MAX_STATS},
                     **{f"reward/{name}": sum(r[name] for r in reward_means) / A for name in reward_means[0]})
        worst = {key: torch.stack([s[key] for s in step_stats]).float().max() for key in MAX_STATS if key in step_stats[0]}
        row = {"step": step, **ctx.mean(local), **ctx.max(worst), "skipped": int(skipped), "bad_steps_total": bad_total}
        if ctx.master:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            if args.wandb:
                import wandb
                wandb.log(row, step=step)
        if row["logp_parity_err"] > PARITY_WARN and not parity_warned:
            parity_warned = True
            ctx.print0(f"warning: step {step}: recorded and recomputed log-probabilities differ by up to "
                       f"{row['logp_parity_err']:.3g} nats (> {PARITY_WARN}): the update does not evaluate the policy "
                       "that sampled (see logp_parity_err in metrics.jsonl; train.py, PARITY_WARN)", file=sys.stderr)
        if skipped:
            ctx.print0(f"step {step}: non-finite reward, advantage, loss or gradient; update skipped "
                       f"({bad_steps} in a row, {bad_total} in all)")
            if bad_steps >= args.max_bad_steps:
                names = checkpoints.checkpoint_names(ckpt_dir)
                last = os.path.join(ckpt_dir, names[-1]) if names else "none yet (the policy is still --init)"
                raise Stop(f"{bad_steps} non-finite steps in a row (--max-bad-steps {args.max_bad_steps}); "
                           f"the last good checkpoint: {last}")

        # --- once in a while: a sample grid, a checkpoint (the trained parameters, over base_path)
        if ctx.master and (step % args.sample_every == 0 or last_step):
            evaluate.save_grid(images[:16], [f"{t} ({s:.2f})" for t, s in zip(texts, scores.tolist())][:16],
                               os.path.join(args.out, "samples", f"step_{step:06d}.png"))
        if (step + 1) % args.save_every == 0 or last_step:
            ctx.barrier()
            if ctx.master:
                trained = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
                checkpoints.save_step(ckpt_dir, step + 1, {
                    "model": trained, "base": base_path, "config": model.config, "optimizer": opt.state_dict(),
                    "step": step + 1, "args": vars(args), "grpo": vars(cfg), "bad_steps_total": bad_total}, args.keep_last)
            ctx.barrier()
    if ctx.master and os.path.exists(metrics_path):
        evaluate.plot_curves(metrics_path, os.path.join(args.out, "curves.png"))
    return os.path.join(ckpt_dir, "latest.pt")


# -----------------------------------------------------------------------------

def main(argv=None):
    """The whole run: check the inputs, load what they name, and only then write. Returns the
    evaluation summary, or None."""
    args = parse_args(argv)
    ctx = Ctx(args)
    cfg = check_inputs(args, ctx.world)

    # --- load what the run needs; a bad file fails here, and nothing has been written yet
    reward_fn = rewards.build_reward(args.reward, device=ctx.device,
                                     weights=rewards.parse_reward_ckpt(args.reward_ckpt, args.reward)) \
        if args.stage != "pretrain" or args.eval_only else None
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
        summary = evaluate.evaluate(args, ctx, base, codec, prompts.eval_items(args.eval_prompts, args.seed),
                                    prompts, reward_fn, args.out, "eval", score)
        ctx.print0(json.dumps(summary, indent=1))
        ctx.print0(f"results: {os.path.join(args.out, 'results.jsonl')}")
        return summary

    if base is None:  # --stage pretrain, or --stage all without a cached base
        init = pretrain(args, ctx)
        if args.stage == "pretrain":
            return None
        base, codec, prompts = load_base(args, ctx, init)
    final = grpo_train(args, ctx, cfg, base, init, codec, prompts, reward_fn)

    if args.stage == "all" and args.eval_prompts > 0:
        # --- evaluation of the base and the tuned model on the same prompts and seeds: held-out
        # compositions (eval/base, eval/tuned) and, for shapes prompts, the training split too
        # (eval/base_train, eval/tuned_train: prompts of the split RL draws from, with fresh seeds; a
        # short run draws few of these very prompts: 40 steps × 8 of the split's 452)
        trained = checkpoints.read_checkpoint(final, "--out")["model"]  # the tuned model shares base's frozen parts
        tuned = models.policy_copy(base, trained).requires_grad_(False)
        models.load_trained(tuned, trained, final)
        splits = ["heldout", "train"] if args.prompts is None and prompts.is_shapes else ["heldout"]
        report = {}
        for split in splits:
            items = prompts.eval_items(args.eval_prompts, args.seed, split)
            suffix = "" if split == "heldout" else "_" + split
            for tag, model in (("base", base), ("tuned", tuned)):
                report[tag + suffix] = evaluate.evaluate(args, ctx, model, codec, items, prompts, reward_fn,
                                                         os.path.join(args.out, "eval", tag + suffix), tag + suffix, score)
        if ctx.master:
            with open(os.path.join(args.out, "eval", "summary.json"), "w") as f:
                json.dump(report, f, indent=1)
            evaluate.print_report(args.out, report)
        return report
    return None


def cli(argv=None, entry=None):
    """`python train.py ...`: main() (or `entry`, e.g. evaluate.main), with failures said in one line
    on stderr (`error: ...`, or `error (rank N): ...` from rank N > 0 under torchrun). Bad flags and
    files: no traceback, exit status 2. A deliberate stop (Stop): exit status 1. Anything else is a
    bug and keeps Python's traceback. Returns the exit status."""
    where = f" (rank {os.environ['RANK']})" if int(os.environ.get("RANK", 0)) > 0 else ""
    try:
        (entry or main)(argv)
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
