"""The first GPU's checks, one command (estimated under 8 minutes on one GPU); one table, also as JSON.

    python -m benchmarks.gpu_check                        # on a CUDA machine: every section
    python -m benchmarks.gpu_check --sections smoke,nccl --json runs/gpu_check.json

Sections (each gives rows of the table):
  smoke       train.py's smoke pipeline of each model (the small MAR's --preset smoke; tiny random
              Harmon and NOVA files, benchmarks/tiny_files.py, with --preset adapter_smoke):
              plain and with --grad-checkpointing in the device's default precision (bf16
              autocast on the GPU), plain in the other (--precision fp32 on the GPU), each with
              its largest recorded-vs-recomputed gap (logp_parity_err), with CUDA's sync debug
              mode set to fail on a host sync inside the per-diffusion-step loops (the head's
              sampler, diffloss.reverse_sample, and the update's recomputed means,
              diffloss.transition_mean).
              A head's first call may copy its schedule to the device once; that call is only warned
              about, and the one-time syncs are counted.
  parity      recorded vs recomputed ℓ (max |Δℓ|, nats) of a rollout and its update both in
              bf16 and both in fp32 (TF32 off), and of an fp32 rollout recomputed in bf16 (the
              size of a precision mismatch, what the first two are judged against), for MAR-B,
              Harmon-1.5B and NOVA-d48w1024 (random weights; the released architectures at
              8 × 8 tokens).
  nccl        one step of the smoke pipeline under `torchrun --standalone --nproc_per_node=1` (NCCL).
  memory      the allocator's peak of one trained AR step of each preset (benchmarks/memory.py's measure,
              one image at --memory-tokens tokens, fp32 and bf16, plain and checkpointed), beside the CPU
              figure `python -m benchmarks.bench --memory PRESET` measured at the same size
              (benchmarks/memory_figures/PRESET.json), and the checkpointed / plain time (medians of
              3 interleaved rounds).
  throughput  mar_base (random weights) at its preset's sampling: plain rollout images/s at G = 4 and
              32 images, and the update's model FLOP utilisation (the FLOPs torch counts in one update
              of 12 AR × 10 diffusion steps, MTE S = 3, / its seconds / the GPU's bf16 peak: the data
              sheet's where known, and a measured 8192² bf16 matmul's).
A section, or one preset of parity and memory, that raises (out of memory, a package missing) is one
FAIL row naming the error, its traceback on stderr, and the others still run; the JSON is rewritten
after each section, so a run killed at a time limit keeps what finished. The time is an estimate: the
command has not yet run on a GPU.
Without CUDA it checks its flags, says so in one line and exits 0. `--device cpu` runs the same
sections on the CPU (no sync check; gloo for the torchrun step), to try the script without a GPU.
"""

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

import torch
from torch.utils.flop_counter import FlopCounterMode

import diffloss
import grpo
import mte
import rollout
import train
from benchmarks import bench, memory, memory_table, tiny_files
from infra import checkpoints, flags, processes, run_folder
from models import loading, nova_heads

SECTIONS = ("smoke", "parity", "nccl", "memory", "throughput")
PRESETS = ("mar_base", "harmon", "nova")
FIGURES = pathlib.Path(__file__).resolve().parent / "memory_figures"
ROLLOUT_IMAGES = (4, 32)  # the preset's G a GPU, and a batch that fills more of one
MATMUL_SIDE = 8192  # the bf16 matmul whose speed the update is read against
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s of the SXM data sheets


# -----------------------------------------------------------------------------
# smoke: no host sync inside the per-diffusion-step loops

