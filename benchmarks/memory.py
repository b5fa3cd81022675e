"""Memory of a GRPO step, measured: what a rollout record holds, the activations autograd saves,
the diffusion head's share of a trained AR step (`python -m benchmarks.bench --sections head_memory
--preset harmon`), with and without recomputing each diffusion step's head call in the backward
pass (rollout.transition_mean), and what one GPU holds at a preset's released settings under DDP,
FSDP and LoRA (`python -m benchmarks.bench --memory PRESET`, `bench_memory`; docs/memory.md).

How `bench_memory` gets each figure (every figure of its table is marked c, m or ~):
  c  counted: parameters (of the released architecture, built on the meta device) × 4 bytes (fp32
     weights and gradients; AdamW keeps two fp32 moments, 8 bytes).
  m  measured: the peak resident memory of this process (Linux VmHWM, reset before each stage; glibc
     told to return every freed block over 64 KiB) above what it held before the stage, on the CPU in
     fp32 with random weights, at the preset's sizes; the record and MTE's trajectories that the
     rollout leaves for the update: the bytes of their tensors.
  ~  modelled from measured figures: the activations measured at two image sizes (--memory-tokens)
     and g images (--memory-images), fitted linearly in the tokens (the CPU attention saves no
     tokens × tokens tensor) and scaled × G / g; or the same figure of another policy.
Activations are measured over a rollout of two AR steps, both recorded: every token unknown at the
first (the head's largest work), all but one known at the second (the transformer's longest input):
the extremes of the preset's 64. Under bf16 autocast on a GPU the transformer's activations are
about half the fp32 figures.
"""

import ctypes
import dataclasses
import json
import math
import os
import re
import time

import open_clip
import torch

import diffloss
import grpo
import mar
import masks
import mte
import rollout
from diffloss import DiffLoss
from infra import flags, lora
from models import loading


def nbytes(obj, seen=None):
    """Bytes held by the tensors of a (nested) record, each storage once (steps share canvases)."""
    seen = set() if seen is None else seen
    if torch.is_tensor(obj):
        storage = obj.untyped_storage()
        new = storage.data_ptr() not in seen
        seen.add(storage.data_ptr())
        return storage.nbytes() if new else 0
    if dataclasses.is_dataclass(obj):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    obj = list(obj.values()) if isinstance(obj, dict) else obj
    return sum(nbytes(v, seen) for v in obj) if isinstance(obj, (list, tuple)) else 0


