"""Pretraining a small MAR on the shapes world: the demo's base models, with the official MAE-style
diffusion loss. train.py is the GRPO loop; this is the script that makes what it starts from.

    python -m demo.pretrain --preset demo --out runs/demo_base     # a base in the demo's world
    python -m demo.pretrain --preset smoke --out runs/smoke_base   # the toy base of train.py --preset smoke
    torchrun --nproc_per_node=2 -m demo.pretrain ...               # the same, data-parallel

demo/base.pt, committed in float16 (3.5 MB; `python -m infra.checkpoints half runs/demo_base/base.pt
demo/base.pt`), was pretrained in three runs: 2000 + 6000 steps in the world of token-aligned objects
(--cell 8) with clean captions, then 1500 steps on under-captioned images (--unmentioned 0.5: half
the images also show one object their prompt does not mention, so the base learnt to add
unrequested objects, which RL can remove), each from the last one's EMA weights with a fresh
optimizer and new data draws (2 CPU cores, torch 2.14):
    python -m demo.pretrain --out runs/cell2k --unmentioned 0 --pretrain-steps 2000 --threads 2       (5 min)
    python -m demo.pretrain --out runs/cell8k --unmentioned 0 --pretrain-steps 6000 \\
        --pretrain-from runs/cell2k/base.pt --pretrain-lr 5e-4 --seed 1 --threads 1        (24 min beside other runs)
    python -m demo.pretrain --out runs/demo_base --pretrain-steps 1500 \\
        --pretrain-from runs/cell8k/base.pt --pretrain-lr 5e-4 --seed 2 --threads 2        (4 min)
demo/smoke.pt is `python -m demo.pretrain --preset smoke --out runs/smoke_base` (20 steps, float32).

The small MAR has a local prior (`--local-conv`, mar.py item 4): without it the base does not read
its canvas. Objects aligned to 8-px cells (--cell 8) suit the 2-pixel tokens: with free positions RL
did not visibly teach a base that draws. A step with a non-finite loss or gradient changes nothing
(no optimizer step, no EMA update); --max-bad-steps of them in a row stop the run before base.pt
is written. The single-process path is the distributed path, as train.py's.
"""

import argparse
import copy
import math
import os
import signal
import sys

import numpy as np
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import mar
from demo import shapes
from infra import checkpoints, processes
from infra.flags import FRACTION, NONNEG_INT, POS_FLOAT, POS_INT, PRECISIONS, number, parse_with_preset
from infra.processes import SEED_STAGES, Ctx, Stop, all_finite

PRESETS = {
    # the world of demo/base.pt: 16×16 images of 64 two-pixel tokens, objects aligned to 8-px cells,
    # under-captioned images (every second one shows one unmentioned object)
    "demo": dict(img_size=16, patch_size=2, local_conv=3, cell=8, unmentioned=0.5, pretrain_steps=8000),
    # the toy base of train.py --preset smoke (demo/smoke.pt), seconds on 2 CPU cores
    "smoke": dict(embed_dim=32, depth=1, heads=2, head_depth=1, head_width=32, num_sampling_steps=8,
                  pretrain_steps=20, pretrain_batch=16),
}


def model_size_flags(p):
    """The small MAR's sizes (also benchmarks/bench.py's, which builds it at other sizes)."""
    a = p.add_argument
    a("--img-size", type=POS_INT, default=32, help="image size in pixels")
    a("--patch-size", type=POS_INT, default=4, help="pixels per token side")
    a("--embed-dim", type=POS_INT, default=128, help="transformer width")
    a("--depth", type=POS_INT, default=3, help="encoder and decoder blocks each")
    a("--heads", type=POS_INT, default=4, help="attention heads")
    a("--head-depth", type=POS_INT, default=3, help="diffusion-head residual blocks")
    a("--head-width", type=POS_INT, default=128, help="diffusion-head width")
    a("--local-conv", type=NONNEG_INT, default=0, help="k×k conv over the decoder's token grid (0 = official; mar.py item 4)")
    a("--num-sampling-steps", type=number(int, 3), default=16, help="diffusion steps T of the head (for sampling)")
    a("--mask-ratio-min", type=FRACTION, default=0.7, help="lowest MAE mask ratio (the official 0.7)")
    a("--diffusion-batch-mul", type=POS_INT, default=1, help="official diffusion_batch_mul")


