"""LoRA policies (`train.py --lora R`, infra/lora.py), on tiny MAR, Harmon and NOVA models and the smoke
pipeline: which projections the adapters wrap and that they alone train; at initialisation the
policy samples and records ℓ bit for bit as its base; an update moves the adapters only, and the KL
to the base (the policy with its adapters off) is exactly 0 before it and positive after; train.py's
checkpoints hold the adapters, resume bit for bit, and merge into a whole checkpoint that --init
takes and that samples as the adapters do."""

import pytest
import torch

import evaluate
import grpo
import rollout
import train
from infra import lora
from infra.processes import cli as run
from models import loading, merge_lora, vae
from tables import paper
from tests.helpers import cli, grpo_flags, load, metrics, settings
from tests.test_distributed import tiny
from tests.test_wiring import lively_base

torch.set_num_threads(1)
PROJECTIONS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")


def trained_blocks(kind, model):
    """(name, blocks) of the trained transformer's block lists, written out for each model."""
    if kind == "small":
        return [("encoder_blocks", model.encoder_blocks), ("decoder_blocks", model.decoder_blocks)]
    if kind == "harmon":
        return [("mar.encoder_blocks", model.mar.encoder_blocks), ("mar.decoder_blocks", model.mar.decoder_blocks)]
    return [("video_encoder.blocks", model.video_encoder.blocks), ("image_encoder.blocks", model.image_encoder.blocks)]


def record(model, inputs, seed=0):
    """A guided 3-step rollout recording AR steps 0 and 1 at two diffusion steps."""
    plan = rollout.RolloutPlan(ar_steps=[0, 1], diff_steps=list(model.diffloss.trainable_steps())[:2])
    return rollout.record_rollout(model, inputs, 3, 3.0, "constant", 1.0, plan, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["small", "harmon", "nova"])
def test_adapters_wrap_the_trained_blocks_projections_train_alone_and_share_every_weight(kind):
    base, _ = tiny(kind)
    base.requires_grad_(False)
    model = lora.policy(base, lora.spec(base, 3), seed=0)
    wrapped = {f"{prefix}.{i}.{proj}" for prefix, blocks in trained_blocks(kind, base) for i in range(len(blocks))
               for proj in PROJECTIONS}
    assert {name for name, m in model.named_modules() if hasattr(m, "lora_A")} == wrapped
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert set(trained) == {f"{w}.lora_{x}.default.weight" for w in wrapped for x in "AB"}
    assert sum(p.numel() for p in trained.values()) == lora.adapter_count(base, 3)  # what benchmarks/bench.py counts
    own = {name.replace(".base_layer.", "."): p for name, p in model.named_parameters() if name not in trained}
    assert own.keys() == dict(base.named_parameters()).keys()
    assert all(own[name] is p for name, p in base.named_parameters())  # the head, Harmon's LLM: all held once
    assert lora.settings(model) == lora.spec(base, 3) and lora.settings(base) is None
    again, other = lora.policy(base, lora.spec(base, 3), seed=0), lora.policy(base, lora.spec(base, 3), seed=1)
    a = lambda m: [p for name, p in m.named_parameters() if ".lora_A." in name]  # noqa: E731
    assert all(torch.equal(x, y) for x, y in zip(a(model), a(again))) and not torch.equal(a(model)[0], a(other)[0])


@pytest.mark.parametrize("kind", ["small", "harmon", "nova"])
def test_at_initialisation_the_lora_policy_samples_and_records_as_its_base(kind):
    base, inputs = tiny(kind)
    base.requires_grad_(False)
    model = lora.policy(base, lora.spec(base, 3), seed=5)
    assert all(p.abs().min() > 0 for name, p in model.named_parameters() if ".lora_A." in name)  # A is drawn: B A x = 0 by B
    (tokens0, rec0), (tokens1, rec1) = record(base, inputs), record(model, inputs)
    assert torch.equal(tokens0, tokens1)
    for s0, s1 in zip(rec0.steps, rec1.steps, strict=True):
        assert torch.equal(s0.x_prev, s1.x_prev) and torch.equal(s0.logp, s1.logp)


def test_an_update_moves_the_adapters_only_and_the_kl_to_the_base_is_0_then_positive():
    base, inputs = tiny("small")
    base.requires_grad_(False)
    before = {name: p.clone() for name, p in base.named_parameters()}
    model = lora.policy(base, lora.spec(base, 4), seed=0)
    adapters = {name: p for name, p in model.named_parameters() if p.requires_grad}
    start = {name: p.clone() for name, p in adapters.items()}
    gcfg = settings("mar-grpo")
    _, rec = record(model, inputs)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    opt = torch.optim.AdamW(adapters.values(), lr=1e-2)
    for j in range(len(rec.steps)):
        loss, stats, _ = grpo.ar_step_loss(model, base, rec, j, inputs, adv, gcfg)
        assert stats["kl"] == 0 and stats["logp_parity_err"] == 0  # the reference is the policy, adapters off
        loss.backward()
    opt.step()
    assert all(torch.equal(p, before[name]) for name, p in base.named_parameters())  # no weight moved
    assert all(not torch.equal(p, start[name]) for name, p in adapters.items())  # every adapter did
    for j in range(len(rec.steps)):
        assert grpo.ar_step_loss(model, base, rec, j, inputs, adv, gcfg)[1]["kl"] > 1e-9


