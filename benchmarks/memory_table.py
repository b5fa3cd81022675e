"""What one GPU holds at a preset's released settings, under DDP, FSDP over N processes and LoRA, each
in fp32 and under bf16 autocast, with and without --grad-checkpointing: `python -m benchmarks.bench
--memory PRESET` (docs/memory.md).

How each figure is got (every cell of the table is marked c, m or ~):
  c  counted: parameters (of the released architecture, built on the meta device) × 4 bytes: weights,
     gradients and the reference are fp32 in both dtypes (autocast casts the weights for each
     operation; it does not store them in bf16), AdamW keeps two fp32 moments (8 bytes).
  m  measured (memory.measure): the peak activations of a rollout and of a trained AR step, on this
     machine with random weights, at the preset's sizes, and the bytes of the tensors the rollout leaves
     for the update (the record, MTE's trajectories).
  ~  modelled from measured figures: the activations measured at two image sizes t1 < t2 (--memory-tokens)
     with g images (--memory-images) and at t1 with 2g, fitted as c + G (p + b (tokens − t1)) (at_preset:
     linear in the tokens, as the CPU attention saves no tokens × tokens tensor; c, what does not grow
     with the images, is mostly the bf16 copies of the weights that autocast keeps); or the same
     figure of the full policy (LoRA, unless measured: its activations were within 0.3% of the full
     policy's in fp32).
A GPU holds more than the table: the CUDA context and the allocator's cached, fragmented blocks (a few
GiB); benchmarks/gpu_check.py measures the allocator's peak of a trained AR step beside these figures.
"""

import json
import math
import os
import re
import time

import open_clip
import torch

import train
from benchmarks import memory
from infra import lora
from models import loading

GiB = 2 ** 30


def counts(args, rank):
    """Parameter counts of the preset's model, from shapes: all, trained (loading.trainable_names, the
    method's), the head, LoRA adapters of rank R, FSDP's largest block unit and its root unit."""
    with torch.device("meta"):
        model = memory.build(args)
    own = dict(model.named_parameters())
    trained = loading.trainable_names(args, model, train.grpo_settings(args).train_head, args.cfg != 1.0)
    blocks = [m for name, m in model.named_modules() if re.fullmatch(type(model).BLOCKS, name)]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    return dict(all=sum(p.numel() for p in own.values()), trained=sum(own[n].numel() for n in trained),
                head=sum(p.numel() for p in model.diffloss.parameters()), lora=lora.adapter_count(model, rank),
                block=max(sum(p.numel() for p in b.parameters()) for b in blocks),
                root=sum(own[n].numel() for n in trained if id(own[n]) not in in_blocks),
                tokens=model.seq_len, name=type(model).__name__)


def frozen_extras(args):
    """Parameters of the frozen models beside the policy: the KL-16 VAE (its official key listing in
    fixtures/) and the presets' reward, HPS v2.1 (open_clip ViT-H-14, built on the meta device).
    NOVA's own VAE ships with its pipeline and is not counted (None)."""
    with open(os.path.join(memory.FIXTURES, "kl16_vae_state_dict.json")) as f:
        vae = sum(math.prod(shape) for shape in json.load(f)["state_dict"].values())
    with torch.device("meta"):
        reward = sum(p.numel() for p in open_clip.model.CLIP(**open_clip.get_model_config("ViT-H-14")).parameters())
    return dict(vae=None if args.model == "nova" else vae, reward=reward if "hpsv2" in args.reward else 0)


def squares(text):
    """An argparse type (bench.py --memory-tokens): comma-separated square numbers of tokens."""
    values = [int(v) for v in text.split(",")]
    if any(v < 1 or math.isqrt(v) ** 2 != v for v in values):
        raise ValueError(f"{text}: not square numbers of tokens")
    return values


