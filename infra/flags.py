"""The flags a run shares with the paper's table, the named presets, how a run's flags are parsed
(`parse_run_args`) and how they are checked (`check_run_inputs`, `check_model_inputs`).

train.py holds the paper's settings (its `paper_flags`: the objective, the GRPO loop, the reward)
and adds them to the groups of this file: the sampling of a rollout (shared with the table of
tables/paper.py, which samples too), the model and its weights, scale, the run, the evaluation, the
reward service. A setting's value is its flag's default, replaced by the --preset's (`PRESETS`),
then by the --method's variant (grpo.METHODS, given by train.py), then by a flag given on the
command line.

Checks happen in two places: a single flag's range and finiteness when it is parsed (`number`),
cross-flag rules and files in `check_run_inputs` (train.py's) and `check_model_inputs` (what train.py
and the table check alike); a bad one raises a one-line ValueError / FileNotFoundError /
PermissionError naming the flag, which processes.cli prints as `error: ...` with exit status 2.
This file imports only infra/: the reward flags are checked by scorers/registry.py, the prompt files
parsed by models/loading.py, the reward server's address by scorers/remote.py, all before anything
is written.
"""

import argparse
import importlib.util
import math
import os
import sys

from infra import checkpoints
from infra.processes import Parser

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo")  # the shipped bases
MODELS = ["small", "mar_base", "mar_large", "mar_huge", "harmon", "nova"]  # --model (models/loading.py)
PRECISIONS = ["bf16", "fp32"]  # --precision (infra/processes.py)
TEMPERATURES = [0.1, 0.2, 0.3, 0.5, 0.7, 1.0]  # the evaluation's τ sweep (evaluate.temperature_sweep)

# -----------------------------------------------------------------------------
# Presets: named groups of defaults, each replacing some of the flags' own; flags given win.
# The real models' presets recompute the transformer's blocks in the backward pass (--grad-checkpointing):
# without it docs/memory.md puts NOVA at 28 GiB per GPU in bf16 (18 with it) and MAR-B at 9.3 (7.9)

# the small MAR of the shapes world: 16×16 images of 64 two-pixel tokens, 16 AR steps sampled from the
# policy itself (no guidance, τ = 1), the last noisy diffusion step not trained (its tiny σ makes that
# step's gradient dominate the others), lr 1e-4, evaluation in batches of 64
SHAPES = dict(img_size=16, num_iter=16, min_diff_step=2, lr=1e-4, cfg=1.0, temperature=1.0,
              eval_images_per_prompt=2, eval_batch_size=64)
# the released runs' settings (docs/method.md §8): 64 AR steps, 12 of them × 10 diffusion steps
# trained, 8 prompts × G = 4 a step (1 prompt per GPU), 1200 steps, HPS v2.1, checkpoints every 50
RELEASED = dict(num_iter=64, temperature=1.0, steps=1200, prompts_per_step=8, group_size=4, train_ar_steps=12,
                train_diff_steps=10, reward="hpsv2", save_every=50, sample_every=50, eval_prompts=0,
                grad_checkpointing=True)