# -----------------------------------------------------------------------------
# train.py --lora: checkpoints, resume, merge

# a base whose head reads z (test_wiring.lively_base), a continuous reward (no tied groups) and a large lr:
# two steps move the samples far beyond float rounding
LORA = ["--lora", "4", "--lr", "1e-2", "--reward", "jpeg_incompressibility"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, smoke_base):
    """(run folder, base): 2 GRPO steps with --lora 4, a checkpoint after each."""
    out = tmp_path_factory.mktemp("lora_run")
    base = lively_base(smoke_base, out / "base.pt")
    assert train.cli(grpo_flags(str(base), str(out / "run"), "--steps", "2", "--save-every", "1", *LORA)) == 0
    return out / "run", base


def test_checkpoints_hold_the_adapters_and_resume_bit_for_bit(lora_run, tmp_path, capsys):
    lora_run, base = lora_run
    ckpt = load(lora_run / "ckpt" / "latest.pt")
    assert ckpt["model"] and all(".lora_A.default." in k or ".lora_B.default." in k for k in ckpt["model"])
    assert ckpt["lora"]["rank"] == 4 and ckpt["base"] == str(base.resolve())
    kl = [row["kl"] for row in metrics(lora_run)]
    assert kl[0] == 0 and kl[1] > 1e-9  # the reference: the base, the policy with its adapters off
    out = tmp_path / "run"
    assert cli(capsys, *grpo_flags(base, out, "--steps", "1", *LORA))[0] == 0
    code, stdout, err = cli(capsys, *grpo_flags(base, out, "--steps", "2", "--resume", *LORA))
    assert code == 0 and "resumed from step 1" in stdout, err
    resumed = load(out / "ckpt" / "latest.pt")
    assert all(torch.equal(resumed["model"][k], v) for k, v in ckpt["model"].items())
    assert resumed["model"].keys() == ckpt["model"].keys()


def test_merged_checkpoint_samples_as_the_adapters_and_init_takes_it(lora_run, tmp_path, capsys):
    """The adapters' checkpoint loads (loading.load_policy) as its base with the adapters on; merged
    into a whole checkpoint (models/merge_lora.py) it samples the same images up to float rounding;
    --eval-only and the paper's table take both."""
    (lora_run, base_path), merged = lora_run, tmp_path / "merged.pt"
    path = lora_run / "ckpt" / "latest.pt"
    assert merge_lora.main([str(path), str(merged)]) is None
    args = train.parse_args(["--preset", "smoke"])
    ckpt = load(path)
    base = loading.load_policy(args, str(base_path))
    adapters = loading.load_policy(args, str(path))  # what --init and the paper's table load from the adapters
    assert lora.settings(adapters) == ckpt["lora"]
    assert all(torch.equal(dict(adapters.named_parameters())[k], v) for k, v in ckpt["model"].items())
    whole = loading.load_policy(args, str(merged))  # ... and from the merged checkpoint
    assert not lora.settings(whole) and set(whole.state_dict()) == set(base.state_dict())
    inputs = dict(prompt_ids=torch.tensor([[1, 2, 0], [3, 4, 5]]))
    images = [evaluate.generate(m, vae.PixelCodec(), inputs, args, torch.Generator().manual_seed(3))
              for m in (adapters, whole, base)]
    gap = (images[0] - images[1]).abs().max()
    assert gap < 1e-4 and (images[0] - images[2]).abs().max() > 100 * max(gap, 1e-6)  # measured: 1.6e-6 and 0.78
    for init in (merged, path):
        code, _, err = cli(capsys, "--preset", "smoke", "--eval-only", "--init", init, "--eval-prompts", "2",
                           "--out", tmp_path / f"eval_{init.name}")
        assert code == 0, err
    table = paper.main(["--preset", "smoke", "--ckpt", f"base={base_path}", "--ckpt", f"lora={path}",
                           "--ckpt", f"merged={merged}", "--reward", "jpeg_incompressibility", "--out", str(tmp_path / "table")])
    cells = {row["name"]: row["cells"]["jpeg_incompressibility"]["mean"] for row in table["rows"]}
    assert cells["lora"] == pytest.approx(cells["merged"], rel=1e-3) and cells["lora"] != cells["base"]


def test_adapters_answer_merge_and_a_new_run_in_one_line(lora_run, smoke_base, tmp_path, capsys):
    path = lora_run[0] / "ckpt" / "latest.pt"
    code, _, err = cli(capsys, *grpo_flags(path, tmp_path / "run"))
    assert code == 2 and err.strip() == (f"error: --init {path}: holds LoRA adapters over their base; continue their run "
                                         f"with --resume, or start a new one from them merged into a whole checkpoint "
                                         f"(python -m models.merge_lora {path} OUT.pt)")
    assert not (tmp_path / "run").exists()
    assert run(merge_lora.main, [str(smoke_base), str(tmp_path / "m.pt")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: python -m models.merge_lora {smoke_base}: not a LoRA checkpoint of "
                                               "train.py (no adapters in it: nothing to merge)")
    assert not (tmp_path / "m.pt").exists()
    assert run(merge_lora.main, [str(path)]) == 2 and "usage: python -m models.merge_lora" in capsys.readouterr().err
    assert run(merge_lora.main, [str(path), str(tmp_path)]) == 2 and "a folder" in capsys.readouterr().err
