"""MAR-GRPO training: one script from a CPU laptop to `torchrun --nproc_per_node=8`.

    python train.py                      # the demo: MAR-GRPO from the shipped small MAR (bases/demo.pt)
                                         # on shapes prompts, evaluation before/after
    python train.py --preset smoke       # the whole pipeline at toy size (tests, CI)
    torchrun --nproc_per_node=8 train.py --preset mar_base --init mar_base.pth --vae kl16.ckpt \\
        --reward hpsv2 --reward-ckpt hpsv2=HPS_v2.1_compressed.pt
    python train.py --eval-only --init CKPT --prompts FILE --out DIR
    torchrun ... train.py --lora R | --fsdp  # models that do not fit as DDP replicas (lora.py, fsdp.py)

Stages: `--stage pretrain` (a base MAR on the shapes world), `--stage grpo` (RL from `--init`),
`--stage all` (default: pretrain unless `--init` or a cached base exists, GRPO, then evaluation of
base and tuned models; the demo's `--init` is its shipped base, `--init scratch` pretrains instead).
The single-process path is the distributed path: DDP when torchrun sets RANK; rank 0 alone logs and
writes. Every random draw of a step comes from a generator seeded by (seed, stage, step, shard) on the
run's device, a shard being a rank's micro-batch (the rank itself without --grad-accum), so a resumed
run continues exactly and 1 process with --grad-accum A draws what A processes draw.

When things go wrong (docs/faults.md): flags are checked when parsed (ranges, finiteness),
cross-flag rules and files in `flags.check_inputs`, then models, rewards and prompts are loaded,
all before anything is written; a bad one is one line `error: ...`, exit status 2. Then the run
locks --out (one writer per folder). A non-finite reward, advantage, loss or gradient skips that
update; `--max-bad-steps` in a row stop the run (exit status 1). SIGINT / SIGTERM stop after the
step with its checkpoint (exit 130 / 143); a failed write is one line naming the file (exit 1).
Checkpoints are written atomically (checkpoints.py); a torchrun relaunch after a failure resumes
by itself (with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: pytorch/pytorch#135712).
"""

import copy
import json
import math
import os
import signal
import sys
import time

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import checkpoints
import evaluate
import fsdp
import grpo
import lora
import mar
import masks
import models
import mte
import policy
import processes
import rewards
import rollout
import shapes
from flags import check_inputs, parse_args, will_pretrain
from processes import Ctx, Stop, all_finite
from rewards import score

# -----------------------------------------------------------------------------
# Models, codecs, prompts, rewards

def load_base(args, ctx, init):
    """The base policy from `init` (on ctx.device, frozen), its codec and the prompts; a missing,
    corrupt or mismatched checkpoint, VAE or prompt file fails in this call, before anything is written."""
    base = models.load_policy(args, init).to(ctx.device).requires_grad_(False)
    return base, models.load_codec(args, base, ctx.device), models.load_prompts(args, base)


# -----------------------------------------------------------------------------
# Stage 1: pretrain a small MAR on the shapes world (the demo's base model)

def pretraining_start(args):
    """The small MAR pretraining starts from: random (seeded: the same on every rank), or the
    weights of --pretrain-from (strict shapes; a fresh optimizer follows). Built before any write."""
    torch.manual_seed(args.seed)
    model = mar.build_mar(models.small_mar_config(args))
    if args.pretrain_from is not None:  # continue a base: its (EMA) weights
        model = models.load_checkpoint(args.pretrain_from, model=model, flag="--pretrain-from")
    return model.train()


def pretrain(args, ctx, stops, model):
    """MAE-style diffusion-loss training of `model` (pretraining_start) with EMA; writes
    <out>/base.pt (the EMA weights). A step with a non-finite loss or gradient changes nothing (no
    optimizer step, no EMA update); --max-bad-steps of them in a row stop the run before base.pt
    is written."""
    local_batch = args.pretrain_batch // ctx.world  # divisibility: check_inputs
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
        signum = int(ctx.max({"stop": stops.requested})["stop"])  # SIGINT / SIGTERM: every rank stops here
        if signum:
            raise processes.Interrupted(f"interrupted ({signal.Signals(signum).name}) at pretraining step {step}: "
                                        "base.pt is not written (pretraining does not resume)", signum)
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