class StrictLoops:
    """While on (a context manager), diffloss.reverse_sample and diffloss.transition_mean (wherever they
    were imported) run with CUDA's sync debug mode: "warn" on a head's first call, recording what syncs
    there (`first_call`), "error" on every later call (a host sync raises)."""

    TARGETS = ((diffloss, "reverse_sample"), (nova_heads, "reverse_sample"), (diffloss, "transition_mean"),
               (grpo, "transition_mean"), (mte, "transition_mean"))

    def __init__(self):
        self.seen, self.first_call, self.saved = set(), 0, []

    def wrap(self, fn):
        def strict(head, *a, **k):
            first = id(head) not in self.seen
            self.seen.add(id(head))
            torch.cuda.set_sync_debug_mode("warn" if first else "error")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    return fn(head, *a, **k)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                self.first_call += sum("synchroniz" in str(w.message) for w in caught)
        return strict

    def __enter__(self):
        self.saved = [(m, name, getattr(m, name)) for m, name in self.TARGETS]
        for m, name, fn in self.saved:
            setattr(m, name, self.wrap(fn))
        return self

    def __exit__(self, *exc):
        for m, name, fn in self.saved:
            setattr(m, name, fn)


def smoke_runs(device):
    """(mode, precision) of each model's smoke runs: plain and checkpointed in the device's default
    precision (processes.Ctx), plain in the other."""
    default = "bf16" if device == "cuda" else "fp32"
    other = next(p for p in processes.PRECISIONS if p != default)
    return [("plain", default), ("checkpointed", default), ("plain", other)]


def smoke(opts, out):
    rows = []
    for model, more in tiny_files.smoke_flags(opts.work / "files").items():
        firsts = {}
        for mode, precision in smoke_runs(opts.device):
            run = opts.work / f"smoke_{model}_{mode}_{precision}"
            argv = [*more, "--device", opts.device, "--precision", precision, "--out", run] + (
                ["--grad-checkpointing"] if mode == "checkpointed" else [])
            t0 = time.time()
            with StrictLoops() if opts.device == "cuda" else contextlib.nullcontext() as strict:
                try:
                    rc, why = train.cli([str(a) for a in argv]), ""
                except RuntimeError as e:  # a host sync in a loop (sync debug mode "error"), or another failure
                    rc, why = 1, str(e).splitlines()[0]
            ok = rc == 0 and (run / "metrics.jsonl").is_file()
            lines = (run / "metrics.jsonl").read_text().splitlines() if ok else []
            firsts[mode, precision] = json.loads(lines[0]) if ok else {}
            parity = max(json.loads(line)["logp_parity_err"] for line in lines) if ok else None
            ok = ok and parity <= run_folder.PARITY_WARN
            one_time = f", {strict.first_call} one-time syncs in heads' first calls" if strict else ""
            figures = f"exit {rc} in {time.time() - t0:.0f} s" + (
                "" if parity is None else f", max |Δℓ| recorded - recomputed {parity:.2g} nats")
            figures += ", no host sync in the per-diffusion-step loops" if ok and strict else ""
            rows.append((f"smoke {model} {mode} {precision}", "ok" if ok else "FAIL",
                         figures + one_time + why))
        plain, checkpointed = (firsts[run] for run in smoke_runs(opts.device)[:2])
        if plain and checkpointed:
            diff = {k: abs(plain[k] - checkpointed[k])
                    for k in ("loss", "grad_norm", "logp_parity_err")}
            rows.append((f"smoke {model}: checkpointed - plain, step 0", "measured",
                         ", ".join(f"Δ {k} {v:.2g}" for k, v in diff.items())))
    for row in rows:
        out(row)
    return rows


# -----------------------------------------------------------------------------
# parity and memory: the released architectures, random weights, reduced token counts

def preset_args(opts, preset):
    return train.parse_args(["--preset", preset, "--out", str(opts.work / preset), "--device", opts.device])


def model_at(args, side, device):
    """The preset's released architecture on a side × side grid, random weights (the head's zero-initialised
    output layers given weight, so that ℓ depends on z), on `device`, frozen."""
    torch.manual_seed(0)
    model = memory.build(args, side)
    with torch.no_grad():
        for name, p in model.diffloss.named_parameters():
            if "adaLN_modulation" in name or "final_layer.linear" in name:
                p.normal_(0, 0.02)
    return model.to(device).eval().requires_grad_(False)


PAIRS = (("bf16", "bf16"), ("fp32", "fp32"), ("fp32", "bf16"))  # (rollout's, update's precision)