PRESETS = {
    # python train.py: MAR-GRPO as released (MTE on the uncertain unknown tokens) from demo/base.pt, a base
    # pretrained on under-captioned images that adds unrequested objects; all prompt categories, the
    # verifier's score as the reward (docs/demo.md; experiments/lab.py holds the spatial presets);
    # lr 1e-4 for its 40 steps, at most 0.006 / --steps for longer runs (--lr-budget: at 1200 steps
    # 5e-6, a run measured to hold; docs/method.md §8)
    "demo": dict(SHAPES, init=os.path.join(DEMO, "base.pt"), lr_budget=0.006),
    # python train.py --preset long: the demo's world and base over the released length, 1200 steps, with the
    # one recipe measured there to hold and to gain at the best τ: lr 1e-5 with MTE off (the frozen head and the
    # consistency mask; the MTE term outside P_i collapses the demo at this length, docs/method.md §4), and a
    # checkpoint every 100 steps kept for `python -m experiments.curve`
    "long": dict(SHAPES, init=os.path.join(DEMO, "base.pt"), steps=1200, lr=1e-5, mte_trajectories=0,
                 save_every=100, keep_last=0),
    # the whole pipeline at toy size, under a minute on 2 CPU cores, from the shipped toy base demo/smoke.pt
    "smoke": dict(init=os.path.join(DEMO, "smoke.pt"), num_iter=4, num_sampling_steps=8, steps=3, prompts_per_step=2,
                  group_size=2, train_ar_steps=2, train_diff_steps=3, eval_prompts=4, sample_every=2, save_every=2,
                  eval_temperatures=[0.5, 1.0], eval_batch_size=64),
    # official MAR-B at 256 px on 8 GPUs with the released MAR-GRPO settings; CFG 3 and 100 diffusion
    # steps are MAR-B's own sampling settings, lr 2e-6 the NOVA run's
    "mar_base": dict(RELEASED, model="mar_base", img_size=256, num_sampling_steps=100, cfg=3.0, lr=2e-6),
    # the released Harmon-1.5B run (AMAP-ML/mar-grpo: scripts/debug_entry_harmon.py, trainer
    # grpo_trainer_harmon_v1_2.py): 512 px (the config's 32×32 grid), CFG 3 constant, S = 5; only the
    # MAR trains (models/loading.trainable_names); T = 25, as the run's name ("25diff") says
    "harmon": dict(RELEASED, model="harmon", model_config="harmon_1.5b", num_sampling_steps=25, cfg=3.0,
                   cfg_schedule="constant", lr=1e-6, mte_trajectories=5),
    # the released NOVA run (scripts/debug_entry_nova.py, grpo_trainer_nova_v1_2.py): d48w1024-sd512,
    # CFG 5 constant, 25 diffusion steps, S = 3 (train.py's default); all but the diffusion MLP trains
    "nova": dict(RELEASED, model="nova", num_sampling_steps=25, cfg=5.0, cfg_schedule="constant", lr=2e-6),
    # the released NOVA mix run (scripts/debug_entry_nova_mix.py, same trainer): the NOVA run's settings
    # with --reward_funcs "hps git gdino", summed unweighted (its trainer's normalize_multi_rewards is
    # hard-coded off), on data/geneval_and_t2i_data_final.json (give it as --prompts: the released
    # records); 3 GPUs × 1 prompt a step there, 8 prompts here as in the others. `gdino` fixes the
    # released scorer's inconsistencies (scorers/composition_rules.py); --reward
    # hpsv2,git_vqa,gdino_released scores exactly as released
    "nova_mix": dict(RELEASED, model="nova", num_sampling_steps=25, cfg=5.0, cfg_schedule="constant", lr=2e-6,
                     reward="hpsv2,git_vqa,gdino", reward_norm="none"),
    # the Harmon and NOVA pipelines at toy size, for tests on a tiny model built from a config
    "adapter_smoke": dict(num_iter=4, num_sampling_steps=6, cfg_schedule="constant", temperature=1.0, steps=2,
                          prompts_per_step=2, group_size=2, train_ar_steps=2, train_diff_steps=2, mte_trajectories=2,
                          reward="jpeg_incompressibility", eval_prompts=2, sample_every=1, save_every=1, lr=1e-4,
                          eval_temperatures=[1.0]),
}

# -----------------------------------------------------------------------------
# Types: a bad value is a one-line error naming the flag (processes.Parser)


def number(kind, low=-math.inf, high=math.inf, low_open=False, high_open=False):
    """An argparse type: a finite int or float in [low, high] (open ends where asked)."""
    def parse(text):
        value = kind(text)
        bad_low = value < low or (low_open and value == low)
        if not math.isfinite(value) or bad_low or value > high or (high_open and value == high):
            lo = ("(" if low_open or low == -math.inf else "[") + f"{low:g}"
            hi = f"{high:g}" + (")" if high_open or high == math.inf else "]")
            raise argparse.ArgumentTypeError(f"{text!r} must be a finite number in {lo}, {hi}")
        return value
    parse.__name__ = kind.__name__
    return parse


def optional_threshold(text):
    """The consistency threshold κ: a number, or 'off' (None: no consistency mask)."""
    return None if text.lower() == "off" else number(float)(text)


POS_INT, NONNEG_INT = number(int, 1), number(int, 0)
POS_FLOAT, NONNEG_FLOAT = number(float, 0, low_open=True), number(float, 0)
FRACTION = number(float, 0, 1, low_open=True)


def optional_positive(text):
    """A positive number, or 'off' (None)."""
    return None if text.lower() == "off" else POS_FLOAT(text)


def POS_FLOATS(text):  # noqa: N802  (an argparse type, as the others)
    """'0.1,0.2,1' -> [0.1, 0.2, 1.0]: a comma-separated list of finite numbers > 0."""
    return [POS_FLOAT(t) for t in text.split(",")]


