"""What a run on many GPUs relies on, checked on the CPU: every trained parameter gets a gradient
(DDP needs it), the policy shares its frozen parameters with the reference, 1 process with
--grad-accum 2 trains exactly as 2 processes do (MAR, Harmon, NOVA under torchrun with gloo), the
reductions of the logged figures and of evaluation, no host sync in the head's per-diffusion-step
loops, and a trained AR step that holds one head graph at a time.
"""

import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import diffloss
import evaluate
import grpo
import mte
import rollout
import train
from benchmarks.memory import saved_activation_bytes
from diffloss import DiffLoss
from infra import processes
from models import loading
from scorers import registry
from tests import helpers, test_harmon, test_nova
from tests.test_train_adapters import DDPM, FLOW, harmon_flags, nova_flags, save_nova_pipeline
from tests.helpers import settings

torch.set_num_threads(1)


# -----------------------------------------------------------------------------
# Trainable = used: DDP all-reduces a gradient for every parameter that requires one

def tiny(kind):
    """A tiny model of each kind and a batch of 4 condition inputs (2 prompts × G = 2)."""
    if kind == "small":
        return helpers.tiny_mar(), dict(prompt_ids=torch.tensor([[1, 2, 0], [1, 2, 0], [3, 4, 5], [3, 4, 5]]))
    if kind == "mar_base":  # the official class-conditioned path
        return helpers.tiny_mar(), dict(labels=torch.tensor([0, 0, 3, 3]))
    if kind == "harmon":
        model = test_harmon.tiny_harmon(seed=21)
        model.set_null_prompt(torch.tensor([5, 6, 7]), 0)
        return model, dict(input_ids=torch.tensor([[5, 8, 9]] * 2 + [[5, 9, 9]] * 2), attention_mask=torch.ones(4, 3))
    model = test_nova.tiny_nova(DDPM, seed=41)
    t = test_nova.tiny_config(None)["transformer"]
    embeds = torch.randn(2, t["text_token_len"], t["text_token_dim"], generator=torch.Generator().manual_seed(0))
    return model, dict(prompt_embeds=embeds.repeat_interleave(2, 0))


def reached(model, ref, inputs, gcfg, w):
    """Names of the parameters that get a gradient from one rollout's loss (every trained step)."""
    plan = rollout.RolloutPlan(ar_steps=[0, 1], diff_steps=list(model.diffloss.trainable_steps())[:2])
    g = torch.Generator().manual_seed(0)
    tokens, record = rollout.record_rollout(model, inputs, 3, w, "constant", 1.0, plan, g)
    seeds = None
    if gcfg.mte_trajectories:
        seeds = mte.sample_trajectories(model.diffloss, record.z_final, record.z_final_null, record.cfg_final, 1.0,
                                        gcfg.mte_trajectories, plan.diff_steps, g)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    for j in range(len(record.steps)):
        grpo.ar_step_loss(model, ref, record, j, inputs, adv, gcfg, seeds)[0].backward()
    return {name for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["small", "mar_base", "harmon", "nova"])
def test_trainable_parameters_are_exactly_those_the_loss_reaches(kind):
    for method in grpo.METHODS:
        for w, train_cfg in ((3.0, "rollout"), (1.0, "rollout"), (3.0, "1")):
            base, inputs = tiny(kind)
            base.requires_grad_(False)
            gcfg = settings(method, train_cfg=train_cfg)
            guided = w != 1.0 and train_cfg == "rollout"
            names = loading.trainable_names(SimpleNamespace(model=kind), base, gcfg.train_head, guided)
            model = loading.policy_copy(base, names)
            assert {n for n, p in model.named_parameters() if p.requires_grad} == set(names)
            assert reached(model, base, inputs, gcfg, w) == set(names), (kind, method, w, train_cfg)


