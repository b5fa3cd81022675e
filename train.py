"""MAR-GRPO training: the GRPO loop, one script from a CPU laptop to `torchrun --nproc_per_node=8`.

    python train.py                  # the demo: MAR-GRPO from a shipped small MAR of the shapes
                                     # world, then base and tuned model at every τ (docs/demo.md)
    python train.py --preset smoke   # the whole pipeline at toy size (tests, CI)
    torchrun --nproc_per_node=8 train.py --preset mar_base --init mar_base.pth --vae kl16.ckpt \\
        --reward hpsv2 --reward-ckpt hpsv2=HPS_v2.1_compressed.pt
    python train.py --eval-only --init CKPT --prompts FILE --out DIR

"Released" in this project is AMAP-ML/mar-grpo at commit fcb7969 (its trainers
src/grpo/src/open_r1/trainer/grpo_trainer_{nova,harmon}_v1_2.py and scripts/debug_entry_*.py);
the paper is arXiv 2604.06966; "docs/method.md §N" is this project's account of its section N.

The settings a paper reader changes sit right below (`paper_flags`), each default written once;
then one GRPO step, top to bottom: rollouts, rewards, advantages, MTE trajectories, the update
L = −mean_i (P_i − β KL_i) with one backward per trained AR step, logging and a checkpoint.

The single-process path is the distributed path: DDP when torchrun sets RANK; rank 0 alone logs and
writes. Every random draw of a step comes from a generator seeded by (seed, stage, step, shard) on
the run's device (infra/processes.SEED_STAGES), a shard being one of the world × --grad-accum
micro-batches, so a resumed run continues exactly and 1 process with --grad-accum A draws what A
processes draw. Bad flags or files are one line `error: ...` (exit status 2) before anything is
written; a non-finite step is skipped; SIGINT / SIGTERM stop after the step with its checkpoint;
a torchrun relaunch after a failure resumes by itself (docs/faults.md, infra/run_folder.py).
"""

import argparse
import contextlib
import math
import sys
import time
from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import evaluate
import grpo
import mte
import rewards
import rollout
from infra import checkpoints, flags, fsdp, lora, processes
from infra.flags import (FRACTION, NONNEG_FLOAT, NONNEG_INT, POS_FLOAT, POS_INT, number,
                         optional_positive, optional_threshold)
from infra.processes import SEED_STAGES, Ctx, all_finite
from infra.run_folder import RunFolder
from models import loading
from scorers import registry

# -----------------------------------------------------------------------------
# The paper's settings (docs/method.md §6-§8: L = −mean_i (P_i − β KL_i), its variants, the
# released values): a value is the default written here, replaced by the --preset's
# (infra/flags.PRESETS: the released runs, the demo), then by the --method's variant
# (grpo.METHODS), then by a flag given. How a rollout samples (N, T, guidance w and its schedule,
# τ) is infra/flags.sampling_flags, which the paper's table shares.


