"""The speed of our code against other implementations of the same arithmetic: `MAR.sample_tokens`
next to the released MAR code (GitHub LTH14/mar), same settings; and ours under torch.compile.

The released code is not part of this repository: pass a local clone with `--official-dir`.
Its `models/mar.py`, `models/diffloss.py` and `diffusion/` package are imported from there as
they are; only what stops them running on a CPU is patched, and only while they run
(`Tensor.cuda` becomes the identity; the global torch / numpy random states they draw from are
seeded and restored afterwards).

Both models are built with the same constructor arguments, our weights are loaded into the
official model (`strict=True`: the key names are the same), and both run `sample_tokens` in eval
mode, fp32, under `torch.no_grad()`, on the same labels:

- tiny: 32×32 RGB pixels in 4×4 patches (64 tokens of 48 channels), encoder/decoder 4 blocks of
  128, head 3×128, 16 AR steps, 50 diffusion steps, batch 16, cfg 3.0 linear;
- mar_base: 256 px, KL-16 latents (256 tokens of 16 channels), head 6×1024 (the official
  mar_base head), 16 AR steps, 100 diffusion steps, one image, cfg 3.0 linear.

Weights are random (speed does not depend on their values). The head keeps its official
initialisation, whose output layer is zero, so ε̂ = 0 and v = 0 at every step: each token is
then a fixed linear combination of the head's Gaussian noises, N(0, σ²) with the same σ in
both implementations. The two use different random streams, so values differ, but the
shapes and the spread of the tokens must agree; that is the cross-check printed beside the
timings (a check of schedule and sampling plumbing, not a test).

Reported per setting and thread count: seconds per call (median of the timed repeats after one
warm-up, the implementations interleaved so that load from other work hits them alike),
tokens/s and images/s of each, and the ratio official / ours (> 1: ours is faster). With
`--compile`, also ours with `compile_model` (inductor, dynamic shapes) and official / compiled.

`compile_figures` (`--compile-figures PRESET`, e.g. demo or mar_base) times the head's sampling loop
and the GRPO update compiled against eager at a preset's size (bench.py's settings), and checks
that recorded and recomputed log-probabilities still agree under compilation.

    python -m benchmarks.official --official-dir ~/src/mar --threads 1 2 [--compile]
    python -m benchmarks.official --compile-figures demo
"""

import argparse
import contextlib
import copy
import dataclasses
import importlib
import importlib.machinery
import importlib.util
import inspect
import math
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

import grpo
import mar
import train
from benchmarks import bench

# name -> (factory in both codebases, constructor arguments, sampling arguments)
SETTINGS = {
    "tiny": dict(
        factory="MAR",
        model=dict(img_size=32, vae_stride=1, patch_size=4, vae_embed_dim=3,
                   encoder_embed_dim=128, encoder_depth=4, encoder_num_heads=4,
                   decoder_embed_dim=128, decoder_depth=4, decoder_num_heads=4,
                   class_num=10, buffer_size=16, diffloss_d=3, diffloss_w=128,
                   num_sampling_steps="50", attn_dropout=0.0, proj_dropout=0.0),
        sample=dict(bsz=16, num_iter=16, cfg=3.0, cfg_schedule="linear", temperature=1.0)),
    "mar_base": dict(
        factory="mar_base",
        model=dict(img_size=256, vae_stride=16, patch_size=1, vae_embed_dim=16,
                   diffloss_d=6, diffloss_w=1024, num_sampling_steps="100"),
        sample=dict(bsz=1, num_iter=16, cfg=3.0, cfg_schedule="linear", temperature=1.0)),
}

OFFICIAL_FILES = ("models/mar.py", "models/diffloss.py", "diffusion/__init__.py",
                  "diffusion/gaussian_diffusion.py")


# -----------------------------------------------------------------------------
# The released code: import from a checkout, run on the CPU