def parity(args, base, inputs, device, pairs=PAIRS):
    """max |ℓ recomputed − ℓ recorded| (nats) over 2 recorded AR steps of an 8-step rollout of the
    images of `inputs` (condition inputs on `device`), per (rollout's precision, update's
    precision) of `pairs`, each side computing as a run in its precision does (processes.autocast;
    on CUDA processes.use_tf32). A pair of one precision is what a run in it logs
    (logp_parity_err); a mixed pair, an update in another precision than its rollout's, is the
    size of a precision mismatch. Returns {(recorded, recomputed): max |Δℓ|}."""
    settings = train.grpo_settings(args)
    model = loading.make_policy(args, base, settings)
    diff_steps = list(model.diffloss.trainable_steps())[-args.train_diff_steps:][::-1]
    plan = rollout.RolloutPlan(ar_steps=[1, 5], diff_steps=diff_steps)
    adv = torch.zeros(len(next(iter(inputs.values()))), device=device)
    err, records = {}, {}

    def computing_in(precision):
        if device.type == "cuda":
            processes.use_tf32(precision)
        return processes.autocast(precision, device)()
    for recorded, recomputed in pairs:
        if recorded not in records:
            with computing_in(recorded):
                records[recorded] = rollout.record_rollout(
                    model, inputs, 8, args.cfg, args.cfg_schedule, args.temperature, plan,
                    torch.Generator(device).manual_seed(0))[1]
        record = records[recorded]
        with computing_in(recomputed), torch.no_grad():
            stats = [grpo.ar_step_loss(model, base, record, j, inputs, adv, settings)[1]
                     for j in range(len(record.steps))]
        err[recorded, recomputed] = max(float(s["logp_parity_err"]) for s in stats)
    return err


def parity_row(name, err):
    """`parity`'s figures as a table row: ok if a run in either precision stays under
    run_folder.PARITY_WARN."""
    same = err["bf16", "bf16"], err["fp32", "fp32"]
    return (name, "ok" if max(same) < run_folder.PARITY_WARN else "FAIL",
            f"max |Δℓ| bf16 {same[0]:.2g} nats, fp32 {same[1]:.2g}; an fp32 rollout recomputed in "
            f"bf16 {err['fp32', 'bf16']:.2g} (warns above {run_folder.PARITY_WARN})")


def cpu_figure(preset, tokens, variant):
    """What `bench.py --memory PRESET` measured on the CPU for one image at `tokens`, or None (no JSON file)."""
    path = FIGURES / f"{preset}.json"
    if not path.is_file():
        return None
    measured = json.loads(path.read_text())["memory"]["measured"]
    return measured.get(f"full {tokens} 1 {memory_table.variant_name(*variant)}", {}).get("step")


def released(opts, out):
    """parity and memory of each preset of --presets; one preset's failure is its FAIL row, not the others'."""
    rows = []
    for preset in opts.presets:
        rows += guarded(f"parity, memory {preset}", lambda opts, out: released_preset(opts, preset, out), opts, out)
        if opts.torch_device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def released_preset(opts, preset, out):
    rows, GiB = [], 2 ** 30
    sides = sorted({8} | {int(t ** 0.5) for t in opts.memory_tokens})
    args, base = preset_args(opts, preset), None
    for side in sides:
        t0 = time.time()
        if hasattr(base, "set_image_shape"):  # Harmon: another grid is the same weights (built once: 2.5B parameters)
            base.set_image_shape((side, side))
        else:
            base = None
            base = model_at(args, side, opts.torch_device)
        if side == 8 and "parity" in opts.sections:
            inputs = {k: v.to(opts.torch_device)
                      for k, v in memory.condition_inputs(args, base, 4).items()}
            err = parity(args, base, inputs, opts.torch_device)
            rows.append(parity_row(f"parity {preset}, 64 tokens", err))
            out(rows[-1])
        if side * side in opts.memory_tokens and "memory" in opts.sections:
            m = memory.measure(args, side, 1, "full", 32, opts.torch_device, base, repeats=3)
            for variant, figures in m.items():
                cpu = cpu_figure(preset, side * side, variant)
                rows.append((f"memory {preset}, {side * side} tokens, 1 image, {memory_table.variant_name(*variant)}",
                             "measured", f"AR step peak {figures['step'] / GiB:.3f} GiB on {opts.device}; "
                             + (f"CPU {cpu / GiB:.3f} GiB (bench.py --memory)" if cpu else "no CPU figure")
                             + (f"; checkpointed / plain time {figures['seconds'] / m[variant[0], False]['seconds']:.2f}×"
                                if variant[1] else "")))
                out(rows[-1])
        out(f"  ({preset} at {side * side} tokens: {time.time() - t0:.0f} s)")
    return rows