def paper_flags(p):
    a = p.add_argument
    a("--method", default="mar-grpo", choices=list(grpo.METHODS),
      help="the paper's variant (docs/method.md §7, the table of variants): grpo and "
           "grpo-fixed-head turn MTE and the consistency mask off, grpo trains the head")
    # the objective of a trained AR step i, −(P_i − β KL_i) (docs/method.md §4-§6)
    a("--beta", type=NONNEG_FLOAT, default=0.01, help="KL weight β")
    a("--kl", default="gaussian", choices=grpo.KL_KINDS, help="the KL term (grpo.py)")
    a("--clip-eps", type=POS_FLOAT, default=0.2, help="PPO clip ε (binds with --inner-epochs > 1)")
    a("--inner-epochs", type=POS_INT, default=1,
      help="optimizer steps E per rollout (1 = released: ρ ≡ 1)")
    a("--train-head", action=argparse.BooleanOptionalAction, default=False,
      help="the diffusion head gets gradients")
    a("--train-cfg", default="rollout", choices=["rollout", "1"],
      help="recompute ℓ with the rollout's guidance, or without (1, the released Harmon trainer)")
    a("--mte-trajectories", type=NONNEG_INT, default=3, help="S head trajectories of MTE (0 = off)")
    a("--top-k", type=FRACTION, default=0.3,
      help="k: the share of tokens with MTE, the most uncertain (M_unc)")
    a("--mte-positions", default="unknown", choices=["unknown", "predicted"],
      help="MTE on the uncertain unknown tokens U_i (released) or only on P_i, those written")
    a("--mte-max-gap", type=optional_positive, default=None,
      help="δ: MTE outside P_i only where a token's trajectories lie within δ nats per element of "
           "z_i's transitions (docs/method.md §4, a gate on the gap), or off (released)")
    a("--consistency-threshold", type=optional_threshold, default=0.0,
      help="κ: keep the tokens whose Δsim exceeds it (the consistency mask W), or 'off'")
    a("--policy-positions", default="unknown", choices=["unknown", "predicted"],
      help="the policy term on U_i (released) or only on P_i")
    # the loop: prompts, groups, recorded steps, the optimizer
    a("--steps", type=POS_INT, default=40, help="GRPO steps")
    a("--prompts-per-step", type=POS_INT, default=8,
      help="prompts per step (global; divides by the world size)")
    a("--group-size", type=number(int, 2), default=6, help="images per prompt G")
    a("--train-ar-steps", type=POS_INT, default=2, help="AR steps trained per rollout")
    a("--train-diff-steps", type=POS_INT, default=6, help="diffusion steps trained per AR step")
    a("--min-diff-step", type=POS_INT, default=1,
      help="lowest diffusion step trained (the last steps' tiny σ dominates a gradient)")
    a("--lr", type=POS_FLOAT, default=1e-4, help="AdamW learning rate (constant)")
    a("--lr-budget", type=optional_positive, default=None,
      help="use at most this / --steps as the learning rate, or off: the released MTE term leaves "
           "a run a budget of learning rate × steps before it drifts away (docs/method.md §8)")
    a("--weight-decay", type=NONNEG_FLOAT, default=0.0, help="AdamW weight decay")
    a("--max-grad-norm", type=POS_FLOAT, default=1.0, help="gradient clipping")
    # the reward
    a("--reward", default="shapes",
      help="reward spec, e.g. shapes or hpsv2:1.0,pickscore:0.5 (scorers/registry.py)")
    a("--reward-norm", default="none", choices=["none", "group-minmax"],
      help="combine the rewards as the weighted sum of their raw values, or of each min-max "
           "normalised within its group (the released normalize_multi_rewards)")


DESCRIPTION = """MAR-GRPO training: GRPO from a base policy (--init), then the base and the tuned
policy evaluated on the same prompts and seeds, each at every τ of --eval-temperatures. A preset
names a group of defaults (infra/flags.py: the released runs, the demo); a flag given wins."""


def build_parser(ext):
    """train.py's parser: the paper's settings, then infra/flags.py's groups, then the groups of
    the Extensions `ext` (e.g. the lab's: experiments/lab.py)."""
    groups = [("the paper's settings", paper_flags), *flags.SHARED, *ext.flag_groups]
    return flags.build_parser(groups, DESCRIPTION)


def parse_args(argv=None, ext=None):
    """The flags over the --method's variant over the preset over the defaults (a Namespace;
    infra/flags.parse_run_args). ext: Extensions whose flags the parser also takes (None: none)."""
    return flags.parse_run_args(build_parser(ext or PAPER), argv, grpo.METHODS)


def grpo_settings(args):
    """The objective's settings (grpo.GRPOSettings) of parsed flags."""
    values = {f.name: getattr(args, f.name) for f in fields(grpo.GRPOSettings)}
    return grpo.GRPOSettings(**values).validate()


# -----------------------------------------------------------------------------
# The update: L = −mean_i (P_i − β KL_i), one backward per trained AR step

