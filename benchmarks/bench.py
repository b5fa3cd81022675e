"""Performance figures, as ratios measured in one run (absolute times on a shared machine are noise).

    python -m benchmarks.bench                          # step, reward, flops, scaling at the demo config
    python -m benchmarks.bench --sections step,reward --preset smoke --repeats 1
    python -m benchmarks.bench --mar-base --threads 1   # mar_base: step and recording ratios (2 shared cores: ~35 min)
    python -m benchmarks.bench --sections head_memory --preset harmon   # a trained AR step's head activations
    python -m benchmarks.bench --memory harmon          # bytes per GPU: DDP, FSDP, LoRA × fp32, bf16 × checkpointed or not

Sections: step (MAR-GRPO step / fixed-head GRPO step, recording / plain rollout, each step's parts, plain rollout
images/s, record bytes), reward (verifier images/s), flops (the update's FLOP/s / a large matmul's), scaling (step
time and record + MTE memory as S, G and tokens grow), mar_base (official mar_base, random weights, at reduced steps,
extrapolated by a cost model fitted in the run), head_memory (memory.py), memory (memory_table.py).

A step is timed stage by stage with train.py's calls: a plain rollout, the recorded rollout (record_rollout),
decoding + reward, MTE trajectories, and each method's update (backward_batch); step(method) = plain rollout +
recording + reward + [MTE] + update(method); medians of repeats after a warm-up, stages interleaved.
"""

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

import grpo
import mar
import mte
import rollout
import train
from benchmarks import memory, memory_table
from demo import shapes, verifier
from infra import checkpoints, flags, processes
from models.prompts import Prompts
from models import loading, vae
from scorers import registry

METHODS = ("grpo-fixed-head", "mar-grpo")


def clock(device):
    """time.perf_counter() once the device's queued work has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def interleaved(fns, device, repeats, warmup=1):
    """Median seconds of each fn of {name: fn} over `repeats` rounds after `warmup` rounds, every fn
    called once per round. Returns ({name: median}, {name: seconds of its first call})."""
    times = {k: [] for k in fns}
    for _ in range(warmup + repeats):
        for k, fn in fns.items():
            t = clock(device)
            fn()
            times[k].append(clock(device) - t)
    return {k: statistics.median(v[warmup:]) for k, v in times.items()}, {k: v[0] for k, v in times.items()}


# -----------------------------------------------------------------------------
# A setting: the policy and its frozen reference as train.py makes them, a batch, the flags

def setting(args, model, items, prompts, device, codec=None, reward=None, trajectories=None):
    """items: G per prompt, adjacent; trajectories: S instead of the method's. Returns a namespace."""
    with torch.no_grad():  # the official init zeroes the head's output and modulation: give them weight
        for p in [p for k, p in model.diffloss.named_parameters() if "adaLN_modulation" in k or "final_layer.linear" in k]:
            p.normal_(0, 0.02)
    ref = model.to(device).eval().requires_grad_(False)
    settings = {m: dataclasses.replace(train.grpo_settings(args), **grpo.METHODS[m]) for m in METHODS}
    settings["mar-grpo"].mte_trajectories = trajectories or settings["mar-grpo"].mte_trajectories
    model = loading.make_policy(args, ref, settings["mar-grpo"])  # as train.py makes it; both methods keep the head fixed
    return SimpleNamespace(args=args, model=model, ref=ref, items=items, prompts=prompts, device=device, settings=settings,
                           B=len(items), G=args.group_size, inputs=prompts.condition(items, device), codec=codec, reward=reward)


def demo_setting(args, device, G=None, trajectories=None, side=1):
    """The preset's small MAR (its base's architecture, random weights, `side` times the image side)
    on shapes prompts, with the shapes reward."""
    args = argparse.Namespace(**{**vars(args), "group_size": G or args.group_size})
    config = checkpoints.read_checkpoint(args.init)["config"]
    config = dict(config, img_size=side * config["img_size"], num_sampling_steps=str(args.num_sampling_steps))
    torch.manual_seed(0)
    items = shapes.sample_prompts(args.prompts_per_step, np.random.default_rng(0))
    return setting(args, mar.build_mar(config), [it for it in items for _ in range(args.group_size)],
                   Prompts("shapes"), device, vae.PixelCodec(), registry.build_reward("shapes"), trajectories)


