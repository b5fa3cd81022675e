"""--precision bf16|fp32: the forward passes' dtype on any device (infra/processes.py autocast; the
default bf16 on CUDA, fp32 on the CPU). Every model's smoke pipeline (MAR, Harmon, NOVA; plain,
--lora, --grad-checkpointing) trains in bf16 on the CPU: its transformer computes in bf16, the
diffusion head in fp32, config.json records the precision, and the update recomputes the ℓ the
rollout recorded (`PARITY_BOUND`); benchmarks/gpu_check.py's parity check in both precisions."""

import contextlib
import json
import math

import pytest
import torch

import diffloss
import grpo
import rollout
import train
from benchmarks import gpu_check, tiny_files
from demo import pretrain
from infra import processes
from infra.processes import Ctx, cli
from models import nova_heads
from tests.test_distributed import tiny

torch.set_num_threads(1)

# Recorded vs recomputed ℓ in bf16 (nats). A rollout records ℓ under the run's autocast and the
# update recomputes it under the same autocast, through the same code (grpo.recompute_z, then the
# head's transition means) on the same shapes: the same bf16 kernels give the same z, the head
# (fp32 in both) the same μ, so the gap is 0 bit for bit on the CPU, as in fp32. Measured 0 in
# every step of the 9 smoke pipelines below (3 models × plain, --lora, --grad-checkpointing;
# seeds 0-2, 4 steps each; 2 CPU cores, torch 2.14). What the bound must catch is an update in
# another precision than its rollout's: bf16 matmuls keep 8 mantissa bits, so z moves by ~2^-9
# relative, μ with it as far as the head depends on z, and ℓ = log N(x_prev; μ, σ²) by
# ~|x_prev − μ| Δμ / σ². A bf16 rollout updated in fp32 (train.backward_batch without autocast)
# logs up to 3.0e-2 (Harmon), 1.0e-3 (NOVA) and 2.9e-5 (the smoke MAR) in 2 steps; on the tiny
# models of the parity test below an fp32 rollout recomputed in bf16 differs by 2.4e-3 (NOVA) to
# 2.4e-2 (MAR). 5e-6, about 5 fp32 ulps of ℓ (|ℓ| ≤ 8.5 per
# element here: an ulp of 9.5e-7), leaves room for kernels that are not bit-reproducible
# (threaded or GPU reductions) and lies 6× below the smallest mismatch; fp32's 1e-4 of the other
# tests would miss the smoke MAR's.
PARITY_BOUND = 5e-6
MISMATCH_FLOOR = 1e-3  # the parity test's: under the smallest mismatch it measures (2.4e-3)


# -----------------------------------------------------------------------------
# The flag and the process's precision

def test_the_default_is_fp32_on_the_cpu_and_the_flag_sets_bf16_autocast():
    args = train.parse_args(["--device", "cpu"])
    assert args.precision is None  # the device decides
    ctx = Ctx(args)
    assert ctx.precision == vars(args)["precision"] == "fp32"  # what config.json records
    with ctx.autocast():
        assert not torch.is_autocast_enabled("cpu")
    ctx = Ctx(train.parse_args(["--device", "cpu", "--precision", "bf16"]))
    assert ctx.precision == "bf16"
    with ctx.autocast():
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