@dataclass
class MicroBatch:
    """What a GRPO step's update needs from one micro-batch of B = prompts × G images: condition
    inputs; record (rollout.RolloutRecord); images (B, 3, H, W); texts; scores, adv (B,); info
    (the reward's extras); trajectories (MTE's S trajectories, or None); old_logp (per trained AR
    step, its ℓ_old after the first inner epoch: grpo.ar_step_loss's `old_logp`); seconds (the
    micro-batch's t_rollout, t_reward and t_mte)."""
    inputs: dict
    record: rollout.RolloutRecord
    images: torch.Tensor
    texts: list
    scores: torch.Tensor
    adv: torch.Tensor
    info: dict
    trajectories: dict | None
    old_logp: list
    seconds: dict


class PolicyLoss(nn.Module):
    """The policy as a module whose forward is one AR step's GRPO loss (grpo.ar_step_loss), so
    DDP can wrap it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ref, batch, j, settings, old_logp):
        return grpo.ar_step_loss(self.model, ref, batch.record, j, batch.inputs, batch.adv,
                                 settings, batch.trajectories, old_logp)


def backward_batch(loss_module, ref, batch, settings, autocast, scale=1.0, sync=True):
    """Backpropagate L = −mean_i (P_i − β KL_i) of one micro-batch: each trained AR step's loss
    / #steps, one step at a time (each graph is freed before the next). Under DDP the all-reduce
    happens once, on the last step when `sync` (False for all but a step's last micro-batch).
    Forward passes run under `autocast`, backward outside it; scale: 1/A for one of A accumulated
    micro-batches. Updates batch.old_logp; returns a list of dicts of 0-dim tensors (each with the
    step's "loss"), read with one sync by the caller."""
    n = len(batch.record.steps)
    stats = []
    for j in range(n):
        defer = isinstance(loss_module, DDP) and not (sync and j == n - 1)
        with loss_module.no_sync() if defer else contextlib.nullcontext():
            with autocast():
                loss, s, batch.old_logp[j] = loss_module(ref, batch, j, settings,
                                                         batch.old_logp[j])
            (loss / n * scale).backward()
        stats.append({**s, "loss": loss.detach()})
    return stats


def update(args, ctx, settings, params, opt, loss_module, ref, batches):
    """E inner epochs over a step's micro-batches, each ending in one optimizer step unless a
    reward, advantage, loss or gradient is not finite on some rank. Returns (stats of the last
    epoch, gradient norm before clipping, skipped)."""
    skipped = False
    for _ in range(settings.inner_epochs):
        stats = []
        for m, b in enumerate(batches):
            stats += backward_batch(loss_module, ref, b, settings, ctx.autocast,
                                    scale=1 / len(batches), sync=m == len(batches) - 1)
        grad_norm = fsdp.whole(torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm))
        scores, adv = [b.scores for b in batches], [b.adv for b in batches]
        if all_finite(ctx, scores, adv, [s["loss"] for s in stats], grad_norm):
            opt.step()
        else:
            skipped = True
        opt.zero_grad(set_to_none=True)
    return stats, grad_norm, skipped


# per-step statistics logged as their maximum over trained AR steps, micro-batches and ranks (an
# outlier is what they exist to show); every other statistic is a mean
MAX_STATS = ("logp_parity_err", "ratio_max_dev")


def group_diversity(images, G):
    """Mean pairwise RMS pixel distance between the images of a group (a collapse detector)."""
    x = images.flatten(1).reshape(-1, G, images[0].numel()).float()  # (#prompts, G, 3·H·W)
    d = torch.cdist(x, x) / math.sqrt(x.shape[-1])  # (#prompts, G, G)
    return d.sum() / (d.shape[0] * G * (G - 1))


def step_row(args, ctx, step, batches, stats, grad_norm, t_update, stops):
    """The metrics row of a step, its scalars reduced over ranks (one sync for the means, one for
    the maxima), and the stop every rank agrees on (0, or a signal's number `stops` received).
    Seconds: t_rollout, t_reward and t_mte summed over the micro-batches, t_update the update's
    (all its epochs and micro-batches)."""
    scores, adv = torch.cat([b.scores for b in batches]), torch.cat([b.adv for b in batches])
    images = torch.cat([b.images for b in batches])  # (B, 3, H, W)
    reward_means = [b.info.get("means", {}) for b in batches]
    times = ("t_rollout", "t_reward", "t_mte")
    local = dict(reward_mean=scores.mean(), reward_std=scores.std() if len(scores) > 1 else 0.0,
                 adv_abs_mean=adv.abs().mean(), adv_max=adv.max(), grad_norm=grad_norm,
                 diversity=group_diversity(images, args.group_size),
                 **{key: sum(b.seconds[key] for b in batches) for key in times}, t_update=t_update,
                 **{key: torch.stack([s[key] for s in stats if key in s]).float().mean()
                    for key in stats[0] if key not in MAX_STATS},
                 **{f"reward/{name}": sum(r[name] for r in reward_means) / len(batches)
                    for name in reward_means[0]})
    worst = {key: torch.stack([s[key] for s in stats]).float().max()
             for key in MAX_STATS if key in stats[0]}
    worst = ctx.max({**worst, "stop": stops.requested})
    signum = int(worst.pop("stop"))
    return {"step": step, **ctx.mean(local), **worst}, signum


def build_policy(args, ctx, settings, base, make_loss):
    """The policy GRPO trains from the frozen `base` (it shares base's frozen parameters; under
    --lora it is base with adapters), its trained parameters, their AdamW optimizer, and the loss
    module `make_loss(model, args)` (under DDP wrapped by it; --fsdp shards the policy instead)."""
    if args.lora:  # the adapters alone train
        model = lora.policy(base, lora.spec(base, args.lora), args.seed)
    else:
        model = loading.make_policy(args, base, settings)
    model.eval()  # no dropout: recomputed log-probabilities must equal the recorded ones
    if args.fsdp:  # the trained parameters, gradients and AdamW state sharded over the processes
        fsdp.shard(model, ctx.world, ctx.device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay)
    loss_module = make_loss(model, args)
    if ctx.ddp and not args.fsdp:  # FSDP reduces the gradients itself (infra/fsdp.py)
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        loss_module = DDP(loss_module, device_ids=device_ids)
    return model, params, opt, loss_module


# -----------------------------------------------------------------------------
# GRPO

def paper_loss(model, args):
    """The update's loss module of the paper: L of grpo.ar_step_loss (`PolicyLoss`)."""
    return PolicyLoss(model)


def paper_steps(args, num_ar_steps, n_trained, trainable, n_diff, generator):
    """A rollout's trained AR and diffusion steps as the paper draws them
    (grpo.choose_train_steps)."""
    return grpo.choose_train_steps(num_ar_steps, n_trained, trainable, n_diff, generator)


@dataclass(frozen=True)
class Extensions:
    """What a caller adds to train.py's run, given once to `main` (the lab's: experiments/lab.py):
    flag groups after train.py's own ([(title, add(group))]), the update's loss module
    make_loss(model, args), and the draw of a rollout's trained steps choose_steps(args, ...) with
    `paper_steps`' signature. The defaults are the paper's."""
    flag_groups: tuple = ()
    make_loss: Callable = paper_loss
    choose_steps: Callable = paper_steps


PAPER = Extensions()


def shard_generator(ctx, stage, step, shard):
    """The torch.Generator of GRPO step `step`'s draws of `stage` ("train_steps", "rollout",
    "mte": infra/processes.SEED_STAGES) for micro-batch `shard`, on the run's device."""
    return ctx.generator(SEED_STAGES[stage], step, shard=shard)


def grpo_train(args, ctx, settings, base, codec, prompts, reward_fn, stops, folder, ext=PAPER):
    """RL from the frozen base policy `base` (the KL's reference; under --lora the policy with its
    adapters off), writing to `folder` (infra/run_folder.RunFolder), with the loss module and the
    choice of trained steps of `ext` (Extensions). Returns the last checkpoint's path."""
    model, params, opt, loss_module = build_policy(args, ctx, settings, base, ext.make_loss)
    candidates = [k for k in model.diffloss.trainable_steps() if k >= args.min_diff_step]
    if not candidates:
        raise ValueError(f"--min-diff-step {args.min_diff_step}: the head trains steps "
                         f"{list(model.diffloss.trainable_steps())}")
    num_ar_steps = len(model.ar_schedule(args.num_iter, model.seq_len))  # N
    G, shards = args.group_size, ctx.world * args.grad_accum
    per_shard = args.prompts_per_step // shards  # divides: flags.check_run_inputs
    start = folder.resume(model, opt, args.init)
    lr = opt.param_groups[0]["lr"]  # --lr under --lr-budget; a resumed run's own, restored
    if lr != args.lr:
        lr_note = f" (restored from the checkpoint; the flags give {args.lr:.3g})"
    elif args.lr < args.lr_as_given:
        lr_note = (f" (--lr {args.lr_as_given:.3g} capped at --lr-budget {args.lr_budget:g} / "
                   f"{args.steps} steps)")
    else:
        lr_note = ""
    ctx.print0(f"GRPO ({args.method}): {args.steps} steps × {args.prompts_per_step} prompts × "
               f"G={G}, world size {ctx.world}"
               + (f" × {args.grad_accum} micro-batches" if args.grad_accum > 1 else "")
               + f"; {sum(p.numel() for p in params) / 1e6:.3g}M trained parameters"
               + (f" (LoRA adapters of rank {args.lora})" if args.lora else "")
               + (f", sharded over the {ctx.world} processes" if args.fsdp else "")
               + f"; lr {lr:.3g}{lr_note}"
               + f"; {settings}")

    for step in tqdm(range(start, args.steps), disable=not ctx.master, desc="grpo", initial=start,
                     total=args.steps):
        batches = []
        for shard in range(ctx.rank * args.grad_accum, (ctx.rank + 1) * args.grad_accum):
            t0 = time.time()
            items = prompts.sample(args.prompts_per_step, args.seed, step)
            items = items[shard * per_shard:(shard + 1) * per_shard]  # this micro-batch's prompts
            items = [it for it in items for _ in range(G)]  # each prompt's group stays together
            inputs = prompts.condition(items, ctx.device)

            # --- rollouts: G images a prompt, recording the chosen AR and diffusion steps (§3)
            plan = rollout.RolloutPlan(*ext.choose_steps(
                args, num_ar_steps, args.train_ar_steps, candidates, args.train_diff_steps,
                shard_generator(ctx, "train_steps", step, shard)))
            with ctx.autocast():
                tokens, record = rollout.record_rollout(
                    model, inputs, args.num_iter, args.cfg, args.cfg_schedule, args.temperature,
                    plan, shard_generator(ctx, "rollout", step, shard))
                images = codec.decode(model.unpatchify(tokens).float())  # (B, 3, H, W) in [0, 1]
            t1 = time.time()

            # --- rewards, and advantages A_b = (r_b − mean_G r) / (std_G r + 1e-4) (§6)
            texts = prompts.texts(items)
            metas = prompts.metas(items)
            scores, info = rewards.score(reward_fn, args.reward, images, texts, metas)
            if args.reward_norm == "group-minmax":  # each component min-max normalised in its group
                scores = grpo.min_max_combined(info["components"], info["weights"], G)
            scores = scores.to(ctx.device)
            adv = grpo.group_advantages(scores, G)  # (B,)
            t2 = time.time()

            # --- MTE: S head trajectories from z_final (§4); the loss builds M_unc and W from them
            trajectories = None
            if settings.mte_trajectories >= 2:
                trajectories = mte.sample_trajectories(
                    model.diffloss, record.z_final, record.z_final_null, record.cfg_final,
                    args.temperature, settings.mte_trajectories, plan.diff_steps,
                    shard_generator(ctx, "mte", step, shard))
            seconds = dict(t_rollout=t1 - t0, t_reward=t2 - t1, t_mte=time.time() - t2)
            old_logp = [None] * len(record.steps)  # ℓ_old per trained AR step, from epoch 1
            batches.append(MicroBatch(inputs, record, images, texts, scores, adv, info,
                                      trajectories, old_logp, seconds))

        # --- the update: E epochs of L = −mean_i (P_i − β KL_i), a backward per AR step (§6)
        t0 = time.time()
        stats, grad_norm, skipped = update(args, ctx, settings, params, opt, loss_module, base,
                                           batches)
        t_update = time.time() - t0

        # --- log (every rank agrees on the row and on a stop), a sample grid, a checkpoint
        row, signum = step_row(args, ctx, step, batches, stats, grad_norm, t_update, stops)
        folder.after_step(step, row, batches, model, opt, settings, skipped, signum)
    return folder.finish()


# -----------------------------------------------------------------------------

def load_base(args, ctx, init):
    """The base policy from `init` (on ctx.device, frozen), its codec and the prompts; a missing,
    corrupt or mismatched checkpoint, VAE or prompt file fails in this call, before any write."""
    base = loading.load_policy(args, init).to(ctx.device).requires_grad_(False)
    if lora.settings(base) and not args.eval_only:
        raise ValueError(f"--init {init}: holds LoRA adapters over their base; continue their run "
                         "with --resume, or start a new one from them merged into a whole "
                         f"checkpoint (python -m models.merge_lora {init} OUT.pt)")
    return base, loading.load_codec(args, base, ctx.device), loading.load_prompts(args, base)


def main(argv=None, ext=PAPER):
    """The whole run: check the inputs, load what they name, and only then write. Returns the
    evaluation's report or summary, or None. ext: what a caller adds (Extensions; the lab's:
    experiments/lab.py)."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = parse_args(argv, ext)
    ctx = Ctx(args)

    # --- every flag and file checked before anything is loaded or written (one-line errors)
    settings = grpo_settings(args)
    flags.check_run_inputs(args, ctx.world, settings.train_head)  # cross-flag rules, --resume
    registry.check_reward_flags(args)
    loading.check_prompt_files(args)

    # --- load what the run needs; a bad file fails now, and nothing has been written yet
    reward_fn = registry.build_run_reward(args, ctx.device)  # or its --reward-url server's
    base, codec, prompts = load_base(args, ctx, args.init)
    # the flags that describe the model say what it is
    loading.describe(args, base, flags.given(argv, build_parser(ext)))
    run_config = {**vars(args), "grpo": vars(settings), "world_size": ctx.world,
                  "model": base.config, "base": loading.base_record(args.init)}  # config.json
    wandb = None
    if args.wandb and ctx.master:  # optional, not in requirements.txt (flags.check_model_inputs)
        import wandb  # noqa: PLC0415
        wandb.init(project="mar-grpo", config=run_config)

    lock = checkpoints.take_run_folder(args.out, ctx)  # the first write: --out is this run's
    try:  # SIGINT / SIGTERM now ask the training loop to stop at a step boundary
        with processes.StopRequests(ctx.print0) as stops:
            if args.eval_only:
                return evaluate.eval_only(args, ctx, base, codec, prompts, reward_fn)
            folder = RunFolder(args, ctx, run_config, wandb)
            final = grpo_train(args, ctx, settings, base, codec, prompts, reward_fn, stops, folder,
                               ext)
            if args.eval_prompts > 0:
                tuned = loading.load_tuned(base, final, "--out")  # shares base's frozen parts
                return evaluate.base_and_tuned(args, ctx, base, tuned, codec, prompts, reward_fn)
            return None
    finally:
        lock.release()


def cli(argv=None, ext=PAPER):
    """`python train.py ...`: main() with failures said in one line (infra/processes.cli).
    Returns the exit status."""
    return processes.cli(lambda a: main(a, ext), argv)


if __name__ == "__main__":
    sys.exit(cli())