def build_parser():
    p = processes.Parser(prog="python -m demo.pretrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--preset", default="demo", choices=sorted(PRESETS), help="named group of defaults")
    a("--out", default=None, help="output folder for base.pt (default runs/<preset>_base)")
    a("--seed", type=NONNEG_INT, default=0, help="seed of the initial weights and of every step's data and noise")
    a("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run")
    a("--precision", default=None, choices=PRECISIONS,
      help="the forward passes' dtype: bf16 autocast or fp32 (default: bf16 on CUDA, fp32 on the "
           "CPU), as train.py's")
    a("--threads", type=NONNEG_INT, default=0, help="torch CPU threads (0: torch's default)")
    model_size_flags(p)
    a("--cell", type=NONNEG_INT, default=0, help="objects aligned to cells of this many pixels (0 = free)")
    a("--unmentioned", type=number(float, 0, 1), default=0.0,
      help="probability that an image shows one more object than its prompt says (shapes.make_dataset)")
    a("--relation-p", type=number(float, 0, 1), default=1.0,
      help="probability that a spatial prompt's image keeps its relation; otherwise its objects lie anywhere")
    a("--relation-mirror", type=number(float, 0, 1), default=0.0,
      help="probability that a spatial prompt's image shows the mirrored relation (left of drawn as right of)")
    a("--categories", nargs="+", default=list(shapes.CATEGORIES), choices=shapes.CATEGORIES,
      help="the prompt categories drawn, each equally often")
    a("--pretrain-steps", type=NONNEG_INT, default=2000, help="optimizer steps")
    a("--pretrain-batch", type=POS_INT, default=32, help="images per step (global)")
    a("--pretrain-lr", type=POS_FLOAT, default=1e-3, help="peak learning rate")
    a("--pretrain-from", default=None, help="start from this base's weights (ours, same size flags) instead of a random "
                                            "model: a new optimizer and lr schedule, e.g. to pretrain a base longer")
    a("--ema", type=number(float, 0, 1, high_open=True), default=0.999, help="EMA decay of the base")
    a("--max-bad-steps", type=POS_INT, default=5, help="non-finite steps in a row before the run stops")
    return p


def parse_args(argv=None):
    """The flags over the preset over the defaults; --out defaults to runs/<preset>_base."""
    args, preset = parse_with_preset(build_parser(), PRESETS, argv)
    args.out = args.out or os.path.join("runs", f"{preset}_base")
    return args


def check_inputs(args, world):
    """Cross-flag rules and files, before anything is written (one-line errors naming the flag)."""
    if args.pretrain_batch % world:
        raise ValueError(f"--pretrain-batch {args.pretrain_batch} must divide by the world size {world}")
    if args.img_size % args.patch_size:
        raise ValueError(f"--img-size {args.img_size}: must be a multiple of --patch-size {args.patch_size}")
    if args.embed_dim % args.heads:
        raise ValueError(f"--embed-dim {args.embed_dim}: must divide by --heads {args.heads} (the attention heads' width)")
    if args.pretrain_from is not None and not os.path.exists(args.pretrain_from):
        raise FileNotFoundError(f"--pretrain-from: no such file: {args.pretrain_from}")
    checkpoints.check_writable(args.out, "--out")


def small_mar_config(args):
    """The small pixel-token MAR of the shapes world, from the size flags."""
    return dict(img_size=args.img_size, vae_stride=1, patch_size=args.patch_size, vae_embed_dim=3,
                encoder_embed_dim=args.embed_dim, encoder_depth=args.depth, encoder_num_heads=args.heads,
                decoder_embed_dim=args.embed_dim, decoder_depth=args.depth, decoder_num_heads=args.heads,
                mlp_ratio=4.0, norm_eps=1e-6, class_num=1, buffer_size=shapes.MAX_PROMPT_TOKENS,
                diffloss_d=args.head_depth, diffloss_w=args.head_width, mask_ratio_min=args.mask_ratio_min,
                num_sampling_steps=str(args.num_sampling_steps), attn_dropout=0.0, proj_dropout=0.0,
                diffusion_batch_mul=args.diffusion_batch_mul, text_vocab_size=len(shapes.VOCAB), clip_denoised=True,
                local_conv=args.local_conv)


def starting_model(args):
    """The model pretraining starts from: random (seeded: the same on every rank), or the weights
    of --pretrain-from (strict shapes; a fresh optimizer follows). Built before any write."""
    torch.manual_seed(args.seed)
    model = mar.build_mar(small_mar_config(args))
    if args.pretrain_from is not None:  # continue a base: its (EMA) weights
        path = args.pretrain_from
        ckpt = checkpoints.read_checkpoint(path, "--pretrain-from")
        model = checkpoints.load_weights(model, checkpoints.model_state(ckpt, path, "--pretrain-from"), path,
                                         "--pretrain-from")
    return model.train()


# -----------------------------------------------------------------------------
# The official MAE-style loss of MAR (LTH14/mar, `MAR.forward`)

def random_masking(model, x, orders, generator=None):
    """MAE training mask (B, L), 1 = masked: the first ⌈L·ratio⌉ positions of each order, the ratio
    a normal(1, 0.25) truncated to [mask_ratio_min, 1] (inverse-CDF sampling), one per batch (the
    encoder keeps the same number of tokens in every row). x: (B, L, C) tokens; orders: (B, L)."""
    bsz, seq_len, _ = x.shape
    u = torch.rand((), generator=generator, dtype=torch.float64, device=orders.device).cpu()
    a = torch.special.ndtr(torch.tensor((model.mask_ratio_min - 1.0) / 0.25, dtype=torch.float64))
    mask_rate = 1.0 + 0.25 * torch.special.ndtri(a + u * (0.5 - a)).item()  # 0.5 = Φ(0)
    num_masked = int(math.ceil(seq_len * mask_rate))
    mask = torch.zeros(bsz, seq_len, device=x.device)
    return torch.scatter(mask, -1, orders[:, :num_masked], 1.0)