@pytest.fixture
def fake_cuda(monkeypatch):
    """Ctx believes a CUDA device is there (none is touched); TF32's switches restored after."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_on_cuda_the_default_is_bf16_with_tf32_and_fp32_turns_both_off(fake_cuda):
    ctx = Ctx(train.parse_args([]))
    assert ctx.device == torch.device("cuda", 0) and ctx.precision == "bf16"
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    ctx = Ctx(train.parse_args(["--precision", "fp32"]))
    assert ctx.precision == "fp32" and ctx.autocast is contextlib.nullcontext
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


def test_a_bad_precision_is_one_line_naming_the_flag(tmp_path, capsys):
    run = tmp_path / "run"
    assert train.cli(["--preset", "smoke", "--precision", "fp16", "--out", str(run)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("error: argument --precision: invalid choice: 'fp16'")
    assert not run.exists()
    with pytest.raises(ValueError, match="^--precision fp16: choose from bf16, fp32$"):
        processes.autocast("fp16", torch.device("cpu"))


def test_pretraining_takes_the_flag_too():
    assert pretrain.parse_args(["--preset", "smoke"]).precision is None
    args = pretrain.parse_args(["--preset", "smoke", "--precision", "bf16", "--device", "cpu"])
    assert Ctx(args).precision == vars(args)["precision"] == "bf16"  # base.pt's "args" record it
    assert cli(pretrain.main, ["--precision", "fp16"]) == 2


# -----------------------------------------------------------------------------
# Every model's smoke pipeline in bf16 on the CPU

HEAD_NETS = (diffloss.SimpleMLPAdaLN, nova_heads.DiffusionMLP)  # the diffusion heads' networks


@pytest.fixture
def linear_dtypes(monkeypatch):
    """{(phase, 'head' or 'model', dtype)} of every nn.Linear output while a rollout is recorded
    (phase 'rollout') and while the update computes a trained AR step's loss ('update')."""
    seen, state = set(), {"phase": None, "in_head": 0}

    def before(module, args):
        state["in_head"] += isinstance(module, HEAD_NETS)

    def after(module, args, out):
        state["in_head"] -= isinstance(module, HEAD_NETS)
        if isinstance(module, torch.nn.Linear) and state["phase"]:
            seen.add((state["phase"], "head" if state["in_head"] else "model", out.dtype))

    def during(phase, fn):
        def run(*a, **k):
            state["phase"] = phase
            try:
                return fn(*a, **k)
            finally:
                state["phase"] = None
        return run
    monkeypatch.setattr(rollout, "record_rollout", during("rollout", rollout.record_rollout))
    monkeypatch.setattr(grpo, "ar_step_loss", during("update", grpo.ar_step_loss))
    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(before),
             torch.nn.modules.module.register_module_forward_hook(after)]
    yield seen
    for hook in hooks:
        hook.remove()


@pytest.fixture(scope="module")
def smoke_flags(tmp_path_factory):
    """{model: train.py's flags of its smoke pipeline}: the shipped smoke MAR, tiny Harmon and
    NOVA files."""
    return tiny_files.smoke_flags(tmp_path_factory.mktemp("precision_files"))


VARIANTS = {"plain": [], "lora": ["--lora", "4"], "grad-checkpointing": ["--grad-checkpointing"]}


@pytest.mark.parametrize("model", ["small", "harmon", "nova"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_smoke_pipeline_trains_in_bf16_and_recomputes_what_it_recorded(
        model, variant, smoke_flags, linear_dtypes, tmp_path, capsys):
    out = tmp_path / "run"
    argv = [*smoke_flags[model], "--precision", "bf16", "--device", "cpu", "--threads", "1",
            "--steps", "2", "--eval-prompts", "0", "--sample-every", "100", "--out", out,
            *VARIANTS[variant]]
    assert train.cli([str(a) for a in argv]) == 0, capsys.readouterr().err[-2000:]
    assert json.loads((out / "config.json").read_text())["precision"] == "bf16"
    # the transformer computed in bf16 in the rollout and in the update; the head in fp32 in both
    assert linear_dtypes == {(phase, part, dtype) for phase in ("rollout", "update") for part, dtype
                             in (("model", torch.bfloat16), ("head", torch.float32))}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and not any(r["skipped"] for r in rows)
    assert all(math.isfinite(r[k]) for r in rows for k in ("loss", "grad_norm", "kl"))
    assert max(r["logp_parity_err"] for r in rows) <= PARITY_BOUND, rows


# -----------------------------------------------------------------------------
# benchmarks/gpu_check.py's parity check, on the CPU in both precisions

@pytest.mark.parametrize("kind", ["small", "harmon", "nova"])
def test_gpu_check_parity_runs_in_both_precisions_and_sees_a_mismatch(kind):
    """gpu_check.parity on a tiny model of each kind, on the CPU: a rollout and its update in one
    precision agree within the bound, in bf16 as in fp32; an fp32 rollout recomputed in bf16 does
    not (so both sides did compute in the precision named)."""
    base, inputs = tiny(kind)
    args = train.parse_args(["--preset", "adapter_smoke", "--model", kind, "--cfg", "3",
                             "--train-diff-steps", "3"])
    err = gpu_check.parity(args, base.requires_grad_(False), inputs, torch.device("cpu"))
    assert set(err) == {("bf16", "bf16"), ("fp32", "fp32"), ("fp32", "bf16")}
    assert err["bf16", "bf16"] <= PARITY_BOUND and err["fp32", "fp32"] <= PARITY_BOUND, err
    assert err["fp32", "bf16"] > MISMATCH_FLOOR, err
    name, result, figures = gpu_check.parity_row(f"parity {kind}", err)
    assert result == "ok"
    assert figures.startswith("max |Δℓ| bf16 0 nats, fp32 0; an fp32 rollout recomputed in bf16 ")