def collect(args, ctx, settings, model, codec, prompts, reward_fn, step, shard, diff_candidates):
    """One micro-batch of a GRPO step: the prompts of `shard` (of world × --grad-accum), G rollouts
    each recording the chosen steps, their rewards and advantages, and the MTE trajectories.
    Returns a dict (inputs, record, images, texts, scores, info, adv, seeds, uncertain, times)."""
    per_shard = args.prompts_per_step // (ctx.world * args.grad_accum)  # divisibility: check_inputs
    t0 = time.time()
    items = prompts.sample(args.prompts_per_step, args.seed, step)[shard * per_shard:(shard + 1) * per_shard]
    items = [it for it in items for _ in range(args.group_size)]  # each prompt's group stays together
    inputs = prompts.condition(items, ctx.device)
    plan_ar, plan_diff = grpo.choose_train_steps(len(model.ar_schedule(args.num_iter, model.seq_len)), args.train_ar_steps,
                                                 diff_candidates, args.train_diff_steps, ctx.generator(3, step, shard=shard),
                                                 args.train_ar_below)
    plan = rollout.RolloutPlan(ar_steps=plan_ar, diff_steps=plan_diff)
    with ctx.autocast():
        tokens, record = rollout.record_rollout(model, inputs, args.num_iter, args.cfg, args.cfg_schedule,
                                                args.temperature, plan, ctx.generator(4, step, shard=shard))
        images = codec.decode(model.unpatchify(tokens).float())
    t1 = time.time()
    texts = prompts.texts(items)
    scores, info = score(reward_fn, args.reward, images, texts, prompts.metas(items))
    if args.reward_norm == "group-minmax":  # each component min-max normalised within its group, then summed
        scores = grpo.min_max_combined(info["components"], info["weights"], args.group_size)
    scores = scores.to(ctx.device)
    adv = grpo.group_advantages(scores, args.group_size)
    t2 = time.time()
    # multi-trajectory expectation: S head trajectories from z_final, per-token uncertainty
    seeds = uncertain = None
    if settings.mte_seeds >= 2:
        seeds = mte.sample_trajectories(model.diffloss, record.z_final, record.z_final_null, record.cfg_final,
                                        args.temperature, settings.mte_seeds, plan.diff_steps, ctx.generator(5, step, shard=shard))
        uncertain = masks.top_k_mask(masks.token_uncertainty(seeds["x0"]), settings.top_k)
    return dict(inputs=inputs, record=record, images=images, texts=texts, scores=scores, info=info, adv=adv,
                seeds=seeds, uncertain=uncertain, olds=[None] * len(record.steps),
                t_rollout=t1 - t0, t_reward=t2 - t1, t_mte=time.time() - t2)


