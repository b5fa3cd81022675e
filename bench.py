"""Performance figures, as ratios measured in one run (absolute times on shared machines are noise).

    python bench.py                       # every section at the demo config (CPU: a few minutes)
    python bench.py --sections step,record
    python bench.py --mar-base            # add the mar_base (256 px) figures (CPU: minutes)
    python bench.py --official-dir DIR    # side by side with a local checkout of LTH14/mar
    python bench.py --study [--study-seeds 3]   # the controlled study (runs train.py many times)
    python bench.py --context-probe runs/demo/base.pt   # does a base model use the canvas?

Sections:
  sample   sample_tokens tokens/s and images/s
  record   rollout recording overhead (with / without a RolloutPlan) and record bytes per image
  step     MAR-GRPO step time / fixed-head GRPO step time (S = 3, k = 30%), and the parts of a step
  reward   the shapes verifier's images/s at 32 and 64 px (its share of a step: see step)
  flops    achieved FLOP/s of the update's transformer forward+backward / FLOP/s of a large matmul
  scaling  step time and record+MTE memory as S, G and the number of tokens grow
Everything is timed as the median of repeats after a warm-up, in one process.
"""

import argparse
import copy
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

import diffloss
import grpo
import mar
import masks
import mte
import policy
import rewards
import shapes
import train


def timed(fn, repeats=3, warmup=1):
    """Median wall time of fn() over `repeats` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def nbytes(obj):
    """Bytes held by the tensors of a (nested) record."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


def demo_model(args):
    """The demo's MAR (random weights: speed does not depend on their values)."""
    torch.manual_seed(0)
    return mar.build_mar(train.small_mar_config(args)).eval()


def demo_batch(args, model, n_prompts, G, seed=0):
    items = shapes.sample_prompts(n_prompts, np.random.default_rng(seed))
    items = [it for it in items for _ in range(G)]
    return items, dict(prompt_ids=torch.from_numpy(shapes.tokenize([m["prompt"] for m in items])))


def plan_for(args, num_ar=None, num_diff=None, seed=0):
    ar, diff = grpo.choose_train_steps(args.num_iter, num_ar or args.train_ar_steps,
                                       diffloss.trainable_steps(args.num_sampling_steps),
                                       num_diff or args.train_diff_steps, torch.Generator().manual_seed(seed))
    return mar.RolloutPlan(ar_steps=ar, diff_steps=diff)


# -----------------------------------------------------------------------------

def bench_sample(args, out):
    model = demo_model(args)
    B = args.prompts_per_step * args.group_size
    _, cond = demo_batch(args, model, args.prompts_per_step, args.group_size)
    t = timed(lambda: model.sample_tokens(B, num_iter=args.num_iter, cfg=args.cfg, generator=torch.Generator().manual_seed(0), **cond))
    res = {"demo": dict(images=B, seconds=t, images_per_s=B / t, tokens_per_s=B * model.seq_len / t)}
    out(f"sample_tokens, demo config ({B} images, {model.seq_len} tokens, {args.num_iter} AR × "
        f"{args.num_sampling_steps} diffusion steps, cfg {args.cfg}): {B / t:.1f} images/s, {B * model.seq_len / t:.0f} tokens/s")
    if args.mar_base:
        big = mar.mar_base(**mar.OFFICIAL_HEADS["mar_base"], num_sampling_steps="100").eval()
        t = timed(lambda: big.sample_tokens(1, num_iter=16, cfg=3.0, labels=torch.tensor([207]),
                                            generator=torch.Generator().manual_seed(0)), repeats=1, warmup=0)
        res["mar_base"] = dict(images=1, seconds=t, images_per_s=1 / t, tokens_per_s=256 / t)
        out(f"sample_tokens, mar_base 256 px (1 image, 16 AR × 100 diffusion steps, cfg 3): "
            f"{1 / t:.3f} images/s, {256 / t:.1f} tokens/s")
    if args.official_dir:
        import bench_official
        res["official"] = bench_official.compare_with_official(args.official_dir, out=out)
    return res


