"""Tests of the paper's table (`python -m tables.paper --ckpt NAME=PATH ...`) and of evaluate.py's generation
and sweep under it, in this process, on the CPU.

Two small-MAR checkpoints in train.py's format ({"model", "config"}: a random one and a perturbed
copy), two shapes prompts, 2 images per prompt, and three rewards: `shapes`, `jpeg_incompressibility`
and a tiny random open_clip model loaded as `hpsv2` through its real weights path. Checked: one row
per checkpoint, one column per reward (two for shapes); every cell's mean ± SEM equals the hand
computation from scores.jsonl; HPS is printed ×100; the stored scores are what each reward gives
for the written PNGs; the images are the seeded generator's, per batch, the same whatever the
checkpoint's place, the run or the rank; the two checkpoints draw different images. Then tiny
Harmon and NOVA releases against tuned checkpoints of ours (test_train_adapters' fixtures), and
the one-line errors.
"""

import contextlib
import json
import math
import statistics

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image

import evaluate
import mar
import train
from demo import pretrain, shapes, verifier
from experiments import spatial
from infra import processes
from models import loading, vae
from scorers import clip as clip_rewards
from scorers import registry
from tables import paper
from tests.helpers import ADAPTER_PROMPTS as NOVA_PROMPTS
from tests.test_train_adapters import DDPM, save_nova_pipeline

torch.set_num_threads(1)  # tiny ops: threads only add contention on a 2-core machine

SHAPES_PROMPTS = ["a red circle", "two blue squares"]
TINY_CLIP = "evaluate-test-tiny"  # 32 px, patch 8, width 32, 2 layers, embed 16
SAMPLING = ["--preset", "smoke", "--num-iter", "2", "--num-sampling-steps", "4", "--temperature", "1.0"]


def run(capsys, *flags):
    """tables.paper.cli in this process. Returns (exit status, stdout, stderr)."""
    capsys.readouterr()
    code = paper.cli([str(f) for f in flags])
    out, err = capsys.readouterr()
    return code, out, err


def read_scores(folder):
    return [json.loads(line) for line in (folder / "scores.jsonl").read_text().splitlines()]