class MAELoss(nn.Module):
    """MAR's training loss as a module (so DDP can wrap it): mask a random share of each image's
    tokens, encode the rest, and regress the diffusion loss on the masked ones, each repeated
    `diffusion_batch_mul` times."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, imgs, labels=None, prompt_ids=None, generator=None):
        """imgs: (B, C, H, W) latent images; labels: (B,) classes, or prompt_ids: (B, S). Returns the loss."""
        m = self.model
        cond = m.condition(labels, prompt_ids, bsz=imgs.shape[0])
        x = m.patchify(imgs)  # (B, L, C_tok)
        target = x.clone().detach()
        orders = m.sample_orders(x.size(0), generator)
        mask = random_masking(m, x, orders, generator)  # (B, L)
        z = m.forward_mae_decoder(m.forward_mae_encoder(x, mask, cond, generator), mask)  # (B, L, D)
        bsz, seq_len, _ = target.shape
        rep = m.diffusion_batch_mul
        return m.diffloss(z=z.reshape(bsz * seq_len, -1).repeat(rep, 1),  # (B·L·rep, D)
                          target=target.reshape(bsz * seq_len, -1).repeat(rep, 1),  # (B·L·rep, C)
                          mask=mask.reshape(bsz * seq_len).repeat(rep), generator=generator)


# -----------------------------------------------------------------------------
# Pretraining

def learning_rate(args, step):
    """Linear warm-up over 100 steps, then cosine decay to 10% of --pretrain-lr."""
    frac = step / max(1, args.pretrain_steps)
    return args.pretrain_lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def data(args, ctx, step):
    """Step `step`'s images and prompt ids for this rank: fresh renders of training-split prompts,
    a different slice on every rank. Returns latents (B, 3, H, W): the pixels in [-1, 1], the small
    MAR's tokens (models/vae.PixelCodec), and ids (B, S)."""
    rng = np.random.default_rng([args.seed, SEED_STAGES["pretrain_data"], step, ctx.rank])
    imgs, metas = shapes.make_dataset(args.pretrain_batch // ctx.world, args.img_size, rng, split="train", cell=args.cell,
                                      unmentioned=args.unmentioned, relation_p=args.relation_p,
                                      mirror_p=args.relation_mirror,
                                      categories=tuple(args.categories))  # divisibility: check_inputs
    x = torch.from_numpy(imgs).permute(0, 3, 1, 2).float().div(255).to(ctx.device) * 2 - 1  # (B, 3, H, W)
    return x, torch.from_numpy(shapes.tokenize([m["prompt"] for m in metas])).to(ctx.device)


def pretrain(args, ctx, stops, model):
    """MAE-style diffusion-loss training of `model` (`starting_model`) with EMA; writes
    <out>/base.pt (the EMA weights). Returns its path."""
    model = model.to(ctx.device)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    model.class_emb.requires_grad_(False)  # prompt-conditioned: the class table is unused
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.pretrain_lr,
                            betas=(0.9, 0.95), weight_decay=0.02)
    net = MAELoss(model)
    if ctx.ddp:
        net = DDP(net, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    ctx.print0(f"pretraining a {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter MAR "
               f"for {args.pretrain_steps} steps of {args.pretrain_batch} images"
               + (f", from {args.pretrain_from}" if args.pretrain_from else ""))
    bad_steps = bad_total = 0
    for step in tqdm(range(args.pretrain_steps), disable=not ctx.master, desc="pretrain"):
        signum = int(ctx.max({"stop": stops.requested})["stop"])  # SIGINT / SIGTERM: every rank stops here
        if signum:
            raise processes.Interrupted(f"interrupted ({signal.Signals(signum).name}) at pretraining step {step}: "
                                        "base.pt is not written (pretraining does not resume)", signum)
        x, ids = data(args, ctx, step)
        for group in opt.param_groups:
            group["lr"] = learning_rate(args, step)
        with ctx.autocast():
            loss = net(x, prompt_ids=ids, generator=ctx.generator(SEED_STAGES["pretrain"], step))
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
        checkpoints.atomic_save({"model": ema.state_dict(), "config": ema.config, "args": vars(args), "stage": "pretrain"}, path)
        ctx.print0(f"base model: {path}" + (f" ({bad_total} non-finite steps skipped)" if bad_total else ""))
    ctx.barrier()
    return path


def main(argv=None):
    """Check the flags, build the starting model, lock --out, pretrain, write base.pt. Returns its path."""
    args = parse_args(argv)
    ctx = Ctx(args)
    check_inputs(args, ctx.world)
    model = starting_model(args)
    lock = checkpoints.take_run_folder(args.out, ctx)  # the first write
    try:
        with processes.StopRequests(ctx.print0) as stops:
            return pretrain(args, ctx, stops, model)
    finally:
        lock.release()


if __name__ == "__main__":
    sys.exit(processes.cli(main))