def bench_record(args, out):
    model = demo_model(args)
    B = args.prompts_per_step * args.group_size
    _, cond = demo_batch(args, model, args.prompts_per_step, args.group_size)
    plan = plan_for(args)
    kw = dict(num_iter=args.num_iter, cfg=args.cfg, **cond)
    t_plain = timed(lambda: model.sample_tokens(B, generator=torch.Generator().manual_seed(0), **kw))
    t_rec = timed(lambda: model.sample_tokens(B, generator=torch.Generator().manual_seed(0), plan=plan, **kw))
    _, record = model.sample_tokens(B, generator=torch.Generator().manual_seed(0), plan=plan, **kw)
    per_image = nbytes(record) / B
    res = dict(overhead=t_rec / t_plain, record_bytes_per_image=per_image)
    out(f"recording overhead (sample_tokens with / without a plan of {len(plan.ar_steps)} AR × "
        f"{len(plan.diff_steps)} diffusion steps): {t_rec / t_plain:.2f}×; record {per_image / 1024:.1f} KiB per image")
    if args.mar_base:
        big = mar.mar_base(**mar.OFFICIAL_HEADS["mar_base"], num_sampling_steps="100").eval()
        big_plan = mar.RolloutPlan(*grpo.choose_train_steps(64, 12, diffloss.trainable_steps(100), 10,
                                                            torch.Generator().manual_seed(0)))
        # the record's size follows from the schedule alone; one 64-step rollout on CPU takes minutes,
        # so the per-step sizes are computed from shapes, as the record would hold them
        L, C, D, K = big.seq_len, big.token_embed_dim, 768, 10
        unknown, sizes = L, []
        for i in range(64):
            nxt = mar.unknown_after_step(i, 64, L, unknown)
            if i in big_plan.ar_steps:
                sizes.append(4 * K * unknown * C * 4 + 3 * L * C * 4 + 3 * L + unknown * 8)  # traj + canvases + masks
            unknown = nxt
        per = sum(sizes) + 2 * L * D * 4 + L * C * 4 + L * 4  # + z_final (cond, null), final tokens, cfg_final
        res["mar_base_record_bytes_per_image"] = per
        out(f"record bytes per image, mar_base 256 px (64 AR steps, 12 AR × 10 diffusion steps recorded, CFG): "
            f"{per / 2 ** 20:.2f} MiB (from the record's shapes)")
    return res


class StepRunner:
    """One GRPO step of train.py's loop, stage by stage, for timing."""

    def __init__(self, args, method, G=None, n_prompts=None, seeds=None, img_size=None):
        self.args = copy.copy(args)
        if img_size:
            self.args.img_size = img_size
        self.model = demo_model(self.args)
        self.ref = copy.deepcopy(self.model).requires_grad_(False)
        self.cfg = grpo.GRPOConfig(**grpo.PRESETS[method])
        if seeds is not None:
            self.cfg.mte_seeds = seeds
        self.model.diffloss.requires_grad_(self.cfg.train_head)
        self.model.class_emb.requires_grad_(False)
        self.G = G or args.group_size
        self.items, self.cond = demo_batch(self.args, self.model, n_prompts or args.prompts_per_step, self.G)
        self.reward = rewards.build_reward("shapes")
        self.codec = mar.PixelCodec()
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-6)
        self.loss = train.PolicyLoss(self.model)
        self.times = {}

    def __call__(self):
        a, B = self.args, len(self.items)
        t0 = time.perf_counter()
        latents, record = self.model.sample_tokens(B, num_iter=a.num_iter, cfg=a.cfg, generator=torch.Generator().manual_seed(0),
                                                   plan=plan_for(a), **self.cond)
        images = self.codec.decode(latents)
        t1 = time.perf_counter()
        scores, _ = self.reward(images, [m["prompt"] for m in self.items], self.items)
        adv = grpo.group_advantages(scores + 1e-3 * torch.arange(B), self.G)  # never an all-zero batch
        t2 = time.perf_counter()
        seeds = uncertain = None
        if self.cfg.mte_seeds >= 2:
            seeds = mte.sample_trajectories(self.model.diffloss, record["z_final"], record.get("z_final_null"),
                                            record["cfg_final"], 1.0, self.cfg.mte_seeds, record["steps"][0]["diff_steps"],
                                            torch.Generator().manual_seed(1))
            uncertain = masks.top_k_mask(masks.token_uncertainty(seeds["x0"]), self.cfg.top_k)
        t3 = time.perf_counter()
        train.backward_rollout(self.loss, False, self.ref, record, self.cond, adv, self.cfg, seeds, uncertain,
                               [None] * len(record["steps"]))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        for k, v in dict(rollout=t1 - t0, reward=t2 - t1, mte=t3 - t2, update=t4 - t3, total=t4 - t0).items():
            self.times.setdefault(k, []).append(v)
        self.bytes = nbytes(record) + nbytes(seeds)

    def median(self, key):
        return statistics.median(self.times[key][1:] or self.times[key])  # drop the warm-up


