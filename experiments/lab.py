"""What the lab adds to train.py and to the demo's pretraining, and the command that runs them with it:
its presets and rewards are registered when this module is imported (experiments/study.py and
spatial.py import it), its flags, loss and choice of trained steps are `LAB` (a train.Extensions),
which it gives train.py once:

    python -m experiments.lab FLAGS               # train.py with FLAGS and the lab's presets, rewards and flags
    python -m experiments.lab --pretrain FLAGS    # python -m demo.pretrain with the lab's pretraining presets

- the preset free16: the base of experiments/study.md (experiments/bases/free16.pt): free object
  sizes and positions, clean captions, CFG 6, τ 0.5, lr 1e-5. Made with 8000 steps, then 8000
  more at half the learning rate on new data draws (43 and 66 minutes on 2 CPU cores, torch 2.14):
      python -m experiments.lab --pretrain --preset free16 --out runs/free_base --threads 2
      python -m experiments.lab --pretrain --preset free16 --out runs/free_base2 \\
          --pretrain-from runs/free_base/base.pt --pretrain-lr 5e-4 --seed 1
      python -m infra.checkpoints half runs/free_base2/base.pt experiments/bases/free16.pt
- the preset relation: the demo's settings from experiments/bases/relation.pt, a base of the cell
  world that half-follows spatial relations (experiments/study.md, "Spatial relations"). Made from
  demo/base.pt on spatial captions only, with MAE masking of at least 90% of the tokens (so that the
  reference object is often hidden while the subject shows), first clean, then with each caption's
  relation kept with probability 0.5 (a random layout otherwise); 7 minutes each on one CPU thread:
      python -m experiments.lab --pretrain --preset relation --pretrain-from demo/base.pt --seed 11 \\
          --threads 1 --out runs/relation_clean
      python -m experiments.lab --pretrain --preset relation --pretrain-from runs/relation_clean/base.pt \\
          --relation-p 0.5 --seed 13 --threads 1 --out runs/relation_half
      python -m infra.checkpoints half runs/relation_half/base.pt experiments/bases/relation.pt
- the presets mirror05 and mirror07: the demo's settings on spatial prompts with the reward
  shapes_partial, from bases that know a relation's axis but not its direction, as no temperature
  can fix (experiments/study.md, "Looking for a result RL earns"): stage 1 above, then 1500 steps on
  captions whose relation is drawn mirrored with probability 0.5 or 0.7 (24 minutes each beside
  other runs on 2 CPU cores):
      python -m experiments.lab --pretrain --preset relation --pretrain-from runs/relation_clean/base.pt \\
          --relation-mirror 0.7 --seed 13 --threads 1 --out runs/mirror0.7
      python -m infra.checkpoints half runs/mirror0.7/base.pt experiments/bases/mirror07.pt
  (and the same with 0.5 into runs/mirror0.5, experiments/bases/mirror05.pt)
- the rewards shapes_coverage (a deliberately hackable proxy) and shapes_relation (the relation,
  scored strictly);
- the flag --train-ar-below N (not in the paper): the trained AR steps are drawn from the first N
  only, the steps that place the objects; and --loss raft, the supervised control of
  experiments/raft.py.
"""

import os
import sys

import numpy as np
import torch

import grpo
import train
from demo import pretrain, shapes, verifier
from experiments import raft
from infra import flags, processes
from scorers import registry

FREE16_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bases", "free16.pt")
FREE16_BASE_SHA256 = "a60207e9f2a68321a025568539d959753f182ded1fbbd46c7c83627d96cd36ee"
RELATION_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bases", "relation.pt")
RELATION_BASE_SHA256 = "5457450d18789d284542b2fe5c9f8694fe4afe2bfdd8a8dd4a4e699bddcb5948"
MIRROR_BASES = {q: os.path.join(os.path.dirname(os.path.abspath(__file__)), "bases", f"mirror{q}.pt")
                for q in ("05", "07")}
MIRROR_SHA256 = {"05": "256d5848f1ca73f718ed970baae33ec1c128da34dab7a3559f7e1e68cb4c767c",
                 "07": "30dd7f4d07be045224e0453d6ffc88e7a9ba95f6fe62a24d789b9a6d56cfe9e6"}
PRESETS = {"free16": dict(init=FREE16_BASE, img_size=16, num_iter=16, min_diff_step=2, lr=1e-5, cfg=6.0),
           "relation": dict(flags.SHAPES, init=RELATION_BASE, categories=["spatial"]),
           **{f"mirror{q}": dict(flags.SHAPES, init=path, categories=["spatial"], reward="shapes_partial")
              for q, path in MIRROR_BASES.items()}}