# -----------------------------------------------------------------------------
# The groups train.py and the table (tables/paper.py) share

def sampling_flags(p):
    """How a rollout samples (docs/method.md §1): what train.py's rollouts and evaluate.py's images use."""
    a = p.add_argument
    a("--num-iter", type=POS_INT, default=8, help="AR steps N per image")
    a("--num-sampling-steps", type=number(int, 3), default=16, help="diffusion steps T of the head")
    a("--cfg", type=NONNEG_FLOAT, default=3.0, help="guidance w (1 = none)")
    a("--cfg-schedule", default="linear", choices=["linear", "constant"], help="guidance over the AR steps")
    a("--temperature", type=POS_FLOAT, default=0.5, help="τ of the head's noise")


def model_flags(p):
    a = p.add_argument
    a("--model", default="small", choices=MODELS, help="which policy: small (the demo's shapes MAR), the "
      "official mar_base/large/huge, harmon, nova (models/loading.py)")
    a("--init", default=None, help="base checkpoint: ours, an official MAR .pth, harmon_*.pth, or a NOVA "
                                   "pipeline folder (the demo's: a preset's)")
    a("--model-config", default="harmon_1.5b", help="Harmon: a released config name or a JSON config file")
    a("--tokenizer", default=None, help="Harmon: the Qwen2.5 tokenizer folder (local)")
    a("--prompt-embeds", default=None, help="NOVA: the prompts' Phi-2 embeddings (python -m models.nova_embed)")
    a("--img-size", type=POS_INT, default=32, help="image size in pixels (the official MAR models)")
    a("--vae", default=None, help="KL-16 VAE .ckpt (LDM format) for MAR and Harmon; NOVA: its vae/ folder "
                                  "(default: beside --init)")
    a("--prompts", default=None, help="prompt file, one per line (shapes prompts, class indices, or text), or "
                                      "for Harmon and NOVA the released metadata, one JSON record a line (.jsonl)")
    a("--split", default="train", choices=["train", "all"], help="shapes prompts to train on")
    a("--categories", nargs="+", default=["single", "two_objects", "counting", "spatial"],
      help="shapes prompts: the categories trained on and evaluated, each equally often")


def scale_flags(p):
    a = p.add_argument
    a("--grad-accum", type=POS_INT, default=1, help="micro-batches per rank and step, gradients accumulated: "
                                                    "the same step as world × this many processes")
    a("--lora", type=POS_INT, default=None, help="train LoRA adapters of rank R on the transformer's attention "
      "and MLP projections instead of its weights; the KL reference is the model without them (infra/lora.py)")
    a("--fsdp", action="store_true", help="shard the trained parameters, their gradients and AdamW state over "
                                          "the torchrun processes (FSDP2, infra/fsdp.py)")
    a("--grad-checkpointing", action=argparse.BooleanOptionalAction, default=False,
      help="recompute each transformer block in the backward pass instead of keeping its activations "
           "(docs/memory.md): the same gradients, one more forward pass of the blocks")


def process_flags(p):
    a = p.add_argument
    a("--preset", default="demo", choices=sorted(PRESETS), help="named group of defaults (infra/flags.py)")
    a("--seed", type=NONNEG_INT, default=0, help="global seed; every random draw derives from (seed, stage, "
                                                  "step, rank)")
    a("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run")
    a("--precision", default=None, choices=PRECISIONS,
      help="the forward passes' dtype on any device: bf16 autocast or fp32 (default: bf16 on CUDA, "
           "fp32 on the CPU); the diffusion head computes in fp32 and the weights, gradients and "
           "AdamW state are fp32 in both (infra/processes.py, docs/memory.md)")
    a("--threads", type=NONNEG_INT, default=0, help="torch CPU threads (0: torch's default)")


def run_flags(p):
    a = p.add_argument
    a("--out", default=None, help="output folder (default runs/<preset>)")
    a("--resume", nargs="?", const="yes", default="no", choices=["no", "yes", "auto"],
      help="continue from the newest readable checkpoint in --out/ckpt: --resume (one must exist), --resume "
           "auto (if one exists; a torchrun relaunch does this by itself), or no (a fresh run replaces --out's "
           "checkpoints)")
    a("--eval-only", action="store_true", help="generate for --prompts and score, then exit")
    a("--wandb", action="store_true", help="also log to Weights & Biases (needs the wandb package)")
    a("--sample-every", type=POS_INT, default=20, help="write a sample grid every N steps")
    a("--save-every", type=POS_INT, default=20, help="checkpoint every N steps")
    a("--keep-last", type=NONNEG_INT, default=2, help="checkpoints kept (0 = all)")
    a("--max-bad-steps", type=POS_INT, default=5, help="non-finite steps in a row before the run stops")


