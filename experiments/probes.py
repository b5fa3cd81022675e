"""Probes of a pixel-token base (the demo's small MAR): measure what a base has learnt before
tuning anything on top of it.

    python -m experiments.probes --context-probe demo/base.pt    # does the base use its canvas? (in the preset's world)
    python -m experiments.probes --noise-probe demo/base.pt      # where does a rollout's randomness decide the image?
    python -m experiments.probes --relation-probe BASE [--split heldout]   # does the base use the relation word?

Every other flag is train.py's (the preset's sampling flags); --cell gives the base's world.
"""

import argparse
import sys

import numpy as np
import torch
import torch.nn.functional as F

import rollout
import train
from demo import shapes, verifier
from diffloss import reverse_sample
from experiments import lab  # noqa: F401  (registers the lab's presets: --preset free16)
from experiments import spatial
from infra import flags, processes
from models.prompts import Prompts
from models import loading, vae
from scorers import registry


def _coloured(tokens):
    """(..., C) pixel tokens in [-1, 1] -> (...) 1.0 where some pixel is not black (black is -1)."""
    return (tokens > -0.5).any(-1).float()


@torch.no_grad()
def context_probe(model, codec, n_images=128, known_fracs=(0.0, 0.5, 0.9), temperature=0.5, seed=0, cell=0):
    """Does a pixel-token base model use the canvas? Rendered training-split images with a random
    fraction of their tokens known: the diffusion loss on the unknown tokens (split into tokens
    with some colour and all-black ones), and how often a token sampled there (no CFG) is coloured
    where the image is black or the reverse. A model that reads its neighbours gets better as more
    of the canvas is known; one that has learnt only the prompt's marginal does not. cell: the
    base's world (shapes.render: 0 free objects, or objects aligned to cells of this many pixels).

    Returns {known_frac: {"loss_coloured", "loss_black", "colour_error"}}, "coloured_frac" and "n_images"."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    imgs, metas = shapes.make_dataset(n_images, model.img_size, np.random.default_rng(seed), split="train", cell=cell)
    tokens = model.patchify(codec.encode(torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 255))  # (B, L, C)
    B, L, C = tokens.shape
    flat = tokens.reshape(B * L, C)
    coloured = _coloured(tokens)  # (B, L)
    cond = model.condition(**Prompts("shapes").condition(metas, tokens.device))
    order = torch.argsort(torch.rand(B, L, generator=g), dim=1)  # the same known positions for every fraction

    def loss(z, sel):  # the training loss on the selected positions (B, L), averaged over 10 noise draws
        return float(np.mean([model.diffloss(z=z, target=flat, mask=sel.reshape(B * L), generator=g).item()
                              for _ in range(10)]))

    res = {"coloured_frac": coloured.mean().item(), "n_images": n_images}
    for frac in known_fracs:
        unknown = torch.ones(B, L).scatter_(1, order[:, :int(L * frac)], 0.0)  # (B, L), 1 = unknown
        z = model.predict_z(tokens, unknown, cond).reshape(B * L, -1)  # (B·L, D)
        sampled = model.diffloss.sample(z, temperature=temperature, generator=g).reshape(B, L, C)
        wrong = (_coloured(sampled) != coloured).float()  # (B, L)
        res[frac] = dict(loss_coloured=loss(z, unknown * coloured), loss_black=loss(z, unknown * (1 - coloured)),
                         colour_error=((wrong * unknown).sum() / unknown.sum()).item())
    return res


def linear_probe(model, codec, known_frac=0.9, n_images=256, seed=0, cell=0):
    """Does z at a hidden position know whether that token is coloured? A logistic regression from
    z (standardised) to "this token has colour", fitted on the hidden tokens of n_images rendered
    training-split images with `known_frac` of their tokens known, tested on the hidden tokens of
    n_images others (rendered in the world of `cell`, as context_probe). Returns (test accuracy, the
    majority-class base rate of the test tokens)."""
    sets = []
    for part in (seed, seed + 1):  # fit, test
        imgs, metas = shapes.make_dataset(n_images, model.img_size, np.random.default_rng([part, 13]), split="train",
                                          cell=cell)
        tokens = model.patchify(codec.encode(torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 255))  # (B, L, C)
        B, L, _ = tokens.shape
        order = torch.argsort(torch.rand(B, L, generator=torch.Generator().manual_seed(part)), dim=1)
        unknown = torch.ones(B, L).scatter_(1, order[:, :round(L * known_frac)], 0.0)  # (B, L), 1 = hidden
        with torch.no_grad():
            z = model.predict_z(tokens, unknown, model.condition(**Prompts("shapes").condition(metas, tokens.device)))
        hidden = unknown.bool()
        sets.append((z[hidden], _coloured(tokens)[hidden]))  # (N, D), (N,)
    (x_fit, y_fit), (x_test, y_test) = sets
    mu, sd = x_fit.mean(0), x_fit.std(0) + 1e-6
    w = torch.zeros(x_fit.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=200)

    def closure():
        opt.zero_grad()
        logits = (x_fit - mu) / sd @ w + b
        loss = F.binary_cross_entropy_with_logits(logits, y_fit) + 1e-3 * (w ** 2).sum()
        loss.backward()
        return loss
    opt.step(closure)
    with torch.no_grad():
        accuracy = ((((x_test - mu) / sd @ w + b) > 0).float() == y_test).float().mean().item()
    return accuracy, max(y_test.mean().item(), 1 - y_test.mean().item())


def _token_colours(tokens, patch_size):
    """(N, 3·p²) pixel tokens in [-1, 1] (channel-major, as MAR.patchify) -> (N, p²) palette index
    of each pixel (verifier.nearest_colour: 0 = black)."""
    pixels = ((tokens.reshape(len(tokens), 3, patch_size ** 2).transpose(1, 2) + 1) / 2).clamp(0, 1)  # (N, p², 3)
    return torch.as_tensor(verifier.nearest_colour(pixels.numpy()))


@torch.no_grad()
def noise_probe(model, codec, reward_fn, num_iter=16, cfg=6.0, temperature=0.5, n_prompts=16, group=12, seed=0):
    """Where does a rollout's randomness decide the image? A rollout has two sources: the random
    generation order (not an action of the policy: no log-probability is taken of it) and the
    head's noise (the actions whose log-probabilities the policy gradient uses). For `n_prompts`
    training-split prompts × `group` images (a GRPO group each):
      - reward variance within a group with every image's order drawn afresh, and with one order
        shared by the group (then only the head's noise differs): their ratio is the share of the
        reward's variance that the policy's actions carry;
      - for each token, z as the rollout generated it; the head is run again from z with the
        same noise except at one diffusion step k (or all of it, x^T too): how often the token's
        colour (any pixel's nearest palette colour) changes, per k, and per AR step of the token.
    Returns {"reward_var_free_order", "reward_var_fixed_order", "share_of_head_noise",
    "flip_at_step": {k: fraction}, "flip_all": fraction, "flip_by_ar_step": [fraction per AR step]}."""
    model.eval()
    items = [m for m in shapes.sample_prompts(n_prompts, np.random.default_rng([seed, 21])) for _ in range(group)]
    prompts = Prompts("shapes")
    inputs, texts = prompts.condition(items, "cpu"), prompts.texts(items)
    B, L = len(items), model.seq_len
    free = model.sample_orders(B, torch.Generator().manual_seed(seed))  # (B, L)
    fixed = free[::group].repeat_interleave(group, 0)  # (B, L): one order per group

    def group_rewards(orders):  # (n_prompts, group) rewards of one rollout with these orders
        tokens, record = rollout.record_rollout(model, inputs, num_iter, cfg, "linear", temperature,
                                                generator=torch.Generator().manual_seed(seed + 1), orders=orders)
        images = codec.decode(model.unpatchify(tokens).float())
        return reward_fn(images, texts, items)[0].reshape(n_prompts, group), record

    r_fixed, _ = group_rewards(fixed)
    r_free, record = group_rewards(free)
    var_free, var_fixed = r_free.var(1).mean().item(), r_fixed.var(1).mean().item()
    res = dict(reward_var_free_order=var_free, reward_var_fixed_order=var_fixed,
               share_of_head_noise=var_fixed / max(var_free, 1e-12))

    # the head's decisions: replay each token's sampling from the z it was generated from
    head, p = model.diffloss, model.patch_size
    D, C = record.z_final.shape[-1], model.token_embed_dim
    z = record.z_final.reshape(B * L, D)  # (BL, D)
    if record.z_final_null is not None:  # with guidance: (2BL, D) = [cond; null]
        z = torch.cat([z, record.z_final_null.reshape(B * L, D)])
    w = record.cfg_final.reshape(B * L)  # (BL,)
    g = torch.Generator().manual_seed(seed + 2)
    draw = lambda: torch.randn(B * L, C, generator=g)  # noqa: E731
    x_T, noise = draw(), {k: draw() for k in range(1, head.num_sampling_steps)}
    ref = _token_colours(reverse_sample(head, z, C, temperature, w, x_T=x_T, noise=noise), p)  # (BL, p²)
    res["flip_at_step"] = {}
    for k in sorted(noise, reverse=True):
        changed = _token_colours(reverse_sample(head, z, C, temperature, w, x_T=x_T, noise={**noise, k: draw()}), p)
        res["flip_at_step"][k] = (changed != ref).any(1).float().mean().item()
    flips = (_token_colours(reverse_sample(head, z, C, temperature, w, x_T=draw(), noise={k: draw() for k in noise}), p)
             != ref).any(1).float().reshape(B, L)  # (B, L)
    res["flip_all"] = flips.mean().item()
    counts = model.ar_schedule(num_iter, L)
    ar_step = torch.repeat_interleave(torch.arange(len(counts)), torch.as_tensor(counts))  # (L,) step of the j-th generated
    step_of = torch.empty(B, L, dtype=torch.long).scatter_(1, record.orders, ar_step.expand(B, L))  # (B, L)
    res["flip_by_ar_step"] = [flips[step_of == i].mean().item() for i in range(len(counts))]
    return res


def _load_pixel_base(path, args, flag):
    """The base a probe looks into: train.py's small model (pixel tokens, prompt-conditioned), or exit
    naming the flag."""
    model = loading.load_policy(args, path, flag)
    if model.config["vae_stride"] != 1 or model.config.get("text_vocab_size", 0) == 0:
        raise ValueError(f"{flag} {path}: needs a prompt-conditioned pixel-token base (the demo's small model)")
    return model


def run_noise_probe(path, args, out):
    model = _load_pixel_base(path, args, "--noise-probe")
    res = noise_probe(model, vae.PixelCodec(), registry.build_reward("shapes"),
                      args.num_iter, args.cfg, args.temperature)
    out(f"noise probe of {path} (CFG {args.cfg:g}, τ {args.temperature:g}, {args.num_iter} AR steps)")
    out(f"  reward variance within a group: orders drawn per image {res['reward_var_free_order']:.4f}, one order per "
        f"group {res['reward_var_fixed_order']:.4f}: the head's noise carries {res['share_of_head_noise']:.0%} of it")
    out("  a token's colour changes when the head's noise is redrawn at one diffusion step k (other noise kept):")
    out("    " + "  ".join(f"k={k}: {v:.1%}" for k, v in res["flip_at_step"].items()))
    out(f"  ... at every step: {res['flip_all']:.1%}; by the token's AR step: "
        + " ".join(f"{v:.0%}" for v in res["flip_by_ar_step"]))
    return res


def run_context_probe(path, args, cell, out):
    model = _load_pixel_base(path, args, "--context-probe")
    res = context_probe(model, vae.PixelCodec(), temperature=args.temperature, cell=cell)
    out(f"context probe of {path}: {res['n_images']} training-split images" + (f" in {cell}-px cells" if cell else "")
        + f", τ {args.temperature:g}, {res['coloured_frac']:.1%} of tokens coloured")
    out("  known fraction | diffusion loss, coloured / black unknown tokens | colour error of sampled unknown tokens")
    for frac, r in res.items():
        if isinstance(frac, float):
            out(f"  {frac:14.1f} | {r['loss_coloured']:.4f} / {r['loss_black']:.4f} | {r['colour_error']:.3f}")
    for frac in (0.5, 0.9):
        res[f"linear_probe_{frac}"] = accuracy, base_rate = linear_probe(model, vae.PixelCodec(), frac, cell=cell)
        out(f"linear probe z -> coloured at the hidden tokens, {frac:.0%} known: accuracy {accuracy:.3f} "
            f"(base rate {base_rate:.3f})")
    return res


# -----------------------------------------------------------------------------
# Does the base use the relation word? (the cell world)

# the cell a relation asks for, from the subject's (row, column) on a 2 × 2 grid; the subject's cell
# must leave room: "left of" puts the subject in column 0 and asks for the reference in column 1
ASKED = {"left of": (0, 1), "right of": (0, -1), "above": (1, 0), "below": (-1, 0)}  # (d_row, d_col) subject -> reference
OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


def complete(model, cond, tokens, unknown, num_iter, temperature, generator):
    """Write the unknown tokens of a canvas: tokens (B, L, C), unknown (B, L) bool with the same
    count n in every row, in a random order over `model.ar_schedule(num_iter, n)` steps at CFG 1 (as
    the demo samples; `spatial.continue_rollout`). Returns the tokens (B, L, C)."""
    n = int(unknown[0].sum())
    noise = torch.rand(unknown.shape, generator=generator).masked_fill(~unknown, 2.0)  # (B, L), known ones last
    return spatial.continue_rollout(model, cond, tokens, unknown, noise.argsort(dim=1), 0, num_iter, temperature,
                                    generator, counts=model.ar_schedule(num_iter, n))


def subject_canvases(model, metas, rng, cell=8):
    """For spatial metas, an image holding only the subject, drawn in a random cell that leaves room
    for the asked reference cell, and the tokens (B, L) bool of the subject's cell (known). Returns
    (images (B, H, W, 3) uint8, known (B, L) bool, asked cells [(row, col)])."""
    size, p = model.img_size, model.patch_size
    n = size // cell
    images, known, asked = np.zeros((len(metas), size, size, 3), dtype=np.uint8), [], []
    for b, meta in enumerate(metas):
        d_row, d_col = ASKED[meta["relation"]]
        rows = [r for r in range(n) if 0 <= r + d_row < n]
        cols = [c for c in range(n) if 0 <= c + d_col < n]
        r, c = int(rng.choice(rows)), int(rng.choice(cols))
        subject = meta["objects"][0]
        images[b, r * cell:r * cell + cell - 1, c * cell:c * cell + cell - 1][shapes._patch(subject["shape"], cell - 1)] = \
            shapes.COLORS[subject["color"]]
        grid = torch.zeros(size // p, size // p, dtype=torch.bool)  # (h, w) token grid
        grid[r * cell // p:(r + 1) * cell // p, c * cell // p:(c + 1) * cell // p] = True
        known.append(grid.flatten())
        asked.append((r + d_row, c + d_col))
    return images, torch.stack(known), asked


@torch.no_grad()
def relation_probe(model, metas, temperature=1.0, num_iter=16, seed=0, cell=8, batch=128):
    """Does a base place the reference where the relation word asks? For each spatial prompt of
    `metas` (one image each), the subject is drawn alone in its cell and known, and the base completes
    the image (`complete`) under the prompt, under the prompt with the opposite relation, and under
    the prompt with a relation of the other axis. Among completions that draw the reference object
    exactly once (and nothing else), the share whose reference lands in the cell the original
    prompt asks for: a base that uses the word puts it there under the prompt and elsewhere under the
    opposite one; one that ignores it lands there 1/3 of the time under all three (3 free cells).
    Returns {"asked", "opposite", "other_axis": {"rate", "n", "drawn"}}."""
    rng = np.random.default_rng([seed, 41])
    images, known, asked = subject_canvases(model, metas, rng, cell)
    tokens0 = model.patchify(vae.PixelCodec().encode(torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255))
    other_axis = {"left of": "above", "right of": "below", "above": "left of", "below": "right of"}
    res = {}
    for name, relation_of in (("asked", lambda r: r), ("opposite", OPPOSITE.get), ("other_axis", other_axis.get)):
        prompts = [m["prompt"].replace(f" {m['relation']} ", f" {relation_of(m['relation'])} ") for m in metas]
        hits = drawn = 0
        for b0 in range(0, len(metas), batch):
            sl = slice(b0, b0 + batch)
            cond = model.condition(prompt_ids=torch.from_numpy(shapes.tokenize(prompts[sl])))
            g = torch.Generator().manual_seed(seed * 1000003 + b0)  # the same noise under every prompt
            tokens = complete(model, cond, tokens0[sl] * known[sl, :, None], ~known[sl], num_iter, temperature, g)
            pixels = vae.PixelCodec().decode(model.unpatchify(tokens)).permute(0, 2, 3, 1).numpy()  # (B, H, W, 3)
            for found, meta, cell_asked in zip(verifier.detect_objects(pixels), metas[sl], asked[sl]):
                ref = meta["objects"][1]
                refs = [d for d in found if (d["color"], d["shape"]) == (ref["color"], ref["shape"])]
                if len(refs) == 1 and len(found) == 2:
                    drawn += 1
                    hits += (int(refs[0]["y"] // cell), int(refs[0]["x"] // cell)) == cell_asked
        res[name] = dict(rate=hits / max(drawn, 1), n=drawn, drawn=drawn / len(metas))
    return res


def run_relation_probe(path, args, split, cell, out):
    """`relation_probe` of the base at `path` on every spatial prompt of `split`, at args.temperature,
    in the world of `cell`-px cells."""
    model = loading.load_policy(args, path, "--relation-probe")
    res = relation_probe(model, spatial.spatial_prompts(split), args.temperature, args.num_iter, args.seed, cell)
    out(f"relation probe of {path} ({split} split, τ {args.temperature:g}): the subject drawn and known, the reference "
        "lands in the cell the prompt asks for (chance 1/3), among completions that draw it once and nothing else")
    for name, r in res.items():
        sem = (r["rate"] * (1 - r["rate"]) / max(r["n"], 1)) ** 0.5
        out(f"  {name:>10} relation word: {r['rate']:.3f} ± {sem:.3f} of {r['n']} ({r['drawn']:.0%} of completions counted)")
    return res


def main(argv=None):
    """`python -m experiments.probes ...`: one probe of a base; returns its figures."""
    p = processes.Parser(prog="python -m experiments.probes", description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context-probe", default=None, metavar="BASE", help="does this base use the canvas? (context_probe)")
    p.add_argument("--noise-probe", default=None, metavar="BASE", help="which random draws decide an image? (noise_probe)")
    p.add_argument("--relation-probe", default=None, metavar="BASE", help="does this base use the relation word? "
                                                                          "(relation_probe; in cells of --cell or 8 px)")
    p.add_argument("--cell", type=flags.NONNEG_INT, default=0, help="the base's world: objects in cells of this many pixels")
    p.add_argument("--split", default="train", choices=["train", "heldout"], help="--relation-probe: which spatial prompts")
    opts, rest = p.parse_known_args(argv)
    if sum(x is not None for x in (opts.context_probe, opts.noise_probe, opts.relation_probe)) != 1:
        p.error("give one of --context-probe BASE, --noise-probe BASE and --relation-probe BASE")
    args = train.parse_args(rest)
    if args.threads:
        torch.set_num_threads(args.threads)
    say = lambda s: print(s, flush=True)  # noqa: E731
    if opts.noise_probe:
        return run_noise_probe(opts.noise_probe, args, say)
    if opts.relation_probe:
        return run_relation_probe(opts.relation_probe, args, opts.split, opts.cell or 8, say)
    return run_context_probe(opts.context_probe, args, opts.cell, say)


if __name__ == "__main__":
    sys.exit(processes.cli(main))