def import_official(official_dir):
    """The official `models.mar` module, imported from a checkout of LTH14/mar.

    Its top-level packages (`models`, `diffusion`) are only on `sys.path` / in `sys.modules`
    while importing; the returned module keeps its own references to them.
    """
    root = Path(official_dir).expanduser().resolve()
    missing = [f for f in OFFICIAL_FILES if not (root / f).is_file()]
    if missing:
        raise FileNotFoundError(f"--official-dir {official_dir}: not a checkout of LTH14/mar (no {missing[0]})")
    packages = ("models", "diffusion")
    ours = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] in packages}
    sys.path.insert(0, str(root))
    for name in packages:  # a folder without __init__.py (the checkout's models/) loses to this repository's models/loading.py
        if not (root / name / "__init__.py").is_file():
            sys.modules[name] = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(name, None, is_package=True))
            sys.modules[name].__path__ = [str(root / name)]
    try:
        return importlib.import_module("models.mar")
    finally:
        sys.path.remove(str(root))
        for k in [k for k in sys.modules if k.split(".")[0] in packages]:
            del sys.modules[k]
        sys.modules.update(ours)


@contextlib.contextmanager
def official_on_cpu(seed):
    """Run the released code on the CPU: `Tensor.cuda` is the identity and the global torch and
    numpy random states (which it draws from) are seeded; all is restored on exit."""
    cuda = torch.Tensor.cuda
    torch_state, numpy_state = torch.get_rng_state(), np.random.get_state()
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.manual_seed(seed)
    np.random.seed(seed)
    try:
        yield
    finally:
        torch.Tensor.cuda = cuda
        torch.set_rng_state(torch_state)
        np.random.set_state(numpy_state)


def accepted(fn, kwargs):
    """The subset of `kwargs` that `fn` takes (stored versions of the released code differ)."""
    params = inspect.signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


def build_pair(official, setting, seed=0):
    """Our MAR and the official one for `setting`, with identical weights, in eval mode."""
    spec = SETTINGS[setting]
    ours_factory = getattr(mar, spec["factory"])
    official_factory = getattr(official, spec["factory"])
    kwargs = dict(spec["model"])
    if spec["factory"] == "MAR":  # the factories fix these; the plain class takes them
        kwargs.update(mlp_ratio=4.0, norm_layer=partial(torch.nn.LayerNorm, eps=1e-6))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        ours = ours_factory(**kwargs).eval()
    official_kwargs = accepted(official.MAR.__init__, kwargs)
    with official_on_cpu(seed):
        theirs = official_factory(**official_kwargs).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return ours, theirs


# -----------------------------------------------------------------------------
# Timing

def _stats(x):
    x = x.double()
    finite = torch.isfinite(x)
    return dict(shape=tuple(x.shape), mean=x[finite].mean().item(), std=x[finite].std().item(),
                finite=finite.float().mean().item())


def time_runs(runs, repeats, seed=0):
    """Median seconds per call of each of `runs` ({name: fn(seed)}) after one warm-up call each; the
    order of the timed calls rotates every round. Returns ({name: median s}, {name: warm-up output},
    {name: warm-up seconds}: with torch.compile, the compilation)."""
    outputs, first = {}, {}
    for name, fn in runs.items():  # warm-up, and the cross-check's outputs (same seed for all)
        t0 = time.perf_counter()
        outputs[name] = fn(seed)
        first[name] = time.perf_counter() - t0
    names, times = list(runs), {name: [] for name in runs}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            runs[name](seed + 1 + r)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}, outputs, first


def sampling_runs(ours, theirs, sample, ours_compiled=None):
    """{name: fn(seed)} calling `sample_tokens` of each implementation on the same labels."""
    bsz = sample["bsz"]
    args = dict(num_iter=sample["num_iter"], cfg=sample["cfg"], cfg_schedule=sample["cfg_schedule"],
                labels=torch.arange(bsz) % ours.num_classes, temperature=sample["temperature"])

    def run_official(s):
        with official_on_cpu(s), torch.no_grad():
            return theirs.sample_tokens(bsz, **args)
    runs = {"official": run_official,
            "ours": lambda s: ours.sample_tokens(bsz, generator=torch.Generator().manual_seed(s), **args)}
    if ours_compiled is not None:
        runs["ours compiled"] = lambda s: ours_compiled.sample_tokens(bsz, generator=torch.Generator().manual_seed(s), **args)
    return runs


