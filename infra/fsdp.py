"""`train.py --fsdp`: the policy's trained parameters, their gradients and their AdamW state sharded
over the processes with PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`), under the same
`torchrun --nproc_per_node=N train.py ...` command; and whole tensors in checkpoints either way.

What is sharded, and why:
1. Each block of the trained transformer (the model's `BLOCKS`: MAR's encoder and decoder blocks,
   Harmon's MAR blocks, NOVA's video and image encoder blocks) is one FSDP unit, gathered whole for
   its forward and its backward and freed after each; the model's other trained parameters (the
   token projection, position tables, the null condition) are the root unit.
2. Frozen parameters are not sharded (`ignored_params`): the diffusion head and Harmon's LLM stay
   whole on every process and shared with the KL reference, as without --fsdp
   (loading.policy_copy). The reference (the base model) and the reward models stay whole and
   frozen. Sharding them as well would divide their bytes by N too, at the price of gathering the
   frozen weights at every forward; `python -m benchmarks.bench --memory PRESET` shows what each part holds.
3. The models never call `forward` in GRPO: the policy interface's `condition`,
   `null_condition_like` and `predict_z` are registered as FSDP forward methods, so the root unit
   is gathered when they run.
4. FSDP reduce-scatters the gradients after each trained AR step's backward (the mean over the
   processes, as DDP's all-reduce), so no process ever holds a whole gradient; train.py calls
   `policy.backward_rollout` with ddp=False (there is no DDP wrapper to hold the sync back).
5. With --grad-checkpointing, a unit's block is recomputed in the backward pass after FSDP's
   pre-backward hook has gathered it (FSDP2 composes with non-reentrant activation checkpointing;
   tests/test_checkpointing.py checks a sharded checkpointed update of Harmon against a plain one).
6. Checkpoints hold whole tensors, as without --fsdp: `whole_state` gathers them (every rank
   calls it, rank 0 keeps them, one tensor at a time), `load_state` shards them again, so a run
   resumes with or without --fsdp.
Not sharded: a trained head (--train-head; its calls run outside the registered methods)
and LoRA adapters (benchmarks/bench.py --memory counts them: a small fraction of the model, and the frozen
weights they sit on stay whole anyway); flags.check_run_inputs refuses both with --fsdp.
"""

import re
import warnings

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, distribute_tensor

FORWARD_METHODS = ("condition", "null_condition_like", "predict_z")  # rollout.py's policy interface


def shard(model, world, device):
    """Shard `model` (a policy: its trained parameters require grad) over the `world` processes
    on `device`'s kind, in place (module docstring). Returns model."""
    mesh = init_device_mesh(device.type, (world,))
    frozen = {p for p in model.parameters() if not p.requires_grad}
    for name, module in model.named_modules():
        if re.fullmatch(type(model).BLOCKS, name):
            fully_shard(module, mesh=mesh, ignored_params=frozen)
    fully_shard(model, mesh=mesh, ignored_params=frozen)
    for method in FORWARD_METHODS:
        register_fsdp_forward_method(model, method)
    # the null condition is a view of `fake_latent` (MAR) or of one computed row (NOVA); FSDP warns that an
    # in-place op on a returned view would lose its backward hook, and nothing changes a condition in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    return model


def whole(t):
    """A sharded tensor gathered whole on every rank (a collective: every rank calls it); any
    other tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def whole_state(model, opt, master):
    """(trained parameters {name: tensor}, optimizer state dict) with whole tensors, for a
    checkpoint, on rank 0 (`master`); (None, None) on the others. Every rank calls it: sharded
    tensors are gathered one at a time, and rank 0 moves each to the host (the whole AdamW state of
    a large model need not fit beside it on one GPU); other tensors are returned as they are."""
    def gathered(t):
        if isinstance(t, DTensor):
            t = t.full_tensor()
            return t.cpu() if master else None
        return t
    trained = {name: gathered(p.detach()) for name, p in model.named_parameters() if p.requires_grad}
    state = opt.state_dict()  # {"state": {index: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups"}; the
    state = {**state, "state": {i: {k: gathered(v) for k, v in s.items()}  # inner dicts are the optimizer's own
                                for i, s in state["state"].items()}}
    return (trained, state) if master else (None, None)


def like(value, param):
    """A whole tensor `value` (from a checkpoint) as `param` holds it: this rank's shard when param
    is sharded, else value itself."""
    if not isinstance(param, DTensor):
        return value
    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)


def load_state(model, opt, trained, optimizer):
    """Load whole tensors from a checkpoint: the trained parameters {name: tensor} into `model`
    and the optimizer state dict into `opt`, sharded like their parameters where those are."""
    params = dict(model.named_parameters())
    model.load_state_dict({k: like(v, params[k]) for k, v in trained.items()}, strict=False)
    order = [p for group in opt.param_groups for p in group["params"]]  # the state dict's indices
    state = {i: {k: like(v, order[i]) if torch.is_tensor(v) and v.shape == order[i].shape else v for k, v in s.items()}
             for i, s in optimizer["state"].items()}
    opt.load_state_dict({**optimizer, "state": state})
