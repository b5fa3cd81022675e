"""MAR-GRPO training: one script from a CPU laptop to `torchrun --nproc_per_node=8`.

    python train.py                      # the demo: MAR-GRPO from the shipped small MAR (demo/base.pt)
                                         # on shapes prompts, evaluation before/after
    python train.py --preset smoke       # the whole pipeline at toy size (tests, CI)
    torchrun --nproc_per_node=8 train.py --preset mar_base --init mar_base.pth --vae kl16.ckpt \\
        --reward hpsv2 --reward-ckpt hpsv2=HPS_v2.1_compressed.pt
    python train.py --eval-only --init CKPT --prompts FILE --out DIR
    torchrun ... train.py --lora R | --fsdp  # models that do not fit as DDP replicas (infra/lora.py, infra/fsdp.py)

A run trains the policy from its base (`--init`; the demo's is demo/base.pt, pretrained by
`python -m demo.pretrain`) with GRPO, then evaluates base and tuned model on the same prompts and
seeds. The single-process path is the distributed path: DDP when torchrun sets RANK; rank 0 alone
logs and writes. Every random draw of a step comes from a generator seeded by (seed, stage, step,
shard) on the run's device, a shard being a rank's micro-batch (the rank itself without
--grad-accum), so a resumed run continues exactly and 1 process with --grad-accum A draws what A
processes draw.

When things go wrong (docs/faults.md): flags are checked when parsed (ranges, finiteness),
cross-flag rules and files in `flags.check_inputs`, then models, rewards and prompts are loaded,
all before anything is written; a bad one is one line `error: ...`, exit status 2. Then the run
locks --out (one writer per folder). A non-finite reward, advantage, loss or gradient skips that
update; `--max-bad-steps` in a row stop the run (exit status 1). SIGINT / SIGTERM stop after the
step with its checkpoint (exit 130 / 143); a failed write is one line naming the file (exit 1).
Checkpoints are written atomically (infra/checkpoints.py); a torchrun relaunch after a failure
resumes by itself (with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: pytorch/pytorch#135712).
"""

import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import evaluate
import grpo
import masks
import mte
import rewards
import rollout
from infra import checkpoints, figures, flags, fsdp, lora, processes
from infra.flags import check_inputs, parse_args
from infra.processes import Ctx, Stop, all_finite
from models import loading
from scorers import remote

# The recorded ℓ of a fresh rollout and the ℓ the update recomputes should agree to float rounding
# (~1e-5 nats in fp32; the tests hold them to 1e-4). A larger gap means the update does not
# evaluate the policy that sampled (a bf16 recompute, a canvas fed differently): at 0.1 nats a
# token's ratio ρ is off by 10%, half of PPO's clip range ε = 0.2, before any update has happened.
PARITY_WARN = 0.1
# per-step statistics logged as their maximum over trained AR steps, micro-batches and ranks (an
# outlier is what they exist to show); every other statistic is a mean
MAX_STATS = ("logp_parity_err", "ratio_max_dev")


def load_base(args, ctx, init):
    """The base policy from `init` (on ctx.device, frozen), its codec and the prompts; a missing,
    corrupt or mismatched checkpoint, VAE or prompt file fails in this call, before anything is written."""
    base = loading.load_policy(args, init).to(ctx.device).requires_grad_(False)
    if lora.settings(base) and not args.eval_only:
        raise ValueError(f"--init {init}: holds LoRA adapters over their base; continue their run with --resume, or "
                         f"start a new one from them merged into a whole checkpoint (python -m models.merge_lora {init} OUT.pt)")
    return base, loading.load_codec(args, base, ctx.device), loading.load_prompts(args, base)


# -----------------------------------------------------------------------------
# One micro-batch: rollouts, rewards, advantages, MTE trajectories

@dataclass
class MicroBatch:
    """What a GRPO step's update needs from one micro-batch of B = prompts × G images.

    inputs: condition inputs; record: rollout.RolloutRecord; images (B, 3, H, W); texts; scores,
    adv: (B,); info: the reward's extras; trajectories, uncertain: MTE's S trajectories and M_unc
    (B, L), or None; olds: per trained AR step, its ℓ_old after the first inner epoch; seconds.
    """
    inputs: dict
    record: rollout.RolloutRecord
    images: torch.Tensor
    texts: list
    scores: torch.Tensor
    adv: torch.Tensor
    info: dict
    trajectories: dict | None
    uncertain: torch.Tensor | None
    olds: list
    seconds: dict