# -----------------------------------------------------------------------------
# nccl and throughput

def nccl(opts, out):
    run = opts.work / "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train.py", "--preset",
           "smoke", "--steps", "1", "--eval-prompts", "0", "--device", opts.device, "--out", str(run)]
    t0 = time.time()
    res = subprocess.run(cmd, cwd=pathlib.Path(train.__file__).parent, capture_output=True, text=True, timeout=300)
    backend = "NCCL" if opts.device == "cuda" else "gloo"
    row = (f"torchrun, 1 process, {backend}", "ok" if res.returncode == 0 else "FAIL",
           f"exit {res.returncode} in {time.time() - t0:.0f} s" + ("" if res.returncode == 0 else ": " + res.stderr.strip()[-300:]))
    out(row)
    return [row]


def timed(fn, device, repeats=3):
    """Median seconds of fn() over `repeats` calls after one warm-up, the device synchronised around each."""
    times = []
    for _ in range(repeats + 1):
        t = bench.clock(device)
        fn()
        times.append(bench.clock(device) - t)
    return statistics.median(times[1:])


def throughput(opts, out):
    device, rows = opts.torch_device, []
    bf16 = processes.autocast("bf16", device)  # a bf16 run's forward passes (Ctx.autocast)
    preset = flags.PRESETS["mar_base"]
    setting_opts = argparse.Namespace(base_steps=f"{preset['num_iter']},{preset['num_sampling_steps']},{preset['train_ar_steps']}")
    st = bench.mar_base_setting(setting_opts, device)
    a = st.args
    for B in ROLLOUT_IMAGES:
        inputs = {k: v[:1].expand(B, *v.shape[1:]) for k, v in st.inputs.items()}

        def plain_rollout():
            with bf16():
                rollout.record_rollout(st.model, inputs, a.num_iter, a.cfg, a.cfg_schedule, a.temperature, None,
                                       processes.seeded(device, 0))
        rows.append((f"throughput mar_base, plain rollout, {B} images", "measured",
                     f"{B / timed(plain_rollout, device, 2):.2f} images/s ({a.num_iter} AR × {a.num_sampling_steps} "
                     f"diffusion steps, guidance {a.cfg}, bf16)"))
        out(rows[-1])
    with bf16():
        tokens, record, plan = bench.run_rollout(st)
    settings = st.settings["mar-grpo"]
    traj = mte.sample_trajectories(st.model.diffloss, record.z_final, record.z_final_null, record.cfg_final, a.temperature,
                                   settings.mte_trajectories, plan.diff_steps, processes.seeded(device, 5))
    adv = grpo.group_advantages(torch.randn(st.B, generator=processes.seeded(device, 9), device=device), st.G)
    loss_module = train.PolicyLoss(st.model)

    def update():
        batch = train.MicroBatch(st.inputs, record, None, [], None, adv, {}, traj, [None] * len(record.steps), {})
        train.backward_batch(loss_module, st.ref, batch, settings, bf16)
        st.model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as fc:
        update()
    seconds, n = timed(update, device), MATMUL_SIDE
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    matmul = 10 * 2 * n ** 3 / timed(lambda: [x @ x for _ in range(10)], device, 5)
    achieved = fc.get_total_flops() / seconds
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    sheet = next((v for k, v in PEAK_BF16.items() if k in gpu and "PCIe" not in gpu), None)
    rows.append(("throughput mar_base, update (bf16)", "measured",
                 f"{seconds:.2f} s, {achieved / 1e12:.1f} TFLOP/s = {achieved / matmul:.1%} of an {n}² bf16 matmul's "
                 f"{matmul / 1e12:.0f} TFLOP/s" + (f", MFU {achieved / sheet:.1%} of the data sheet's {sheet / 1e12:.0f}" if sheet else "")
                 + f" ({len(record.steps)} AR × {len(record.steps[0].diff_steps)} diffusion steps, S = {settings.mte_trajectories})"))
    out(rows[-1])
    return rows