def read_png(path):
    return np.array(Image.open(path))  # (H, W, 3) uint8


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two small-MAR checkpoints as train.py writes them, a shapes prompt file, a tiny HPS file."""
    d = tmp_path_factory.mktemp("evaluate")
    config = pretrain.small_mar_config(pretrain.parse_args(["--preset", "smoke", "--num-sampling-steps", "4"]))
    torch.manual_seed(0)  # the model initialises from the global generator; tests only
    base = mar.build_mar(config)
    g = torch.Generator().manual_seed(1)
    tuned = {k: v + 0.1 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
             for k, v in base.state_dict().items()}  # every weight moves, the zero-initialised ones too
    torch.save({"model": base.state_dict(), "config": config, "stage": "pretrain"}, d / "base.pt")
    torch.save({"model": tuned, "config": config, "step": 3}, d / "tuned.pt")
    (d / "prompts.txt").write_text("\n".join(SHAPES_PROMPTS) + "\n")
    save_tiny_hps(d)
    return d


def save_tiny_hps(folder, name=TINY_CLIP, layers=2, seed=2):
    """A tiny open_clip architecture `name` registered from `folder`, and its HPS file folder/HPS_tiny.pt."""
    cfg = {"embed_dim": 16, "vision_cfg": {"image_size": 32, "layers": layers, "width": 32, "head_width": 16, "patch_size": 8},
           "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": layers}}
    (folder / f"{name}.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(folder)
    torch.manual_seed(seed)  # open_clip initialises from the global generator; tests only
    torch.save({"state_dict": open_clip.create_model(name, pretrained=None).state_dict()}, folder / "HPS_tiny.pt")
    return folder / "HPS_tiny.pt"


def tiny_hps(monkeypatch, name=TINY_CLIP):
    """`--reward hpsv2` builds HPS on the tiny open_clip architecture `name` (its real loading path)."""
    factory = lambda **kw: clip_rewards.HPSv2Reward(model_name=name, **kw)
    monkeypatch.setitem(registry.REWARDS, "hpsv2", (factory, ("hpsv2",), set()))


def table_flags(files, out, *ckpts, batch=3, reward="shapes,jpeg_incompressibility,hpsv2"):
    weights = ["--reward-ckpt", f"hpsv2={files / 'HPS_tiny.pt'}"] if "hpsv2" in reward else []  # only what is used
    return [str(f) for f in [*ckpts, "--prompts", files / "prompts.txt", "--images-per-prompt", 2, "--seed", 5,
                             "--batch-size", batch, "--reward", reward, *weights, "--out", out, *SAMPLING]]


@pytest.fixture(scope="module")
def table_run(files, tmp_path_factory):
    """One run: base, tuned, and base again under another name, 2 prompts × 2 images in batches of 3."""
    out = tmp_path_factory.mktemp("table")
    with pytest.MonkeyPatch.context() as mp:
        tiny_hps(mp)
        table = paper.main(table_flags(files, out, "--ckpt", f"base={files / 'base.pt'}", "--ckpt",
                                          f"tuned={files / 'tuned.pt'}", "--ckpt", f"again={files / 'base.pt'}"))
    return out, table


def test_table_rows_columns_and_cells_from_scores(table_run):
    out, table = table_run
    assert table == json.loads((out / "table.json").read_text())
    assert [r["name"] for r in table["rows"]] == ["base", "tuned", "again"]
    assert [c["key"] for c in table["columns"]] == ["shapes_accuracy", "shapes", "jpeg_incompressibility", "hpsv2"]
    md = (out / "table.md").read_text().splitlines()
    assert md[0].startswith("2 prompts × 2 images per checkpoint, seed 5; mean ± standard error")
    assert md[2] == "| checkpoint | Shapes accuracy | Shapes reward | jpeg_incompressibility | HPS v2 (×100) |"
    assert len(md) == 4 + len(table["rows"])
    for row, line in zip(table["rows"], md[4:]):
        scores = read_scores(out / row["name"])
        assert [(s["prompt"], s["prompt_index"], s["image_index"]) for s in scores] == \
            [(p, i, j) for i, p in enumerate(SHAPES_PROMPTS) for j in range(2)]
        assert row["n"] == 4
        shown = [row["name"]]
        for col in table["columns"]:
            values = [col["scale"] * s[col["key"]] for s in scores]
            mean, sem = statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))
            cell = row["cells"][col["key"]]
            assert cell["n"] == 4 and cell["mean"] == pytest.approx(mean, abs=1e-9)
            assert cell["sem"] == pytest.approx(sem, abs=1e-9)
            shown.append(f"{mean:.{col['decimals']}f} ± {sem:.{col['decimals']}f}")
        assert line == "| " + " | ".join(shown) + " |"
        # the verifier's accuracy is "score 1": both columns come from one call
        assert all(s["shapes_accuracy"] == float(s["shapes"] == 1.0) for s in scores)
    assert table["rows"][1]["cells"]["hpsv2"] != table["rows"][0]["cells"]["hpsv2"] == table["rows"][2]["cells"]["hpsv2"]


def test_hps_is_printed_times_100_and_scores_are_the_rewards_of_the_pngs(table_run, files, monkeypatch):
    out, table = table_run
    col = next(c for c in table["columns"] if c["key"] == "hpsv2")
    assert col["scale"] == 100.0 and col["label"] == "HPS v2 (×100)"
    tiny_hps(monkeypatch)
    hps = registry.build_reward("hpsv2", weights={"hpsv2": str(files / "HPS_tiny.pt")})
    jpeg = registry.build_reward("jpeg_incompressibility")
    for row in table["rows"]:
        scores = read_scores(out / row["name"])
        pngs = torch.stack([torch.from_numpy(read_png(out / row["name"] / s["file"])).permute(2, 0, 1) for s in scores])
        texts = [s["prompt"] for s in scores]
        raw_hps, _ = hps(pngs, texts)  # both rewards read 8-bit images: the PNG is what they scored
        assert torch.allclose(raw_hps, torch.tensor([s["hpsv2"] for s in scores]), atol=1e-5)
        assert raw_hps.abs().max() < 1  # a cosine, stored raw ...
        assert row["cells"]["hpsv2"]["mean"] == pytest.approx(100 * raw_hps.double().mean().item(), abs=1e-3)  # ... shown ×100
        assert torch.equal(jpeg(pngs, texts)[0], torch.tensor([s["jpeg_incompressibility"] for s in scores]))


def test_images_are_the_seeded_batches_and_differ_between_checkpoints(table_run, files):
    out, _ = table_run
    names = [s["file"] for s in read_scores(out / "base")]
    assert len(names) == 4 and len({read_png(out / "base" / n).tobytes() for n in names}) == 4
    for n in names:  # the same seeds for every checkpoint: base again = base, tuned differs
        assert np.array_equal(read_png(out / "base" / n), read_png(out / "again" / n))
        assert not np.array_equal(read_png(out / "base" / n), read_png(out / "tuned" / n))
    # by hand: batch b = jobs [3b, 3b + 3) of (prompt, image), generator seeded by (seed, SEED_STAGE, b)
    args, _ = paper.parse_table_args(table_flags(files, out, "--ckpt", f"base={files / 'base.pt'}"))
    model = loading.load_policy(args, str(files / "base.pt"))
    prompts = loading.load_prompts(args, model)
    jobs = [(i, j) for i in range(2) for j in range(2)]
    for b, chunk in enumerate([jobs[:3], jobs[3:]]):
        gen = processes.seeded(torch.device("cpu"), 5, evaluate.SEED_STAGE, b)
        inputs = prompts.condition([prompts.items[i] for i, _ in chunk], "cpu")
        images = evaluate.generate(model, vae.PixelCodec(), inputs, args, gen)  # (len(chunk), 3, 32, 32)
        for k, (i, j) in enumerate(chunk):
            expected = (images[k].clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()  # (32, 32, 3)
            assert np.array_equal(read_png(out / "base" / f"images/{i:05d}_{j:03d}.png"), expected)


def test_same_images_in_a_second_run_and_on_rank_1_of_2(table_run, files, tmp_path, capsys):
    out, _ = table_run
    second = tmp_path / "second"
    code, stdout, err = run(capsys, *table_flags(files, second, "--ckpt", f"b={files / 'base.pt'}",
                                                 reward="jpeg_incompressibility"))
    assert code == 0, err
    assert (second / "table.md").read_text() in stdout and "| b |" in stdout
    for s in read_scores(second / "b"):
        assert np.array_equal(read_png(second / "b" / s["file"]), read_png(out / "base" / s["file"]))
    # rank 1 of 2 generates batches 1, 3, ... with the same generators as one process does
    args, _ = paper.parse_table_args(table_flags(files, tmp_path / "r1", "--ckpt", f"b={files / 'base.pt'}"))

    class Rank1:
        rank, world, ddp, master, device = 1, 2, False, False, torch.device("cpu")
        autocast = staticmethod(contextlib.nullcontext)
        barrier = staticmethod(lambda: None)

    model = loading.load_policy(args, str(files / "base.pt"))
    prompts = loading.load_prompts(args, model)
    reward_fns = {"jpeg_incompressibility": registry.build_reward("jpeg_incompressibility")}
    rows = evaluate.generate_and_score(args, Rank1(), model, vae.PixelCodec(), prompts, prompts.items, reward_fns,
                                       str(tmp_path / "r1" / "b"))
    assert [(r["prompt_index"], r["image_index"]) for r in rows] == [(1, 1)]  # batch 1 = job 3 alone
    assert not (tmp_path / "r1" / "b" / "scores.jsonl").exists()  # rank 0 writes it
    assert np.array_equal(read_png(tmp_path / "r1" / "b" / rows[0]["file"]), read_png(out / "base" / rows[0]["file"]))


def test_harmon_release_against_a_tuned_checkpoint(harmon_files, tmp_path, capsys):
    flags = ["--preset", "adapter_smoke", "--model", "harmon", "--model-config", harmon_files["config"],
             "--vae", harmon_files["vae"], "--tokenizer", harmon_files["tok"], "--prompts", harmon_files["prompts"],
             "--reward", "jpeg_incompressibility"]
    base = loading.load_policy(train.parse_args([str(f) for f in flags]), str(harmon_files["init"]))
    g = torch.Generator().manual_seed(4)
    sd = {k: v + 0.05 * torch.randn(v.shape, generator=g) if k.startswith("mar.") and v.is_floating_point() else v
          for k, v in base.state_dict().items()}  # as train.py tunes Harmon: the MAR part only
    torch.save({"model": sd, "config": base.config, "step": 2}, tmp_path / "tuned.pt")
    out = tmp_path / "table"
    code, _, err = run(capsys, *flags, "--ckpt", f"base={harmon_files['init']}", "--ckpt", f"tuned={tmp_path / 'tuned.pt'}",
                       "--ckpt", f"again={harmon_files['init']}", "--out", out)
    assert code == 0, err
    for s in read_scores(out / "base"):  # the null prompt is set on every model: base again = base
        a = read_png(out / "base" / s["file"])
        assert np.array_equal(a, read_png(out / "again" / s["file"])) and not np.array_equal(a, read_png(out / "tuned" / s["file"]))


def test_nova_base_pipeline_against_a_tuned_checkpoint(nova_common, tiny_archs, tmp_path, capsys):  # noqa: F811
    pipe = tmp_path / "pipe"
    base, config = save_nova_pipeline(pipe, DDPM, seed=41)
    g = torch.Generator().manual_seed(3)
    sd = {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
          for k, v in base.state_dict().items()}
    torch.save({"model": sd, "config": base.config, "step": 2}, tmp_path / "tuned.pt")
    out = tmp_path / "table"
    code, stdout, err = run(capsys, "--preset", "adapter_smoke", "--model", "nova", "--ckpt", f"base={pipe}",
                            "--ckpt", f"tuned={tmp_path / 'tuned.pt'}", "--prompt-embeds", nova_common["embeds"],
                            "--prompts", nova_common["prompts"], "--reward", "jpeg_incompressibility", "--out", out)
    assert code == 0, err
    table = json.loads((out / "table.json").read_text())
    assert [r["name"] for r in table["rows"]] == ["base", "tuned"] and all(r["n"] == len(NOVA_PROMPTS) for r in table["rows"])
    for s in read_scores(out / "base"):
        a, b = read_png(out / "base" / s["file"]), read_png(out / "tuned" / s["file"])
        assert a.shape == (*config["transformer"]["image_size"], 3) and not np.array_equal(a, b)  # (H, W, 3)


# -----------------------------------------------------------------------------
# One-line errors, exit status 2, before anything is generated

def bad_inputs(files, tmp):
    """case -> (flags, words its error line must hold); every other flag is a good one."""
    base, prompts = ["--ckpt", f"base={files / 'base.pt'}"], ["--prompts", files / "prompts.txt"]
    good = lambda *more, ckpt=base, reward="shapes", out=("--out", tmp / "out"): \
        [*ckpt, *prompts, "--reward", reward, *SAMPLING, *out, *more]
    foreign = files / "HPS_tiny.pt"
    return {
        "no_ckpt": (good(ckpt=[]), ["--ckpt", "NAME=PATH"]),
        "empty_out": (good(out=("--out", "")), ["--out ''"]),
        "name_twice": (good(ckpt=base + base), ["--ckpt base", "twice"]),
        "no_name": (good(ckpt=["--ckpt", files / "base.pt"]), ["--ckpt", "NAME=PATH"]),
        "missing_ckpt": (good(ckpt=["--ckpt", f"x={tmp / 'nope.pt'}"]), [f"--ckpt x={tmp / 'nope.pt'}", "no such"]),
        "foreign_ckpt": (good(ckpt=["--ckpt", f"x={foreign}"]), [f"--ckpt x={foreign}: not a MAR checkpoint"]),
        "missing_prompts": (good("--prompts", tmp / "nope.txt"), ["--prompts", "nope.txt"]),
        "unknown_reward": (good(reward="shapes,hps"), ["--reward", "'hps'"]),
        "weighted_reward": (good(reward="shapes:0.5"), ["--reward", "without weights"]),
        "missing_weights": (good(reward="shapes,hpsv2"), ["--reward-ckpt hpsv2=PATH", "HPS_v2.1_compressed.pt"]),
        "no_out": (good(out=()), ["--out"]),
        "shapes_on_nova": (good("--model", "nova"), ["--reward shapes", "nova"]),
        # a later checkpoint that cannot be read, or does not fit: found before the first one's images
        "second_ckpt_cut": (good(ckpt=base + ["--ckpt", f"cut={tmp / 'cut.pt'}"]), [f"--ckpt cut={tmp / 'cut.pt'}", "cut short"]),
        "second_ckpt_a_folder": (good(ckpt=base + ["--ckpt", f"dir={tmp}"]), [f"--ckpt dir={tmp}", "a folder"]),
        "second_ckpt_of_another_size": (good(ckpt=base + ["--ckpt", f"wide={tmp / 'wide.pt'}"]),
                                        [f"--ckpt wide={tmp / 'wide.pt'}", "does not fit its base"]),
    }


@pytest.mark.parametrize("case", ["no_ckpt", "name_twice", "no_name", "missing_ckpt", "foreign_ckpt", "missing_prompts",
                                  "unknown_reward", "weighted_reward", "missing_weights", "no_out", "shapes_on_nova",
                                  "second_ckpt_cut", "second_ckpt_a_folder", "second_ckpt_of_another_size"])
def test_bad_input_is_one_line_naming_the_flag(case, files, tmp_path, capsys):
    blob = (files / "tuned.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(blob[:len(blob) // 2])  # a copy that stopped half-way
    tuned = torch.load(files / "tuned.pt", weights_only=True)
    tuned["model"] = {k: torch.cat([v, v]) if k.endswith("decoder_embed.weight") else v for k, v in tuned["model"].items()}
    torch.save(dict(tuned, base=str(files / "base.pt")), tmp_path / "wide.pt")  # trained weights of another size
    flags, words = bad_inputs(files, tmp_path)[case]
    code, stdout, err = run(capsys, *flags)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert all(w in lines[0] for w in words), lines[0]
    assert not (tmp_path / "out").exists() and stdout == ""  # nothing generated, nothing written


# -----------------------------------------------------------------------------
# Each model at its best τ, and how images fail

def layout_images(kind):
    """16-px images of 'a red square left of a blue circle' in the demo's 8-px cells (shapes.render):
    right, mirrored (wrong relation), one object missing, a copy too many, an unrequested object."""
    meta = shapes.parse_prompt("a red square left of a blue circle")
    rng = np.random.default_rng(0)
    if kind == "right":
        return shapes.render(meta, 16, rng, cell=8), meta
    if kind == "wrong relation":
        return shapes.render({**meta, "relation": "right of"}, 16, rng, cell=8), meta
    if kind == "missing object":
        return shapes.render({**meta, "objects": meta["objects"][:1], "relation": None, "category": "single"}, 16,
                             rng, cell=8), meta
    if kind == "wrong count":
        return shapes.render(meta, 16, rng, cell=8, unmentioned=[("red", "square")]), meta
    return shapes.render(meta, 16, rng, cell=8, unmentioned=[("green", "triangle")]), meta  # extra object


@pytest.mark.parametrize("kind", ["right", "wrong relation", "missing object", "wrong count", "extra object"])
def test_failure_modes_and_the_partial_reward_on_hand_made_images(kind):
    """Every image is one failure mode; shapes_partial pays half for the requested objects drawn
    exactly (a quarter each here), half for the whole image right, nothing for a copy."""
    image, meta = layout_images(kind)
    score, details = verifier.verify(image, meta)
    assert verifier.failure(details) == {"right": "correct"}.get(kind, kind)
    partial, _ = registry.build_reward("shapes_partial")(torch.from_numpy(image).permute(2, 0, 1)[None], [meta["prompt"]])
    want = {"right": 1.0, "wrong relation": 0.5, "missing object": 0.25, "wrong count": 0.25, "extra object": 0.5}[kind]
    assert partial.item() == pytest.approx(want)
    empty, _ = registry.build_reward("shapes_partial")(torch.zeros(1, 3, 16, 16), [meta["prompt"]])
    assert empty.item() == 0.0 < partial.item()  # a partly right image is paid more than an empty one


def test_summary_counts_every_image_and_relation_given_both_beside_it():
    """Five images, one of each mode: strict accuracy 1/5 of all images; the spatial study's relation
    right (both objects drawn once, relation holds, extras allowed) 2/5; relation | both among the 4
    with both objects."""
    rows = []
    for i, kind in enumerate(["right", "wrong relation", "missing object", "wrong count", "extra object"]):
        image, meta = layout_images(kind)
        _, details = verifier.verify(image, meta)
        rows.append(dict(prompt_index=i, image_index=0, category="spatial", details=details, shapes=0.0))
    s = evaluate.summarize(rows, ["shapes"])
    assert s["n"] == 5 and s["accuracy"] == pytest.approx(0.2)
    assert s["failures"] == {m: pytest.approx(0.2) for m in verifier.FAILURES}
    assert "both" not in s and "pass_at" not in s  # the spatial study's figures are its own
    s = spatial.spatial_summary(rows, ["shapes"])
    assert s == {**evaluate.summarize(rows, ["shapes"]), **{k: s[k] for k in ("spatial_n", "both", "relation_right",
                                                                            "relation_given_both")}}
    # right and extra hold it; the copy's relation is read off the first of its equal instances, here not
    assert s["both"] == 4 and s["relation_given_both"] == pytest.approx(2 / 4)
    assert s["relation_right"] == pytest.approx(2 / 5)


def fake_generate(peaks):
    """evaluate.generate for models {id(model): τ*}: the prompt's right image (shapes.render) at τ*,
    a blank canvas at any other τ, so a model's strict accuracy peaks at its τ*."""
    def generate(model, codec, inputs, args, generator, temperature=None, cfg=None):
        metas = shapes.detokenize(inputs["prompt_ids"].cpu().numpy())
        rng = np.random.default_rng(0)
        images = [shapes.render(shapes.parse_prompt(p), 16, rng, cell=8) if temperature == peaks[id(model)]
                  else np.zeros((16, 16, 3), np.uint8) for p in metas]
        return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255  # (B, 3, H, W)
    return generate


