"""`--grad-checkpointing`: every block of the trained transformer (MAR's encoder and decoder, Harmon's
MAR blocks and its frozen Qwen2 layers, NOVA's video and image encoder blocks) is recomputed in the
backward pass, and the gradients equal those of the plain pass, for the full policy, with a trained
head and with LoRA adapters, beside the head's own recomputation; train.py's smoke pipeline with
--grad-accum trains the same with and without it, and a sharded (--fsdp) checkpointed update of Harmon
is the unsharded plain one."""

import json
import re
from types import SimpleNamespace

import pytest
import torch

import grpo
import mte
import rollout
import train
from benchmarks.memory import saved_activation_bytes
from infra import flags, lora
from models import loading
from tests.helpers import grpo_flags, metrics, settings
from tests.test_distributed import _rank_env, free_port, tiny
from tests.test_fsdp import LR, update

torch.set_num_threads(1)


def checkpointed_blocks(model):
    """{name: module} of the blocks --grad-checkpointing recomputes: the model's BLOCKS, and Harmon's LLM layers."""
    pattern = type(model).BLOCKS + (r"|llm\.model\.layers\.\d+" if hasattr(model, "llm") else "")
    return {name: m for name, m in model.named_modules() if re.fullmatch(pattern, name)}


def gradients(model, ref, record, inputs, gcfg, traj, checkpointing):
    """The gradients of L over the record's two trained AR steps, the blocks whose MLP ran again in the
    backward pass, and the bytes autograd saved in the forward passes."""
    model.grad_checkpointing = checkpointing
    model.zero_grad(set_to_none=True)
    phase, again = ["forward"], set()
    hooks = [block.mlp.register_forward_pre_hook(lambda *a, name=name: again.add(name) if phase[0] == "backward" else None)
             for name, block in checkpointed_blocks(model).items()]
    adv, saved = torch.tensor([1.0, -1.0, 0.5, -0.5]), 0
    for j in range(len(record.steps)):
        phase[0] = "forward"
        nbytes, (loss, _, _) = saved_activation_bytes(
            lambda: grpo.ar_step_loss(model, ref, record, j, inputs, adv, gcfg, traj), model.parameters())
        saved += nbytes
        phase[0] = "backward"
        (loss / len(record.steps)).backward()
    for hook in hooks:
        hook.remove()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, again, saved


@pytest.mark.parametrize("kind, policy", [(k, p) for k in ("small", "mar_base", "harmon", "nova") for p in ("full", "lora")]
                         + [("small", "trained head")])
def test_checkpointed_blocks_give_the_plain_gradients(kind, policy):
    base, inputs = tiny(kind)
    base.requires_grad_(False)
    gcfg = settings("grpo" if policy == "trained head" else "mar-grpo")
    if policy == "lora":
        model = lora.policy(base, lora.spec(base, 3), seed=0)
        with torch.no_grad():  # B = 0 at initialisation would leave A without a gradient
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.normal_(0, 0.1)
    else:
        model = loading.policy_copy(base, loading.trainable_names(SimpleNamespace(model=kind), base, gcfg.train_head, True))
    plan = rollout.RolloutPlan(ar_steps=[0, 1], diff_steps=list(base.diffloss.trainable_steps())[:2])
    g = torch.Generator().manual_seed(0)
    _, record = rollout.record_rollout(model, inputs, 3, 3.0, "constant", 1.0, plan, g)
    traj = None
    if gcfg.mte_trajectories:  # MTE's head calls are recomputed per diffusion step too
        traj = mte.sample_trajectories(model.diffloss, record.z_final, record.z_final_null, record.cfg_final, 1.0, 2,
                                       plan.diff_steps, g)
    plain, again_plain, saved_plain = gradients(model, base, record, inputs, gcfg, traj, False)
    ckpt, again, saved = gradients(model, base, record, inputs, gcfg, traj, True)
    blocks = checkpointed_blocks(model)
    assert len(blocks) >= 4 and again_plain == set() and again == set(blocks)  # every block, recomputed
    assert saved < saved_plain
    assert plain.keys() == ckpt.keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(k.startswith("diffloss.") for k in plain) == (policy == "trained head")
    for name, grad in plain.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(ckpt[name], grad, rtol=1e-5, atol=1e-8, msg=name)  # fp32: float rounding at most
    if kind == "harmon":  # the LLM ran its checkpointed layers in training mode, and is back in eval mode
        assert not model.llm.training and not base.llm.training


def test_harmon_refuses_checkpointing_an_llm_with_attention_dropout():
    model, _ = tiny("harmon")
    model.llm.config.attention_dropout = 0.1
    with pytest.raises(ValueError, match="^--grad-checkpointing runs the LLM's layers in training mode, .* 0.1 "):
        model.grad_checkpointing = True
    assert not model.grad_checkpointing


def test_the_smoke_pipeline_trains_the_same_with_checkpointing_and_micro_batches(smoke_base, tmp_path):
    for name, more in (("plain", []), ("ckpt", ["--grad-checkpointing"])):
        assert train.cli(grpo_flags(str(smoke_base), str(tmp_path / name), "--steps", "2", "--grad-accum", "2", *more)) == 0
    plain, ckpt = metrics(tmp_path / "plain"), metrics(tmp_path / "ckpt")
    assert [{k: v for k, v in r.items() if not k.startswith("t_")} for r in plain] == \
        [{k: v for k, v in r.items() if not k.startswith("t_")} for r in ckpt]
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["grad_checkpointing"] is True
    a, b = (torch.load(tmp_path / n / "ckpt" / "latest.pt", weights_only=True)["model"] for n in ("plain", "ckpt"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _fsdp_worker(rank, world, port, out_dir):
    _rank_env(rank, world, port)
    torch.distributed.init_process_group("gloo")
    try:
        trained, norm, _ = update("harmon", [slice(2 * rank, 2 * rank + 2)], world, checkpointing=True)
        if rank == 0:
            torch.save(dict(trained=trained, norm=norm), f"{out_dir}/harmon.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_a_sharded_checkpointed_update_of_harmon_is_the_unsharded_plain_one(tmp_path):
    torch.multiprocessing.spawn(_fsdp_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    sharded = torch.load(tmp_path / "harmon.pt", weights_only=True)
    trained, norm, _ = update("harmon", [slice(0, 2), slice(2, 4)])
    assert sharded["norm"] == pytest.approx(norm, rel=1e-5) and sharded["trained"].keys() == trained.keys()
    for k, v in trained.items():  # as test_fsdp's sharded update: the reduction's rounding moves elements by < lr/100
        torch.testing.assert_close(sharded["trained"][k], v, rtol=0, atol=LR / 100, msg=k)


def test_the_real_models_presets_checkpoint_and_a_flag_turns_it_off():
    on = {p for p in flags.PRESETS if train.parse_args(["--preset", p]).grad_checkpointing}
    assert on == {"mar_base", "harmon", "nova", "nova_mix"}  # docs/memory.md: what each needs to fit
    assert not train.parse_args(["--preset", "harmon", "--no-grad-checkpointing"]).grad_checkpointing
    assert train.parse_args(["--grad-checkpointing"]).grad_checkpointing