def collect(args, ctx, settings, model, codec, prompts, reward_fn, step, shard, diff_candidates):
    """Micro-batch `shard` (of world × --grad-accum) of a GRPO step: its prompts, G rollouts each
    recording the chosen steps, their rewards and advantages, and the MTE trajectories."""
    per_shard = args.prompts_per_step // (ctx.world * args.grad_accum)  # divisibility: check_inputs
    t0 = time.time()
    items = prompts.sample(args.prompts_per_step, args.seed, step)[shard * per_shard:(shard + 1) * per_shard]
    items = [it for it in items for _ in range(args.group_size)]  # each prompt's group stays together
    inputs = prompts.condition(items, ctx.device)
    plan_ar, plan_diff = grpo.choose_train_steps(len(model.ar_schedule(args.num_iter, model.seq_len)), args.train_ar_steps,
                                                 diff_candidates, args.train_diff_steps, ctx.generator(3, step, shard=shard),
                                                 args.train_ar_below)
    with ctx.autocast():
        tokens, record = rollout.record_rollout(model, inputs, args.num_iter, args.cfg, args.cfg_schedule, args.temperature,
                                                rollout.RolloutPlan(plan_ar, plan_diff), ctx.generator(4, step, shard=shard))
        images = codec.decode(model.unpatchify(tokens).float())
    t1 = time.time()
    texts = prompts.texts(items)
    scores, info = rewards.score(reward_fn, args.reward, images, texts, prompts.metas(items))
    if args.reward_norm == "group-minmax":  # each component min-max normalised within its group, then summed
        scores = grpo.min_max_combined(info["components"], info["weights"], args.group_size)
    scores = scores.to(ctx.device)
    adv = grpo.group_advantages(scores, args.group_size)
    t2 = time.time()
    trajectories = uncertain = None  # multi-trajectory expectation: S head trajectories from z_final
    if settings.mte_trajectories >= 2:
        trajectories = mte.sample_trajectories(model.diffloss, record.z_final, record.z_final_null, record.cfg_final,
                                               args.temperature, settings.mte_trajectories, plan_diff,
                                               ctx.generator(5, step, shard=shard))
        uncertain = masks.top_k_mask(masks.token_uncertainty(trajectories["x0"]), settings.top_k)
    return MicroBatch(inputs, record, images, texts, scores, adv, info, trajectories, uncertain, [None] * len(record.steps),
                      dict(t_rollout=t1 - t0, t_reward=t2 - t1, t_mte=time.time() - t2))


# -----------------------------------------------------------------------------
# The update: L = −mean_i (P_i − β KL_i), one backward per trained AR step