def saved_activation_bytes(fn, params=()):
    """Run fn() and return (bytes of the distinct storages autograd saved for backward, parameters
    excluded, fn's result)."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def bench_head_memory(args, opts, out):
    """The head's part of one trained AR step (rollout.transition_mean of the rollout trajectory, K
    diffusion steps over 2n guided rows, and of the MTE trajectories, S × K steps over the uncertain rows),
    random weights at the preset's head size, measured at --head-rows unknown tokens and scaled
    linearly (saved bytes are proportional to rows) to AR step 0 of the preset: every token unknown,
    G images a process."""
    if args.model == "harmon":
        config = loading.harmon_config(args)
        c, p = config["mar"], config["mar"].get("patch_size", 1)
        h, w = config.get("image_shape") or [c["img_size"] // c["vae_stride"] // p] * 2  # the released: 32 × 32 at 512 px
        C, D, depth, width, L = c["vae_embed_dim"] * p ** 2, c["decoder_embed_dim"], c["diffloss_d"], c["diffloss_w"], h * w
    elif args.model.startswith("mar_"):
        ref = getattr(mar, args.model)(**mar.OFFICIAL_HEADS[args.model], img_size=args.img_size)
        C, D, L = ref.token_embed_dim, ref.decoder_embed.out_features, ref.seq_len
        depth, width = len(ref.diffloss.net.res_blocks), ref.diffloss.net.model_channels
        del ref
    else:
        raise ValueError(f"head_memory: --preset {opts.preset} (--model {args.model}): measured for harmon and mar_* presets")
    settings = flags.grpo_settings(args)
    K, S, R = args.train_diff_steps, settings.mte_trajectories, opts.head_rows
    U = max(1, round(settings.top_k * R))  # uncertain rows among them
    scale = L * args.group_size / R
    torch.manual_seed(0)
    head = DiffLoss(C, D, depth, width, args.num_sampling_steps).requires_grad_(False)
    steps = list(range(1, K + 1))
    x_t, x_traj = torch.randn(K, R, C), torch.randn(K, S, U, C)
    z = torch.randn(R, D, requires_grad=True)
    out(f"head {depth} × {width} (token {C}, z {D}), T = {args.num_sampling_steps}, K = {K} trained diffusion steps, "
        f"S = {S}, guidance {args.cfg}; measured at {R} unknown tokens ({U} uncertain), scaled ×{scale:.0f} to "
        f"{L} tokens × G = {args.group_size} images (AR step 0 of the preset)")

    zs = z[:U].expand(S, U, D)

    def step_head(store, k=K, parts=("rollout", "trajectories")):  # as grpo.ar_step_loss calls the head
        loss = diffloss.transition_mean(head, x_t[:k], steps[:k], z, z, args.cfg, store).sum() if "rollout" in parts else 0
        if S and "trajectories" in parts:
            loss = loss + diffloss.transition_mean(head, x_traj[:k], steps[:k], zs, zs, args.cfg, store).sum()
        return loss
    res = {}
    for store in (False, True):
        t0 = time.perf_counter()
        saved, loss = saved_activation_bytes(lambda: step_head(store), head.parameters())
        loss.backward()
        res[store] = dict(saved=saved, seconds=time.perf_counter() - t0)
        del loss
    # the backward pass recomputes one diffusion step's head call at a time: the larger of the two
    one = max(saved_activation_bytes(lambda: step_head(False, 1, (part,)), head.parameters())[0] for part in ("rollout", "trajectories"))
    peak_after = res[True]["saved"] + one
    gb = lambda b: f"{b * scale / 2 ** 30:.1f} GB"
    out(f"  saved by the forward pass, all K{' and S × K' if S else ''} head graphs (no recomputation): {gb(res[False]['saved'])}")
    out(f"  recomputed per diffusion step: {gb(res[True]['saved'])} saved + {gb(one)} while one step is recomputed = "
        f"{gb(peak_after)} at the peak ({res[False]['saved'] / peak_after:.1f}× less)")
    out(f"  time, forward + backward of the head: recomputed / kept {res[True]['seconds'] / res[False]['seconds']:.2f}×")
    return dict(rows=R, scale=scale, before=res[False]["saved"] * scale, after=peak_after * scale,
                time_ratio=res[True]["seconds"] / res[False]["seconds"])


# -----------------------------------------------------------------------------
# What one GPU holds at a preset (`python -m benchmarks.bench --memory PRESET`)

# the released models' state-dict listings (recorded data the tests pin)
FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures")


def nova_512():
    """The nova preset's transformer: the released d48w1024 NOVA (the sdxl1024 release's constructor in
    fixtures/nova_state_dict.json, 645.7M parameters) on the 32 × 32 token grid of 512 px (video grid
    16 × 16, as nova-d48w1024-sd512 samples), with a flow-matching head."""
    with open(os.path.join(FIXTURES, "nova_state_dict.json")) as f:
        t = dict(json.load(f)["nova_d48w1024_sdxl1024"]["constructor"])
    t.update(image_size=[512, 512], image_base_size=[32, 32], video_base_size=[1, 16, 16])
    return {"transformer": t, "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0}}


def build(args, side=None):
    """The preset's model (random weights, the released architecture) on a side × side token grid
    (default: the preset's), on the current default device (the meta device: shapes only)."""
    T = args.num_sampling_steps
    if args.model.startswith("mar_"):
        img = side * 16 if side else args.img_size  # KL-16 latents, 1 × 1 patches
        return getattr(mar, args.model)(**mar.OFFICIAL_HEADS[args.model], img_size=img, num_sampling_steps=str(T))
    if args.model == "harmon":
        config = dict(loading.harmon_config(args))
        config["mar"] = dict(config["mar"], num_sampling_steps=str(T))
        return loading.adapter("harmon").build({**config, **({"image_shape": [side, side]} if side else {})})
    if args.model == "nova":
        config = nova_512()
        if side:
            config["transformer"]["image_base_size"] = [side, side]
        return loading.adapter("nova").build(dict(config, num_diffusion_steps=T))
    raise ValueError(f"--memory: --model {args.model}: the table is for mar_*, harmon and nova presets")


def counts(args, rank):
    """Parameter counts of the preset's model, from shapes: all, trained (loading.trainable_names, the
    method's), the head, LoRA adapters of rank R, FSDP's largest block unit and its root unit."""
    with torch.device("meta"):
        model = build(args)
    own = dict(model.named_parameters())
    trained = loading.trainable_names(args, model, flags.grpo_settings(args).train_head, args.cfg != 1.0)
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
    with open(os.path.join(FIXTURES, "kl16_vae_state_dict.json")) as f:
        vae = sum(math.prod(shape) for shape in json.load(f)["state_dict"].values())
    with torch.device("meta"):
        reward = sum(p.numel() for p in open_clip.model.CLIP(**open_clip.get_model_config("ViT-H-14")).parameters())
    return dict(vae=None if args.model == "nova" else vae, reward=reward if "hpsv2" in args.reward else 0)


def proc_status(key, pid="self"):
    """A figure of /proc/PID/status (Linux: VmRSS, VmHWM, ...), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def reset_peak(pid="self"):
    """Set the process's VmHWM to its current resident memory (Linux: /proc/PID/clear_refs)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


class PeakRSS:
    """`with PeakRSS() as m:` m.peak: the peak resident memory of this process above its resident
    memory at entry, in bytes (Linux: VmHWM, reset through /proc/self/clear_refs)."""

    def __enter__(self):
        reset_peak()
        self.start = proc_status("VmRSS")
        return self

    def __exit__(self, *exc):
        self.peak = proc_status("VmHWM") - self.start


def return_freed_memory():
    """glibc: every block over 64 KiB mapped on its own and returned when freed (M_MMAP_THRESHOLD,
    M_TRIM_THRESHOLD), so the resident memory follows the live tensors."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)
    libc.mallopt(-1, 64 * 1024)


def condition_inputs(args, model, G):
    """Condition inputs for G images: class labels (MAR), 32 prompt token ids (Harmon, whose null
    prompt is set to 16 ids) or 32 Phi-2 prompt embeddings (NOVA)."""
    g = torch.Generator().manual_seed(0)
    if args.model.startswith("mar_"):
        return dict(labels=torch.arange(G) % model.num_classes)
    if args.model == "harmon":
        vocab = model.llm.config.vocab_size
        model.set_null_prompt(torch.randint(1, vocab, (16,), generator=g), 0)
        return dict(input_ids=torch.randint(1, vocab, (G, 32), generator=g), attention_mask=torch.ones(G, 32, dtype=torch.bool))
    return dict(prompt_embeds=torch.randn(G, 32, model.text_embed.proj.in_features, generator=g))


def measure(args, side, G, kind, rank):
    """Peak activations of the preset's step on a side × side grid with G images, policy `kind` ("full":
    the method's trained set, "lora": adapters of rank R): dict(rollout: peak of the rollout and MTE,
    held: the bytes of what they leave for the update (the record, MTE's trajectories and mask),
    step: the larger peak of the two trained AR steps' forward and backward, record_step: bytes of
    the first step's record), in bytes."""
    torch.manual_seed(0)
    base = build(args, side).eval().requires_grad_(False)
    inputs = condition_inputs(args, base, G)
    settings = flags.grpo_settings(args)
    model = lora.policy(base, lora.spec(base, rank)) if kind == "lora" else loading.make_policy(args, base, settings)
    model.ar_schedule = lambda num_iter, seq_len: [seq_len - 1, 1]  # the two extremes (module docstring)
    for p in model.parameters():  # gradients are counted apart: the peaks below hold activations only
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    plan = rollout.RolloutPlan(ar_steps=[0, 1], diff_steps=list(model.diffloss.trainable_steps())[:args.train_diff_steps])
    gen = torch.Generator().manual_seed(0)
    with PeakRSS() as collect:
        _, record = rollout.record_rollout(model, inputs, 2, args.cfg, args.cfg_schedule, args.temperature, plan, gen)
        traj = uncertain = None
        if settings.mte_trajectories >= 2:
            traj = mte.sample_trajectories(model.diffloss, record.z_final, record.z_final_null, record.cfg_final,
                                            args.temperature, settings.mte_trajectories, plan.diff_steps, gen)
            uncertain = masks.top_k_mask(masks.token_uncertainty(traj["x0"]), settings.top_k)
    adv = torch.randn(G, generator=gen)  # any advantages: the memory does not depend on them
    steps = []
    for j in range(2):
        with PeakRSS() as step:
            loss, _, _ = grpo.ar_step_loss(model, base, record, j, inputs, adv, settings, traj, uncertain)
            (loss / 2).backward()
            del loss
        steps.append(step.peak)
    held = nbytes(dict(record=record, trajectories=traj, uncertain=uncertain))  # the tensors' bytes: exact, where RSS is noisy
    return dict(rollout=collect.peak, held=held, step=max(steps), record_step=nbytes(record.steps[0]))


def squares(text):
    """An argparse type (bench.py --memory-tokens): comma-separated square numbers of tokens."""
    values = [int(v) for v in text.split(",")]
    if any(v < 1 or math.isqrt(v) ** 2 != v for v in values):
        raise ValueError(f"{text}: not square numbers of tokens")
    return values


def at_preset(points, tokens, G):
    """A measured figure at the preset's tokens and G, from {(tokens_i, g): value}: the value itself
    when measured there, else the line through two token counts at g images, × G / g. (value, mark)."""
    (t1, g), v1 = min(points.items())
    (t2, _), v2 = max(points.items())
    if (t2, g) == (tokens, G):
        return v2, "m"
    slope = (v2 - v1) / (t2 - t1) if t2 != t1 else 0.0
    return (v1 + slope * (tokens - t1)) * G / g, "~"


def bench_memory(args, opts, out):
    """The table of `python -m benchmarks.bench --memory PRESET` (module docstring): per GPU, under DDP, FSDP over
    --world ranks and LoRA of rank --lora (32 when not given)."""
    rank, world, G = args.lora or 32, opts.world, args.group_size
    n, extra = counts(args, rank), frozen_extras(args)
    out(f"{n['name']} of --preset {opts.preset}: {n['all'] / 1e6:,.1f}M parameters, {n['trained'] / 1e6:,.1f}M trained "
        f"({args.method}), head {n['head'] / 1e6:,.1f}M, LoRA of rank {rank} {n['lora'] / 1e6:,.2f}M; {n['tokens']} tokens, "
        f"G = {G} images per GPU, K = {args.train_diff_steps}, S = {flags.grpo_settings(args).mte_trajectories}, "
        f"T = {args.num_sampling_steps} (the figures do not depend on T)")
    return_freed_memory()
    sides = [int(math.isqrt(t)) for t in opts.memory_tokens]
    measured = {}
    for kind in opts.memory_policies:
        for side in sides:
            t0 = time.time()
            measured[(kind, side * side)] = m = measure(args, side, opts.memory_images, kind, rank)
            out(f"  measured, {kind} policy, {side * side} tokens, {opts.memory_images} images: " +
                ", ".join(f"{k} {v / 2 ** 30:.3f} GiB" for k, v in m.items()) + f" ({time.time() - t0:.0f} s)")
    fit = {kind: {key: at_preset({(t, opts.memory_images): m[key] for (k, t), m in measured.items() if k == kind},
                                 n["tokens"], G) for key in ("rollout", "held", "step", "record_step")}
           for kind in opts.memory_policies}
    B = 4  # bytes per fp32 number
    rows = {"DDP": dict(weights=n["all"], gradients=n["trained"], AdamW=2 * n["trained"], reference=n["trained"]),
            f"FSDP over {world}": dict(weights=n["all"] - n["trained"] + n["trained"] / world, gradients=n["trained"] / world,
                                       AdamW=2 * n["trained"] / world, reference=n["trained"]),
            f"LoRA rank {rank}": dict(weights=n["all"] + n["lora"], gradients=n["lora"], AdamW=2 * n["lora"], reference=0)}
    table = {}
    for name, row in rows.items():
        kind = "lora" if name.startswith("LoRA") else "full"
        act = fit.get(kind) or {key: (v, "~") for key, (v, _) in next(iter(fit.values())).items()}  # the other policy's
        cells = {k: (v * B, "c") for k, v in row.items()}
        cells["VAE + reward"] = ((extra["vae"] or 0) + extra["reward"]) * B, "c"
        # the record the update reads: the measured one (2 recorded AR steps) and, at most, one more step of
        # every token unknown for each further trained AR step; MTE's trajectories are in it
        more = (args.train_ar_steps - 2) * act["record_step"][0]
        cells["record + MTE"] = act["held"][0] + more, "~" if more else act["held"][1]
        cells["rollout peak"] = act["rollout"][0] - act["held"][0], act["rollout"][1]  # beyond the record it leaves
        cells["AR step peak"] = act["step"]
        if name.startswith("FSDP"):  # + the unit being computed and the next one, whole, and one unreduced gradient
            cells["AR step peak"] = act["step"][0] + (3 * n["block"] + 2 * n["root"]) * B, "~"
        static = sum(v for k, (v, _) in cells.items() if k not in ("rollout peak", "AR step peak"))
        cells["total"] = static + max(cells["rollout peak"][0], cells["AR step peak"][0]), "~"
        table[name] = cells
    cols = list(next(iter(table.values())))
    out("\n| bytes per GPU (GiB) | " + " | ".join(cols) + " |\n" + "|---" * (len(cols) + 1) + "|")
    for name, cells in table.items():
        out(f"| {name} | " + " | ".join(f"{v / 2 ** 30:.2f} {m}" for v, m in cells.values()) + " |")
    held = [name for name, n in (("the KL-16 VAE", extra["vae"]), ("the reward, HPS v2.1", extra["reward"])) if n]
    out("c counted, m measured, ~ modelled (memory.py); VAE + reward: " + (" and ".join(held) or "none")
        + ("" if extra["vae"] else " (NOVA's own VAE, in its pipeline, is not counted)"))
    return dict(counts=n, extra=extra, measured={f"{k} {t}": m for (k, t), m in measured.items()},
                table={name: {k: [v, m] for k, (v, m) in cells.items()} for name, cells in table.items()})
