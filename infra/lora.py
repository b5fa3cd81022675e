"""LoRA adapters for the policy (`train.py --lora R`); models/merge_lora.py merges them into a whole
checkpoint (`python -m models.merge_lora RUN/ckpt/latest.pt merged.pt`).

A LoRA adapter (Hu et al. 2021) on a linear layer y = W x + b adds a rank-R update:
y = W x + b + (α / R) · B A x, with A (R, in) and B (out, R); only A and B train. With --lora R,
peft wraps the attention and MLP projections (qkv, proj, fc1, fc2) of the trained transformer's
blocks, which each model's file names (`LORA_TARGETS`): MAR's encoder and decoder blocks, Harmon's
MAR encoder and decoder (the LLM stays frozen, as the released trainer keeps it), NOVA's video and
image encoder blocks. Peers train the same way: DDPO and Flow-GRPO (rank 32) fine-tune LoRA.

What this file decides, and why:
1. Only A and B train. Every weight of the model stays frozen, the diffusion head among them, as
   MAR-GRPO wants it (flags.check_run_inputs refuses --lora with a trained head).
2. B starts at zero (peft's default), so at initialisation the policy computes exactly what its base
   computes: the same z, samples and recorded ℓ, bit for bit (adding B A x = 0 changes no value).
   A is drawn (kaiming-uniform, peft's choice) from a generator seeded by --seed, not from the
   global random state peft draws from: every process and a resumed run build the same adapters.
3. α = R, so the update B A is added at scale 1 whatever the rank.
4. The KL reference is the base itself: the policy is a copy of the base that shares every weight
   with it and carries the adapters (`policy`), i.e. the same model with the adapters off. No
   second copy of any weight is held.
5. A checkpoint holds A and B (and their optimizer state) with their settings (`settings`) and the
   path of their base: train.py resumes from it, and --init and the paper's table read it as its base with
   the adapters on (models/loading.load_policy). `merged_state_dict` adds (α / R) B A into each
   wrapped weight, for a whole checkpoint other tools can read (models/merge_lora.py); its samples
   equal the adapters' up to float rounding: W + B A is summed before the product with x instead of
   after.
"""

import copy
import math
import re

import torch
import torch.nn as nn

ADAPTER = "default"  # peft's adapter name: parameters are named `<layer>.lora_A.default.weight`


def spec(model, rank):
    """The adapters' settings for `model` at rank R, as a checkpoint stores them (a plain dict)."""
    return dict(rank=rank, alpha=float(rank), targets=type(model).LORA_TARGETS)


def settings(model):
    """The settings of the adapters on `model` (peft keeps them on it), or None without adapters."""
    config = getattr(model, "peft_config", {}).get(ADAPTER)
    return None if config is None else dict(rank=config.r, alpha=float(config.lora_alpha), targets=config.target_modules)


def add_adapters(model, spec, seed=0):
    """Wrap the target projections of `model` (in place) with LoRA adapters of `spec` (see `spec`):
    every other parameter frozen, B zero, A drawn from a CPU generator seeded by `seed` (module
    docstring, item 2). Returns model."""
    from peft import LoraConfig, inject_adapter_in_model  # here, not at the top: only --lora runs pay its import (~1.3 s)
    model.requires_grad_(False)
    config = LoraConfig(r=spec["rank"], lora_alpha=spec["alpha"], lora_dropout=0.0, target_modules=spec["targets"])
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    generator = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if f".lora_A.{ADAPTER}." in name:  # (R, in)
            a = nn.init.kaiming_uniform_(torch.empty(p.shape), a=math.sqrt(5), generator=generator)
            with torch.no_grad():
                p.copy_(a)
    return model


def policy(base, spec, seed=0):
    """The LoRA policy over `base`: a copy of base that shares every parameter with it (buffers
    copied; nothing trained but the adapters), with adapters of `spec` drawn from `seed`."""
    return add_adapters(copy.deepcopy(base, {id(p): p for p in base.parameters()}), spec, seed)


def adapter_count(model, rank):
    """Parameters that adapters of rank R on `model` would add: R · (in + out) per target
    projection. Reads only shapes, so it works on a model built on the meta device (benchmarks/bench.py)."""
    return sum(rank * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and re.fullmatch(type(model).LORA_TARGETS, name))


def merged_state_dict(model):
    """The state dict of `model` with its adapters merged: W + (α / R) B A for every wrapped
    projection, under the base's own key names (`.base_layer` dropped, no `lora_` keys). The
    model is not changed."""
    merged = {}
    for key, value in model.state_dict().items():
        if ".lora_" in key:
            continue
        if key.endswith(".base_layer.weight"):  # a wrapped projection's W (out, in)
            layer = model.get_submodule(key.removesuffix(".base_layer.weight"))
            A, B = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight  # (R, in), (out, R)
            value = value + layer.scaling[ADAPTER] * (B @ A)  # (out, in)
        merged[key.replace(".base_layer.", ".")] = value
    return merged
