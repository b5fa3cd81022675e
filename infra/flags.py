"""The flags of a run, one place: every flag with its default and meaning, the named presets, and
the checks that run before any work. train.py and evaluate.py (whose table flags come on top of
these) both parse and check through this file; the demo's pretraining (demo/pretrain.py) and the
lab (experiments/) register their own.

Checks happen in two places: a single flag's range and finiteness when it is parsed (`number`),
cross-flag rules and files in `check_inputs` (train.py) and `check_model_inputs` (both scripts);
a bad one raises a one-line ValueError / FileNotFoundError / PermissionError naming the flag,
which processes.cli prints as `error: ...` with exit status 2.
"""

import argparse
import importlib.util
import math
import os
from dataclasses import fields

import demo
import grpo
import rewards
from infra import checkpoints, prompt_records
from infra.processes import Parser
from infra.prompts import read_prompt_file
from models import loading
from scorers import remote

# -----------------------------------------------------------------------------
# Configuration: every flag with its default and meaning; a preset replaces some defaults; flags win.

# The real models' presets recompute the transformer's blocks in the backward pass (--grad-checkpointing):
# without it docs/memory.md puts NOVA at 28 GiB per GPU in bf16 (18 with it) and MAR-B at 9.3 (7.9); Harmon's fp32
# trained AR step alone holds 62 GiB of activations
PRESETS = {
    # python train.py: MAR-GRPO as released (MTE on the uncertain unknown tokens) from the shipped small
    # MAR of the shapes world (demo/base.pt: 16×16 images of 64 two-pixel tokens), 16 AR steps sampled
    # from the policy itself (no guidance, τ = 1), without the last noisy diffusion step (its tiny σ
    # makes that step's gradient dominate the others)
    "demo": dict(init=demo.BASE, img_size=16, num_iter=16, min_diff_step=2, lr=1e-4, cfg=1.0, temperature=1.0,
                 eval_images_per_prompt=2),
    # the whole pipeline at toy size, under a minute on 2 CPU cores, from the shipped toy base demo/smoke.pt
    "smoke": dict(init=demo.SMOKE_BASE, num_iter=4, num_sampling_steps=8, steps=3, prompts_per_step=2, group_size=2,
                  train_ar_steps=2, train_diff_steps=3, eval_prompts=4, sample_every=2, save_every=2),
    # official MAR-B at 256 px on 8 GPUs with the released MAR-GRPO settings (docs/method.md §8); CFG 3 and 100
    # diffusion steps are MAR-B's own sampling settings, lr 2e-6 the NOVA run's
    "mar_base": dict(model="mar_base", img_size=256, num_iter=64, num_sampling_steps=100, cfg=3.0, temperature=1.0,
                     steps=1200, prompts_per_step=8, group_size=4, lr=2e-6, train_ar_steps=12, train_diff_steps=10,
                     reward="hpsv2", save_every=50, sample_every=50, eval_prompts=0, grad_checkpointing=True),
    # the released Harmon-1.5B run (AMAP-ML/mar-grpo: scripts/debug_entry_harmon.py, trainer
    # grpo_trainer_harmon_v1_2.py): 512 px (the config's 32×32 grid), CFG 3 constant, S = 5; only the
    # MAR trains (models/loading.trainable_names); T = 25, as the run's name ("25diff") says
    "harmon": dict(model="harmon", model_config="harmon_1.5b", num_iter=64, num_sampling_steps=25, cfg=3.0,
                   cfg_schedule="constant", temperature=1.0, steps=1200, prompts_per_step=8, group_size=4, lr=1e-6,
                   train_ar_steps=12, train_diff_steps=10, mte_trajectories=5, reward="hpsv2", save_every=50,
                   sample_every=50, eval_prompts=0, grad_checkpointing=True),
    # the released NOVA run (scripts/debug_entry_nova.py, grpo_trainer_nova_v1_2.py): d48w1024-sd512,
    # CFG 5 constant, 25 diffusion steps, S = 3; all but the diffusion MLP trains (models/loading.trainable_names)
    "nova": dict(model="nova", num_iter=64, num_sampling_steps=25, cfg=5.0, cfg_schedule="constant", temperature=1.0,
                 steps=1200, prompts_per_step=8, group_size=4, lr=2e-6, train_ar_steps=12, train_diff_steps=10,
                 mte_trajectories=3, reward="hpsv2", save_every=50, sample_every=50, eval_prompts=0, grad_checkpointing=True),
    # the released NOVA mix run (scripts/debug_entry_nova_mix.py, same trainer): the NOVA run's settings
    # (lr 2e-6 constant, β 0.01, 4 images per prompt, 12 of 64 AR steps, 10 of 25 diffusion steps, S = 3,
    # top 30 %, Δsim > 0, guidance 5 constant) with --reward_funcs "hps git gdino", summed unweighted
    # (its trainer's normalize_multi_rewards is hard-coded off), on data/geneval_and_t2i_data_final.json
    # (give it as --prompts: the released records); 3 GPUs × 1 prompt a step there, 8 prompts in this
    # preset as in the others. `gdino` fixes the released scorer's inconsistencies (scorers/composition_rules.py);
    # --reward hpsv2,git_vqa,gdino_released scores exactly as released
    "nova_mix": dict(model="nova", num_iter=64, num_sampling_steps=25, cfg=5.0, cfg_schedule="constant", temperature=1.0,
                     steps=1200, prompts_per_step=8, group_size=4, lr=2e-6, train_ar_steps=12, train_diff_steps=10,
                     mte_trajectories=3, reward="hpsv2,git_vqa,gdino", reward_norm="none", save_every=50, sample_every=50,
                     eval_prompts=0, grad_checkpointing=True),
    # the Harmon and NOVA pipelines at toy size, for tests on a tiny model built from a config
    "adapter_smoke": dict(num_iter=4, num_sampling_steps=6, cfg_schedule="constant", temperature=1.0, steps=2,
                          prompts_per_step=2, group_size=2, train_ar_steps=2, train_diff_steps=2, mte_trajectories=2,
                          reward="jpeg_incompressibility", eval_prompts=2, sample_every=1, save_every=1, lr=1e-4),
}