def compare_with_official(official_dir, out=print, repeats=3, base_repeats=2, threads=(None,),
                          settings=("tiny", "mar_base"), seed=0, compile=False):
    """Time `sample_tokens` of ours and of the released MAR code side by side.

    official_dir: a local clone of LTH14/mar; repeats: timed calls per implementation for the
    tiny setting (base_repeats for mar_base), after one warm-up; threads: torch thread counts to
    run each setting with (None = torch's default); settings: names from SETTINGS; compile: also
    time ours with `compile_model` (its first call, which compiles, is reported apart).
    Returns {"rows": [one dict per (setting, threads)], "checks": {setting: cross-check}}.
    """
    official = import_official(official_dir)
    default_threads = torch.get_num_threads()
    rows, checks = [], {}
    out("sample_tokens, ours vs. official LTH14/mar (fp32, eval, no_grad); median of timed calls after a warm-up")
    out(f"{'setting':<9} {'thr':>3} {'official s':>10} {'ours s':>8} {'official tok/s':>14} {'ours tok/s':>10} "
        f"{'official img/s':>14} {'ours img/s':>10} {'off/ours':>8}" + (f" {'off/compiled':>12}" if compile else ""))
    try:
        for setting in settings:
            spec = SETTINGS[setting]
            ours, theirs = build_pair(official, setting, seed)
            ours_compiled = compile_model(copy.deepcopy(ours)) if compile else None
            bsz, n_rep = spec["sample"]["bsz"], (base_repeats if setting == "mar_base" else repeats)
            tokens = bsz * ours.seq_len
            for n in threads:
                torch.set_num_threads(default_threads if n is None else int(n))
                t, y, first = time_runs(sampling_runs(ours, theirs, spec["sample"], ours_compiled), n_rep, seed)
                t_ours, t_official = t["ours"], t["official"]
                row = dict(setting=setting, threads=torch.get_num_threads(), bsz=bsz, tokens=tokens,
                           repeats=n_rep, official_s=t_official, ours_s=t_ours,
                           official_tok_s=tokens / t_official, ours_tok_s=tokens / t_ours,
                           official_img_s=bsz / t_official, ours_img_s=bsz / t_ours,
                           ratio=t_official / t_ours)
                if compile:
                    row.update(ours_compiled_s=t["ours compiled"], ratio_compiled=t_official / t["ours compiled"],
                               compile_first_call_s=first["ours compiled"])
                rows.append(row)
                out(f"{setting:<9} {row['threads']:>3} {t_official:>10.3f} {t_ours:>8.3f} {row['official_tok_s']:>14.1f} "
                    f"{row['ours_tok_s']:>10.1f} {row['official_img_s']:>14.3f} {row['ours_img_s']:>10.3f} "
                    f"{row['ratio']:>7.2f}x" + (f" {row['ratio_compiled']:>11.2f}x (compiled first call "
                                                f"{first['ours compiled']:.1f} s)" if compile else ""))
                if setting not in checks:
                    a, b = _stats(y["ours"]), _stats(y["official"])
                    # relative standard error of a sample std is about 1/sqrt(2n)
                    tol = 5.0 / math.sqrt(2 * y["ours"].numel())
                    ok = a["shape"] == b["shape"] and a["finite"] == b["finite"] == 1.0 and \
                        abs(a["std"] / b["std"] - 1) < tol
                    checks[setting] = dict(ours=a, official=b, std_tolerance=tol, ok=ok)
                    out(f"  check {setting}: shape {a['shape']} vs {b['shape']}; mean {a['mean']:.4g} vs "
                        f"{b['mean']:.4g}; std {a['std']:.4g} vs {b['std']:.4g} (rel. tol {tol:.3f}); "
                        f"{'OK' if ok else 'MISMATCH'}")
    finally:
        torch.set_num_threads(default_threads)
    return dict(rows=rows, checks=checks)


# -----------------------------------------------------------------------------
# Ours under torch.compile

def compile_model(model):
    """torch.compile (inductor; dynamic shapes, since the row counts change every AR step) where the
    arithmetic is: each transformer block and the head's net. In place; returns the model."""
    for block in [*model.encoder_blocks, *model.decoder_blocks, model.diffloss.net]:
        block.compile(dynamic=True)
    return model