def mar_base_setting(opts, device):
    """The official mar_base (constructor + OFFICIAL_HEADS) with train.py's mar_base preset (one class
    prompt × G = 4, CFG 3, τ = 1, K = 10) at --base-steps' AR steps, diffusion steps and trained AR steps."""
    N, T, M = opts.base_steps.split(",")
    args = train.parse_args(["--preset", "mar_base", "--prompts-per-step", "1", "--num-iter", N, "--num-sampling-steps", T,
                             "--train-ar-steps", M])
    torch.manual_seed(0)
    model = mar.mar_base(**mar.OFFICIAL_HEADS["mar_base"], num_sampling_steps=str(args.num_sampling_steps))
    return setting(args, model, [207] * args.group_size, Prompts("class", num_classes=1000), device)


def run_rollout(st, seed=0, record=True):
    """train.py's rollout: (tokens, RolloutRecord, RolloutPlan) with the plan train.py would draw (diffusion-step
    candidates: trainable and >= --min-diff-step), or with nothing recorded (plan None)."""
    a, plan = st.args, None
    if record:
        candidates = [k for k in st.model.diffloss.trainable_steps() if k >= a.min_diff_step]
        ar, diff = grpo.choose_train_steps(len(st.model.ar_schedule(a.num_iter, st.model.seq_len)), a.train_ar_steps,
                                           candidates, a.train_diff_steps, processes.seeded(st.device, seed, 3))
        plan = rollout.RolloutPlan(ar_steps=ar, diff_steps=diff)
    return (*rollout.record_rollout(st.model, st.inputs, a.num_iter, a.cfg, a.cfg_schedule, a.temperature, plan,
                                    processes.seeded(st.device, seed, 4)), plan)


# -----------------------------------------------------------------------------
# One GRPO step, stage by stage

