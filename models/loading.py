"""The policies train.py drives, by name, each with its codec and its prompts.

`--model` names one of: the small MAR of the shapes world (`small`, demo/pretrain.py), the
official MAR models (`mar_base`, `mar_large`, `mar_huge`: class labels, KL-16 latents), Harmon
(`harmon`: text through Qwen2.5, KL-16 latents, harmon.py) and NOVA (`nova`: precomputed Phi-2
prompt embeddings, its own VAE, nova.py). This is the one place that knows which is which; the
recorder, the loss and the training loop see only the policy interface (mar.MaskedAR).

What trains under RL (`trainable_names`), following the released trainers (AMAP-ML/mar-grpo),
less every parameter the loss never reads (DDP needs a gradient for each trained parameter; the
released trainers run under DeepSpeed, which does not, so they list them without training them):
- MAR: the transformer (encoder, decoder, condition embedding); the head only with --train-head.
  Not read: the class table of the prompt-conditioned small model, the word table of the
  class-conditioned official models, and their null embedding `fake_latent` when the loss is not
  guided (--cfg 1 or --train-cfg 1).
- Harmon: only the MAR encoder/decoder (`fix_head`; the LLM, proj_in and proj_out stay frozen
  but in the graph, so gradients reach the MAR encoder through the LLM). Not read: `mar.class_emb`
  (Harmon conditions through the LLM).
- NOVA: the whole transformer except its diffusion MLP `image_decoder` (`fix_head`). Not read:
  `video_encoder.patch_embed` (the text-to-image video encoder sees one bos frame, never patches).
The policy shares every frozen parameter with the reference it was copied from (`policy_copy`), so
a frozen LLM is held once, and a GRPO checkpoint holds the trained parameters only, over its base
(`load_policy` reads both). With --lora, LoRA adapters train instead (infra/lora.py); `load_policy`
reads their checkpoint as the base with the adapters on.
"""

import copy
import importlib
import json
import math
import os

import torch.nn as nn

import mar
from demo import shapes
from infra import checkpoints, flags, lora
from models import vae
from models.prompts import Prompts, prompt_text, read_prompt_file

MODELS = flags.MODELS  # what --model names


def adapter(name):
    """models.harmon or models.nova, imported when a run first asks for it: both pull in parts of
    transformers (seconds to import) that runs of the other models never need."""
    return importlib.import_module(f"models.{name}")


def _ours(path, flag="--init", mmap=False):
    """The {"model", "config"} dict of a checkpoint this project wrote, or None for another file
    (mmap: its tensors mapped, not read)."""
    if not path.endswith(".pt") or not os.path.isfile(path):
        return None
    ckpt = checkpoints.read_checkpoint(path, flag, mmap=mmap)
    return ckpt if isinstance(ckpt, dict) and "model" in ckpt and isinstance(ckpt.get("config"), dict) else None


# -----------------------------------------------------------------------------
# MAR checkpoints: official `.pth` files and this project's own