def test_each_model_is_scored_at_its_best_tau_and_the_gain_is_against_the_bases_best(tmp_path, monkeypatch, capsys):
    """A base whose accuracy peaks at τ 0.2 and a tuned model peaking at τ 0.5: the sweep chooses each
    one's τ on the training split, the gain is tuned at 0.5 minus base at 0.2 (zero here), not the
    gain at τ 1 (zero too, both blank) nor at one shared τ; train.py's report says both."""
    base, tuned = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    monkeypatch.setattr(evaluate, "generate", fake_generate({id(base): 0.2, id(tuned): 0.5}))
    args = train.parse_args(["--preset", "smoke", "--out", str(tmp_path), "--eval-batch-size", "8"])
    ctx = processes.Ctx(args)
    prompts = loading.load_prompts(args, None)
    splits = {"heldout": prompts.eval_items(8, 0, "heldout"), "train": prompts.eval_items(8, 0, "train")}
    report = {tag: evaluate.sweep_splits(args, ctx, m, None, prompts, splits, {"shapes": registry.build_reward("shapes")},
                                         str(tmp_path / tag), [0.1, 0.2, 0.5, 1.0])
              for tag, m in (("base", base), ("tuned", tuned))}
    assert report["base"]["best"] == {"temperature": 0.2, "cfg": None}
    assert report["tuned"]["best"] == {"temperature": 0.5, "cfg": None}
    assert evaluate.cell(report["base"], "heldout")["accuracy"] == 1.0
    assert evaluate.cell(report["tuned"], "heldout", {"temperature": 0.2, "cfg": None})["accuracy"] == 0.0
    assert evaluate.gain_at_best(report["base"], report["tuned"], "heldout") == 0.0
    capsys.readouterr()
    evaluate.print_report(str(tmp_path), report, {"temperature": 1.0, "cfg": None})
    out = capsys.readouterr().out
    assert "at its best, τ 0.2   100.0%" in out and "at its best, τ 0.5   100.0%" in out
    assert "+0.0 points each at its best τ, +0.0 points at τ 1" in out
    at = {"temperature": 0.5, "cfg": None}  # compared at the tuned model's τ alone, it would gain 100 points
    assert evaluate.cell(report["tuned"], "heldout", at)["accuracy"] - evaluate.cell(report["base"], "heldout", at)["accuracy"] == 1