# Options of train.py that only the lab sets: experiments/ registers their flags (`EXTENSIONS`); a run
# without them takes these values.
LAB_OPTIONS = {"train_ar_below": 0, "loss": "grpo"}
EXTENSIONS = []  # functions add(parser) that register more flags on train.py's parser (experiments/)


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


def optional_threshold(text):  # the consistency threshold κ: a number or 'off'
    return "off" if text.lower() == "off" else number(float)(text)


POS_INT, NONNEG_INT = number(int, 1), number(int, 0)
POS_FLOAT, NONNEG_FLOAT, FRACTION = number(float, 0, low_open=True), number(float, 0), number(float, 0, 1, low_open=True)


def run_flags(p):
    a = p.add_argument
    a("--preset", default="demo", choices=sorted(PRESETS), help="named group of defaults")
    a("--out", default=None, help="output folder (default runs/<preset>)")
    a("--init", default=None, help="base checkpoint: ours, an official MAR .pth, harmon_*.pth, or a NOVA pipeline folder "
                                   "(the demo's: demo/base.pt)")
    a("--resume", nargs="?", const="yes", default="no", choices=["no", "yes", "auto"],
      help="continue from the newest readable checkpoint in --out/ckpt: --resume (one must exist), --resume auto "
           "(if one exists; a torchrun relaunch does this by itself), or no (a fresh run replaces --out's checkpoints)")
    a("--eval-only", action="store_true", help="generate for --prompts and score, then exit")
    a("--seed", type=NONNEG_INT, default=0, help="global seed; every step's randomness derives from (seed, step, rank)")
    a("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run")
    a("--precision", default=None, choices=["bf16", "fp32"],
      help="the forward passes' dtype on any device: bf16 autocast or fp32 (default: bf16 on CUDA, "
           "fp32 on the CPU); the diffusion head computes in fp32 and the weights, gradients and "
           "AdamW state are fp32 in both (infra/processes.py, docs/memory.md)")
    a("--threads", type=NONNEG_INT, default=0, help="torch CPU threads (0: torch's default)")
    a("--wandb", action="store_true", help="also log to Weights & Biases (needs the wandb package)")