def eval_flags(p):
    a = p.add_argument
    a("--eval-prompts", type=NONNEG_INT, default=96, help="shapes prompts evaluated per split (0: no evaluation)")
    a("--eval-images-per-prompt", "--images-per-prompt", type=POS_INT, default=1, help="images per evaluated prompt")
    a("--eval-batch-size", "--batch-size", type=POS_INT, default=16,
      help="images per evaluated batch (each batch has its own seed)")
    a("--eval-temperatures", type=POS_FLOATS, default=TEMPERATURES, metavar="T,T,...",
      help="a model is scored at each τ (and at --temperature) and reported at its best, chosen on the training "
           "split (evaluate.temperature_sweep)")
    a("--eval-cfgs", type=POS_FLOATS, default=None, metavar="W,W,...",
      help="the sweep's guidance weights (default: --cfg alone)")


def reward_service_flags(p):
    a = p.add_argument
    a("--reward-ckpt", action="append", default=[], help="reward weights KEY=PATH (repeatable)")
    a("--reward-url", default=None, help="score with the reward server at this URL (python -m scorers.server, "
      "docs/reward_server.md) instead of loading the reward models; its token from MARGRPO_REWARD_TOKEN")
    a("--reward-token-file", default=None, help="a file holding the reward server's token (instead of "
                                                "MARGRPO_REWARD_TOKEN)")
    a("--reward-timeout", type=POS_FLOAT, default=120.0,
      help="seconds a request to the reward server may take in all, from connecting to the last byte of its answer")
    a("--reward-retries", type=NONNEG_INT, default=8, help="tries again when the reward server cannot be reached, "
                                                           "waiting 0.5 s, 1 s, 2 s, ... (at most 15 s) between")


SAMPLING = ("sampling (docs/method.md §1)", sampling_flags)
MODEL, PROCESSES = ("the model and its weights", model_flags), ("the processes", process_flags)
EVALUATION, REWARD_SERVICE = ("evaluation", eval_flags), ("the reward service", reward_service_flags)
SHARED = [SAMPLING, MODEL, ("scale", scale_flags), PROCESSES, ("the run", run_flags), EVALUATION, REWARD_SERVICE]


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help: the description as written, every flag's default after its help."""


def build_parser(groups, description=None, prog=None):
    """A parser of `groups` ([(title, add(group))], in order): one-line errors (processes.Parser)."""
    p = Parser(prog=prog, description=description, formatter_class=HelpFormatter, allow_abbrev=False)
    for title, add in groups:
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


def given(argv, parser):
    """The dests of the flags written in `argv` (not taken from a preset or a default)."""
    words = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    return {a.dest for a in parser._actions if words & set(a.option_strings)}


