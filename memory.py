"""Memory of a GRPO step, measured: what a rollout record holds, the activations autograd saves,
and the diffusion head's share of a trained AR step (`python bench.py --sections head_memory
--preset harmon`), with and without recomputing each diffusion step's head call in the backward
pass (rollout.transition_mean)."""

import dataclasses
import time

import torch

import flags
import mar
import models
import rollout
from diffloss import DiffLoss


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
    diffusion steps over 2n guided rows, and of the MTE seeds, S × K steps over the uncertain rows),
    random weights at the preset's head size, measured at --head-rows unknown tokens and scaled
    linearly (saved bytes are proportional to rows) to AR step 0 of the preset: every token unknown,
    G images a process."""
    if args.model == "harmon":
        config = models.harmon_config(args)
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
    K, S, R = args.train_diff_steps, settings.mte_seeds, opts.head_rows
    U = max(1, round(settings.top_k * R))  # uncertain rows among them
    scale = L * args.group_size / R
    torch.manual_seed(0)
    head = DiffLoss(C, D, depth, width, args.num_sampling_steps).requires_grad_(False)
    steps = list(range(1, K + 1))
    x_t, x_seeds = torch.randn(K, R, C), torch.randn(K, S, U, C)
    z = torch.randn(R, D, requires_grad=True)
    out(f"head {depth} × {width} (token {C}, z {D}), T = {args.num_sampling_steps}, K = {K} trained diffusion steps, "
        f"S = {S}, guidance {args.cfg}; measured at {R} unknown tokens ({U} uncertain), scaled ×{scale:.0f} to "
        f"{L} tokens × G = {args.group_size} images (AR step 0 of the preset)")

    zs = z[:U].expand(S, U, D)

    def step_head(store, k=K, parts=("rollout", "seeds")):  # as policy.rollout_loss calls the head
        loss = rollout.transition_mean(head, x_t[:k], steps[:k], z, z, args.cfg, store).sum() if "rollout" in parts else 0
        if S and "seeds" in parts:
            loss = loss + rollout.transition_mean(head, x_seeds[:k], steps[:k], zs, zs, args.cfg, store).sum()
        return loss
    res = {}
    for store in (False, True):
        t0 = time.perf_counter()
        saved, loss = saved_activation_bytes(lambda: step_head(store), head.parameters())
        loss.backward()
        res[store] = dict(saved=saved, seconds=time.perf_counter() - t0)
        del loss
    # the backward pass recomputes one diffusion step's head call at a time: the larger of the two
    one = max(saved_activation_bytes(lambda: step_head(False, 1, (part,)), head.parameters())[0] for part in ("rollout", "seeds"))
    peak_after = res[True]["saved"] + one
    gb = lambda b: f"{b * scale / 2 ** 30:.1f} GB"
    out(f"  saved by the forward pass, all K{' and S × K' if S else ''} head graphs (no recomputation): {gb(res[False]['saved'])}")
    out(f"  recomputed per diffusion step: {gb(res[True]['saved'])} saved + {gb(one)} while one step is recomputed = "
        f"{gb(peak_after)} at the peak ({res[False]['saved'] / peak_after:.1f}× less)")
    out(f"  time, forward + backward of the head: recomputed / kept {res[True]['seconds'] / res[False]['seconds']:.2f}×")
    return dict(rows=R, scale=scale, before=res[False]["saved"] * scale, after=peak_after * scale,
                time_ratio=res[True]["seconds"] / res[False]["seconds"])