def at_preset(points, tokens, G):
    """A measured figure at the preset's tokens and G, from {(tokens_i, images_i): value}: the value itself
    when measured there, else c + G (p + b (tokens − t1)), with b the slope per image and token between
    two token counts t1 < t2 at g images, p the figure per image at t1, and c what does not grow with
    the images (e.g. the bf16 copies of the weights that autocast keeps): from g and more images at t1
    when measured (else c = 0). Returns (value, mark)."""
    if (tokens, G) in points:
        return points[tokens, G], "m"
    t1, t2 = min(t for t, _ in points), max(t for t, _ in points)
    g = min(i for t, i in points if t == t1)
    b = (points[t2, g] - points[t1, g]) / (g * (t2 - t1)) if t2 != t1 else 0.0
    more = [i for t, i in points if t == t1 and i > g]
    p = (points[t1, more[0]] - points[t1, g]) / (more[0] - g) if more else points[t1, g] / g
    c = points[t1, g] - g * p
    return c + G * (p + b * (tokens - t1)), "~"


def variant_name(dtype, ckpt):
    return f"{dtype}{', checkpointed' if ckpt else ''}"


def row_cells(args, n, extra, act, mode, world):
    """The cells {column: (bytes, mark)} of one row: `mode` (DDP, FSDP, LoRA) with the activations
    `act` {figure: (bytes, mark)} of its dtype and checkpointing."""
    B = 4  # bytes per fp32 number
    counted = {"DDP": dict(weights=n["all"], gradients=n["trained"], AdamW=2 * n["trained"], reference=n["trained"]),
               "FSDP": dict(weights=n["all"] - n["trained"] + n["trained"] / world, gradients=n["trained"] / world,
                            AdamW=2 * n["trained"] / world, reference=n["trained"]),
               "LoRA": dict(weights=n["all"] + n["lora"], gradients=n["lora"], AdamW=2 * n["lora"], reference=0)}[mode]
    cells = {k: (v * B, "c") for k, v in counted.items()}
    cells["VAE + reward"] = ((extra["vae"] or 0) + extra["reward"]) * B, "c"
    # the record the update reads: the measured one (2 recorded AR steps) and, at most, one more step of
    # every token unknown for each further trained AR step; MTE's trajectories are in it
    more = (args.train_ar_steps - 2) * act["record_step"][0]
    cells["record + MTE"] = act["held"][0] + more, "~" if more else act["held"][1]
    cells["rollout peak"] = act["rollout"][0] - act["held"][0], act["rollout"][1]  # beyond the record it leaves
    cells["AR step peak"] = act["step"]
    if mode == "FSDP":  # + the unit being computed and the next one, whole, and one unreduced gradient
        cells["AR step peak"] = act["step"][0] + (3 * n["block"] + 2 * n["root"]) * B, "~"
    static = sum(v for k, (v, _) in cells.items() if k not in ("rollout peak", "AR step peak"))
    cells["total"] = static + max(cells["rollout peak"][0], cells["AR step peak"][0]), "~"
    return cells