class PolicyLoss(nn.Module):
    """The policy as a module whose forward is one AR step's GRPO loss (grpo.ar_step_loss), so DDP can wrap it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ref, batch, j, settings, old):
        return grpo.ar_step_loss(self.model, ref, batch.record, j, batch.inputs, batch.adv, settings,
                                 batch.trajectories, batch.uncertain, old)


# the update's loss module by name (--loss, a lab option): make(policy, args) -> a module with
# PolicyLoss's forward; experiments/ registers its controls here (the RAFT control, experiments/raft.py)
LOSSES = {"grpo": lambda model, args: PolicyLoss(model)}


def backward_batch(loss_module, ref, batch, settings, autocast, scale=1.0, sync=True):
    """Backpropagate L = −mean_i (P_i − β KL_i) of one micro-batch: each trained AR step's loss /
    #steps, one step at a time (each graph is freed before the next). Under DDP (`loss_module` a
    DistributedDataParallel) the all-reduce happens once, on the last step when `sync` (False for
    all but a step's last micro-batch). Forward passes run under `autocast`, backward outside it;
    scale: 1/A for one of A accumulated micro-batches. Updates batch.olds; returns a list of dicts
    of 0-dim tensors (each with the step's "loss"), read with one sync by the caller."""
    n = len(batch.record.steps)
    stats = []
    for j in range(n):
        defer = isinstance(loss_module, DDP) and not (sync and j == n - 1)
        with loss_module.no_sync() if defer else contextlib.nullcontext():
            with autocast():
                loss, s, batch.olds[j] = loss_module(ref, batch, j, settings, batch.olds[j])
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
            stats += backward_batch(loss_module, ref, b, settings, ctx.autocast, scale=1 / len(batches),
                                    sync=m == len(batches) - 1)
        grad_norm = fsdp.whole(torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm))
        if all_finite(ctx, [b.scores for b in batches], [b.adv for b in batches], [s["loss"] for s in stats], grad_norm):
            opt.step()
        else:
            skipped = True
        opt.zero_grad(set_to_none=True)
    return stats, grad_norm, skipped


def step_row(args, ctx, step, batches, stats, grad_norm, t_update, stops):
    """The metrics row of a step, its scalars reduced over ranks (one sync for the means, one for
    the maxima), and the stop every rank agrees on (0, or the number of a signal `stops` received)."""
    scores, adv = torch.cat([b.scores for b in batches]), torch.cat([b.adv for b in batches])
    images = torch.cat([b.images for b in batches])
    reward_means = [b.info.get("means", {}) for b in batches]
    local = dict(reward_mean=scores.mean(), reward_std=scores.std() if len(scores) > 1 else 0.0,
                 adv_abs_mean=adv.abs().mean(), adv_max=adv.max(), grad_norm=grad_norm,
                 diversity=evaluate.group_diversity(images, args.group_size),
                 **{key: sum(b.seconds[key] for b in batches) for key in ("t_rollout", "t_reward")},
                 t_update=t_update + sum(b.seconds["t_mte"] for b in batches),
                 **{key: torch.stack([s[key] for s in stats if key in s]).float().mean()
                    for key in stats[0] if key not in MAX_STATS},
                 **{f"reward/{name}": sum(r[name] for r in reward_means) / len(batches) for name in reward_means[0]})
    worst = {key: torch.stack([s[key] for s in stats]).float().max() for key in MAX_STATS if key in stats[0]}
    worst = ctx.max({**worst, "stop": stops.requested})
    signum = int(worst.pop("stop"))
    return {"step": step, **ctx.mean(local), **worst}, signum


# -----------------------------------------------------------------------------
# GRPO

def build_policy(args, ctx, settings, base):
    """The policy GRPO trains from the frozen `base` (it shares base's frozen parameters; under --lora
    it is base with adapters), its trained parameters, their AdamW optimizer, and the loss module
    (under DDP wrapped by it; --fsdp shards the policy instead). Returns (model, params, opt, loss_module)."""
    model = (lora.policy(base, lora.spec(base, args.lora), args.seed) if args.lora  # the adapters alone train
             else loading.make_policy(args, base, settings))
    model.eval()  # no dropout: recomputed log-probabilities must equal the recorded ones
    if args.fsdp:  # the trained parameters, gradients and optimizer state sharded over the processes
        fsdp.shard(model, ctx.world, ctx.device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay)
    loss_module = LOSSES[args.loss](model, args)
    if ctx.ddp and not args.fsdp:  # FSDP reduces the gradients itself (infra/fsdp.py, item 4)
        loss_module = DDP(loss_module, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    return model, params, opt, loss_module


def save(args, ctx, settings, step, model, opt, base_path, bad_total):
    """Checkpoint after `step`: the trained parameters over base_path and the optimizer state, whole
    tensors (gathered on every rank under --fsdp); rank 0 writes. Every rank calls it."""
    ctx.barrier()
    trained, opt_state = fsdp.whole_state(model, opt, ctx.master)
    if ctx.master:
        checkpoints.save_step(os.path.join(args.out, "ckpt"), step + 1, {
            "model": trained, "base": base_path, "config": model.config, "lora": lora.settings(model),
            "optimizer": opt_state, "step": step + 1, "args": vars(args), "grpo": vars(settings),
            "bad_steps_total": bad_total}, args.keep_last)
    ctx.barrier()


def write_row(args, ctx, row, wandb, warned):
    """Rank 0 appends a step's row to metrics.jsonl (and to wandb); the first recorded-vs-recomputed
    gap above PARITY_WARN warns once. Returns whether it has warned."""
    if ctx.master:
        path = os.path.join(args.out, "metrics.jsonl")
        with checkpoints.writing(path), open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if wandb is not None:
            wandb.log(row, step=row["step"])
    if row["logp_parity_err"] > PARITY_WARN and not warned:
        ctx.print0(f"warning: step {row['step']}: recorded and recomputed log-probabilities differ by up to "
                   f"{row['logp_parity_err']:.3g} nats (> {PARITY_WARN}): the update does not evaluate the policy "
                   "that sampled (see logp_parity_err in metrics.jsonl; train.py, PARITY_WARN)", file=sys.stderr)
        return True
    return warned


def skip_or_stop(args, ctx, step, bad_steps, bad_total):
    """A skipped (non-finite) step is said; --max-bad-steps of them in a row stop the run (Stop),
    naming the last good checkpoint."""
    ctx.print0(f"step {step}: non-finite reward, advantage, loss or gradient; update skipped "
               f"({bad_steps} in a row, {bad_total} in all)")
    if bad_steps >= args.max_bad_steps:
        ckpt_dir = os.path.join(args.out, "ckpt")
        names = checkpoints.checkpoint_names(ckpt_dir)
        last = os.path.join(ckpt_dir, names[-1]) if names else "none yet (the policy is still --init)"
        raise Stop(f"{bad_steps} non-finite steps in a row (--max-bad-steps {args.max_bad_steps}); "
                   f"the last good checkpoint: {last}")


def grpo_train(args, ctx, settings, base, base_path, codec, prompts, reward_fn, stops, run_config, wandb=None):
    """RL from the base policy `base` (on ctx.device; it stays frozen as the reference of the KL);
    config.json (`run_config`), checkpoints (the trained parameters over `base_path`), samples and
    metrics under args.out (and to `wandb`, a started wandb module, on rank 0 with --wandb). Returns
    the final checkpoint path.

    Each rank's share of a step's prompts runs as --grad-accum micro-batches whose gradients add up
    before the one optimizer step, drawn exactly as world × --grad-accum processes would draw them.
    --max-bad-steps skipped (non-finite) steps in a row stop the run (Stop).
    """
    ref = base  # the frozen reference of the KL (under --lora: the policy with its adapters off, infra/lora.py)
    model, params, opt, loss_module = build_policy(args, ctx, settings, base)
    diff_candidates = [k for k in model.diffloss.trainable_steps() if k >= args.min_diff_step]  # what a rollout may record
    if not diff_candidates:
        raise ValueError(f"--min-diff-step {args.min_diff_step}: the head trains steps {list(model.diffloss.trainable_steps())}")
    ckpt_dir, metrics_path = os.path.join(args.out, "ckpt"), os.path.join(args.out, "metrics.jsonl")
    base_path = os.path.abspath(base_path)
    start, bad_total = 0, 0
    if args.resume != "no":
        start, bad_total = checkpoints.resume_training(ckpt_dir, model, opt, base_path, args.resume == "yes",
                                                       lambda msg: ctx.print0(msg, file=sys.stderr))
        if start:
            ctx.print0(f"resumed from step {start}")
    if ctx.master:  # the run's first write
        checkpoints.start_run_folder(args.out, start, args.keep_last, run_config)
    ctx.barrier()
    ctx.print0(f"GRPO ({args.method}): {args.steps} steps × {args.prompts_per_step} prompts × G={args.group_size}, "
               f"world size {ctx.world}" + (f" × {args.grad_accum} micro-batches" if args.grad_accum > 1 else "")
               + f"; {sum(p.numel() for p in params) / 1e6:.3g}M trained parameters"
               + (f" (LoRA adapters of rank {args.lora})" if args.lora else "")
               + (f", sharded over the {ctx.world} processes" if args.fsdp else "") + f"; {settings}")

    bad_steps, parity_warned = 0, False  # non-finite steps in a row
    for step in tqdm(range(start, args.steps), disable=not ctx.master, desc="grpo", initial=start, total=args.steps):
        last_step = step == args.steps - 1
        # --- rollouts, rewards, MTE: this rank's micro-batches
        batches = [collect(args, ctx, settings, model, codec, prompts, reward_fn, step, ctx.rank * args.grad_accum + m,
                           diff_candidates) for m in range(args.grad_accum)]

        # --- policy update: E inner epochs, one backward per trained AR step
        t0 = time.time()
        stats, grad_norm, skipped = update(args, ctx, settings, params, opt, loss_module, ref, batches)
        bad_steps, bad_total = (bad_steps + 1 if skipped else 0), bad_total + skipped

        # --- logging: every rank agrees on the row and on whether to stop
        row, signum = step_row(args, ctx, step, batches, stats, grad_norm, time.time() - t0, stops)
        row.update(skipped=int(skipped), bad_steps_total=bad_total)
        parity_warned = write_row(args, ctx, row, wandb, parity_warned)
        if skipped:
            skip_or_stop(args, ctx, step, bad_steps, bad_total)

        # --- once in a while: a sample grid, a checkpoint
        if ctx.master and (step % args.sample_every == 0 or last_step):
            grid = os.path.join(args.out, "samples", f"step_{step:06d}.png")
            captions = [f"{t} ({s:.2f})" for b in batches for t, s in zip(b.texts, b.scores.tolist())]
            with checkpoints.writing(grid):
                figures.save_grid(torch.cat([b.images for b in batches])[:16], captions[:16], grid)
        if (step + 1) % args.save_every == 0 or last_step or signum:
            save(args, ctx, settings, step, model, opt, base_path, bad_total)
        if signum:  # SIGINT / SIGTERM: the step is saved, every rank stops here
            raise processes.Interrupted(f"interrupted ({signal.Signals(signum).name}) after step {step}; "
                                        f"`--resume` continues from step {step + 1}", signum)
    if ctx.master and os.path.exists(metrics_path):
        figures.plot_curves(metrics_path, os.path.join(args.out, "curves.png"))
    return os.path.join(ckpt_dir, "latest.pt")


# -----------------------------------------------------------------------------

def evaluate_base_and_tuned(args, ctx, base, final, codec, prompts, reward_fn):
    """Base and tuned model on the same prompts and seeds: held-out compositions (eval/base,
    eval/tuned) and, for shapes prompts, the training split too (eval/base_train, eval/tuned_train:
    prompts of the split RL draws from, with fresh seeds; a short run draws few of these very
    prompts: 40 steps × 8 of the split's 452). Returns the report."""
    ckpt = checkpoints.read_checkpoint(final, "--out")  # the tuned model shares base's frozen parts
    tuned = lora.policy(base, ckpt["lora"]) if ckpt.get("lora") else loading.policy_copy(base, ckpt["model"])
    loading.load_trained(tuned.requires_grad_(False), ckpt["model"], final)
    splits = ["heldout", "train"] if args.prompts is None and prompts.is_shapes else ["heldout"]
    report = {}
    for split in splits:
        items = prompts.eval_items(args.eval_prompts, args.seed, split)
        suffix = "" if split == "heldout" else "_" + split
        for tag, model in (("base", base), ("tuned", tuned)):
            report[tag + suffix] = evaluate.evaluate(args, ctx, model, codec, items, prompts, reward_fn,
                                                     os.path.join(args.out, "eval", tag + suffix), tag + suffix)
    if ctx.master:
        path = os.path.join(args.out, "eval", "summary.json")
        with checkpoints.writing(path), open(path, "w") as f:
            json.dump(report, f, indent=1)
        evaluate.print_report(args.out, report)
        if args.preset == "smoke":
            print("(the smoke preset trains a toy model for seconds: its numbers test the pipeline, not the method)")
    return report


def main(argv=None):
    """The whole run: check the inputs, load what they name, and only then write. Returns the
    evaluation summary, or None."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = parse_args(argv)
    ctx = Ctx(args)
    settings = check_inputs(args, ctx.world)

    # --- load what the run needs; a bad file fails now, and nothing has been written yet
    reward_fn = rewards.build_reward(args.reward, device=ctx.device, server=remote.settings(args),  # --reward-url
                                     weights=rewards.parse_reward_ckpt(args.reward_ckpt, args.reward))
    base, codec, prompts = load_base(args, ctx, args.init)
    loading.describe(args, base, flags.given(argv))  # the flags that describe the model say what it is
    run_config = {**vars(args), "grpo": vars(settings), "world_size": ctx.world, "model": base.config,
                  "base": loading.base_record(args.init)}  # config.json: the run as it runs
    wandb = None
    if args.wandb and ctx.master:
        import wandb  # optional (not in requirements.txt): only --wandb runs import it; flags.check_inputs checked it exists
        wandb.init(project="mar-grpo", config=run_config)

    lock = checkpoints.take_run_folder(args.out, ctx)  # the first write: from now on this run alone writes --out
    try:  # SIGINT / SIGTERM now ask the training loop to stop at a step boundary
        with processes.StopRequests(ctx.print0) as stops:
            if args.eval_only:
                summary = evaluate.evaluate(args, ctx, base, codec, prompts.eval_items(args.eval_prompts, args.seed),
                                            prompts, reward_fn, args.out, "eval")
                ctx.print0(json.dumps(summary, indent=1) + f"\nresults: {os.path.join(args.out, 'results.jsonl')}")
                return summary
            final = grpo_train(args, ctx, settings, base, args.init, codec, prompts, reward_fn, stops, run_config, wandb)
            if args.eval_prompts > 0:
                return evaluate_base_and_tuned(args, ctx, base, final, codec, prompts, reward_fn)
            return None
    finally:
        lock.release()


def cli(argv=None):
    """`python train.py ...`: main() with failures said in one line (infra/processes.cli). Returns the exit status."""
    return processes.cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