def parse_run_args(p, argv, methods):
    """A training run's flags (train.py's parser `p`; argv None: the command line's): the flags given
    over the --method's variant (`methods`, grpo.METHODS: the fields each changes) over the --preset's
    defaults over the parser's; no --out is runs/<preset>, and a run that torchrun relaunched after a
    failure continues (--resume auto). Returns the argparse.Namespace."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args, preset = parse_with_preset(p, PRESETS, argv)
    on_command_line = given(argv, p)
    for name, value in methods[args.method].items():
        if name not in on_command_line:  # the variant's, unless its own flag was given
            setattr(args, name, value)
    args.lr_as_given = args.lr
    if args.lr_budget is not None:  # learning rate × steps at most the budget (docs/method.md §8)
        args.lr = min(args.lr, args.lr_budget / args.steps)
    args.out = args.out or os.path.join("runs", preset)
    if args.resume == "no" and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
        args.resume = "auto"  # torchrun relaunched the job after a failure: continue it
    return args


def check_run_inputs(args, world, train_head):
    """train.py's cross-flag rules and files, before any work, then `check_model_inputs` and the
    --resume checkpoint: a bad one raises a one-line ValueError / FileNotFoundError / PermissionError
    naming it. Reads, never writes. world: the number of processes; train_head: the GRPO settings'
    (whether the diffusion head trains)."""
    if args.init is None:
        raise ValueError("--init: give the base checkpoint to train or evaluate (a preset's, or "
                         "one of python -m demo.pretrain)")
    if not os.path.exists(args.init):
        raise FileNotFoundError(f"--init: no such file: {args.init}")
    if args.min_diff_step >= args.num_sampling_steps - 1:  # the head's own steps: train.grpo_train
        raise ValueError(f"--min-diff-step {args.min_diff_step}: no diffusion step left below "
                         f"T − 1 = {args.num_sampling_steps - 1}")
    for flag, value in (("--lora", args.lora), ("--fsdp", args.fsdp)):
        if value and args.eval_only:
            raise ValueError(f"{flag}: changes how GRPO trains; --eval-only trains no GRPO policy")
    if args.lora and train_head:
        raise ValueError(f"--lora {args.lora}: the diffusion head stays frozen under LoRA (drop "
                         "--train-head; --method grpo trains the head)")
    if args.fsdp and world < 2:
        raise ValueError("--fsdp: shards over the processes of torchrun; with one there is nothing "
                         "to shard (torchrun --nproc_per_node=N train.py ..., N >= 2)")
    if args.fsdp and (train_head or args.lora):
        why = ("a trained head is not sharded (drop --train-head / --method grpo, or --fsdp)"
               if train_head else
               "--lora trains its adapters alone, too small to shard: use --lora without --fsdp")
        raise ValueError(f"--fsdp: shards the transformer's trained weights; {why}")
    if args.prompts_per_step % (world * args.grad_accum):
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} must divide by the world "
                         f"size {world} × --grad-accum {args.grad_accum} (each prompt's group is "
                         "generated in one micro-batch)")
    check_model_inputs(args)
    ckpt_dir = os.path.join(args.out, "ckpt")
    again = " (--resume auto starts fresh if none)"
    if args.resume == "yes" and not checkpoints.checkpoint_names(ckpt_dir):
        raise FileNotFoundError(f"--resume: no checkpoint in {ckpt_dir}{again}")
    readable = checkpoints.newest_training_state(ckpt_dir, lambda message: None, mmap=True)
    if args.resume == "yes" and readable is None:
        raise ValueError(f"--resume: no checkpoint in {ckpt_dir} can be read{again}")


def check_model_inputs(args, scores_reward=True):
    """What train.py and the table (tables/paper.py) check alike, before anything is loaded: the model's files exist,
    the KL-16 VAE is given where the model needs one, Harmon and NOVA have a prompt file, a reward
    server is named only by a run that scores a --reward (`scores_reward`) and its token file exists,
    and --out is writable. (scorers/registry.check_reward_flags checks the --reward spec and its weight
    flags, models.loading.check_prompt_files parses the prompt files, and scorers/remote.py reads the
    token and asks the server, also before any write.)"""
    for name in ("prompts", "vae", "tokenizer", "prompt_embeds"):
        path = getattr(args, name)
        if path is not None and not os.path.exists(path):
            raise FileNotFoundError(f"--{name.replace('_', '-')}: no such file: {path}")
    if args.model not in ("small", "nova") and args.vae is None:
        raise ValueError(f"--vae: --model {args.model} needs the KL-16 VAE checkpoint (kl16.ckpt)")
    if args.model in ("harmon", "nova") and args.prompts is None:
        raise ValueError(f"--prompts: --model {args.model} needs a prompt file (one prompt per line)")
    if args.reward_url is not None:  # a reward server scores: its weights and its address are its own
        if args.reward_ckpt:
            raise ValueError(f"--reward-ckpt {args.reward_ckpt[0]}: the reward server of --reward-url loads the "
                             "reward weights (python -m scorers.server --reward-ckpt KEY=PATH)")
        if not scores_reward:
            raise ValueError("--reward-url: this run scores no --reward in this process's place (the "
                             "T2I-CompBench evaluators run here); drop --reward-url")
    if args.reward_token_file is not None:
        if args.reward_url is None:
            raise ValueError(f"--reward-token-file {args.reward_token_file}: it is sent to a reward server; "
                             "give --reward-url")
        if not os.path.exists(args.reward_token_file):  # what it holds: scorers/auth.py, when it is read
            raise FileNotFoundError(f"--reward-token-file: no such file: {args.reward_token_file}")
    if getattr(args, "wandb", False) and importlib.util.find_spec("wandb") is None:
        raise ValueError("--wandb: the wandb package is not installed (pip install wandb, or drop --wandb)")
    checkpoints.check_writable(args.out, "--out")
