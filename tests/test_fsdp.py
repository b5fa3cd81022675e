"""`train.py --fsdp` (infra/fsdp.py), on the CPU with gloo: two processes sharding the small MAR's smoke
pipeline train as one process with --grad-accum 2 does, across a checkpoint and --resume (whole
tensors gathered, sharded again); and one sharded GRPO update of tiny Harmon and NOVA policies (the
LLM frozen and whole, the head whole) equals the unsharded update of the same two rollouts."""

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import grpo
import rollout
import train
from infra import flags, fsdp
from models import loading
from tests.test_distributed import _rank_env, assert_same_training, free_port, run_train, tiny
from tests.helpers import settings

torch.set_num_threads(1)


def test_two_sharded_processes_train_and_resume_as_one_process(smoke_base, tmp_path):
    flags = lambda out, steps: ["--preset", "smoke", "--eval-prompts", "0", "--init", str(smoke_base), "--steps", str(steps),
                                "--out", str(tmp_path / out)]
    assert train.cli(flags("one", 2) + ["--grad-accum", "2"]) == 0
    first = run_train(flags("two", 1) + ["--fsdp"], nproc=2)
    assert "sharded over the 2 processes" in first.stdout
    second = run_train(flags("two", 2) + ["--fsdp", "--resume"], nproc=2)
    assert "resumed from step 1" in second.stdout
    assert_same_training(tmp_path / "one", tmp_path / "two")


@pytest.mark.parametrize("more, words", [(["--method", "grpo"], "a trained head is not sharded"),
                                         (["--lora", "4"], "use --lora without --fsdp")])
def test_what_fsdp_does_not_shard_is_one_line(smoke_base, more, words):
    args = train.parse_args(["--preset", "smoke", "--eval-prompts", "0", "--init", str(smoke_base), "--fsdp", *more])
    with pytest.raises(ValueError, match=words):
        flags.check_run_inputs(args, 2, train.grpo_settings(args).train_head)
    args = train.parse_args(["--preset", "smoke", "--eval-prompts", "0", "--init", str(smoke_base), "--fsdp"])
    flags.check_run_inputs(args, 2, train.grpo_settings(args).train_head)


# -----------------------------------------------------------------------------
# One sharded update of Harmon and NOVA

LR, MAX_NORM = 1e-3, 1e-3  # the clip binds: the gradient norm over the shards enters the update