def test_policy_shares_every_frozen_parameter_with_the_reference():
    for kind in ("harmon", "nova"):
        base, _ = tiny(kind)
        base.requires_grad_(False)
        names = set(loading.trainable_names(SimpleNamespace(model=kind), base, False, True))
        model = loading.policy_copy(base, names)
        own, ref = dict(model.named_parameters()), dict(base.named_parameters())
        assert names and set(own) == set(ref)
        for name in own:
            assert (own[name] is ref[name]) == (name not in names), name  # shared iff frozen
            assert torch.equal(own[name], ref[name]) and not ref[name].requires_grad
        if kind == "harmon":  # the frozen LLM is held once; only the MAR is copied
            assert all(n.startswith("mar.") for n in names) and model.llm is not base.llm
            assert all(p is q for p, q in zip(model.llm.parameters(), base.llm.parameters()))
        else:  # NOVA's head is its image_decoder, shared and still the head
            assert model.diffloss.net is model.image_decoder and model.image_decoder.head.weight is base.image_decoder.head.weight


# -----------------------------------------------------------------------------
# 1 process × 2 micro-batches == 2 processes (torchrun, gloo), for each model's smoke pipeline

def run_train(flags, nproc):
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1
           else [sys.executable]) + [str(helpers.ROOT / "train.py"), *map(str, flags)]
    res = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def nova_pipeline(folder):
    """A NOVA pipeline folder whose transformer config carries its tiny architectures (arch_defs),
    so that a fresh process (torchrun's) builds it without test_nova's registry entries."""
    save_nova_pipeline(folder, FLOW, seed=41)
    config = json.loads((folder / "transformer" / "config.json").read_text())
    config["arch_defs"] = test_nova.tiny_config(None)["arch_defs"]
    (folder / "transformer" / "config.json").write_text(json.dumps(config))
    return folder


def assert_same_training(one, two):
    """Two run folders of 2 steps: the same first step (rewards, loss, pre-clip gradient norm: a
    gradient that was not all-reduced or not scaled by 1/micro-batches changes it) and the same
    trained parameters. Adam divides each gradient element by its own size, so the float rounding
    of summing in another order (1e-7 relative) moves an element with a near-zero gradient by up
    to ~1% of lr; 1e-5 is a tenth of the lr of these presets, while a wrong or missing half of the
    batch moves most elements by ~lr. The second step's figures follow the first update, so they
    agree to 1e-3, and its KL to 1e-2: the KL is quadratic in the weights' distance from the base,
    of which those rounding-sized moves are a part (0.25% measured on one Intel Xeon)."""
    a = torch.load(one / "ckpt" / "latest.pt", weights_only=True)
    b = torch.load(two / "ckpt" / "latest.pt", weights_only=True)
    assert a["model"].keys() == b["model"].keys() and a["step"] == b["step"] == 2
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=0, atol=1e-5, msg=k)
    ra = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines()]
    rb = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    assert len(ra) == len(rb) == 2
    for x, y, rel in zip(ra, rb, (1e-6, 1e-3)):
        for key in ("reward_mean", "adv_abs_mean", "loss", "kl", "grad_norm", "logp_parity_err", "ratio_max_dev"):
            tol = 1e-2 if key == "kl" and x["step"] == 1 else rel
            assert x[key] == pytest.approx(y[key], rel=tol, abs=1e-9), (x["step"], key, x[key], y[key])


@pytest.mark.parametrize("kind", ["small", "harmon", "nova"])
def test_two_processes_train_as_one_process_with_two_micro_batches(kind, smoke_base, harmon_files, nova_common, tmp_path):
    if kind == "small":
        flags = lambda out: ["--preset", "smoke", "--eval-prompts", "0", "--init", smoke_base, "--steps", 2, "--out", out]
    elif kind == "harmon":
        flags = lambda out: harmon_flags(harmon_files, out, "--eval-prompts", 0)
    else:
        pipe = nova_pipeline(tmp_path / "pipe")
        flags = lambda out: nova_flags(pipe, nova_common, out, "--eval-prompts", 0)
    run_train(flags(tmp_path / "one") + ["--grad-accum", 2], nproc=1)
    res = run_train(flags(tmp_path / "two"), nproc=2)
    assert res.stdout.count("GRPO (") == 1 and "world size 2" in res.stdout  # rank 0 alone prints
    assert_same_training(tmp_path / "one", tmp_path / "two")