def model_flags(p):
    a = p.add_argument
    a("--model", default="small", choices=loading.MODELS,
      help="which policy: small (the demo's shapes MAR), the official mar_base/large/huge, harmon, nova (models/loading.py)")
    a("--model-config", default="harmon_1.5b", help="Harmon: a released config name or a JSON config file")
    a("--tokenizer", default=None, help="Harmon: the Qwen2.5 tokenizer folder (local)")
    a("--prompt-embeds", default=None, help="NOVA: the prompts' Phi-2 embeddings (python -m infra.prompts embed-nova)")
    a("--img-size", type=POS_INT, default=32, help="image size in pixels (the official MAR models)")
    a("--vae", default=None, help="KL-16 VAE .ckpt (LDM format) for MAR and Harmon; NOVA: its vae/ folder (default: beside --init)")
    # sampling
    a("--num-iter", type=POS_INT, default=8, help="AR steps N per image")
    a("--num-sampling-steps", type=number(int, 3), default=16, help="diffusion steps T of the head")
    a("--cfg", type=NONNEG_FLOAT, default=3.0, help="guidance w (1 = none)")
    a("--cfg-schedule", default="linear", choices=["linear", "constant"], help="guidance over the AR steps")
    a("--temperature", type=POS_FLOAT, default=0.5, help="τ of the head's noise")


def grpo_flags(p):
    """docs/method.md §6–§8; the component flags (default: the --method's) override the method."""
    a = p.add_argument
    a("--method", default="mar-grpo", choices=list(grpo.METHODS), help="the paper's variant (docs/method.md §7)")
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
    a("--mte-trajectories", type=NONNEG_INT, default=None, help="S head trajectories for MTE (0 = off)")
    a("--top-k", type=FRACTION, default=None, help="fraction of tokens with MTE")
    a("--policy-positions", default=None, choices=["unknown", "predicted"],
      help="policy term on U_i (released) or only on P_i, the tokens written at the trained step")
    a("--mte-positions", default=None, choices=["unknown", "predicted"], help="MTE on uncertain U_i (released) or P_i only")
    a("--consistency-threshold", type=optional_threshold, default=None,
      help="consistency-aware token selection: keep tokens whose Δsim exceeds this κ (0), or 'off' (masks.py)")
    a("--train-head", default=None, choices=["yes", "no"], help="train the diffusion head")
    # models that do not fit as DDP replicas (docs/memory.md)
    a("--lora", type=POS_INT, default=None, help="train LoRA adapters of rank R on the transformer's attention and MLP "
                                                "projections instead of its weights; the KL reference is the model "
                                                "without them (infra/lora.py)")
    a("--fsdp", action="store_true", help="shard the trained parameters, their gradients and AdamW state over the "
                                          "torchrun processes (FSDP2, infra/fsdp.py)")
    a("--grad-checkpointing", action=argparse.BooleanOptionalAction, default=False,
      help="recompute each block of the transformer in the backward pass instead of keeping its activations: MAR's "
           "encoder and decoder, Harmon's MAR blocks and Qwen2 layers, NOVA's blocks (docs/memory.md); the same "
           "gradients, one more forward pass of the blocks")


def reward_and_eval_flags(p):
    a = p.add_argument
    a("--reward", default="shapes", help="reward spec, e.g. shapes or hpsv2:1.0,pickscore:0.5")
    a("--reward-ckpt", action="append", default=[], help="reward weights KEY=PATH (repeatable)")
    a("--reward-url", default=None, help="score with the reward server at this URL (python -m scorers.server, "
      "docs/reward_server.md) instead of loading the reward models; its token from MARGRPO_REWARD_TOKEN")
    a("--reward-token-file", default=None, help="a file holding the reward server's token (instead of MARGRPO_REWARD_TOKEN)")
    a("--reward-timeout", type=POS_FLOAT, default=120.0,
      help="seconds a request to the reward server may take in all, from connecting to the last "
           "byte of its answer")
    a("--reward-retries", type=NONNEG_INT, default=8,
      help="tries again when the reward server cannot be reached, waiting 0.5 s, 1 s, 2 s, ... (at most 15 s) between")
    a("--reward-norm", default="none", choices=["none", "group-minmax"],
      help="combine the rewards as the weighted sum of their raw values, or of each min-max normalised within its "
           "group (the released normalize_multi_rewards; grpo.min_max_combined)")
    a("--prompts", default=None, help="prompt file, one per line (shapes prompts, class indices, or text), or for "
                                      "Harmon and NOVA the released metadata, one JSON record a line (.jsonl)")
    a("--split", default="train", choices=["train", "all"], help="shapes prompts to train on")
    a("--eval-prompts", type=NONNEG_INT, default=96, help="shapes prompts evaluated per split (0: no evaluation)")
    a("--eval-images-per-prompt", type=POS_INT, default=1, help="images per evaluated prompt")
    a("--eval-temperature", type=POS_FLOAT, default=None, help="τ for evaluation images (default: --temperature)")
    a("--sample-every", type=POS_INT, default=20, help="write a sample grid every N steps")
    a("--save-every", type=POS_INT, default=20, help="checkpoint every N steps")
    a("--keep-last", type=NONNEG_INT, default=2, help="checkpoints kept (0 = all)")
    a("--max-bad-steps", type=POS_INT, default=5, help="non-finite steps in a row before the run stops")