def compile_figures(step, out, repeats, update_steps=None):
    """Compiled / eager seconds of the head's sampling loop (head.sample at a plain AR step's rows and
    at all L rows) and of MAR-GRPO's update (train.backward_batch of the last rollout of `step`, a
    bench.StepBench that has run, on its first `update_steps` trained steps), on deep copies; the
    first (compiling) calls are reported apart, and the log-probability parity of both."""
    st, res, parity = step.st, {}, {}
    a, L, D = st.args, st.model.seq_len, st.model.diffloss.net.cond_embed.in_features
    comp, comp_ref = compile_model(copy.deepcopy(st.model)), compile_model(copy.deepcopy(st.ref))
    record = dataclasses.replace(step.record, steps=step.record.steps[:update_steps])
    adv = grpo.group_advantages(torch.randn(st.B, generator=torch.Generator().manual_seed(7)).to(st.device), st.G)

    def update(model, ref, tag):
        batch = train.MicroBatch(st.inputs, record, None, [], None, adv, {}, step.traj,
                                 [None] * len(record.steps), {})
        stats = train.backward_batch(train.PolicyLoss(model), ref, batch, st.settings["mar-grpo"], contextlib.nullcontext)
        model.zero_grad(set_to_none=True)
        parity[tag] = max(float(s["logp_parity_err"]) for s in stats)

    def head_sample(model, z):
        return lambda: model.diffloss.sample(z, a.temperature, a.cfg, torch.Generator(st.device).manual_seed(0))

    jobs = {}
    for rows in (st.B * max(st.model.ar_schedule(a.num_iter, L)), st.B * L):
        z = torch.randn((2 if a.cfg != 1 else 1) * rows, D, generator=torch.Generator().manual_seed(8)).to(st.device)
        jobs[f"head.sample, {rows} rows"] = dict(eager=head_sample(st.model, z), compiled=head_sample(comp, z))
    jobs[f"update, {len(record.steps)} trained AR step(s)"] = dict(
        eager=lambda: update(st.model, st.ref, "eager"), compiled=lambda: update(comp, comp_ref, "compiled"))
    out(f"torch.compile (inductor, dynamic shapes), {a.preset} size: compiled / eager, median of {repeats} after the first calls")
    for name, fns in jobs.items():
        t, first = bench.interleaved(fns, st.device, repeats)
        res[name] = dict(ratio=t["compiled"] / t["eager"], seconds=t, first_call_s=first)
        out(f"  {name:<36}{t['compiled'] / t['eager']:5.2f}×  (first calls: eager {first['eager']:.1f} s, "
            f"compiled {first['compiled']:.1f} s)")
    res["logp_parity_err"] = parity
    out(f"  recorded vs recomputed ℓ, max |Δ|: eager {parity['eager']:.1e}, compiled {parity['compiled']:.1e}")
    return res


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile-figures", default=None, metavar="PRESET",
                        help="only time torch.compile against eager at this train.py preset's size (compile_figures)")
    parser.add_argument("--official-dir", default=None, help="local clone of github.com/LTH14/mar")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="torch thread counts to run each setting with (default: torch's default)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per implementation, tiny setting")
    parser.add_argument("--base-repeats", type=int, default=2, help="timed calls per implementation, mar_base")
    parser.add_argument("--settings", nargs="+", default=["tiny", "mar_base"], choices=list(SETTINGS),
                        help="which settings to run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and of the sampling")
    parser.add_argument("--compile", action="store_true", help="also time ours under torch.compile (compile_model)")
    args = parser.parse_args()
    if args.repeats < 1 or args.base_repeats < 1:
        parser.error("--repeats and --base-repeats must be at least 1")
    if args.compile_figures:
        run_args = train.parse_args(["--preset", args.compile_figures])
        setting = (bench.mar_base_setting(argparse.Namespace(base_steps="8,12,2"), torch.device("cpu"))
                   if args.compile_figures == "mar_base" else bench.demo_setting(run_args, torch.device("cpu")))
        step = bench.StepBench(setting, methods=()).run(0)  # one rollout and its MTE trajectories
        compile_figures(step, lambda line: print(line, flush=True), max(args.repeats, 2), update_steps=1)
        sys.exit(0)
    if args.official_dir is None:
        parser.error("--official-dir is required (or --compile-figures PRESET)")
    try:
        compare_with_official(args.official_dir, repeats=args.repeats, base_repeats=args.base_repeats,
                              threads=tuple(args.threads) if args.threads else (None,),
                              settings=tuple(args.settings), seed=args.seed, compile=args.compile)
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