def test_best_setting_breaks_ties_toward_less_sharpening_and_reads_the_choice_split_only():
    cells = [dict(temperature=t, cfg=w, split=s, accuracy=a, n=10)
             for t, w, s, a in [(0.1, None, "train", 0.5), (0.3, None, "train", 0.5), (1.0, None, "train", 0.2),
                                (0.1, None, "heldout", 0.9), (0.3, None, "heldout", 0.1), (1.0, None, "heldout", 0.0)]]
    sweep = dict(cells=cells, choose_on="train", key="accuracy")
    assert evaluate.best_setting(sweep) == {"temperature": 0.3, "cfg": None}  # not held out's 0.1
    guided = dict(sweep, cells=cells + [dict(temperature=0.3, cfg=3.0, split="train", accuracy=0.5, n=10)])
    assert evaluate.best_setting(guided) == {"temperature": 0.3, "cfg": None}  # a tie: the lower guidance
    with pytest.raises(ValueError, match="choice split 'valid'"):
        evaluate.best_setting(dict(sweep, choose_on="valid"))


def test_image_rows_puts_each_folders_images_in_its_own_row(tmp_path):
    """python train.py's eval/base_vs_tuned.png: one row per (label, folder), the folder's first k
    images in scores.jsonl's order, captioned with the label and caption(row); folders holding
    different numbers of images (not the same prompts and seeds) are an error."""
    from infra import figures
    rows = []
    for r, colour in enumerate([(255, 0, 0), (0, 0, 255)]):
        folder = tmp_path / f"setting{r}"
        (folder / "images").mkdir(parents=True)
        lines = []
        for j in range(3):
            Image.new("RGB", (4, 4), tuple(c // (j + 1) for c in colour)).save(folder / "images" / f"{j}.png")
            lines.append(json.dumps(dict(prompt=f"p{j}", file=f"images/{j}.png", score=j)))
        (folder / "scores.jsonl").write_text("\n".join(lines) + "\n")
        rows.append((f"row {r}", str(folder)))
    captions = []
    path = figures.image_rows(rows, str(tmp_path / "grid.png"), lambda row: captions.append(row["prompt"]) or "x", k=2)
    assert captions == ["p0", "p1", "p0", "p1"]  # k of each folder, evenly spaced, in order
    with Image.open(path) as grid:
        cw, ch = 160, 4 * 4 + 28  # a cell: at least 160 px wide; the image at scale 4 and two caption lines
        assert grid.size == (2 * cw, 2 * ch)
        assert grid.getpixel((1, 1)) == (255, 0, 0) and grid.getpixel((cw + 1, 1)) == (127, 0, 0)
        assert grid.getpixel((1, ch + 1)) == (0, 0, 255) and grid.getpixel((cw + 1, ch + 1)) == (0, 0, 127)
    (tmp_path / "setting1" / "scores.jsonl").write_text(json.dumps(dict(prompt="p0", file="images/0.png")) + "\n")
    with pytest.raises(ValueError, match="different numbers of images"):
        figures.image_rows(rows, str(tmp_path / "grid.png"), lambda row: "x", k=2)


def test_train_pys_report_with_guidance_weights_includes_the_runs_own(tmp_path, monkeypatch, capsys):
    """python train.py --eval-cfgs 1,2 with the run's guidance w 3: the sweep adds w 3, so the report's
    "at the run's setting" row and the grid's first rows are cells of the sweep (they were missing)."""
    base, tuned = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    monkeypatch.setattr(evaluate, "generate", fake_generate({id(base): 0.5, id(tuned): 1.0}))
    args = train.parse_args(["--preset", "smoke", "--out", str(tmp_path), "--cfg", "3", "--eval-cfgs", "1,2",
                             "--eval-temperatures", "0.5,1"])
    ctx = processes.Ctx(args)
    report = evaluate.base_and_tuned(args, ctx, base, tuned, None, loading.load_prompts(args, None),
                                     registry.build_reward("shapes"))
    assert {c["cfg"] for c in report["base"]["cells"]} == {1.0, 2.0, 3.0}
    assert f"at τ {args.temperature:g}, w 3" in capsys.readouterr().out
    assert (tmp_path / "eval" / "base_vs_tuned.png").exists()
