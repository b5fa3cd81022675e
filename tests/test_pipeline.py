"""train.py as a whole: the smoke pipeline, the draws' generators, CUDA, resume, the DDP gradient,
the sign of the whole objective, and the benchmarks at smoke size."""

import contextlib
import copy
import json
import math
import os
import subprocess
import sys

import pytest
from PIL import Image
import torch

import diffloss
import grpo
import train
from diffloss import transition_logprob
from infra import processes
from tests.helpers import ROOT, loss_and_grads, make_rollout, settings, tiny_mar

torch.set_num_threads(1)
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def run_train(*flags, torchrun=0, check=True, env=None, timeout=300):
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
           if torchrun else [sys.executable]) + [str(ROOT / "train.py"), *flags]
    out = subprocess.run(cmd, cwd=ROOT, env=env or ENV, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"{cmd} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def test_smoke_pipeline_end_to_end(tmp_path):
    out = tmp_path / "run"
    res = run_train("--preset", "smoke", "--out", str(out), "--threads", "1")
    for name in ["config.json", "metrics.jsonl", "curves.png", "ckpt/latest.pt",
                 "eval/base/tau0.5/heldout/scores.jsonl", "eval/tuned/tau1/heldout/scores.jsonl",
                 "eval/tuned/tau1/train/scores.jsonl", "eval/summary.json"]:
        assert (out / name).exists(), name
    assert list((out / "samples").glob("step_*.png"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ["reward_mean", "reward_std", "adv_abs_mean", "kl", "policy_term", "grad_norm", "keep_frac",
                "uncertain_frac", "t_rollout", "t_reward", "t_mte", "t_update", "logp_parity_err", "diversity", "reward/shapes"]:
        assert key in rows[0] and math.isfinite(rows[0][key]), key
    assert max(r["logp_parity_err"] for r in rows) < 1e-4
    line = json.loads((out / "eval/tuned/tau1/heldout/scores.jsonl").read_text().splitlines()[0])
    assert {"prompt", "file", "shapes", "details"} <= line.keys() and (out / "eval/tuned/tau1/heldout" / line["file"]).exists()
    assert "held-out prompts" in res.stdout and "training-split prompts" in res.stdout and "its best" in res.stdout
    summary = json.loads((out / "eval/summary.json").read_text())
    assert set(summary) == {"base", "tuned"} and summary["base"]["choose_on"] == "train"
    cells = {(c["temperature"], c["split"]): c["n"] for c in summary["base"]["cells"]}
    assert cells == {(t, s): 4 for t in (0.5, 1.0) for s in ("heldout", "train")}
    with Image.open(out / "eval/tuned/tau1/heldout" / line["file"]) as image, \
            Image.open(out / "eval/base_vs_tuned.png") as grid:  # base, tuned at τ 1; each at its best
        assert grid.height == 4 * (image.height * 4 + 28)  # 4 rows: images at scale 4, two caption lines
    ckpt = torch.load(out / "ckpt/latest.pt", weights_only=True)  # plain dicts only
    assert ckpt["step"] == 3 and isinstance(ckpt["config"], dict)


def test_seeded_generators_live_on_the_draws_device(smoke_base, monkeypatch):
    """No random draw of a GRPO step may use a generator of another device than the draw (a CUDA
    draw with a CPU generator raises), nor the global RNG (a resumed run would not repeat it).
    Every torch sampling function is wrapped to check both during a smoke GRPO step; processes.seeded
    puts its generator on the device it is given."""
    assert processes.seeded(torch.device("cpu"), 0, 1).device == torch.device("cpu")
    if torch.cuda.is_available():
        assert processes.seeded(torch.device("cuda"), 0, 1).device.type == "cuda"
    seen = []

    def checked(fn):
        def draw(*a, generator=None, device=None, **k):
            out = fn(*a, generator=generator, device=device, **k) if device is not None else fn(*a, generator=generator, **k)
            assert generator is not None, f"torch.{fn.__name__} drew from the global RNG"
            assert generator.device.type == out.device.type, (fn.__name__, generator.device, out.device)
            seen.append(fn.__name__)
            return out
        return draw
    for name in ("rand", "randn", "randint", "randperm"):
        monkeypatch.setattr(torch, name, checked(getattr(torch, name)))
    out = smoke_base.parent / "device_check"
    assert train.cli(["--preset", "smoke", "--eval-prompts", "0", "--init", str(smoke_base), "--steps", "1",
                      "--out", str(out), "--threads", "1"]) == 0
    assert {"rand", "randn"} <= set(seen)  # the checks ran: orders and the head's noise


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_smoke_pipeline_on_cuda(tmp_path):
    """The whole smoke pipeline (rollouts, MTE, update under bf16 autocast, evaluation) on the GPU;
    recorded and recomputed log-probabilities still agree."""
    out = tmp_path / "cuda"
    run_train("--preset", "smoke", "--out", str(out), "--device", "cuda")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and max(r["logp_parity_err"] for r in rows) < 1e-3
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)


def test_resume_continues_identically(tmp_path, smoke_base):
    common = ["--preset", "smoke", "--eval-prompts", "0", "--init", str(smoke_base), "--save-every", "1"]
    full = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *common, "--steps", "4", "--out",
                             str(tmp_path / "full")], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # beside the interrupted run: one thread each
    run_train(*common, "--steps", "2", "--out", str(tmp_path / "part"))
    run_train(*common, "--steps", "4", "--resume", "--out", str(tmp_path / "part"))
    _, err = full.communicate(timeout=300)
    assert full.returncode == 0, err[-3000:]

    def rows(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: {k: v for k, v in r.items() if not k.startswith("t_")} for r in map(json.loads, lines)}
    full, part = rows("full"), rows("part")
    assert sorted(part) == [0, 1, 2, 3]
    for s in (2, 3):
        assert full[s] == part[s], (s, full[s], part[s])
    a = torch.load(tmp_path / "full/ckpt/latest.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "part/ckpt/latest.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def _ddp_worker(rank, world, init_file, out_dir):
    """One rank of the distributed-gradient test: its own half of the rollouts, DDP backward."""
    torch.set_num_threads(1)
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model, records = _ddp_setup()
    record, cond, adv = records[rank]
    module = torch.nn.parallel.DistributedDataParallel(train.PolicyLoss(model))
    cfg = settings("grpo-fixed-head")
    train.backward_batch(module, copy.deepcopy(model), micro_batch(record, cond, adv), cfg, contextlib.nullcontext)
    torch.save({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, f"{out_dir}/grad{rank}.pt")
    dist.destroy_process_group()


def micro_batch(record, cond, adv):
    """train.py's MicroBatch of a recorded rollout, without MTE."""
    return train.MicroBatch(cond, record, None, [], None, adv, {}, None, [None] * len(record.steps), {})


def _ddp_setup():
    model = tiny_mar()
    model.diffloss.requires_grad_(False)
    model.text_emb.requires_grad_(False)
    records = []
    for r in range(2):
        record, cond = make_rollout(model, seed=100 + r)
        adv = grpo.group_advantages(torch.randn(4, generator=torch.Generator().manual_seed(r)), 2)
        records.append((record, cond, adv))
    return model, records


def test_ddp_gradient_equals_single_process(tmp_path):
    torch.multiprocessing.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    model, records = _ddp_setup()
    cfg = settings("grpo-fixed-head")
    loss_module = train.PolicyLoss(model)
    for record, cond, adv in records:  # single process: both halves, accumulated
        train.backward_batch(loss_module, copy.deepcopy(model), micro_batch(record, cond, adv), cfg, contextlib.nullcontext)
    g0, g1 = torch.load(tmp_path / "grad0.pt"), torch.load(tmp_path / "grad1.pt")
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        torch.testing.assert_close(g0[n], p.grad / 2, rtol=0, atol=1e-6)
        torch.testing.assert_close(g1[n], g0[n], rtol=0, atol=0)  # all-reduced: identical on both ranks


def test_clip_denoised_bounds_x0_and_keeps_parity():
    model = tiny_mar(clip_denoised=True)
    head = model.diffloss
    x = 50 * torch.randn(6, 48, generator=torch.Generator().manual_seed(0))
    _, _, x0 = head.p_mean_variance(x, 5, torch.randn(6, 32))
    assert x0.abs().max() <= 1.0
    _, _, x0_free = tiny_mar().diffloss.p_mean_variance(x, 5, torch.randn(6, 32))
    assert x0_free.abs().max() > 1.0
    record, cond = make_rollout(model)
    loss, stats, _ = grpo.ar_step_loss(model, model, record, 1, cond, torch.tensor([1.0, -1.0, 0.5, -0.5]),
                                         settings("mar-grpo", mte_trajectories=0))
    assert stats["logp_parity_err"] < 1e-4 and torch.isfinite(loss)


def test_gradient_step_moves_logp_toward_positive_advantages():
    """The sign of the whole objective: a small SGD step on the loss raises Σ_b A_b ℓ_b, the
    advantage-weighted log-probability of the recorded transitions (kept elements)."""
    model = tiny_mar()
    model.diffloss.requires_grad_(False)
    record, cond = make_rollout(model, cfg=2.0)
    adv = torch.tensor([1.5, -1.5, 0.5, -0.5])
    cfg = settings("grpo-fixed-head", beta=0.0)

    def weighted_logp():
        with torch.no_grad():
            total = 0.0
            for s in record.steps:
                z, z_null = grpo.recompute_z(model, s, cond, guided=True)
                mean = diffloss.transition_mean(model.diffloss, s.x_t, s.diff_steps, z, z_null, s.cfg)
                logp = transition_logprob(s.x_prev, mean, s.std).sum(dim=(0, 2, 3))  # (B,)
                total += (adv * logp).sum().item()
            return total

    before = weighted_logp()
    loss_and_grads(model, record, cond, adv, cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 1e-4 * p.grad
    assert weighted_logp() > before


def test_bench_sections_run_at_smoke_size(capsys):
    """benchmarks/bench.py's figures at toy size: every section runs and reports ratios in their ranges."""
    from benchmarks import bench
    res = bench.main(["--preset", "smoke", "--sections", "step,reward,flops", "--repeats", "1"])
    step = res["step"]
    assert step["ratio"] > 0 and step["recording_overhead"] > 0 and step["record_bytes_per_image"] > 0
    assert 0.99 < sum(step["shares"].values()) < 1.01 and step["shares"]["mte"] > 0  # the MAR-GRPO step's parts
    assert 0 < res["flops"]["utilisation"] and res["reward"]["verifier_images_per_s_32px"] > 0
    assert "MAR-GRPO step / fixed-head GRPO step" in capsys.readouterr().out