def grpo_train(args, ctx, settings, base, base_path, codec, prompts, reward_fn, stops):
    """RL from the base policy `base` (on ctx.device; it stays frozen as the reference of the KL,
    and the policy shares its frozen parameters); checkpoints (the trained parameters over
    `base_path`), samples and metrics under args.out. Returns the final checkpoint path.

    settings: grpo.GRPOSettings; codec: latents <-> images; prompts: Prompts; reward_fn: a rewards.Reward.
    Each rank's share of a step's prompts runs as --grad-accum micro-batches whose gradients add up
    before the one optimizer step, drawn exactly as world × --grad-accum processes would draw them.
    A step whose reward, advantage, loss or gradient is not finite on some rank changes nothing (no
    optimizer step on any rank); --max-bad-steps of them in a row stop the run (Stop).
    """
    ref = base  # the frozen reference of the KL (under --lora: the policy with its adapters off, lora.py item 4)
    model = (lora.policy(base, lora.spec(base, args.lora), args.seed) if args.lora  # the adapters alone train
             else models.make_policy(args, base, settings))
    model.eval()  # no dropout: recomputed log-probabilities must equal the recorded ones
    if args.fsdp:  # the trained parameters, gradients and optimizer state sharded over the processes
        fsdp.shard(model, ctx.world, ctx.device)
    params = [p for p in model.parameters() if p.requires_grad]
    diff_candidates = [k for k in model.diffloss.trainable_steps() if k >= args.min_diff_step]  # what a rollout may record
    if not diff_candidates:
        raise ValueError(f"--min-diff-step {args.min_diff_step}: the head trains steps {list(model.diffloss.trainable_steps())}")
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay)
    loss_module = policy.PolicyLoss(model)
    ddp = ctx.ddp and not args.fsdp  # FSDP reduces the gradients itself (fsdp.py, item 4)
    if ddp:
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
        checkpoints.start_run_folder(args.out, start, args.keep_last, {**vars(args), "grpo": vars(settings), "world_size": ctx.world})
    ctx.barrier()
    ctx.print0(f"GRPO ({args.method}): {args.steps} steps × {args.prompts_per_step} prompts × G={args.group_size}, "
               f"world size {ctx.world}" + (f" × {args.grad_accum} micro-batches" if args.grad_accum > 1 else "")
               + f"; {sum(p.numel() for p in params) / 1e6:.3g}M trained parameters"
               + (f" (LoRA adapters of rank {args.lora})" if args.lora else "")
               + (f", sharded over the {ctx.world} processes" if args.fsdp else "") + f"; {settings}")

    A, G = args.grad_accum, args.group_size
    bad_steps, parity_warned = 0, False  # non-finite steps in a row
    for step in tqdm(range(start, args.steps), disable=not ctx.master, desc="grpo", initial=start, total=args.steps):
        last_step = step == args.steps - 1
        # --- rollouts, rewards, MTE: this rank's micro-batches
        batches = [collect(args, ctx, settings, model, codec, prompts, reward_fn, step, ctx.rank * A + m, diff_candidates)
                   for m in range(A)]

        # --- policy update: E inner epochs, one backward per trained AR step (DDP all-reduces on the
        #     last micro-batch's last step); anything non-finite on any rank skips the optimizer step
        t2 = time.time()
        skipped = False
        for epoch in range(settings.inner_epochs):
            step_stats = []
            for m, b in enumerate(batches):
                stats, b["olds"] = policy.backward_rollout(loss_module, ddp, ref, b["record"], b["inputs"], b["adv"], settings,
                                                           b["seeds"], b["uncertain"], b["olds"], ctx.autocast,
                                                           scale=1 / A, sync=m == A - 1)
                step_stats += stats
            grad_norm = fsdp.whole(torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm))
            if all_finite(ctx, [b["scores"] for b in batches], [b["adv"] for b in batches],
                          [s["loss"] for s in step_stats], grad_norm):
                opt.step()
            else:
                skipped = True
            opt.zero_grad(set_to_none=True)
        t_update = time.time() - t2
        bad_steps = bad_steps + 1 if skipped else 0
        bad_total += skipped

        # --- logging: scalars (tensors until now) are reduced over ranks, one sync each for the
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
        worst = ctx.max({**worst, "stop": stops.requested})  # every rank stops at the same step
        signum = int(worst.pop("stop"))
        row = {"step": step, **ctx.mean(local), **worst, "skipped": int(skipped), "bad_steps_total": bad_total}
        if ctx.master:
            with checkpoints.writing(metrics_path), open(metrics_path, "a") as f:
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

        # --- once in a while: a sample grid, a checkpoint (the trained parameters, over base_path; whole
        #     tensors, which every rank gathers under --fsdp)
        if ctx.master and (step % args.sample_every == 0 or last_step):
            grid = os.path.join(args.out, "samples", f"step_{step:06d}.png")
            with checkpoints.writing(grid):
                evaluate.save_grid(images[:16], [f"{t} ({s:.2f})" for t, s in zip(texts, scores.tolist())][:16], grid)
        if (step + 1) % args.save_every == 0 or last_step or signum:
            ctx.barrier()
            trained, opt_state = fsdp.whole_state(model, opt, ctx.master)
            if ctx.master:
                checkpoints.save_step(ckpt_dir, step + 1, {
                    "model": trained, "base": base_path, "config": model.config, "lora": lora.settings(model),
                    "optimizer": opt_state, "step": step + 1, "args": vars(args), "grpo": vars(settings),
                    "bad_steps_total": bad_total}, args.keep_last)
            ctx.barrier()
        if signum:  # SIGINT / SIGTERM: the step is saved, every rank stops here
            raise processes.Interrupted(f"interrupted ({signal.Signals(signum).name}) after step {step}; "
                                        f"`--resume` continues from step {step + 1}", signum)
    if ctx.master and os.path.exists(metrics_path):
        evaluate.plot_curves(metrics_path, os.path.join(args.out, "curves.png"))
    return os.path.join(ckpt_dir, "latest.pt")