def mar_config_from_state_dict(sd, args=None):
    """Infer MAR constructor arguments from an official state dict's shapes (and its pickled
    args when present). Head counts are not in the shapes: the official models use 64-dim heads
    except mar_large/huge (16 heads)."""
    def depth(prefix):  # number of distinct indices i in "prefix.i.*"
        return len({k[len(prefix) + 1:].split(".")[0] for k in sd if k.startswith(prefix + ".")})
    enc_dim, tok_dim = sd["z_proj.weight"].shape
    dec_dim = sd["decoder_embed.weight"].shape[0]
    seq_len = sd["diffusion_pos_embed_learned"].shape[1]
    heads = {768: 12, 1024: 16, 1280: 16}
    get = (lambda name, default: getattr(args, name, default)) if args is not None else (lambda name, default: default)
    vae_embed_dim = get("vae_embed_dim", tok_dim)
    patch_size = get("patch_size", 1)
    vae_stride = get("vae_stride", 16)
    return dict(
        img_size=get("img_size", int(round(math.sqrt(seq_len))) * patch_size * vae_stride),
        vae_stride=vae_stride, patch_size=patch_size, vae_embed_dim=vae_embed_dim,
        encoder_embed_dim=enc_dim, encoder_depth=depth("encoder_blocks"), encoder_num_heads=heads.get(enc_dim, max(1, enc_dim // 64)),
        decoder_embed_dim=dec_dim, decoder_depth=depth("decoder_blocks"), decoder_num_heads=heads.get(dec_dim, max(1, dec_dim // 64)),
        mlp_ratio=sd["encoder_blocks.0.mlp.fc1.weight"].shape[0] / enc_dim, norm_eps=1e-6,
        class_num=sd["class_emb.weight"].shape[0],
        buffer_size=sd["encoder_pos_embed_learned"].shape[1] - seq_len,
        diffloss_d=depth("diffloss.net.res_blocks"),
        diffloss_w=sd["diffloss.net.input_proj.weight"].shape[0],
        num_sampling_steps=str(get("num_sampling_steps", "100")),
        text_vocab_size=sd["text_emb.weight"].shape[0] if "text_emb.weight" in sd else 0,
    )


def load_checkpoint(path, ema=True, model=None, flag="--init", ckpt=None, **overrides):
    """Load an official MAR `.pth` ({'model', 'model_ema', 'args'}) or one of ours ({'model',
    'config', ...}) into a MAR, in eval mode.

    ema: take 'model_ema' when the file has it (official default), else 'model'.
    model: load into this model (strict); otherwise build one from the file's config (ours) or
           from the state dict's shapes and pickled args (official); `overrides` replace config
           entries (e.g. num_sampling_steps="100"); ckpt: the file's contents when already read.
    """
    ckpt = checkpoints.read_checkpoint(path, flag) if ckpt is None else ckpt
    sd = checkpoints.model_state(ckpt, path, flag, ema)
    if model is None:
        if "z_proj.weight" not in sd:
            raise ValueError(f"{flag} {path}: not a MAR checkpoint (no 'z_proj.weight' in its state dict)")
        config = ckpt["config"] if isinstance(ckpt.get("config"), dict) else mar_config_from_state_dict(sd, ckpt.get("args"))
        model = mar.build_mar({**config, **overrides})
    return checkpoints.load_weights(model, sd, path, flag).eval()


def load_policy(args, path, flag="--init"):
    """The policy in eval mode on the CPU from `path`: an official release, a base of ours, or a
    GRPO checkpoint of ours (its trained parameters over the base it names), with the run's number
    of diffusion steps and, with --grad-checkpointing, its transformer's blocks recomputed in the
    backward pass (the policy GRPO trains is a copy of it and keeps the setting; passes without
    gradients, the rollout's and the reference's, are not changed by it)."""
    model = read_policy(args, path, flag)
    model.grad_checkpointing = getattr(args, "grad_checkpointing", False)  # a checkpoint's old flags may lack it
    return model


def read_policy(args, path, flag):
    """`load_policy` without its checkpointing setting."""
    T = args.num_sampling_steps
    ours = _ours(path, flag)
    if ours is not None and "base" in ours:  # a GRPO checkpoint: the trained parameters (or LoRA adapters) only
        base = ours["base"]
        if not os.path.exists(base):
            raise FileNotFoundError(f"{flag} {path}: holds the trained parameters only, and its base {base} is missing")
        model = read_policy(args, base, flag)
        if ours.get("lora"):  # the base with the adapters on (infra/lora.py)
            model = lora.policy(model, ours["lora"])
        load_trained(model, ours["model"], path, flag)
        return model
    if args.model == "small":
        return load_checkpoint(path, flag=flag, ckpt=ours, num_sampling_steps=str(T))  # ours: read once
    if args.model.startswith("mar_"):
        model = getattr(mar, args.model)(**mar.OFFICIAL_HEADS[args.model], img_size=args.img_size, num_sampling_steps=str(T))
        return load_checkpoint(path, model=model, flag=flag)
    if args.model == "harmon":
        harmon = adapter("harmon")
        config = ours["config"] if ours else harmon_config(args)
        config = dict(config, mar=dict(config["mar"], num_sampling_steps=str(T)))
        return harmon.load_harmon(path, config, flag)
    nova = adapter("nova")
    if ours:
        model = nova.build(dict(ours["config"], num_diffusion_steps=T))
        checkpoints.check_state_dict(model, ours["model"], path, flag)
        model.load_state_dict(ours["model"])
        return model.eval()
    return nova.load_nova(path, num_sampling_steps=T)


def describe(args, model, given):
    """Make the flags that describe the model say what `model` is, so that what a run records about
    itself (config.json, checkpoints) is what ran: the small model's --img-size is its checkpoint's
    (a preset's value gives way; one written on the command line that contradicts the checkpoint is
    a one-line error naming both). The model's whole configuration is recorded beside the flags
    (config.json's "model"). given: the dests written on the command line (flags.given)."""
    if args.model == "small" and args.img_size != model.img_size:
        if "img_size" in given:
            raise ValueError(f"--img-size {args.img_size}: the base {args.init} is a model of {model.img_size}-px images "
                             "(drop --img-size: the small model's size is its checkpoint's)")
        args.img_size = model.img_size


def base_record(path):
    """What a run records of its base: the path and, for a checkpoint of this project, how it was
    made (its stage and flags: the world it was pretrained in)."""
    ours = _ours(path, mmap=True)
    made = {k: ours[k] for k in ("stage", "args", "base") if k in ours} if ours else {}
    return {"path": os.path.abspath(path), **made}


def load_trained(model, sd, path, flag="--init"):
    """Load a GRPO checkpoint's trained parameters `sd` into `model` (its base); a key the model
    lacks or a wrong shape is a one-line error naming `flag` and `path`."""
    own = dict(model.named_parameters())
    problems = checkpoints.state_dict_mismatch({k: own[k] for k in sd if k in own}, sd)
    if problems:
        raise ValueError(f"{flag} {path}: checkpoint does not fit its base: {problems}")
    model.load_state_dict(sd, strict=False)


def harmon_config(args):
    """--model-config: a released Harmon config name (harmon.CONFIGS) or a JSON file of one."""
    harmon = adapter("harmon")
    if args.model_config in harmon.CONFIGS:
        return harmon.CONFIGS[args.model_config]
    if args.model_config and os.path.isfile(args.model_config):
        with open(args.model_config) as f:
            return json.load(f)
    raise ValueError(f"--model-config {args.model_config!r}: a name in {sorted(harmon.CONFIGS)} or a JSON config file")


def load_codec(args, model, device="cpu"):
    """Latent images <-> pixels on `device`: raw pixels (small), the KL-16 VAE (--vae: MAR,
    Harmon), or the NOVA pipeline's own VAE (the vae/ folder beside --init)."""
    if args.model == "small":
        return vae.PixelCodec()
    if args.model == "nova":
        folder = os.path.join(os.path.dirname(os.path.abspath(args.init.rstrip("/"))), "vae") \
            if not os.path.isdir(os.path.join(args.init, "vae")) else os.path.join(args.init, "vae")
        return vae.DiffusersCodec(args.vae or folder, device=device)
    return vae.VAECodec(vae.load_vae(args.vae).to(device))


def check_prompt_files(args):
    """Before anything is loaded: --prompts parses (shapes prompts for the small model, text lines or
    released records for Harmon and NOVA; a class file is checked against its model when loaded), and
    --categories names categories of the shapes world. One-line errors naming the flag."""
    unknown = [c for c in args.categories if c not in shapes.CATEGORIES]
    if unknown or not args.categories:
        raise ValueError(f"--categories {' '.join(args.categories)}: choose from {', '.join(shapes.CATEGORIES)}")
    if args.prompts is not None and args.model in ("small", "harmon", "nova"):
        read_prompt_file(args.prompts, "shapes" if args.model == "small" else "text")


def load_prompts(args, model, path=None, flag="--prompts"):
    """The run's Prompts: shapes prompts, class indices, or text lines encoded for the model, from
    --prompts (or the prompt file `path` of `flag`, e.g. the paper's table's --choose-prompts)."""
    path = args.prompts if path is None else path
    if args.model == "small":
        items = read_prompt_file(path, "shapes", flag=flag) if path else None
        return Prompts("shapes", items, args.split, categories=args.categories)
    if args.model.startswith("mar_"):
        items = read_prompt_file(path, "class", model.num_classes, flag) if path else None
        return Prompts("class", items, num_classes=model.num_classes)
    if path is None:
        raise ValueError(f"{flag}: --model {args.model} needs a prompt file (one prompt per line)")
    items = read_prompt_file(path, "text", flag=flag)  # lines, or the released metadata records
    return Prompts("text", items, encode=text_encoder(args, model, [prompt_text(it) for it in items]))


def text_encoder(args, model, texts):
    """prompts (list of str), device -> condition inputs: Harmon's tokenizer (--tokenizer, a local
    folder), or NOVA's precomputed embeddings (--prompt-embeds, written by `python -m
    models.nova_embed`), which must hold every prompt of `texts`."""
    if args.model == "harmon":
        harmon = adapter("harmon")
        if not args.tokenizer:
            raise ValueError("--tokenizer: --model harmon needs the Qwen2.5 tokenizer folder")
        tokenizer = harmon.load_tokenizer(args.tokenizer)
        harmon.set_null_prompt_from_tokenizer(model, tokenizer)
        return lambda prompts, device: {k: v.to(device) for k, v in harmon.prompt_ids(tokenizer, prompts).items()}
    if not args.prompt_embeds:
        raise ValueError("--prompt-embeds: --model nova needs the prompts' Phi-2 embeddings (python -m models.nova_embed)")
    table = checkpoints.read_checkpoint(args.prompt_embeds, "--prompt-embeds")
    if not isinstance(table, dict) or not {"prompts", "embeds"} <= table.keys():
        raise ValueError(f"--prompt-embeds {args.prompt_embeds}: expected a dict with 'prompts' and 'embeds'")
    index = {p: i for i, p in enumerate(table["prompts"])}
    missing = [p for p in texts if p not in index]
    if missing:
        raise ValueError(f"--prompt-embeds {args.prompt_embeds}: no embedding for {len(missing)} prompts, e.g. {missing[0]!r}")
    return lambda prompts, device: dict(prompt_embeds=table["embeds"][[index[p] for p in prompts]].to(device))


def load_tuned(base, path, flag="--init"):
    """The tuned policy of GRPO checkpoint `path` (its trained parameters, or LoRA adapters) over
    the loaded `base`, whose frozen parts it shares; frozen, in eval mode."""
    ckpt = checkpoints.read_checkpoint(path, flag)
    tuned = lora.policy(base, ckpt["lora"]) if ckpt.get("lora") else policy_copy(base, ckpt["model"])
    load_trained(tuned.requires_grad_(False), ckpt["model"], path, flag)
    return tuned.eval()


def trainable_names(args, model, train_head, guided):
    """The names of the parameters RL trains (module docstring), in the model's order.

    train_head: the diffusion head trains too (--method grpo); guided: the loss recomputes z of the
    null condition (guidance in the rollout and --train-cfg rollout).
    """
    trained, frozen = ([model.mar] if args.model == "harmon" else [model]), []
    if args.model == "harmon":
        frozen.append(model.mar.class_emb)
    elif args.model == "small":
        frozen.append(model.class_emb)  # prompt-conditioned: the class table is unused
    elif args.model.startswith("mar_"):
        frozen.append(getattr(model, "text_emb", nn.Identity()))
        if not guided:
            frozen.append(model.fake_latent)
    elif args.model == "nova":
        frozen.append(model.video_encoder.patch_embed)
    if not train_head:
        frozen.append(model.diffloss)
    tensors = lambda m: list(m.parameters()) if isinstance(m, nn.Module) else [m]
    keep = {id(p) for m in trained for p in tensors(m)} - {id(p) for m in frozen for p in tensors(m)}
    return [name for name, p in model.named_parameters() if id(p) in keep]


def make_policy(args, base, settings):
    """The policy GRPO trains from `base` (grpo.GRPOSettings `settings`): `policy_copy` of the
    parameters `trainable_names` picks, the null condition counted as read when the loss is guided
    (guidance in the rollout and --train-cfg rollout)."""
    guided = args.cfg != 1.0 and settings.train_cfg == "rollout"
    return policy_copy(base, trainable_names(args, base, settings.train_head, guided))


def policy_copy(base, trainable):
    """A copy of `base` that owns the parameters named in `trainable` (requires_grad) and shares
    every other parameter with `base` (frozen, held once). Buffers are copied."""
    trainable = set(trainable)
    memo = {id(p): p for name, p in base.named_parameters() if name not in trainable}  # deepcopy keeps these
    model = copy.deepcopy(base, memo)
    for name, p in model.named_parameters():
        p.requires_grad_(name in trainable)
    return model