# -----------------------------------------------------------------------------

def main(argv=None):
    """`python -m benchmarks.gpu_check ...`. Returns the rows, or None without CUDA."""
    p = processes.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--presets", default=",".join(PRESETS), help="parity and memory: the presets' models, of " + ", ".join(PRESETS))
    p.add_argument("--memory-tokens", type=memory_table.squares, default=[64, 256], help="memory: tokens measured (squares)")
    p.add_argument("--json", default="runs/gpu_check.json", help="the table as JSON")
    p.add_argument("--work", default=None, help="a folder for the tiny models and the runs (default: a new temporary one)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: try the sections without a GPU")
    p.add_argument("--threads", type=flags.NONNEG_INT, default=0, help="torch CPU threads (0: torch's default)")
    opts = p.parse_args(argv)
    opts.sections, opts.presets = opts.sections.split(","), opts.presets.split(",")
    for flag, given, allowed in (("--sections", opts.sections, SECTIONS), ("--presets", opts.presets, PRESETS)):
        if not set(given) <= set(allowed):
            raise ValueError(f"{flag} {','.join(given)}: choose from {', '.join(allowed)}")
    checkpoints.check_writable(os.path.dirname(os.path.abspath(opts.json)) or ".", "--json")
    if opts.work is not None:
        checkpoints.check_writable(opts.work, "--work")
    if opts.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; flags checked, nothing run")
        return None
    torch.set_num_threads(opts.threads or torch.get_num_threads())
    opts.work = pathlib.Path(opts.work or tempfile.mkdtemp(prefix="gpu_check_"))
    opts.work.mkdir(parents=True, exist_ok=True)
    opts.torch_device = torch.device("cuda", 0) if opts.device == "cuda" else torch.device("cpu")
    name = torch.cuda.get_device_name(opts.torch_device) if opts.device == "cuda" else "CPU"
    print(f"gpu_check: {name}, torch {torch.__version__}; work folder {opts.work}", flush=True)
    out = lambda row: print("  " + (" | ".join(row) if isinstance(row, tuple) else row), flush=True)  # noqa: E731
    t0, rows = time.time(), []
    for section, run in (("smoke", smoke), ("nccl", nccl), ("parity, memory", released), ("throughput", throughput)):
        if set(section.split(", ")) & set(opts.sections):
            rows += guarded(section, run, opts, out)
            write_json(opts.json, name, time.time() - t0, rows)  # what has run survives a later crash or kill
    print(f"\n{name}, torch {torch.__version__}, {time.time() - t0:.0f} s\n\n| check | result | figures |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return rows


def guarded(section, run, opts, out):
    """run(opts, out)'s rows; where it raises (out of memory, a missing package, a bug), its rows so far
    and one FAIL row naming the error (the traceback on stderr), so that the other sections still run."""
    rows = []

    def keep(row):  # what the section has printed, kept for its FAIL case
        if isinstance(row, tuple):
            rows.append(row)
        out(row)
    try:
        return run(opts, keep)
    except Exception as e:  # noqa: BLE001 - reported as a row, the next section still runs
        traceback.print_exc()
        rows.append((f"{section}: not finished", "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        out(rows[-1])
        return rows


def write_json(path, device, seconds, rows):
    """The table so far as JSON at `path` (written whole, then renamed over the last one)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(dict(device=device, torch=torch.__version__, seconds=seconds,
                       rows=[dict(check=c, result=r, figures=x) for c, r, x in rows]), f, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(processes.cli(main))