DESCRIPTION = """MAR-GRPO training: GRPO from a base policy (--init; the demo's is demo/base.pt), then the base and
the tuned policy evaluated on the same prompts and seeds. A preset names a group of defaults (the
released runs' settings: docs/method.md §8); every flag given wins over its preset."""


def build_parser():
    p = Parser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    groups = [("the run", run_flags), ("the model and its sampling", model_flags),
              ("GRPO (docs/method.md §6-§8)", grpo_flags), ("rewards, prompts, evaluation, checkpoints", reward_and_eval_flags)]
    for title, add in groups + [("the lab (experiments/lab.py)", add) for add in EXTENSIONS]:
        add(p.add_argument_group(title))
    return p


def parse_with_preset(p, presets, argv):
    """Flags over the --preset's defaults over the parser's (`p` has --preset and --out). A blank --out
    is a one-line error; no --out is runs/<preset>. Returns (argparse.Namespace, the preset's name)."""
    preset = p.parse_known_args(argv)[0].preset
    p.set_defaults(**presets[preset])
    args = p.parse_args(argv)
    if args.out is not None and not args.out.strip():
        raise ValueError("--out '': give a folder (or leave --out out: runs/<preset>)")
    return args, preset


def parse_args(argv=None):
    """train.py's flags over the preset over the parser's defaults. Returns an argparse.Namespace."""
    args, preset = parse_with_preset(build_parser(), PRESETS, argv)
    for name, value in LAB_OPTIONS.items():  # a lab option whose flag is not registered keeps its value
        vars(args).setdefault(name, value)
    args.out = args.out or os.path.join("runs", preset)
    if args.resume == "no" and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
        args.resume = "auto"  # torchrun relaunched the job after a failure: continue, do not start over
    return args


def given(argv, parser=None):
    """The dests of the flags written in `argv` (not taken from a preset or a default)."""
    words = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    return {a.dest for a in (parser or build_parser())._actions if words & set(a.option_strings)}


def grpo_settings(args):
    """The method's settings (docs/method.md §7) with every component flag that was given on top."""
    settings = grpo.GRPOSettings(**grpo.METHODS[args.method])
    for f in fields(grpo.GRPOSettings):
        value = getattr(args, f.name)
        if value is not None:
            setattr(settings, f.name, {"off": None}.get(value, value) if f.name == "consistency_threshold" else
                    (value == "yes") if f.name == "train_head" else value)
    return settings.validate()