def update(kind, parts, world=None, checkpointing=False):
    """One GRPO update of `kind`'s tiny policy from one rollout of each batch slice in `parts` (2
    prompts × G = 2 in all), each slice's loss scaled by 1/len(parts), sharded over `world`
    processes when given, its blocks checkpointed when asked (--grad-checkpointing). Returns (the
    trained parameters, whole; pre-clip gradient norm; model)."""
    base, inputs = tiny(kind)
    base.requires_grad_(False)
    gcfg = settings("mar-grpo")
    model = loading.make_policy(SimpleNamespace(model=kind, cfg=3.0), base, gcfg)
    model.grad_checkpointing = checkpointing
    if world:
        fsdp.shard(model, world, torch.device("cpu"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR)
    for rows in parts:
        part = {k: v[rows] for k, v in inputs.items()}
        plan = rollout.RolloutPlan(ar_steps=[0, 1], diff_steps=list(base.diffloss.trainable_steps())[:2])
        _, record = rollout.record_rollout(model, part, 3, 3.0, "constant", 1.0, plan,
                                           torch.Generator().manual_seed(rows.start))
        for j in range(len(record.steps)):
            loss = grpo.ar_step_loss(model, base, record, j, part, torch.tensor([1.0, -1.0]), gcfg)[0]
            (loss / len(record.steps) / len(parts)).backward()
    norm = fsdp.whole(torch.nn.utils.clip_grad_norm_(params, MAX_NORM))
    opt.step()
    trained = {name: fsdp.whole(p.detach()) for name, p in model.named_parameters() if p.requires_grad}
    return trained, float(norm), (model, base)


def _update_worker(rank, world, port, out_dir):
    _rank_env(rank, world, port)
    dist.init_process_group("gloo")
    try:
        for kind in ("harmon", "nova"):
            trained, norm, (model, base) = update(kind, [slice(2 * rank, 2 * rank + 2)], world)
            shared = dict(base.named_parameters())
            for name, p in model.named_parameters():  # trained: sharded; frozen: whole, the reference's own
                assert isinstance(p, DTensor) == p.requires_grad and (p.requires_grad or p is shared[name]), name
            if rank == 0:
                torch.save(dict(trained=trained, norm=norm), os.path.join(out_dir, f"{kind}.pt"))
    finally:
        dist.destroy_process_group()


def test_a_sharded_update_of_harmon_and_nova_is_the_unsharded_one(tmp_path):
    torch.multiprocessing.spawn(_update_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for kind in ("harmon", "nova"):
        sharded = torch.load(tmp_path / f"{kind}.pt", weights_only=True)
        trained, norm, (model, _) = update(kind, [slice(0, 2), slice(2, 4)])
        assert sharded["norm"] == pytest.approx(norm, rel=1e-5) and norm > MAX_NORM
        assert sharded["trained"].keys() == trained.keys()
        start = {name: p for name, p in tiny(kind)[0].named_parameters()}
        moved = max((trained[k] - start[k]).abs().max() for k in trained)
        assert moved > 0.5 * LR  # the update is real: Adam moves elements by up to lr
        for k, v in trained.items():  # float rounding of the reduction moves near-zero-gradient elements by < lr/100
            torch.testing.assert_close(sharded["trained"][k], v, rtol=0, atol=LR / 100, msg=k)


# -----------------------------------------------------------------------------
# The memory table (`python -m benchmarks.bench --memory PRESET`, benchmarks/memory_table.py): its counted cells and its model

def tiny_harmon_memory_flags(folder):
    """bench.py's --memory flags for a tiny Harmon (its config written to folder) at 4 and 9 tokens."""
    import json

    from tests import test_harmon
    (folder / "h.json").write_text(json.dumps(test_harmon.tiny_config()))
    return ["--memory", "adapter_smoke", "--model", "harmon", "--model-config", str(folder / "h.json"), "--memory-tokens", "4,9"]


def test_memory_table_counts_each_mode_at_a_tiny_harmon(tmp_path):
    from benchmarks import bench
    from infra import lora
    from benchmarks import memory_table
    from tests import test_harmon
    res = bench.main(tiny_harmon_memory_flags(tmp_path) + ["--memory-images", "2", "--lora", "3", "--world", "4"])["memory"]
    model = test_harmon.tiny_harmon(seed=0)
    args = SimpleNamespace(model="harmon")
    trained = sum(p.numel() for n, p in model.named_parameters() if n in loading.trainable_names(args, model, False, True))
    everything = sum(p.numel() for p in model.parameters())
    adapters = sum(p.numel() for p in lora.policy(model, lora.spec(model, 3)).parameters() if p.requires_grad)
    n, t = res["counts"], res["table"]
    assert (n["all"], n["trained"], n["lora"], n["tokens"]) == (everything, trained, adapters, 9)
    variants = ["fp32", "fp32, checkpointed", "bf16", "bf16, checkpointed"]
    assert list(t) == [f"{mode}, {v}" for mode in ("DDP", "FSDP over 4", "LoRA rank 3") for v in variants]
    measured = {" ".join(k.split(" ")[:3]) for k in res["measured"]}  # "policy tokens images dtype[, checkpointed]"
    assert measured == {"full 4 2", "full 9 2", "full 4 4"}  # two token counts, and twice the images at the smaller
    for v in variants:
        cell = lambda row, col: t[f"{row}, {v}"][col][0] / 4  # noqa: E731  (numbers of fp32 values, in either dtype)
        assert [cell("DDP", c) for c in ("weights", "gradients", "AdamW", "reference")] == [everything, trained, 2 * trained, trained]
        assert [cell("FSDP over 4", c) for c in ("weights", "gradients", "AdamW", "reference")] == \
            [everything - trained * 3 / 4, trained / 4, trained / 2, trained]
        assert [cell("LoRA rank 3", c) for c in ("weights", "gradients", "AdamW", "reference")] == \
            [everything + adapters, adapters, 2 * adapters, 0]
        assert cell("DDP", "VAE + reward") == 66_456_019  # the KL-16 VAE's official parameters; the JPEG reward has none
        assert t[f"DDP, {v}"]["AR step peak"][1] == "m" and t[f"FSDP over 4, {v}"]["AR step peak"][1] == "~"
        assert t[f"LoRA rank 3, {v}"]["AR step peak"][1] == "~"  # the full policy's, LoRA's not measured
    for name, row in t.items():  # G = 2 images, 9 tokens: measured at the preset; the record of 2 trained AR steps is whole
        assert [row[c][1] for c in ("weights", "record + MTE", "rollout peak")] == ["c"] + ["~" if "LoRA" in name else "m"] * 2
        static = sum(v for c, (v, _) in row.items() if c not in ("rollout peak", "AR step peak", "total"))
        assert row["total"][0] == static + max(row["rollout peak"][0], row["AR step peak"][0])
    assert set(res["time_ratio"]) == {"fp32", "bf16"}
    # the model: a line through two token counts, scaled to the preset's images, less what does not grow with them
    assert memory_table.at_preset({(64, 1): 10.0, (256, 1): 40.0}, 1024, 4) == ((10 + 30 / 192 * 960) * 4, "~")
    assert memory_table.at_preset({(64, 1): 10.0, (256, 1): 40.0, (64, 2): 15.0}, 1024, 4) == (5 + 4 * (5 + 30 / 192 * 960), "~")
    assert memory_table.at_preset({(64, 4): 10.0, (256, 4): 40.0}, 256, 4) == (40.0, "m")


def test_memory_table_measures_only_the_dtypes_asked_for(tmp_path):
    """--memory-dtypes bf16: the bf16 rows, measured and modelled as in the full table, no fp32 row;
    a dtype that is not fp32 or bf16, or one given twice, is a one-line error naming the flag."""
    from benchmarks import bench
    flags_ = tiny_harmon_memory_flags(tmp_path) + ["--memory-repeats", "1"]
    res = bench.main(flags_ + ["--memory-dtypes", "bf16"])["memory"]
    assert list(res["table"]) == [f"{mode}, bf16{c}" for mode in ("DDP", "FSDP over 8", "LoRA rank 32")
                                  for c in ("", ", checkpointed")]
    assert set(res["time_ratio"]) == {"bf16"} and all("fp32" not in k for k in res["measured"])
    for bad in ("fp16", "bf16,bf16", ""):
        with pytest.raises(ValueError, match=r"^--memory-dtypes"):
            bench.main(flags_ + ["--memory-dtypes", bad])
