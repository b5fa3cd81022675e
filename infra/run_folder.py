"""What a GRPO run writes to --out, and how it stops: config.json, metrics.jsonl (and wandb), the
sample grids, the checkpoints, curves.png; resuming from the newest checkpoint; the run's stops (a
non-finite step, --max-bad-steps of them in a row, SIGINT / SIGTERM at a step boundary). train.py
calls `RunFolder.resume` before its first step and `RunFolder.after_step` after each one.

Rank 0 alone writes; every rank calls both (a checkpoint gathers sharded tensors, a stop is agreed
on by all). Checkpoints are written atomically (checkpoints.py).
"""

import json
import os
import signal
import sys

import torch

from infra import checkpoints, figures, fsdp, lora, processes
from infra.processes import Stop

# The recorded ℓ of a fresh rollout and the ℓ the update recomputes agree: the same code on the same
# shapes gives 0 in fp32 and in bf16 (tests/test_precision.py). A gap means the update does not
# evaluate the policy that sampled (a rollout in bf16 recomputed in fp32, a canvas fed differently):
# at 0.1 nats a token's ratio ρ is off by 10%, half of PPO's clip range ε = 0.2, before any update.
PARITY_WARN = 0.1


class RunFolder:
    """--out of a run: `args` its flags, `ctx` processes.Ctx, `config` config.json's contents,
    `wandb` a started wandb module (rank 0 with --wandb) or None."""

    def __init__(self, args, ctx, config, wandb=None):
        self.args, self.ctx, self.config, self.wandb = args, ctx, config, wandb
        self.ckpt_dir = os.path.join(args.out, "ckpt")
        self.metrics = os.path.join(args.out, "metrics.jsonl")
        self.bad_steps = self.bad_total = 0  # non-finite steps in a row, and in all
        self.warned = False

    def resume(self, model, opt, base_path):
        """With --resume, the newest readable checkpoint into `model` and `opt` (whose trained
        parameters are over `base_path`); then the run's first write. Returns the first step."""
        start = 0
        if self.args.resume != "no":
            start, self.bad_total = checkpoints.resume_training(
                self.ckpt_dir, model, opt, os.path.abspath(base_path), self.args.resume == "yes",
                lambda msg: self.ctx.print0(msg, file=sys.stderr))
            if start:
                self.ctx.print0(f"resumed from step {start}")
        if self.ctx.master:
            checkpoints.start_run_folder(self.args.out, start, self.args.keep_last, self.config)
        self.ctx.barrier()
        return start

    def after_step(self, step, row, batches, model, opt, settings, skipped, signum):
        """After GRPO step `step`: its metrics row written (the first recorded-vs-recomputed gap
        above PARITY_WARN warned once), a skipped step said (--max-bad-steps in a row: Stop), a
        sample grid of the micro-batches' first 16 images, captioned with their prompt and reward,
        every --sample-every steps, a checkpoint every --save-every steps, at the last step and at
        a stop (`signum`, a signal's number, 0 for none: then processes.Interrupted)."""
        args, ctx = self.args, self.ctx
        self.bad_steps, self.bad_total = (self.bad_steps + 1 if skipped else 0), self.bad_total + skipped
        row.update(skipped=int(skipped), bad_steps_total=self.bad_total)
        self.write_row(row)
        if skipped:
            self.skip_or_stop(step)
        last = step == args.steps - 1
        if ctx.master and (step % args.sample_every == 0 or last):
            grid = os.path.join(args.out, "samples", f"step_{step:06d}.png")
            images = torch.cat([b.images for b in batches])[:16]  # (16, 3, H, W)
            captions = [f"{t} ({s:.2f})" for b in batches for t, s in zip(b.texts, b.scores.tolist())]
            with checkpoints.writing(grid):
                figures.save_grid(images, captions[:16], grid)
        if (step + 1) % args.save_every == 0 or last or signum:
            self.save(step, model, opt, settings)
        if signum:  # SIGINT / SIGTERM: the step is saved, every rank stops here
            raise processes.Interrupted(f"interrupted ({signal.Signals(signum).name}) after step {step}; "
                                        f"`--resume` continues from step {step + 1}", signum)

    def finish(self):
        """After the last step: curves.png from metrics.jsonl (rank 0). Returns the last checkpoint."""
        if self.ctx.master and os.path.exists(self.metrics):
            figures.plot_curves(self.metrics, os.path.join(self.args.out, "curves.png"))
        return os.path.join(self.ckpt_dir, "latest.pt")

    def write_row(self, row):
        """Rank 0 appends a step's row to metrics.jsonl (and to wandb); warns once of a parity gap."""
        if self.ctx.master:
            with checkpoints.writing(self.metrics), open(self.metrics, "a") as f:
                f.write(json.dumps(row) + "\n")
            if self.wandb is not None:
                self.wandb.log(row, step=row["step"])
        if row["logp_parity_err"] > PARITY_WARN and not self.warned:
            self.ctx.print0(f"warning: step {row['step']}: recorded and recomputed log-probabilities differ by up "
                            f"to {row['logp_parity_err']:.3g} nats (> {PARITY_WARN}): the update does not evaluate "
                            "the policy that sampled (see logp_parity_err in metrics.jsonl; infra/run_folder.py, "
                            "PARITY_WARN)", file=sys.stderr)
            self.warned = True

    def skip_or_stop(self, step):
        """A skipped (non-finite) step is said; --max-bad-steps of them in a row stop the run (Stop),
        naming the last good checkpoint."""
        self.ctx.print0(f"step {step}: non-finite reward, advantage, loss or gradient; update skipped "
                        f"({self.bad_steps} in a row, {self.bad_total} in all)")
        if self.bad_steps >= self.args.max_bad_steps:
            names = checkpoints.checkpoint_names(self.ckpt_dir)
            last = os.path.join(self.ckpt_dir, names[-1]) if names else "none yet (the policy is still --init)"
            raise Stop(f"{self.bad_steps} non-finite steps in a row (--max-bad-steps {self.args.max_bad_steps}); "
                       f"the last good checkpoint: {last}")

    def save(self, step, model, opt, settings):
        """Checkpoint after `step`: the trained parameters over --init and the optimizer state, whole
        tensors (gathered on every rank under --fsdp); rank 0 writes. Every rank calls it."""
        self.ctx.barrier()
        trained, opt_state = fsdp.whole_state(model, opt, self.ctx.master)
        if self.ctx.master:
            checkpoints.save_step(self.ckpt_dir, step + 1, {
                "model": trained, "base": os.path.abspath(self.args.init), "config": model.config,
                "lora": lora.settings(model), "optimizer": opt_state, "step": step + 1, "args": vars(self.args),
                "grpo": vars(settings), "bad_steps_total": self.bad_total}, self.args.keep_last)
        self.ctx.barrier()