def check_inputs(args, world):
    """Cross-flag rules and files, before any work: a bad one raises a one-line ValueError /
    FileNotFoundError / PermissionError naming it. Reads, never writes. (Single flags were checked
    when parsed; file contents are checked next, by loading them, still before the first write.)
    world: the number of processes. Returns the GRPO settings (grpo.GRPOSettings)."""
    settings = grpo_settings(args)
    if args.init is None:
        raise ValueError("--init: give the base checkpoint to train or evaluate (the demo's: demo/base.pt; "
                         "python -m demo.pretrain makes one)")
    if not os.path.exists(args.init):
        raise FileNotFoundError(f"--init: no such file: {args.init}")
    if args.min_diff_step >= args.num_sampling_steps - 1:  # the head's own trainable steps are checked in grpo_train
        raise ValueError(f"--min-diff-step {args.min_diff_step}: no diffusion step left below T − 1 = {args.num_sampling_steps - 1}")
    for flag, given in (("--lora", args.lora), ("--fsdp", args.fsdp)):
        if given and args.eval_only:
            raise ValueError(f"{flag}: changes how GRPO trains; --eval-only trains no GRPO policy")
    if args.lora and settings.train_head:
        raise ValueError(f"--lora {args.lora}: the diffusion head stays frozen under LoRA (drop --train-head yes; "
                         "--method grpo trains the head)")
    if args.fsdp and world < 2:
        raise ValueError("--fsdp: shards over the processes of torchrun; with one there is nothing to shard "
                         "(torchrun --nproc_per_node=N train.py ..., N >= 2)")
    if args.fsdp and (settings.train_head or args.lora):
        why = ("a trained head is not sharded (drop --train-head yes / --method grpo, or --fsdp)" if settings.train_head
               else "--lora trains its adapters alone, too small to shard: use --lora without --fsdp")
        raise ValueError(f"--fsdp: shards the transformer's trained weights; {why}")
    if args.prompts_per_step % (world * args.grad_accum):
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} must divide by the world size {world} × "
                         f"--grad-accum {args.grad_accum} (each prompt's group is generated in one micro-batch)")
    check_model_inputs(args, [name for name, _ in rewards.parse_reward_spec(args.reward)])
    if args.wandb and importlib.util.find_spec("wandb") is None:
        raise ValueError("--wandb: the wandb package is not installed (pip install wandb, or drop --wandb)")
    ckpt_dir = os.path.join(args.out, "ckpt")
    if args.resume == "yes" and not checkpoints.checkpoint_names(ckpt_dir):
        raise FileNotFoundError(f"--resume: no checkpoint in {ckpt_dir} (--resume auto starts fresh if none)")
    if args.resume == "yes" and checkpoints.newest_training_state(ckpt_dir, lambda message: None, mmap=True) is None:
        raise ValueError(f"--resume: no checkpoint in {ckpt_dir} can be read (--resume auto starts fresh if none)")
    return settings


def check_model_inputs(args, reward_names=None):
    """What train.py and evaluate.py check alike, before anything is loaded: the model's files exist,
    the KL-16 VAE is given where the model needs one, Harmon and NOVA have a prompt file, a prompt
    file parses (shapes prompts for the small model, text lines for Harmon and NOVA), the rewards
    (names from rewards.parse_reward_spec, or None when the run scores nothing) fit the model and
    their weight flags parse, and --out is writable."""
    for name in ("prompts", "vae", "tokenizer", "prompt_embeds"):
        path = getattr(args, name)
        if path is not None and not os.path.exists(path):
            raise FileNotFoundError(f"--{name.replace('_', '-')}: no such file: {path}")
    if args.model not in ("small", "nova") and args.vae is None:
        raise ValueError(f"--vae: --model {args.model} needs the KL-16 VAE checkpoint (kl16.ckpt)")
    if args.model in ("harmon", "nova") and args.prompts is None:
        raise ValueError(f"--prompts: --model {args.model} needs a prompt file (one prompt per line)")
    if args.prompts is not None and args.model in ("small", "harmon", "nova"):  # class files need the model
        read_prompt_file(args.prompts, "shapes" if args.model == "small" else "text")
    if reward_names is not None:
        if "shapes" in reward_names and args.model != "small":
            raise ValueError(f"--reward shapes scores shapes-world prompts; --model {args.model} does not draw them")
        needs_records = [n for n in reward_names if n in rewards.METADATA_REWARDS]
        if needs_records and not (args.prompts and prompt_records.is_record_file(args.prompts)):
            raise ValueError(f"--reward {needs_records[0]} reads the released prompt metadata: give --prompts FILE.jsonl "
                             f"(one JSON record a line, prompt_records.py){'' if args.prompts is None else f', not {args.prompts}'}")
        rewards.parse_reward_ckpt(args.reward_ckpt, args.reward)  # the weight files are checked when built
    if args.reward_url is not None:  # a reward server scores: its weights and its address are its own
        remote.parse_url(args.reward_url)
        if args.reward_ckpt:
            raise ValueError(f"--reward-ckpt {args.reward_ckpt[0]}: the reward server of --reward-url loads the reward "
                             "weights (python -m scorers.server --reward-ckpt KEY=PATH)")
        if reward_names is None:
            raise ValueError("--reward-url: this run scores no --reward in this process's place (the T2I-CompBench "
                             "evaluators run here); drop --reward-url")
    if args.reward_token_file is not None:
        if args.reward_url is None:
            raise ValueError(f"--reward-token-file {args.reward_token_file}: it is sent to a reward server; give --reward-url")
        if not os.path.isfile(args.reward_token_file):
            raise FileNotFoundError(f"--reward-token-file: no such file: {args.reward_token_file}")
    checkpoints.check_writable(args.out, "--out")