class StepBench:
    """train.py's GRPO step, stage by stage (module docstring). After run(): times[stage] lists seconds
    per timed repeat; upd_steps[method] (n = |U_i|, seconds) per trained AR step's forward + backward."""

    def __init__(self, st, methods=METHODS):
        self.st, self.methods, self.times, self.upd_steps = st, methods, {}, {m: [] for m in methods}
        self.loss = train.PolicyLoss(st.model)
        # lr 0: the optimizer step costs what it costs, and the weights stay the rollouts' (compile_figures' parity)
        self.opt = torch.optim.AdamW([p for p in st.model.parameters() if p.requires_grad], lr=0.0)

    def update(self, method, adv, timing):
        """One inner epoch of train.py's update; the loss module's forward calls mark the trained steps."""
        st, settings, marks = self.st, self.st.settings[method], []
        forward = self.loss.forward
        self.loss.forward = lambda *a, **k: (marks.append(clock(st.device)), forward(*a, **k))[1]
        traj = self.traj if settings.mte_trajectories >= 2 else None
        batch = train.MicroBatch(st.inputs, self.record, None, [], None, adv, {}, traj,
                                 [None] * len(self.record.steps), {})
        try:
            train.backward_batch(self.loss, st.ref, batch, settings, contextlib.nullcontext)
        finally:
            del self.loss.forward
        marks.append(clock(st.device))
        if timing:
            self.upd_steps[method] += [(s.unk_idx.shape[1], t1 - t0) for s, t0, t1 in zip(self.record.steps, marks, marks[1:])]
        torch.nn.utils.clip_grad_norm_(self.opt.param_groups[0]["params"], st.args.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def run(self, repeats, warmup=1):
        st, a, settings = self.st, self.st.args, self.st.settings["mar-grpo"]
        for r in range(warmup + repeats):
            marks = [clock(st.device)]

            def done(stage):  # the stage that has just ended (timed after the warm-up)
                marks.append(clock(st.device))
                self.times.setdefault(stage, []).extend([marks[-1] - marks[-2]] if r >= warmup else [])
            outs = {}
            for stage in ("rollout", "recorded")[::1 if r % 2 == 0 else -1]:  # their order alternates: drift cancels
                outs[stage] = run_rollout(st, r, record=stage == "recorded")
                done(stage)
            tokens, self.record, plan = outs["recorded"]
            scores = torch.randn(st.B, generator=processes.seeded(st.device, r, 9), device=st.device) if st.reward is None \
                else st.reward(st.codec.decode(st.model.unpatchify(tokens).float()), st.prompts.texts(st.items),
                               st.prompts.metas(st.items))[0].to(st.device)  # mar_base: no reward (needs weights)
            adv = grpo.group_advantages(scores + 1e-3 * torch.arange(st.B, device=st.device), st.G)  # never all 0
            done("reward")
            self.traj = mte.sample_trajectories(st.model.diffloss, self.record.z_final, self.record.z_final_null,
                                                 self.record.cfg_final, a.temperature, settings.mte_trajectories, plan.diff_steps,
                                                 processes.seeded(st.device, r, 5))
            done("mte")
            for m in self.methods:
                self.update(m, adv, timing=r >= warmup)
                done("update " + m)
        return self

    def median(self, stage):
        """Median seconds of a stage; "recording" is the recorded rollout less the plain one, paired per repeat."""
        pairs = zip(self.times.get("rollout", []), self.times.get("recorded", []))
        return statistics.median([b - a for a, b in pairs] if stage == "recording" else self.times[stage])

    def parts(self, method):
        """{stage: median seconds} of one method's step."""
        keys = ["rollout", "recording", "reward"] + (["mte"] if self.st.settings[method].mte_trajectories >= 2 else [])
        return {k: self.median(k) for k in keys} | {"update": self.median("update " + method)}


def step_figures(bench, out, label):
    """Print and return the two ratios, each method's breakdown, the plain rollout's rate and the record's size."""
    st, settings, fixed, full = bench.st, bench.st.settings["mar-grpo"], bench.parts("grpo-fixed-head"), bench.parts("mar-grpo")
    ratio, rec = sum(full.values()) / sum(fixed.values()), 1 + bench.median("recording") / bench.median("rollout")
    a, L, plan, per_image = st.args, st.model.seq_len, bench.record.steps, memory.nbytes(bench.record) / st.B
    out(f"{label}: {st.B} images, {L} tokens, {a.num_iter} AR × {a.num_sampling_steps} diffusion steps, guidance {a.cfg}, "
        f"{len(plan)} AR × {len(plan[0].diff_steps)} diffusion steps trained")
    out(f"MAR-GRPO step / fixed-head GRPO step (S = {settings.mte_trajectories}, k = {settings.top_k:.0%}): {ratio:.2f}×")
    out(f"recording / plain rollout (record_rollout with / without a plan): {rec:.2f}×")
    for name, p in (("fixed-head GRPO", fixed), ("MAR-GRPO", full)):
        out(f"  {name + ' step':<21}{sum(p.values()):8.2f} s = " + ", ".join(f"{k} {v / sum(p.values()):.0%}" for k, v in p.items()))
    out(f"plain rollout {st.B / bench.median('rollout'):.2f} images/s, {st.B * L / bench.median('rollout'):.0f} tokens/s; "
        f"record {per_image / 2 ** 20:.2f} MiB per image")
    return dict(ratio=ratio, recording_overhead=rec, shares={k: v / sum(full.values()) for k, v in full.items()},
                fixed_parts=fixed, mar_grpo_parts=full, images_per_s=st.B / bench.median("rollout"),
                record_bytes_per_image=per_image)


# -----------------------------------------------------------------------------
# Sections at the preset's size

def bench_step(args, opts, out):
    return step_figures(StepBench(demo_setting(args, opts.device)).run(opts.repeats), out, f"{opts.preset} config")


def bench_reward(args, opts, out):
    res = {}
    for size in (32, 64):
        imgs, metas = shapes.make_dataset(512, size, np.random.default_rng(0))
        x = torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 255
        t = interleaved({"v": lambda: verifier.verify_batch(x, metas)}, torch.device("cpu"), opts.repeats)[0]["v"]
        res[f"verifier_images_per_s_{size}px"] = 512 / t
        out(f"shapes verifier at {size} px: {512 / t:.0f} images/s")
    return res  # the reward's share of a step is part of the step section's breakdown


def bench_flops(args, opts, out):
    st = demo_setting(args, opts.device)
    _, record, _ = run_rollout(st)
    step = record.steps[len(record.steps) // 2]

    def fwd_bwd():  # the update's transformer pass at one AR step, with CFG: (2B, L) canvas
        z, z_null = grpo.recompute_z(st.model, step, st.inputs, guided=True)
        (z.square().mean() + z_null.square().mean()).backward()
        st.model.zero_grad(set_to_none=True)

    with FlopCounterMode(display=False) as fc:
        fwd_bwd()
    n = 2048  # the matmul whose speed is the machine's reference
    a, b = torch.randn(n, n, device=st.device), torch.randn(n, n, device=st.device)
    t, _ = interleaved({"update": fwd_bwd, "matmul": lambda: a @ b}, st.device, max(3, opts.repeats))
    gflops, mm = fc.get_total_flops() / t["update"] / 1e9, 2 * n ** 3 / t["matmul"] / 1e9
    out(f"transformer forward+backward of the update: {gflops:.1f} GFLOP/s = {gflops / mm:.1%} of a {n}² matmul's {mm:.1f} GFLOP/s")
    return dict(gflops=gflops, matmul_gflops=mm, utilisation=gflops / mm)


def bench_scaling(args, opts, out):
    rows, base = [], None
    for name, kw in [("baseline", {}), ("S = 5", dict(trajectories=5)), ("S = 8", dict(trajectories=8)),
                     ("G × 2", dict(G=2 * args.group_size)), ("tokens × 4", dict(side=2))]:
        bench = StepBench(demo_setting(args, opts.device, **kw), methods=("mar-grpo",)).run(1)
        t, mib = sum(bench.parts("mar-grpo").values()), (memory.nbytes(bench.record) + memory.nbytes(bench.traj)) / 2 ** 20
        base = base or t
        rows.append(dict(name=name, seconds=t, relative=t / base, mib=mib))
        out(f"  {name:<12} step {t / base:5.2f}×   record + MTE trajectories {mib:7.1f} MiB")
    return rows


# -----------------------------------------------------------------------------
# mar_base: measured at fewer steps, extrapolated by a cost model fitted to the same run's calls

def unit_costs(bench, repeats=3):
    """The calls a step is made of, timed apart (interleaved, median of `repeats`): model.predict_z on
    the (2B, L) CFG canvas with 0 and with L known tokens (a pass costs linearly in between), and one
    guided diffusion step of the head (p_mean_variance) at token-row counts from B to S·B·L; and from
    the timed step, per method, seconds per trained AR step as a + b·n (n = |U_i|; clipping and the
    optimizer step, ~1% at mar_base, left out)."""
    st, g = bench.st, 2 if bench.st.args.cfg != 1 else 1
    L, C, D = st.model.seq_len, st.model.token_embed_dim, st.model.diffloss.net.cond_embed.in_features
    gen, S = processes.seeded(st.device, 6), st.settings["mar-grpo"].mte_trajectories
    cond = st.model.condition(**st.inputs)
    cond = mar.cat_rows(cond, st.model.null_condition_like(cond)) if g == 2 else cond
    canvas, unknown = torch.zeros(g * st.B, L, C, device=st.device), torch.ones(g * st.B, L, device=st.device)
    fns = {"z0": lambda: st.model.predict_z(canvas, unknown, cond), "zL": lambda: st.model.predict_z(canvas, 0 * unknown, cond)}
    rows = np.unique(np.geomspace(st.B, S * st.B * L, 6).round().astype(int))
    for r in rows:
        x, z = torch.randn(r, C, generator=gen, device=st.device), torch.randn(g * r, D, generator=gen, device=st.device)
        fns[int(r)] = lambda x=x, z=z: st.model.diffloss.p_mean_variance(x, st.model.diffloss.num_sampling_steps // 2, z, st.args.cfg)
    with torch.no_grad():
        t, _ = interleaved(fns, st.device, repeats)
    upd = {}
    for m, steps in bench.upd_steps.items():
        n, s = np.array(steps, dtype=float).T
        upd[m] = tuple(np.polyfit(n, s, 1)[::-1]) if len(set(n)) > 1 else (s.mean(), 0.0)
    return SimpleNamespace(z0=t["z0"], zL=t["zL"], rows=rows, head=np.array([t[int(r)] for r in rows]), upd=upd)


def predict(u, st, N, T, m):
    """Both methods' stage seconds at N AR steps, T diffusion steps, m trained AR steps (K and the rest
    as measured): the plain rollout runs N transformer passes and the head on P_i; recording runs the
    head on U_i instead at the AR steps that are trained or precede a trained one (expected, m of N
    drawn uniformly); MTE runs the head on S·B·L rows; the update as fitted, at the mean |U_i|."""
    L, B, S = st.model.seq_len, st.B, st.settings["mar-grpo"].mte_trajectories

    def head(rows):  # seconds of T diffusion steps on `rows` token rows
        return T * np.interp(rows, u.rows, u.head)
    counts = np.array(st.model.ar_schedule(N, L))
    n_exec, m = len(counts), min(m, len(counts))
    unknown = L - np.concatenate([[0], np.cumsum(counts)[:-1]])  # |U_i| at the start of step i
    idle = [math.comb(n_exec - 2 if i < n_exec - 1 else n_exec - 1, m) for i in range(n_exec)]  # neither i nor i+1 drawn
    p_full = 1 - np.array(idle, dtype=float) / math.comb(n_exec, m)
    shared = dict(rollout=np.sum(u.z0 + (u.zL - u.z0) * (L - unknown) / L + head(B * counts)),
                  recording=np.sum(p_full * (head(B * unknown) - head(B * counts))))
    upd = {k: m * (a + b * unknown.mean()) for k, (a, b) in u.upd.items()}
    fixed = dict(shared, update=upd["grpo-fixed-head"])
    full = dict(shared, mte=head(S * B * L), update=upd["mar-grpo"])
    return dict(fixed=fixed, full=full, ratio=sum(full.values()) / sum(fixed.values()),
                recording_overhead=1 + shared["recording"] / shared["rollout"])


def bench_mar_base(args, opts, out):
    st, P = mar_base_setting(opts, opts.device), flags.PRESETS["mar_base"]
    a, full_size = st.args, (P["num_iter"], P["num_sampling_steps"], P["train_ar_steps"])
    out("mar_base 256 px (official constructor + OFFICIAL_HEADS, random weights), MEASURED AT FEWER STEPS than train.py's "
        "preset ({} AR × {}, {} AR trained: hours per step on 2 CPU cores); no decoding or reward (need weights)".format(*full_size))
    with torch.no_grad():  # warm-up: a 1-image, 1-step rollout (the kernels' first-call costs)
        rollout.record_rollout(st.model, {k: v[:1] for k, v in st.inputs.items()}, 1, a.cfg, generator=processes.seeded(st.device, 1))
    bench = StepBench(st).run(opts.base_repeats, warmup=0)
    res = step_figures(bench, out, "measured")
    u = unit_costs(bench)
    out(f"cost model: transformer pass on the (2B, L) canvas {u.z0:.1f} s with no token known, {u.zL:.1f} s with all; head, "
        "one diffusion step: " + ", ".join(f"{t:.2f} s on {r}" for r, t in zip(u.rows, u.head)) + " token rows; update per "
        "trained AR step: " + "; ".join(f"{k} {x:.1f} s + {y * 1e3:.0f} ms per unknown token" for k, (x, y) in u.upd.items()))
    measured_cfg, full = predict(u, st, a.num_iter, a.num_sampling_steps, a.train_ar_steps), predict(u, st, *full_size)
    out(f"  {'':<26}{'model, measured config':>23}{'measured':>10}{'model, the preset':>20}")
    for key, label in (("recording_overhead", "recording / plain rollout"), ("ratio", "MAR-GRPO / fixed-head")):
        out(f"  {label:<26}{measured_cfg[key]:>22.2f}×{res[key]:>9.2f}×{full[key]:>19.2f}×")
    for name, key in (("fixed-head", "fixed"), ("MAR-GRPO", "full")):
        total = sum(full[key].values())
        out(f"  model, the preset, {name} step: {total / 60:.0f} min on this machine = " +
            ", ".join(f"{k} {v / total:.0%}" for k, v in full[key].items()))
    res.update(model_measured=measured_cfg, model_preset=full, units=vars(u))
    return res


SECTIONS = dict(step=bench_step, reward=bench_reward, flops=bench_flops, scaling=bench_scaling,
                mar_base=bench_mar_base, head_memory=memory.bench_head_memory, memory=memory_table.bench_memory)
DEFAULT = ["step", "reward", "flops", "scaling"]


def main(argv=None):
    """`python -m benchmarks.bench ...`; unknown flags go to train.py's parser (the preset's sizes). Returns {section: figures}."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = processes.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--sections", default=None, help=f"comma-separated, of {', '.join(SECTIONS)} (default: {','.join(DEFAULT)}, "
      "or only what --mar-base asks for)")
    a("--preset", default="demo", help="train.py preset whose sizes are benchmarked")
    a("--repeats", type=flags.POS_INT, default=3, help="timed repeats per figure")
    a("--threads", type=flags.NONNEG_INT, default=0, help="torch CPU threads (0: default)")
    a("--device", default="cpu", choices=["cpu", "cuda"], help="cpu or cuda")
    a("--mar-base", action="store_true", help="the mar_base section")
    a("--base-steps", default="8,12,2", help="mar_base: AR, diffusion and trained AR steps measured (preset: 64,100,12)")
    a("--base-repeats", type=flags.POS_INT, default=2, help="mar_base: timed repeats (2: the rollouts' order alternates)")
    a("--head-rows", type=flags.POS_INT, default=64, help="head_memory: unknown tokens measured (then scaled to the preset)")
    a("--memory", default=None, metavar="PRESET", help="the memory section for PRESET: what one GPU holds")
    a("--memory-tokens", type=memory_table.squares, default=[64, 256], help="memory: image tokens measured (squares; then fitted)")
    a("--memory-images", type=flags.POS_INT, default=1, help="memory: images measured (then scaled to G)")
    a("--memory-policies", default="full", type=lambda s: s.split(","),
      help="memory: policies measured, full and/or lora (LoRA's rows take the full policy's activations if not measured)")
    a("--memory-repeats", type=flags.POS_INT, default=3, help="memory: timed rounds of the plain and checkpointed step")
    a("--memory-dtypes", default=list(memory.DTYPES), type=lambda s: s.split(","), help="memory: fp32 and/or bf16 (autocast)")
    a("--world", type=flags.POS_INT, default=8, help="memory: processes FSDP shards over")
    a("--json", default=None, help="also write the figures to this JSON file")
    opts, rest = p.parse_known_args(argv)
    if opts.memory:
        opts.preset, opts.sections = opts.memory, "memory"
    checks = [(opts.device == "cuda" and not torch.cuda.is_available(), "--device cuda: no CUDA device is available"),
              ("full" not in opts.memory_policies or not set(opts.memory_policies) <= {"full", "lora"},
               f"--memory-policies {','.join(opts.memory_policies)}: full, or full,lora"),
              (opts.memory_dtypes not in (["fp32"], ["bf16"], ["fp32", "bf16"], ["bf16", "fp32"]),
               f"--memory-dtypes {','.join(opts.memory_dtypes)}: fp32, bf16 or fp32,bf16"),
              (not re.fullmatch(r"[1-9]\d*,[1-9]\d*,[1-9]\d*", opts.base_steps), f"--base-steps {opts.base_steps}: N,T,M > 0")]
    for bad, message in checks:
        if bad:
            raise ValueError(message)
    checkpoints.check_writable(os.path.dirname(os.path.abspath(opts.json or ".")), "--json")
    opts.device = torch.device(opts.device)
    torch.set_num_threads(opts.threads or torch.get_num_threads())
    sections = opts.sections.split(",") if opts.sections else ([] if opts.mar_base else list(DEFAULT))
    sections += ["mar_base"] if opts.mar_base and "mar_base" not in sections else []
    if any(s not in SECTIONS for s in sections):
        p.error(f"--sections {opts.sections}: choose from {', '.join(SECTIONS)}")
    args = train.parse_args(["--preset", opts.preset] + rest)
    print(f"bench: preset {opts.preset}, torch {torch.__version__}, {torch.get_num_threads()} threads, {opts.device}. "
          "The figures are ratios within this run; absolute times on a shared machine are noise.", flush=True)
    results = {}
    for name in sections:
        print(f"\n[{name}]", flush=True)
        results[name] = SECTIONS[name](args, opts, lambda s: print(s, flush=True))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist") else float(o))
    return results


if __name__ == "__main__":
    sys.exit(processes.cli(main))