def bench_memory(args, opts, out):
    """The table of `python -m benchmarks.bench --memory PRESET` (module docstring): per GPU, under DDP, FSDP over
    --world ranks and LoRA of rank --lora (32 when not given), each in the --memory-dtypes (fp32, bf16), plain and
    checkpointed."""
    rank, world, G = args.lora or 32, opts.world, args.group_size
    variants = [v for v in memory.VARIANTS if v[0] in opts.memory_dtypes]
    n, extra = counts(args, rank), frozen_extras(args)
    out(f"{n['name']} of --preset {opts.preset}: {n['all'] / 1e6:,.1f}M parameters, {n['trained'] / 1e6:,.1f}M trained "
        f"({args.method}), head {n['head'] / 1e6:,.1f}M, LoRA of rank {rank} {n['lora'] / 1e6:,.2f}M; {n['tokens']} tokens, "
        f"G = {G} images per GPU, K = {args.train_diff_steps}, S = {train.grpo_settings(args).mte_trajectories}, "
        f"T = {args.num_sampling_steps} (the figures do not depend on T)")
    memory.return_freed_memory()
    g, points = opts.memory_images, [(t, opts.memory_images) for t in opts.memory_tokens]
    points += [(min(opts.memory_tokens), 2 * g)] if len(opts.memory_tokens) > 1 else []  # what grows with the images
    measured = {}
    for kind in opts.memory_policies:
        for tokens, images in points:
            t0 = time.time()
            repeats = opts.memory_repeats if (kind, tokens, images) == ("full", max(opts.memory_tokens), g) else 0
            measured[kind, tokens, images] = m = memory.measure(args, math.isqrt(tokens), images, kind, rank, repeats=repeats,
                                                                dtypes=opts.memory_dtypes)
            for variant, figures in m.items():
                out(f"  measured, {kind} policy, {tokens} tokens, {images} images, {variant_name(*variant)}: " +
                    ", ".join(f"{k} {v / GiB:.3f} GiB" for k, v in figures.items() if k != "seconds") +
                    f"; the two AR steps {figures['seconds']:.1f} s")
            out(f"  ({time.time() - t0:.0f} s)")
    fit = {(kind, variant): {key: at_preset({(t, i): m[variant][key] for (k, t, i), m in measured.items() if k == kind},
                                            n["tokens"], G) for key in ("rollout", "held", "step", "record_step")}
           for kind in opts.memory_policies for variant in variants}
    table = {}
    for mode in ("DDP", "FSDP", "LoRA"):
        kind = "lora" if mode == "LoRA" else "full"
        for variant in variants:
            act = fit.get((kind, variant)) or {key: (v, "~") for key, (v, _) in fit["full", variant].items()}  # the full policy's
            label = {"DDP": "DDP", "FSDP": f"FSDP over {world}", "LoRA": f"LoRA rank {rank}"}[mode]
            table[f"{label}, {variant_name(*variant)}"] = row_cells(args, n, extra, act, mode, world)
    cols = list(next(iter(table.values())))
    out("\n| GiB per GPU | " + " | ".join(cols) + " |\n" + "|---" * (len(cols) + 1) + "|")
    for name, cells in table.items():
        out(f"| {name} | " + " | ".join(f"{v / GiB:.2f} {m}" for v, m in cells.values()) + " |")
    held = [name for name, k in (("the KL-16 VAE", extra["vae"]), ("the reward, HPS v2.1", extra["reward"])) if k]
    out("c counted, m measured, ~ modelled (memory_table.py); VAE + reward: " + (" and ".join(held) or "none")
        + ("" if extra["vae"] else " (NOVA's own VAE, in its pipeline, is not counted)"))
    # the totals side by side, and the checkpointed step's time over the plain one's, measured in this run
    heads = [variant_name(*v) for v in variants]
    out("\n| total GiB per GPU | " + " | ".join(heads) + " |\n" + "|---" * (len(heads) + 1) + "|")
    for label in dict.fromkeys(name.split(", ")[0] for name in table):
        out(f"| {label} | " + " | ".join(f"{table[f'{label}, {h}']['total'][0] / GiB:.1f} ~" for h in heads) + " |")
    largest = measured["full", max(opts.memory_tokens), g]
    ratio = {dtype: largest[dtype, True]["seconds"] / largest[dtype, False]["seconds"] for dtype in opts.memory_dtypes}
    out(f"time of the two trained AR steps' forward and backward, checkpointed / plain (full policy, "
        f"{max(opts.memory_tokens)} tokens, {g} images, medians of {opts.memory_repeats} interleaved rounds in this run): " +
        ", ".join(f"{dtype} {r:.2f}×" for dtype, r in ratio.items()))
    return dict(counts=n, extra=extra, time_ratio=ratio,
                measured={f"{k} {t} {i} {variant_name(*v)}": f for (k, t, i), m in measured.items() for v, f in m.items()},
                table={name: {k: [v, m] for k, (v, m) in cells.items()} for name, cells in table.items()})