def bench_step(args, out):
    runs = {m: StepRunner(args, m) for m in ("grpo-fixed-head", "mar-grpo")}
    for _ in range(args.repeats + 1):  # interleaved, so that machine noise hits both alike
        for r in runs.values():
            r()
    fixed, full = runs["grpo-fixed-head"], runs["mar-grpo"]
    ratio = full.median("total") / fixed.median("total")
    parts = {k: full.median(k) / full.median("total") for k in ("rollout", "reward", "mte", "update")}
    out(f"MAR-GRPO step / fixed-head GRPO step (S = 3, k = 30%, demo config, {len(fixed.items)} images): {ratio:.2f}×")
    out("  share of a MAR-GRPO step: " + ", ".join(f"{k} {v:.0%}" for k, v in parts.items()))
    return dict(ratio=ratio, shares=parts, fixed_s=fixed.median("total"), mar_grpo_s=full.median("total"))


def bench_reward(args, out):
    res = {}
    for size in (32, 64):
        rng = np.random.default_rng(0)
        imgs, metas = shapes.make_dataset(512, size, rng)
        x = torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 255
        t = timed(lambda: shapes.verify_batch(x, metas))
        res[f"verifier_images_per_s_{size}px"] = 512 / t
        out(f"shapes verifier at {size} px: {512 / t:.0f} images/s")
    return res  # the reward's share of a step is part of the step section's breakdown