# -----------------------------------------------------------------------------

def main(argv=None):
    """The whole run: check the inputs, load what they name, and only then write. Returns the
    evaluation summary, or None."""
    args = parse_args(argv)
    ctx = Ctx(args)
    settings = check_inputs(args, ctx.world)

    # --- load what the run needs; a bad file fails now, and nothing has been written yet
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

    start = pretraining_start(args) if base is None and not args.eval_only else None
    lock = take_run_folder(args, ctx)  # the first write: from now on this run alone writes --out
    try:  # SIGINT / SIGTERM now ask the training loops to stop at a step boundary
        with processes.StopRequests(ctx.print0) as stops:
            return run_stages(args, ctx, settings, reward_fn, init, base, codec, prompts, stops, start)
    finally:
        lock.release()


def take_run_folder(args, ctx):
    """Rank 0 locks --out for this run (checkpoints.RunLock); every rank learns whether it could,
    so a refused run stops on every rank. Returns the lock."""
    lock, refused = checkpoints.RunLock(args.out), None
    if ctx.master:
        try:
            lock.acquire()
        except ValueError as e:
            refused = e
    if ctx.max({"refused": float(refused is not None)})["refused"]:
        raise refused or ValueError(f"--out {args.out}: rank 0 could not take the run folder")
    return lock


def run_stages(args, ctx, settings, reward_fn, init, base, codec, prompts, stops, start=None):
    """Evaluation only, or pretraining (unless a base is given), GRPO and the evaluation of base and
    tuned model. Returns the evaluation summary, or None."""
    if args.eval_only:
        summary = evaluate.evaluate(args, ctx, base, codec, prompts.eval_items(args.eval_prompts, args.seed),
                                    prompts, reward_fn, args.out, "eval")
        ctx.print0(json.dumps(summary, indent=1))
        ctx.print0(f"results: {os.path.join(args.out, 'results.jsonl')}")
        return summary

    if base is None:  # --stage pretrain, or --stage all without a cached base
        init = pretrain(args, ctx, stops, start)
        if args.stage == "pretrain":
            return None
        base, codec, prompts = load_base(args, ctx, init)
    final = grpo_train(args, ctx, settings, base, init, codec, prompts, reward_fn, stops)

    if args.stage == "all" and args.eval_prompts > 0:
        # --- evaluation of the base and the tuned model on the same prompts and seeds: held-out
        # compositions (eval/base, eval/tuned) and, for shapes prompts, the training split too
        # (eval/base_train, eval/tuned_train: prompts of the split RL draws from, with fresh seeds; a
        # short run draws few of these very prompts: 40 steps × 8 of the split's 452)
        ckpt = checkpoints.read_checkpoint(final, "--out")  # the tuned model shares base's frozen parts
        tuned = lora.policy(base, ckpt["lora"]) if ckpt.get("lora") else models.policy_copy(base, ckpt["model"])
        models.load_trained(tuned.requires_grad_(False), ckpt["model"], final)
        splits = ["heldout", "train"] if args.prompts is None and prompts.is_shapes else ["heldout"]
        report = {}
        for split in splits:
            items = prompts.eval_items(args.eval_prompts, args.seed, split)
            suffix = "" if split == "heldout" else "_" + split
            for tag, model in (("base", base), ("tuned", tuned)):
                report[tag + suffix] = evaluate.evaluate(args, ctx, model, codec, items, prompts, reward_fn,
                                                         os.path.join(args.out, "eval", tag + suffix), tag + suffix)
        if ctx.master:
            with checkpoints.writing(os.path.join(args.out, "eval", "summary.json")):
                with open(os.path.join(args.out, "eval", "summary.json"), "w") as f:
                    json.dump(report, f, indent=1)
            evaluate.print_report(args.out, report)
            if args.preset == "smoke":
                print("(the smoke preset trains a toy model for seconds: its numbers test the pipeline, not the method)")
        return report
    return None


def cli(argv=None):
    """`python train.py ...`: main() with failures said in one line (processes.cli). Returns the exit status."""
    return processes.cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