PRETRAIN_PRESETS = {"free16": dict(img_size=16, patch_size=2, local_conv=3, pretrain_steps=8000),
                    "relation": dict(pretrain.PRESETS["demo"], categories=["spatial"], unmentioned=0.0,
                                     mask_ratio_min=0.9, pretrain_steps=1500, pretrain_lr=5e-4)}
PRETRAIN_PRESETS.update({f"mirror{q}": dict(PRETRAIN_PRESETS["relation"], relation_mirror=int(q) / 10)
                         for q in MIRROR_BASES})


class ShapesCoverageReward(verifier.ShapesReward):
    """A deliberately hackable proxy of the shapes world, for the reward-hacking study (study.md):
    the mean, over the colours the prompt asks for, of the fraction of pixels of that colour,

        r = 1/|C| sum_{c in C} #{pixels nearest to colour c} / (H W),   C = the prompt's colours,

    pixels assigned to the nearest of black and the palette as the verifier does. It rises with
    the right colours on the canvas, so it correlates with the verifier's score, but it pays more
    for more paint: large blobs score higher than the asked shapes, counts and sizes."""

    name = "shapes_coverage"

    def score(self, images, prompts, metadata):
        classes = verifier.nearest_colour(images.cpu().permute(0, 2, 3, 1).numpy())  # (B, H, W), 0 = black
        names = list(shapes.COLORS)  # colour k is class k + 1
        scores = []
        for b, meta in enumerate(self.metas(prompts, metadata)):
            asked = sorted({names.index(o["color"]) + 1 for o in meta["objects"]})
            scores.append(float(np.mean([(classes[b] == k).mean() for k in asked])))
        return torch.tensor(scores, dtype=torch.float32), {}


class ShapesRelationReward(verifier.ShapesReward):
    """The relation, scored strictly: r = 1 where a spatial prompt's relation holds (demo/verifier.py) with
    each of its two objects drawn exactly once and nothing else drawn, else 0; the verifier's score
    for prompts of the other categories. Strict because the verifier's relation compares the largest
    instances, which duplicates game: trained on the verifier alone, the demo base learnt to fill the
    grid with copies of the requested objects (study.md, "Spatial relations"). Weighted beside
    `shapes` it puts more of the reward on placement: `--reward shapes:1,shapes_relation:1`."""

    name = "shapes_relation"

    def score(self, images, prompts, metadata):
        scores, details = verifier.verify_batch(images.cpu(), self.metas(prompts, metadata))
        r = [float(d["relation"] is True and d["count"] and d["extra_objects"] == 0) if d["relation"] is not None
             else float(s) for s, d in zip(scores, details)]
        return torch.tensor(r, dtype=torch.float32), {"details": list(details)}


def lab_flags(p):
    p.add_argument("--train-ar-below", type=flags.NONNEG_INT, default=0,
                   help="draw the trained AR steps from the first N only (0 = from all, as released; not in the paper)")
    p.add_argument("--loss", default="grpo", choices=["grpo", "raft"],
                   help="the update's loss: grpo, or raft (the supervised control of experiments/raft.py; not in the paper)")


def make_loss(model, args):
    """The update's loss module of --loss: train.py's GRPO loss, or RAFT's supervised control."""
    return raft.RAFTLoss(model, args.group_size) if args.loss == "raft" else train.PolicyLoss(model)


def choose_steps(args, num_ar_steps, n_trained, trainable, n_diff, generator):
    """A rollout's trained steps, its AR steps drawn from the first --train-ar-below ones (0: all)."""
    return grpo.choose_train_steps(num_ar_steps, n_trained, trainable, n_diff, generator,
                                   below=args.train_ar_below)


# what the lab adds to train.py, given once to train.main: its flags, loss and choice of steps
LAB = train.Extensions(flag_groups=(("the lab (experiments/lab.py)", lab_flags),), make_loss=make_loss,
                       choose_steps=choose_steps)


def parse_args(argv):
    """train.py's flags with the lab's presets and flags."""
    return train.parse_args(argv, LAB)


flags.PRESETS.update(PRESETS)
pretrain.PRESETS.update(PRETRAIN_PRESETS)
registry.REWARDS["shapes_coverage"] = (ShapesCoverageReward, (), set())
registry.REWARDS["shapes_relation"] = (ShapesRelationReward, (), set())


def main(argv=None):
    """train.py (or, after --pretrain, the demo's pretraining) with the lab's additions. Returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--pretrain"]:
        return processes.cli(pretrain.main, argv[1:])
    return train.cli(argv, LAB)


if __name__ == "__main__":
    sys.exit(main())
