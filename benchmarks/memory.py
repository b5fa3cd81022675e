"""Memory of a GRPO step, measured: what a rollout record holds, the activations autograd saves,
the diffusion head's share of a trained AR step (`python -m benchmarks.bench --sections head_memory
--preset harmon`), with and without recomputing each diffusion step's head call in the backward
pass (rollout.transition_mean), and the peak activations of a preset's rollout and trained AR steps
at a given size (`measure`), from which memory_table.py models what one GPU holds
(`python -m benchmarks.bench --memory PRESET`; docs/memory.md).

`measure` runs as train.py does: the rollout and each trained AR step's forward under the run's
autocast (fp32: none; bf16: torch.autocast to bfloat16, --precision bf16, CUDA's default; the
weights stay fp32 and the head runs in fp32 under it), the backward outside it, with and without
--grad-checkpointing. Its peaks: on the CPU the peak resident memory of this process (Linux
VmHWM, reset before each stage; glibc told to return every freed block over 64 KiB) above what it
held before the stage; on a GPU the peak of torch's allocator above what it held before. The
rollout runs two AR steps, both recorded: every token unknown at the first (the head's largest
work), all but one known at the second (the transformer's longest input): the extremes of a
preset's 64.
"""

import ctypes
import dataclasses
import json
import os
import statistics
import time

import torch

import diffloss
import grpo
import mar
import mte
import rollout
import train
from diffloss import DiffLoss
from infra import lora, processes
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
    settings = train.grpo_settings(args)
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
# A preset's step, measured at a given size

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
        self.peak = max(0, proc_status("VmHWM") - self.start)


class PeakCUDA:
    """`with PeakCUDA(device) as m:` m.peak: the peak of torch's CUDA allocator on `device` above what it
    held at entry, in bytes (the device's queued work finished at entry and at exit)."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.start = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize(self.device)
        self.peak = torch.cuda.max_memory_allocated(self.device) - self.start


def peak_meter(device):
    """PeakCUDA on a GPU, PeakRSS on the CPU."""
    return PeakCUDA(device) if device.type == "cuda" else PeakRSS()


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


# the dtypes a run computes in (--precision): fp32 (the CPU's default) and bf16 autocast (CUDA's)
DTYPES = ("fp32", "bf16")
VARIANTS = [(dtype, ckpt) for dtype in DTYPES for ckpt in (False, True)]  # × plain / --grad-checkpointing


def autocast(dtype, device):
    """The forward passes' autocast of a run in `dtype` on `device` (processes.autocast, as
    processes.Ctx.autocast): none for fp32, bfloat16 for bf16."""
    return processes.autocast(dtype, device)()


def measure(args, side, G, kind, rank, device=torch.device("cpu"), base=None, repeats=0, dtypes=DTYPES):
    """Peak activations of the preset's step on a side × side grid with G images, policy `kind` ("full":
    the method's trained set, "lora": adapters of rank R), for each dtype of `dtypes` plain and checkpointed:
    dict(rollout: peak of the rollout and MTE, held: the bytes of what they leave for the update (the
    record, MTE's trajectories and mask), step: the larger peak of the two trained AR steps' forward and
    backward, record_step: bytes of the first step's record (bytes), seconds: the two steps' forward and
    backward; with `repeats`, the median of that many further rounds, plain and checkpointed taking turns,
    so that load from other work hits both alike). base: the preset's model on `device` at that size
    (default: built here, on the CPU, moved)."""
    torch.manual_seed(0)
    base = (build(args, side).to(device) if base is None else base).eval().requires_grad_(False)
    inputs = {k: v.to(device) for k, v in condition_inputs(args, base, G).items()}
    settings = train.grpo_settings(args)
    model = lora.policy(base, lora.spec(base, rank)) if kind == "lora" else loading.make_policy(args, base, settings)
    model.ar_schedule = lambda num_iter, seq_len: [seq_len - 1, 1]  # the two extremes (module docstring)
    for p in model.parameters():  # gradients are counted apart: each is dropped once accumulated, so the
        if p.requires_grad:       # peaks below hold activations (and one parameter's gradient at a time)
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    plan = rollout.RolloutPlan(ar_steps=[0, 1], diff_steps=list(model.diffloss.trainable_steps())[:args.train_diff_steps])
    out = {}
    for dtype in dtypes:
        gen = torch.Generator(device).manual_seed(0)
        with peak_meter(device) as collect:  # as train.grpo_train: the rollout under the run's autocast, MTE in fp32
            with autocast(dtype, device):
                _, record = rollout.record_rollout(model, inputs, 2, args.cfg, args.cfg_schedule, args.temperature, plan, gen)
            traj = None
            if settings.mte_trajectories >= 2:
                traj = mte.sample_trajectories(model.diffloss, record.z_final, record.z_final_null, record.cfg_final,
                                                args.temperature, settings.mte_trajectories, plan.diff_steps, gen)
        adv = torch.randn(G, generator=gen, device=device)  # any advantages: the memory does not depend on them
        held = nbytes(dict(record=record, trajectories=traj))  # exact, where RSS is noisy

        def steps():  # as train.backward_batch: the forward under autocast, the backward outside it; peaks, seconds
            peaks, t0 = [], time.perf_counter()
            for j in range(2):
                with peak_meter(device) as step:
                    with autocast(dtype, device):
                        loss, _, _ = grpo.ar_step_loss(model, base, record, j, inputs, adv, settings, traj)
                    (loss / 2).backward()
                    del loss
                peaks.append(step.peak)
            return max(peaks), time.perf_counter() - t0
        for ckpt in (False, True):
            model.grad_checkpointing = ckpt
            peak, seconds = steps()
            out[dtype, ckpt] = dict(rollout=collect.peak, held=held, step=peak, record_step=nbytes(record.steps[0]),
                                    seconds=seconds)
        times = {False: [], True: []}
        for r in range(repeats):
            for ckpt in (False, True)[::1 if r % 2 == 0 else -1]:  # the order alternates: drift cancels
                model.grad_checkpointing = ckpt
                times[ckpt].append(steps()[1])
        for ckpt in (False, True) if repeats else ():
            out[dtype, ckpt]["seconds"] = statistics.median(times[ckpt])
        record = traj = None  # freed before the next dtype's rollout
    return out