def bench_flops(args, out):
    from torch.utils.flop_counter import FlopCounterMode
    model = demo_model(args)
    B = args.prompts_per_step * args.group_size
    _, cond = demo_batch(args, model, args.prompts_per_step, args.group_size)
    _, record = model.sample_tokens(B, num_iter=args.num_iter, cfg=args.cfg, generator=torch.Generator().manual_seed(0),
                                    plan=plan_for(args), **cond)
    step = record["steps"][len(record["steps"]) // 2]

    def fwd_bwd():  # the update's transformer pass at one AR step, with CFG: (2B, L) canvas
        z, z_null = policy.recompute_z(model, step, cond, guided=True)
        (z.square().mean() + z_null.square().mean()).backward()
        model.zero_grad(set_to_none=True)

    with FlopCounterMode(display=False) as fc:
        fwd_bwd()
    flops = fc.get_total_flops()
    t = timed(fwd_bwd, repeats=5)
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    t_mm = timed(lambda: a @ b, repeats=5)
    util = (flops / t) / (2 * n ** 3 / t_mm)
    out(f"transformer forward+backward of the update: {flops / t / 1e9:.1f} GFLOP/s = {util:.1%} of a "
        f"{n}² matmul's {2 * n ** 3 / t_mm / 1e9:.1f} GFLOP/s")
    return dict(gflops=flops / t / 1e9, matmul_gflops=2 * n ** 3 / t_mm / 1e9, utilisation=util)


def bench_scaling(args, out):
    rows = []
    base = None
    for name, kw in [("baseline", {}), ("S = 5", dict(seeds=5)), ("S = 8", dict(seeds=8)),
                     ("G × 2", dict(G=2 * args.group_size)), ("tokens × 4 (64 px)", dict(img_size=2 * args.img_size))]:
        r = StepRunner(args, "mar-grpo", **kw)
        for _ in range(2):
            r()
        t = r.median("total")
        base = base or t
        rows.append(dict(name=name, seconds=t, relative=t / base, mib=r.bytes / 2 ** 20))
        out(f"  {name:<20} step {t / base:5.2f}×   record + MTE trajectories {r.bytes / 2 ** 20:7.1f} MiB")
    return rows


# -----------------------------------------------------------------------------
# The controlled study (issue 6): same base, prompts, steps and samples for every arm

STUDY_MAIN = {  # arm -> train.py flags; --study-seeds seeds each
    "grpo": ["--method", "grpo"],
    "grpo-fixed-head": ["--method", "grpo-fixed-head"],
    "mar-grpo": ["--method", "mar-grpo", "--mte-positions", "unknown"],
    "mar-grpo, MTE on P_i": ["--method", "mar-grpo", "--mte-positions", "predicted"],
}
STUDY_ABLATIONS = {  # one seed each; S = 1 is the fixed head with the masks alone
    "MTE alone": ["--method", "grpo-fixed-head", "--mte-seeds", "3", "--mte-positions", "unknown"],
    "MTE on P_i alone": ["--method", "grpo-fixed-head", "--mte-seeds", "3", "--mte-positions", "predicted"],
    "masks alone (S=1, tau 0)": ["--method", "grpo-fixed-head", "--tau", "0"],
    "mar-grpo S=5": ["--method", "mar-grpo", "--mte-seeds", "5", "--mte-positions", "unknown"],
    "mar-grpo k=10%": ["--method", "mar-grpo", "--top-k", "0.1", "--mte-positions", "unknown"],
    "mar-grpo k=60%": ["--method", "mar-grpo", "--top-k", "0.6", "--mte-positions", "unknown"],
    "mar-grpo tau off": ["--method", "mar-grpo", "--tau", "off", "--mte-positions", "unknown"],
}


# the study trains on four fixed training-split prompts, one per category, so that 25 GRPO steps
# on 2 CPU cores separate the arms; held-out evaluation uses the usual stratified held-out set
STUDY_PROMPTS = ["a red square", "a green circle and a yellow square", "three red circles",
                 "a blue square left of a green circle"]


def _coloured(tokens):
    """(..., C) pixel tokens in [-1, 1] -> (...) 1.0 where some pixel is not black (black is -1)."""
    return (tokens > -0.5).any(-1).float()


@torch.no_grad()
def context_probe(model, codec, n_images=128, known_fracs=(0.0, 0.5, 0.9), temperature=0.5, seed=0):
    """Does a pixel-token base model use the canvas? Rendered training-split images with a random
    fraction of their tokens known: the diffusion loss on the unknown tokens (split into tokens
    with some colour and all-black ones), and how often a token sampled there (no CFG) is coloured
    where the image is black or the reverse. A model that reads its neighbours gets better as more
    of the canvas is known; one that has learnt only the prompt's marginal does not.

    Returns {known_frac: {"loss_coloured", "loss_black", "colour_error"}}, "coloured_frac" and "n_images"."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    imgs, metas = shapes.make_dataset(n_images, model.img_size, np.random.default_rng(seed), split="train")
    tokens = model.patchify(codec.encode(torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 255))  # (B, L, C)
    B, L, C = tokens.shape
    flat = tokens.reshape(B * L, C)
    coloured = _coloured(tokens)  # (B, L)
    cond = model.condition(**train.Prompts(model).condition(metas, tokens.device))
    order = torch.argsort(torch.rand(B, L, generator=g), dim=1)  # the same known positions for every fraction

    def loss(z, sel):  # the training loss on the selected positions (B, L), averaged over 10 noise draws
        return float(np.mean([model.diffloss(z=z, target=flat, mask=sel.reshape(B * L), generator=g).item()
                              for _ in range(10)]))

    res = {"coloured_frac": coloured.mean().item(), "n_images": n_images}
    for frac in known_fracs:
        unknown = torch.ones(B, L).scatter_(1, order[:, :int(L * frac)], 0.0)  # (B, L), 1 = unknown
        z = model.predict_z(tokens, unknown, cond).reshape(B * L, -1)  # (B·L, D)
        sampled = model.diffloss.sample(z, temperature=temperature, generator=g).reshape(B, L, C)
        wrong = (_coloured(sampled) != coloured).float()  # (B, L)
        res[frac] = dict(loss_coloured=loss(z, unknown * coloured), loss_black=loss(z, unknown * (1 - coloured)),
                         colour_error=((wrong * unknown).sum() / unknown.sum()).item())
    return res


def run_context_probe(path, args, out):
    model = train.load_policy(args, path)
    if model.config["vae_stride"] != 1 or not train.Prompts(model).text_conditioned:
        raise SystemExit(f"--context-probe {path}: needs a prompt-conditioned pixel-token base (train.py's small model)")
    res = context_probe(model, mar.PixelCodec(), temperature=args.temperature)
    out(f"context probe of {path}: {res['n_images']} training-split images, {res['coloured_frac']:.1%} of tokens coloured")
    out("  known fraction | diffusion loss, coloured / black unknown tokens | colour error of sampled unknown tokens")
    for frac, r in res.items():
        if isinstance(frac, float):
            out(f"  {frac:14.1f} | {r['loss_coloured']:.4f} / {r['loss_black']:.4f} | {r['colour_error']:.3f}")
    return res


def _slug(arm):
    """A folder name for an arm: 'mar-grpo, MTE on P_i' -> 'mar-grpo_MTE_on_P_i'."""
    return re.sub(r"[^A-Za-z0-9.=-]+", "_", arm).strip("_")


def _study_runs(opts):
    runs = [(arm, seed, flags) for arm, flags in STUDY_MAIN.items() for seed in range(opts.study_seeds)]
    if opts.study_arms == "main":
        return runs
    return runs + [(arm, 0, flags) for arm, flags in STUDY_ABLATIONS.items()]


def study(opts, extra):
    """Run every arm (GRPO from one base, then two evaluations: the stratified held-out prompts, and
    the study's four training prompts × 24 images with fixed seeds), two processes at a time with
    one thread each, skipping what is already finished; then write the table, JSON and plot.
    `extra` flags go to every train.py call; --study-train-flags only to the GRPO runs."""
    root = opts.study_out
    extra = ["--preset", opts.preset] + extra
    os.makedirs(root, exist_ok=True)
    prompt_file = os.path.join(root, "prompts.txt")
    with open(prompt_file, "w") as f:
        f.write("\n".join(STUDY_PROMPTS) + "\n")
    train_extra = ["--prompts", prompt_file, "--steps", str(opts.study_steps)] + opts.study_train_flags.split()
    base = os.path.join(root, "base.pt")
    py = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")]
    if not os.path.exists(base):
        subprocess.run(py + ["--stage", "pretrain", "--out", root] + extra, check=True)

    def evals(ckpt, out):  # held-out prompts (stratified), then the study's training prompts, 24 images each
        cmds = []
        if not os.path.exists(os.path.join(out, "eval", "summary.json")):
            cmds.append(py + ["--eval-only", "--init", ckpt, "--out", os.path.join(out, "eval"), "--threads", "1"] + extra)
        if not os.path.exists(os.path.join(out, "eval_train", "summary.json")):
            cmds.append(py + ["--eval-only", "--init", ckpt, "--out", os.path.join(out, "eval_train"), "--threads", "1",
                              "--prompts", prompt_file, "--eval-images-per-prompt", "24"] + extra)
        return cmds

    def shell(cmds):
        return " && ".join(" ".join(shlex.quote(str(c)) for c in cmd) for cmd in cmds)

    jobs = []
    base_cmds = evals(base, os.path.join(root, "base"))
    if base_cmds:
        jobs.append(("base", 0, shell(base_cmds)))
    for arm, seed, flags in _study_runs(opts):
        out = os.path.join(root, _slug(arm), f"seed{seed}")
        cmds = []
        if not os.path.exists(os.path.join(out, "eval", "summary.json")):  # evaluation follows a finished run
            cmds.append(py + ["--stage", "grpo", "--init", base, "--out", out, "--seed", str(seed), "--threads", "1"]
                        + flags + extra + train_extra)
        cmds += evals(os.path.join(out, "ckpt", "latest.pt"), out)
        if cmds:
            jobs.append((arm, seed, shell(cmds)))
    running = []
    while jobs or running:
        while jobs and len(running) < 2:
            arm, seed, cmd = jobs.pop(0)
            print(f"study: {arm} seed {seed}", flush=True)
            log = open(os.path.join(root, f"log_{_slug(arm)}_{seed}.txt"), "w")
            running.append(subprocess.Popen(cmd, shell=True, stdout=log, stderr=subprocess.STDOUT,
                                            env=dict(os.environ, OMP_NUM_THREADS="1")))
        time.sleep(2)
        for p in [p for p in running if p.poll() is not None]:
            if p.returncode:
                print(f"study: a run failed ({p.args[:120]}...)", flush=True)
            running.remove(p)
    return study_report(opts)


def study_report(opts):
    """Aggregate metrics.jsonl and eval summaries into study.json, study.md and study.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    root, table, curves = opts.study_out, {}, {}
    for arm, seed, _ in _study_runs(opts):
        out = os.path.join(root, _slug(arm), f"seed{seed}")
        try:
            rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
            ev = json.load(open(os.path.join(out, "eval", "summary.json")))
            ev_train = json.load(open(os.path.join(out, "eval_train", "summary.json")))
        except (OSError, ValueError):
            continue
        grad = [r["grad_norm"] for r in rows]
        tail, head = rows[-max(1, len(rows) // 5):], rows[:max(1, len(rows) // 5)]
        rec = dict(heldout_acc=ev.get("accuracy", float("nan")), heldout_reward=ev.get("reward_mean", float("nan")),
                   train_acc=ev_train["accuracy"], train_reward=ev_train["reward_mean"],
                   train_reward_first=float(np.mean([r["reward_mean"] for r in head])),
                   train_reward_last=float(np.mean([r["reward_mean"] for r in tail])),
                   grad_norm_mean=float(np.mean(grad)), grad_norm_std=float(np.std(grad)),
                   grad_norm_cv=float(np.std(grad) / np.mean(grad)), kl_last=float(np.mean([r["kl"] for r in tail])),
                   diversity_last=float(np.mean([r["diversity"] for r in tail])),
                   step_s=float(np.mean([r["t_rollout"] + r["t_reward"] + r["t_update"] for r in rows])),
                   **{k: v for k, v in ev.items() if k.startswith("accuracy/")})
        table.setdefault(arm, []).append(rec)
        curves.setdefault(arm, []).append(([r["reward_mean"] for r in rows], grad))
    try:  # the base model without RL, for reference
        ev = json.load(open(os.path.join(root, "base", "eval", "summary.json")))
        ev_train = json.load(open(os.path.join(root, "base", "eval_train", "summary.json")))
        table["base (no RL)"] = [dict(heldout_acc=ev["accuracy"], heldout_reward=ev["reward_mean"],
                                      train_acc=ev_train["accuracy"], train_reward=ev_train["reward_mean"],
                                      **{k: v for k, v in ev.items() if k.startswith("accuracy/")})]
    except (OSError, ValueError):
        pass
    summary = {arm: {k: (float(np.mean([r[k] for r in recs])), float(np.std([r[k] for r in recs])), len(recs))
                     for k in recs[0]} for arm, recs in table.items()}
    with open(os.path.join(root, "study.json"), "w") as f:
        json.dump(summary, f, indent=1)
    cols = ["train_reward_first", "train_reward_last", "train_reward", "train_acc", "heldout_reward", "heldout_acc", "accuracy/single",
            "accuracy/two_objects", "accuracy/counting", "accuracy/spatial", "grad_norm_mean", "grad_norm_std", "grad_norm_cv",
            "kl_last", "diversity_last", "step_s"]
    lines = ["| arm | seeds | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for arm, stats in summary.items():
        cells = [f"{stats[c][0]:.3f} ± {stats[c][1]:.3f}" if c in stats else "–" for c in cols]
        lines.append(f"| {arm} | {next(iter(stats.values()))[2]} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    with open(os.path.join(root, "study.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.6))
    for arm in STUDY_MAIN:
        if arm not in curves:
            continue
        r = np.mean([c[0] for c in curves[arm]], axis=0)
        g = np.mean([c[1] for c in curves[arm]], axis=0)
        ax[0].plot(r, label=arm)
        ax[1].plot(g, label=arm)
    ax[0].set(xlabel="GRPO step", ylabel="train reward (mean over seeds)")
    ax[1].set(xlabel="GRPO step", ylabel="grad norm before clipping", yscale="log")
    ax[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(root, "study.png"), dpi=110)
    return summary


SECTIONS = dict(sample=bench_sample, record=bench_record, step=bench_step, reward=bench_reward,
                flops=bench_flops, scaling=bench_scaling)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated: " + ", ".join(SECTIONS))
    p.add_argument("--preset", default="demo", help="train.py preset whose sizes are benchmarked")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per figure")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--mar-base", action="store_true", help="also time mar_base at 256 px (slow on CPU)")
    p.add_argument("--official-dir", default=None, help="local checkout of LTH14/mar for the side-by-side figures")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.add_argument("--study", action="store_true", help="run the controlled study instead (see study())")
    p.add_argument("--study-seeds", type=int, default=3)
    p.add_argument("--study-out", default="runs/study")
    p.add_argument("--study-train-flags", default="", help="extra train.py flags for the GRPO runs only")
    p.add_argument("--study-steps", type=int, default=25, help="GRPO steps per study run")
    p.add_argument("--study-arms", default="all", choices=["all", "main"], help="main: the four main arms only")
    p.add_argument("--context-probe", default=None, metavar="BASE",
                   help="instead: does this pixel-token base model (base.pt) use the canvas? (see context_probe)")
    opts, rest = p.parse_known_args(argv)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    if opts.study:
        return study(opts, rest)
    args = train.parse_args(["--preset", opts.preset] + rest)
    if opts.context_probe:
        return run_context_probe(opts.context_probe, args, lambda s: print(s, flush=True))
    args.repeats, args.mar_base, args.official_dir = opts.repeats, opts.mar_base, opts.official_dir
    print(f"bench: preset {opts.preset}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"device cpu", flush=True)
    results = {}
    for name in opts.sections.split(","):
        print(f"\n[{name}]", flush=True)
        results[name] = SECTIONS[name](args, lambda s: print(s, flush=True))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