# -----------------------------------------------------------------------------
# Reductions over ranks: logged maxima and means, evaluation gathered to rank 0 only

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(rank, world, port):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def _reduce_worker(rank, world, port, out_dir):
    _rank_env(rank, world, port)
    ctx = processes.Ctx(SimpleNamespace(device="cpu", threads=1, seed=0))
    res = dict(max=ctx.max({"a": float(rank), "b": 3.0 - rank}), mean=ctx.mean({"a": float(rank)}),
               timeout=dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    torch.save(res, f"{out_dir}/reduce{rank}.pt")
    dist.destroy_process_group()


def test_logged_maxima_and_means_over_two_ranks_and_the_timeout(tmp_path):
    torch.multiprocessing.spawn(_reduce_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        res = torch.load(tmp_path / f"reduce{rank}.pt")
        assert res == dict(max={"a": 1.0, "b": 3.0}, mean={"a": 0.5}, timeout=processes.TIMEOUT.total_seconds())


def _eval_worker(rank, world, port, base, out_dir):
    _rank_env(rank, world, port)
    gathered_everywhere = dist.all_gather_object

    def no_images(obj_list, obj, *a, **k):  # the rows cross the processes, never an image
        assert all(not any(torch.is_tensor(v) for v in row.values()) for row in obj)
        return gathered_everywhere(obj_list, obj, *a, **k)
    dist.all_gather_object = no_images
    try:
        args = train.parse_args(["--preset", "smoke", "--init", base, "--out", out_dir, "--eval-images-per-prompt", "2",
                                 "--eval-batch-size", "3"])
        ctx = processes.Ctx(args)
        model, codec, prompts = train.load_base(args, ctx, base)
        items = prompts.eval_items(4, args.seed)  # one prompt of each of the 4 categories
        rows = evaluate.generate_and_score(args, ctx, model, codec, prompts, items,
                                           {"shapes": registry.build_reward("shapes")}, os.path.join(out_dir, "eval"))
        torch.save(rows, os.path.join(out_dir, f"rows{rank}.pt"))
    finally:
        dist.all_gather_object = gathered_everywhere
        dist.destroy_process_group()


def test_evaluation_writes_each_ranks_images_and_gathers_the_rows(smoke_base, tmp_path):
    """8 images in batches of 3 on 2 ranks: each rank writes the PNGs of its batches (0 and 2 on rank
    0, 1 on rank 1), every rank ends with all 8 rows, rank 0 writes scores.jsonl; the images are those
    of one process."""
    torch.multiprocessing.spawn(_eval_worker, args=(2, free_port(), str(smoke_base), str(tmp_path)), nprocs=2, join=True)
    lines = (tmp_path / "eval" / "scores.jsonl").read_text().splitlines()
    rows = [torch.load(tmp_path / f"rows{r}.pt", weights_only=False) for r in (0, 1)]
    assert len(lines) == 8 and rows[0] == rows[1] == [json.loads(line) for line in lines]
    assert len(list((tmp_path / "eval" / "images").glob("*.png"))) == 8
    args = train.parse_args(["--preset", "smoke", "--init", str(smoke_base), "--out", str(tmp_path / "one"),
                             "--eval-images-per-prompt", "2", "--eval-batch-size", "3"])
    ctx = processes.Ctx(args)
    model, codec, prompts = train.load_base(args, ctx, str(smoke_base))
    one = evaluate.generate_and_score(args, ctx, model, codec, prompts, prompts.eval_items(4, args.seed),
                                      {"shapes": registry.build_reward("shapes")}, str(tmp_path / "one"))
    assert one == rows[0]
    for r in one:
        assert (tmp_path / "one" / r["file"]).read_bytes() == (tmp_path / "eval" / r["file"]).read_bytes()


def test_logged_parity_error_is_the_maximum_over_steps_and_warns_once(smoke_base, tmp_path, monkeypatch, capsys):
    real = grpo.ar_step_loss

    def planted(model, ref, record, j, *a, **k):  # step j's parity error: 0.3 at j = 1, 0 at j = 0
        loss, stats, old = real(model, ref, record, j, *a, **k)
        return loss, {**stats, "logp_parity_err": torch.tensor(0.3 * j)}, old
    monkeypatch.setattr(grpo, "ar_step_loss", planted)
    out = tmp_path / "run"
    code = train.cli(["--preset", "smoke", "--eval-prompts", "0", "--init", str(smoke_base), "--steps", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["logp_parity_err"] for r in rows] == [pytest.approx(0.3)] * 2  # the mean over the 2 steps is 0.15
    assert err.count("warning: step 0: recorded and recomputed log-probabilities differ by up to 0.3") == 1
    assert "warning: step 1" not in err


# -----------------------------------------------------------------------------
# No host sync in the head's per-diffusion-step loops (nor in the recorder)

class SyncCounter(TorchDispatchMode):
    """Records the ops that make the host wait for the device: reading a value (.item(), int(),
    bool()), a shape that depends on values (nonzero, boolean-mask indexing), and a tensor made
    from Python data (a host-to-device copy on a GPU). `paused` excludes code under test elsewhere."""

    def __init__(self):
        super().__init__()
        self.syncs, self.paused = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if not self.paused and (name in ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.lift_fresh")
                                or (name in ("aten.index", "aten.index_put", "aten.index_put_")
                                    and any(t is not None and t.dtype == torch.bool for t in args[1]))):
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


def test_no_host_sync_in_head_sampling_recording_and_mte():
    torch.manual_seed(0)
    head = helpers.tiny_mar().diffloss
    z = torch.randn(10, 32)
    heads = [(head, z)] + [(test_nova.tiny_nova(s, seed=3).diffloss, torch.randn(10, 48)) for s in (DDPM, FLOW)]
    for h, zz in heads:
        steps = list(h.trainable_steps())[-3:]
        with SyncCounter() as c:
            h.sample(zz, 0.9, 3.0, torch.Generator().manual_seed(0), record_steps=steps)  # guided, float w
            h.sample(zz, 0.9, torch.full((5,), 2.0), torch.Generator().manual_seed(0), record_steps=steps)  # w per row
            h.sample(zz[:5], 0.9, 1.0, torch.Generator().manual_seed(0))
        assert c.syncs == [], (type(h).__name__, c.syncs)

    # the recorder, outside the model's own predict_z, and the MTE trajectories
    model = helpers.tiny_mar()
    inputs = dict(prompt_ids=torch.tensor([[1, 2, 0], [3, 4, 5]]))
    real = model.predict_z
    counter = SyncCounter()

    def predict_z(*a):
        counter.paused += 1
        try:
            return real(*a)
        finally:
            counter.paused -= 1
    model.predict_z = predict_z
    plan = rollout.RolloutPlan(ar_steps=[1, 3], diff_steps=[7, 4])
    with counter:
        _, record = rollout.record_rollout(model, inputs, 5, 3.0, "linear", 0.9, plan, torch.Generator().manual_seed(0))
        mte.sample_trajectories(model.diffloss, record.z_final, record.z_final_null, record.cfg_final, 0.9, 3,
                                plan.diff_steps, torch.Generator().manual_seed(1))
    assert counter.syncs == [] and len(record.steps) == 2

    # the recomputed means, forward and backward (checkpointed per diffusion step)
    s = record.steps[0]
    zc = torch.randn(*s.unk_idx.shape, 32, requires_grad=True)
    with SyncCounter() as c:
        diffloss.transition_mean(model.diffloss, s.x_t, s.diff_steps, zc, zc.detach(), s.cfg).sum().backward()
    assert c.syncs == [] and zc.grad.abs().sum() > 0


# -----------------------------------------------------------------------------
# A trained AR step holds one head graph at a time

@pytest.mark.parametrize("train_head", [False, True])
def test_checkpointed_head_keeps_values_gradients_and_one_graph(train_head):
    torch.manual_seed(0)
    head = DiffLoss(8, 24, depth=3, width=64, num_sampling_steps="12").requires_grad_(train_head)
    K, rows = 6, 40
    x_t, steps = torch.randn(K, 4, rows // 4, 8), [10, 8, 7, 5, 3, 1][:K]
    z0, zn0 = torch.randn(4, rows // 4, 24), torch.randn(4, rows // 4, 24)

    def run(store, k=K):
        z, zn = z0.clone().requires_grad_(), zn0.clone().requires_grad_()
        head.zero_grad(set_to_none=True)
        nbytes, mean = saved_activation_bytes(lambda: diffloss.transition_mean(head, x_t[:k], steps[:k], z, zn, 2.5, store),
                                              head.parameters())
        (mean * torch.linspace(-1, 1, mean.numel()).reshape(mean.shape)).sum().backward()
        grads = [z.grad, zn.grad] + [p.grad for p in head.parameters() if p.requires_grad]
        return nbytes, mean.detach(), grads
    full_bytes, full_mean, full_grads = run(False)
    ckpt_bytes, ckpt_mean, ckpt_grads = run(True)
    one_bytes = run(False, k=1)[0]
    assert torch.equal(full_mean, ckpt_mean)
    assert len(full_grads) == len(ckpt_grads) == (2 + len(list(head.parameters())) * train_head)
    for a, b in zip(full_grads, ckpt_grads):
        assert torch.equal(a, b)
    assert full_bytes > 0.9 * K * one_bytes  # without checkpoints: K head graphs
    assert ckpt_bytes < one_bytes  # with them: the inputs of each step, less than one head graph


def test_a_trained_ar_step_holds_one_head_graph_whatever_k_and_s():
    """grpo.ar_step_loss, MAR-GRPO with MTE (S = 3): the activations it saves grow by less than one
    head graph from K = 1 to K = 6 recorded diffusion steps (each step's head call, and each of the
    S seeds', is recomputed in the backward pass)."""
    model = helpers.tiny_mar(diffloss_w=256)  # a head wide enough to dominate, as at real sizes
    model.requires_grad_(False)
    names = loading.trainable_names(SimpleNamespace(model="small"), model, False, True)
    policy_model = loading.policy_copy(model, names)
    params = list(model.parameters())
    inputs = dict(prompt_ids=torch.tensor([[1, 2, 0], [1, 2, 0], [3, 4, 5], [3, 4, 5]]))
    gcfg = settings("mar-grpo")
    saved = {}
    for K in (1, 6):
        plan = rollout.RolloutPlan(ar_steps=[1], diff_steps=[8, 7, 6, 5, 3, 1][:K])
        _, record = rollout.record_rollout(policy_model, inputs, 4, 3.0, "linear", 1.0, plan, torch.Generator().manual_seed(0))
        seeds = mte.sample_trajectories(model.diffloss, record.z_final, record.z_final_null, record.cfg_final, 1.0, 3,
                                        plan.diff_steps, torch.Generator().manual_seed(1))
        adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
        saved[K], (loss, _, _) = saved_activation_bytes(
            lambda: grpo.ar_step_loss(policy_model, model, record, 0, inputs, adv, gcfg, seeds), params)
        loss.backward()
    step = record.steps[0]
    z = torch.randn(*step.unk_idx.shape, 32, requires_grad=True)  # tiny_mar: decoder width 32
    one_graph, _ = saved_activation_bytes(
        lambda: diffloss.transition_mean(model.diffloss, step.x_t[:1], step.diff_steps[:1], z, z, 2.0, False), params)
    assert 0 < saved[6] - saved[1] < one_graph, (saved, one_graph)


def test_bench_head_memory_at_a_tiny_harmon(harmon_files, capsys):
    from benchmarks import bench
    res = bench.main(["--sections", "head_memory", "--preset", "adapter_smoke", "--model", "harmon", "--model-config",
                      str(harmon_files["config"]), "--head-rows", "8"])["head_memory"]
    assert res["scale"] == 9 * 2 / 8  # 3×3 tokens × G = 2 images, from 8 measured
    assert res["after"] * 1.5 < res["before"]  # K = 2 steps and S × K = 4 seeds' graphs against one
    assert "saved by the forward pass" in capsys.readouterr().out
