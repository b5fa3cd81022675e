"""The lab (experiments/): its rewards, the probes of a base, the study's tables and the spatial
study's measurements, at toy size."""

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import diffloss
import evaluate
import grpo
from benchmarks import harmon_lora_step
from demo import shapes, verifier
from demo.pretrain import MAELoss
from experiments import lab, probes, raft, relation_study, spatial, study
from models import harmon, loading, vae
from scorers import registry
from tests import test_harmon
from tests.helpers import make_rollout, settings, tiny_mar
from train import MicroBatch

torch.set_num_threads(1)


def test_shapes_coverage_is_the_mean_fraction_of_the_prompts_colours_and_pays_for_paint():
    img = torch.zeros(2, 3, 4, 4)                                                # black, (B, 3, H, W)
    img[:, 0, 0, :] = 0.9                                                        # 4 nearly red pixels
    img[:, :2, 1, :2] = 1.0                                                      # 2 yellow pixels
    img[:, 2, 3, 3] = 0.6                                                        # 1 blue-ish pixel
    prompts = ["a red square", "a green circle and a yellow square"]
    scores, _ = registry.build_reward("shapes_coverage")(img, prompts, None)
    assert scores.tolist() == pytest.approx([4 / 16, (0 / 16 + 2 / 16) / 2])
    # the study's spec: trained on the proxy, the verifier logged beside it with weight 0
    total, info = registry.build_reward("shapes_coverage:1,shapes:0")(img, prompts, None)
    assert torch.equal(total, scores) and set(info["means"]) == {"shapes_coverage", "shapes"}
    # hackable: an all-red canvas beats a correct render of "a red square" on the proxy, not on the verifier
    meta = shapes.parse_prompt("a red square")
    render = torch.from_numpy(shapes.render(meta, size=16, rng=np.random.default_rng(0))).permute(2, 0, 1)[None] / 255
    painted = torch.zeros_like(render)
    painted[:, 0] = 1.0
    painted[:, 0, 8, :] = 0.0                                                    # two red bars, no square
    both = torch.cat([render, painted]).float()
    proxy, _ = registry.build_reward("shapes_coverage")(both, ["a red square"] * 2, None)
    truth, _ = registry.build_reward("shapes")(both, ["a red square"] * 2, None)
    assert proxy[1] == 15 / 16 > proxy[0] > 0 and truth[0] == 1.0 and truth[1] < 0.5
    with pytest.raises(ValueError, match="shapes_coverage reward: 'a photo of a cat' is not a shapes prompt"):
        registry.build_reward("shapes_coverage")(img[:1], ["a photo of a cat"], None)


def test_context_probe_metric(smoke_base, monkeypatch):
    """probes.context_probe: a head that always samples black is wrong on exactly the coloured
    unknown tokens, so with the whole canvas unknown its colour error is the coloured fraction."""
    model = loading.load_checkpoint(smoke_base)
    monkeypatch.setattr(model.diffloss, "sample", lambda z, **kw: torch.full((z.shape[0], model.token_embed_dim), -1.0))
    res = probes.context_probe(model, vae.PixelCodec(), n_images=16, known_fracs=(0.0, 0.5))
    assert 0.05 < res["coloured_frac"] < 0.6
    assert res[0.0]["colour_error"] == pytest.approx(res["coloured_frac"], abs=1e-6)


def test_linear_probe_separates_an_oracle_from_noise(smoke_base, monkeypatch):
    """probes.linear_probe: z that holds the colour state of its token scores 1.0; z of pure noise
    scores about the base rate (the majority class)."""
    model = loading.load_checkpoint(smoke_base)
    real = model.predict_z
    monkeypatch.setattr(model, "predict_z", lambda tokens, mask, cond: probes._coloured(tokens)[..., None].repeat(1, 1, 4))
    accuracy, base_rate = probes.linear_probe(model, vae.PixelCodec(), 0.5, n_images=32)
    assert accuracy == 1.0 and 0.5 <= base_rate < 0.95
    g = torch.Generator().manual_seed(0)
    monkeypatch.setattr(model, "predict_z", lambda tokens, mask, cond: torch.randn(real(tokens, mask, cond).shape, generator=g))
    accuracy, base_rate = probes.linear_probe(model, vae.PixelCodec(), 0.5, n_images=32)
    assert abs(accuracy - base_rate) < 0.08


def test_context_probe_renders_the_presets_world(smoke_base, monkeypatch, capsys):
    """probes.py --context-probe probes a base in its own world: with --cell 8 every image of both
    probes has its objects in 8-px cells (the demo's world), without it they are free."""
    for flags, cell in (([], 0), (["--cell", "8"], 8)):
        seen = []
        make = shapes.make_dataset
        monkeypatch.setattr(shapes, "make_dataset", lambda *a, **k: seen.append(k.get("cell", 0)) or make(*a, **k))
        probes.main(["--preset", "smoke", "--context-probe", str(smoke_base), *flags])
        monkeypatch.undo()
        assert len(seen) == 5 and set(seen) == {cell}  # context probe; linear probe fit + test at 50, 90%
    assert "in 8-px cells" in capsys.readouterr().out


def test_study_table_runs_evaluates_and_reports_then_skips_what_is_done(tmp_path, capsys):
    """study.py --study hack at toy size (from the smoke preset's base; two of its three arms): each
    arm trains on the proxy with the verifier logged beside it, its last checkpoint and the base are
    evaluated, and the report holds one row per arm; a second call starts no process."""
    out = tmp_path / "study"
    argv = ["--study", "hack", "--preset", "smoke", "--study-steps", "2", "--study-out", str(out),
            "--study-arms", "grpo,mar-grpo"]
    summary = study.main(argv)["hack"]
    assert "study: hack: mar-grpo seed 0" in capsys.readouterr().out
    assert set(summary) == {"grpo", "mar-grpo"}
    for stats in summary.values():
        assert stats["reward_first"][2] == 1 and 0 <= stats["verifier_last"][0] <= 1
        assert 0 <= stats["train_acc@2"][0] <= 1 and stats["grad_norm_max"][0] >= stats["grad_norm_mean"][0] > 0
    rows = [json.loads(line) for line in open(out / "hack" / "mar-grpo" / "seed0" / "metrics.jsonl")]
    assert len(rows) == 2 and {"reward/shapes_coverage", "reward/shapes"} <= set(rows[0])
    assert rows[0]["reward_mean"] == pytest.approx(rows[0]["reward/shapes_coverage"])  # trained on the proxy
    for name in ("hack.md", "hack.png", "hack_samples.png", "base/eval_train_0/summary.json"):
        assert (out / name).exists(), name
    again = study.main(argv)["hack"]  # a second run: everything is done already
    assert "study: hack:" not in capsys.readouterr().out and again == summary  # all finished: nothing ran again
    with pytest.raises(ValueError, match="--study"):
        study.main(["--study", "nope"])


def test_noise_probe_finds_the_draws_that_decide(smoke_base, monkeypatch):
    """probes.noise_probe: with a head of σ = 1 whose mean is 0 but at the last step (where it
    returns x_t), a token is step 1's noise, so redrawing any other step's noise changes no token and
    redrawing step 1's changes most; with a head that ignores its noise (tokens a function of z),
    the images of a group that shares one order are identical (within-group reward variance 0), and
    those of a group with an order per image are not."""
    model = loading.load_checkpoint(smoke_base)
    head = model.diffloss
    last_noise = lambda x, t, z, cfg=1.0: (x if int(t) == 0 else 0 * x, 0 * x, x)  # noqa: E731  (mean, log σ², x̂0)
    monkeypatch.setattr(head, "p_mean_variance", last_noise)
    res = probes.noise_probe(model, vae.PixelCodec(), registry.build_reward("shapes"), num_iter=4, cfg=3.0,
                            n_prompts=3, group=2)
    assert set(res["flip_at_step"]) == set(range(1, head.num_sampling_steps))
    assert all(res["flip_at_step"][k] == 0 for k in res["flip_at_step"] if k > 1)
    assert res["flip_at_step"][1] > 0.5 and res["flip_all"] > 0.5 and len(res["flip_by_ar_step"]) == 4
    monkeypatch.undo()
    C = model.token_embed_dim
    monkeypatch.setattr(head, "sample", lambda z, temperature=1.0, cfg=1.0, generator=None, record_steps=None:
                        torch.sin(z[:z.shape[0] // 2].sum(1, keepdim=True) * torch.linspace(0.01, 1, C)))
    brightness = lambda images, texts, metas: (images.mean(dim=(1, 2, 3)), {})  # noqa: E731  differs with the order
    res = probes.noise_probe(model, vae.PixelCodec(), brightness, num_iter=4, cfg=3.0, n_prompts=3, group=2)
    assert res["reward_var_free_order"] > 0
    assert res["reward_var_fixed_order"] == 0 and res["share_of_head_noise"] == 0


def test_spatial_group_signal_counts_groups_relations_and_best_of_n():
    """spatial.group_signal on hand-made verifier results: two groups of G = 3; the relation's rate
    is over images whose two objects are both drawn; pass@N is the unbiased estimator."""
    d = lambda correct, present, relation, extra=0, count=True: {  # noqa: E731
        "correct": correct, "present": present, "relation": relation, "extra_objects": extra, "count": count}
    details = [d(True, True, True), d(False, True, False), d(False, False, False, count=False),  # group 0: one correct
               d(False, True, False), d(False, True, True, extra=1), d(False, False, False, 2)]  # group 1: relation right, extras
    scores = [1.0, 0.5, 0.2, 0.5, 0.5, 0.5]
    r = spatial.group_signal(scores, details, 3)
    assert r["groups"] == 2 and r["accuracy"] == pytest.approx(1 / 6)
    assert r["extra"] == pytest.approx(2 / 6) and r["counts_off"] == pytest.approx(1 / 6)
    assert r["groups_any_correct"] == 0.5 and r["groups_any_relation"] == 1.0 and r["groups_reward_varies"] == 0.5
    assert (r["both"], r["relation_given_both"]) == (4, 2) and r["relation_rate_given_both"] == 0.5
    assert r["pass_at"] == pytest.approx({1: 1 / 6, 2: (2 / 3) / 2, 3: 0.5})
    assert spatial.pass_at(6, 0, 3) == 0 and spatial.pass_at(6, 4, 3) == 1 and spatial.pass_at(6, 1, 1) == pytest.approx(1 / 6)
    assert r["reward_var_within"] == pytest.approx(np.var([1.0, 0.5, 0.2], ddof=1) / 2)


def test_spatial_relation_reward_and_layout_on_renders():
    """lab.ShapesRelationReward: 1 on a render of a spatial prompt in the demo's cell world, 0 on
    the same objects mirrored (relation wrong) and on the render with a copy of the subject added
    (the verifier's relation still holds there), the verifier's score on a non-spatial prompt;
    cell_layout names each object's cell."""
    meta = shapes.parse_prompt("a red square left of a green circle")
    img = shapes.render(meta, size=16, rng=np.random.default_rng(0), cell=8)  # (16, 16, 3) uint8
    mirrored = img[:, ::-1].copy()
    assert img[8:, :8].any() and img[8:, 8:].any() and not img[:8].any()  # seed 0: square bottom left, circle bottom right
    copied = np.zeros_like(img)
    copied[:8] = img[8:]            # the pair moved to the top row
    copied[8:, :8] = img[8:, :8]    # and a copy of the square below it: the verifier compares the first of equal copies
    single = shapes.render(shapes.parse_prompt("a blue square"), size=16, rng=np.random.default_rng(1), cell=8)
    batch = torch.from_numpy(np.stack([img, mirrored, copied, single])).permute(0, 3, 1, 2).float() / 255
    texts = ["a red square left of a green circle"] * 3 + ["a blue square"]
    r, _ = registry.build_reward("shapes_relation")(batch, texts, None)
    assert r.tolist() == [1.0, 0.0, 0.0, 1.0]
    full, details = registry.build_reward("shapes")(batch, texts, None)
    assert full.tolist() == [1.0, 0.5, 0.9375, 1.0]  # relation wrong halves the score; a copy costs a sixteenth
    assert details["details"][2]["relation"] is True and not details["details"][2]["count"]
    layout = spatial.cell_layout(verifier.verify(img, meta)[1]["detected"])
    assert len(layout) == 2 and {c[2:] for c in layout} == {("red", "square"), ("green", "circle")}
    red, green = (next(c for c in layout if c[2] == k) for k in ("red", "green"))
    assert red[0] == green[0] and red[1] == 0 and green[1] == 1  # the same row, red left


def test_train_ar_below_draws_the_trained_ar_steps_from_the_first_ones():
    """grpo.choose_train_steps(below=n): AR steps from 0 .. n − 1 only; below=0 is the released draw,
    the same steps as before the option existed."""
    for seed in range(20):
        ar, _ = grpo.choose_train_steps(16, 2, diffloss.trainable_steps(16), 6, torch.Generator().manual_seed(seed), below=4)
        assert len(ar) == 2 and all(0 <= i < 4 for i in ar)
        released = grpo.choose_train_steps(16, 2, diffloss.trainable_steps(16), 6, torch.Generator().manual_seed(seed))
        g = torch.Generator().manual_seed(seed)
        assert released[0] == torch.randperm(16, generator=g)[:2].sort().values.tolist()
    assert grpo.choose_train_steps(16, 6, [1, 2], 1, torch.Generator().manual_seed(0), below=3)[0] == [0, 1, 2]


def test_harmon_lora_step_writes_the_released_layout_and_measures_a_step(tmp_path, monkeypatch, capsys):
    """benchmarks/harmon_lora_step.py end to end, with a tiny Harmon in place of the 1.5B config and a
    tiny VAE in place of the KL-16: the files it writes load through train.py's flags, the LoRA step
    exits 0, and both peaks are read from the running process."""
    monkeypatch.setitem(harmon.CONFIGS, "harmon_1.5b", test_harmon.tiny_config())
    monkeypatch.setattr(harmon_lora_step, "KL16", dict(ch=32, ch_mult=(1,) * 5, num_res_blocks=1, z=16,
                                                       enc_attn_levels=(4,)))
    rc = harmon_lora_step.main(["--work", str(tmp_path), "--side", "3", "--num-iter", "2", "--threads", "1"])
    out = capsys.readouterr().out
    assert rc == 0, (tmp_path / "run_lora32.log").read_text()[-2000:]
    assert json.loads((tmp_path / "harmon_1.5b_3x3.json").read_text())["image_shape"] == [3, 3]
    loading, grpo = map(float, re.search(r"exit 0; .* ([\d.]+) GiB loading, ([\d.]+) GiB in the GRPO", out).groups())
    assert 0 < loading and 0 < grpo
    ckpt = torch.load(tmp_path / "run_lora32" / "ckpt" / "latest.pt", weights_only=False)
    assert ckpt["lora"]["rank"] == 32 and all(".lora_" in k for k in ckpt["model"])  # the adapters alone


def test_spatial_report_reads_blocks_verifier_gradient_kl_and_evaluation(tmp_path):
    rows = [dict(reward_mean=float(i), grad_norm=[1.0, 3.0][i % 2], kl=0.1 * i, t_rollout=1.0, t_reward=0.5,
                 t_update=2.5, **{"reward/shapes_coverage": float(i), "reward/shapes": 10.0 - i}) for i in range(12)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval").mkdir()
    cells = [dict(temperature=t, cfg=None, split=s, accuracy=a, n=8)
             for t, s, a in [(1.0, "train", 0.4), (0.3, "train", 0.5), (1.0, "heldout", 0.3), (0.3, "heldout", 0.25)]]
    sweep = dict(cells=cells, choose_on="train", key="accuracy", best=dict(temperature=0.3, cfg=None))
    (tmp_path / "eval" / "summary.json").write_text(json.dumps(dict(tuned=sweep, base=sweep)))
    r = spatial.run_summary(str(tmp_path), block=5)
    assert r["steps"] == 12 and r["reward_blocks"] == [2.0, 7.0, 10.5] and r["verifier_blocks"] == [8.0, 3.0, -0.5]
    assert r["grad_norm_mean"] == 2.0 and r["grad_norm_cv"] == pytest.approx(0.5)   # std 1 over mean 2
    assert r["kl_last"] == pytest.approx(0.1 * np.mean(range(2, 12))) and r["step_s"] == 4.0
    assert r["accuracy"] == dict(best_tau=0.3, heldout=0.25, train=0.5)


def _fake_completion(place):
    """A stand-in for probes.complete on a model whose `condition` returns the prompt ids: it draws
    the prompt's reference object in the cell place(relation, subject cell) picks (None: nothing)."""
    def complete(model, cond, tokens, unknown, num_iter, temperature, generator):
        codec, cell = vae.PixelCodec(), model.img_size // 2
        tokens = tokens.masked_fill(unknown[..., None], -1.0)  # the unknown tokens black (pixel codec: [-1, 1])
        images = (codec.decode(model.unpatchify(tokens)).permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
        for b, prompt in enumerate(shapes.detokenize(cond.numpy())):
            meta = shapes.parse_prompt(prompt)
            known = (~unknown[b]).reshape(model.img_size // model.patch_size, -1).nonzero()[0] * model.patch_size
            target = place(meta["relation"], (int(known[0]) // cell, int(known[1]) // cell), generator)
            if target is not None:
                ref = meta["objects"][1]
                y, x = target[0] * cell, target[1] * cell
                images[b, y:y + cell - 1, x:x + cell - 1][shapes._patch(ref["shape"], cell - 1)] = shapes.COLORS[ref["color"]]
        return model.patchify(codec.encode(torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255))
    return complete


def test_relation_probe_scores_a_model_that_follows_the_word_and_one_that_ignores_it(smoke_base, monkeypatch, capsys):
    """probes.relation_probe's bookkeeping with the completion replaced: a model that puts the
    reference where the word says scores 1 under the prompt and 0 under the opposite and the other
    axis' word (a cell off the grid becomes the diagonal one); one that picks a free cell at random
    scores about 1/3 under all three; completions that draw nothing are not counted."""
    model = loading.load_checkpoint(smoke_base)  # 32 px: a 2 × 2 grid of 16-px cells
    monkeypatch.setattr(type(model), "condition", lambda self, prompt_ids: prompt_ids)
    metas = spatial.spatial_prompts("train")[::4]  # 78 prompts

    def follows(relation, subject, generator):  # "A left of B": B one column right of A, and so on
        d_row, d_col = {"left of": (0, 1), "right of": (0, -1), "above": (1, 0), "below": (-1, 0)}[relation]
        row, col = subject[0] + d_row, subject[1] + d_col
        return (row, col) if 0 <= row < 2 and 0 <= col < 2 else (1 - subject[0], 1 - subject[1])

    monkeypatch.setattr(probes, "complete", _fake_completion(follows))
    res = probes.relation_probe(model, metas, cell=16)
    assert {k: (v["rate"], v["n"], v["drawn"]) for k, v in res.items()} == {
        "asked": (1.0, 78, 1.0), "opposite": (0.0, 78, 1.0), "other_axis": (0.0, 78, 1.0)}

    def ignores(relation, subject, generator):
        free = [c for c in [(0, 0), (0, 1), (1, 0), (1, 1)] if c != subject]
        return free[int(torch.randint(3, (), generator=generator))]

    monkeypatch.setattr(probes, "complete", _fake_completion(ignores))
    res = probes.relation_probe(model, metas, cell=16, batch=1)
    for v in res.values():
        assert v["n"] == 78 and abs(v["rate"] - 1 / 3) < 3 * np.sqrt(2 / 9 / 78)

    res = probes.main(["--preset", "smoke", "--relation-probe", str(smoke_base), "--cell", "16", "--split", "heldout"])
    assert res["asked"]["n"] == len(spatial.spatial_prompts("heldout"))  # the command: every held-out prompt
    assert "relation probe of" in capsys.readouterr().out

    half = lambda relation, subject, generator: follows(relation, subject, generator) if relation in ("left of", "above") else None  # noqa: E731
    monkeypatch.setattr(probes, "complete", _fake_completion(half))
    res = probes.relation_probe(model, metas, cell=16)
    assert res["asked"]["rate"] == 1.0 and 0 < res["asked"]["drawn"] < 1
    assert res["asked"]["n"] == sum(m["relation"] in ("left of", "above") for m in metas)


def test_raft_trains_on_each_varying_groups_best_rollout_and_reports_grpos_statistics():
    """experiments/raft.py: group_best picks the first best of each group whose reward varies; the
    RAFT loss of a batch is MAR's MAE loss on exactly those rollouts under their own conditions, with
    GRPO's statistics of the same step beside it; with no varying group the loss is a zero with a graph."""
    scores = torch.tensor([0.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.2, 0.0, 0.7])
    assert raft.group_best(scores, 3).tolist() == [1, 8]
    model = tiny_mar()
    record, inputs = make_rollout(model)  # 2 prompts × G = 2
    gcfg = settings("grpo-fixed-head")
    batch = MicroBatch(inputs, record, None, None, torch.tensor([0.1, 0.9, 0.3, 0.3]), torch.tensor([-1.0, 1.0, 0.0, 0.0]),
                       {}, None, [None] * len(record.steps), {})
    loss_module = raft.RAFTLoss(model, group_size=2)
    torch.manual_seed(3)
    loss, stats, _ = loss_module(model, batch, 0, gcfg, None)
    torch.manual_seed(3)
    expected = MAELoss(model)(model.unpatchify(record.tokens[[1]]), labels=inputs["labels"][[1]])
    assert torch.equal(loss, expected) and stats["raft_images"] == 1 and stats["raft_loss"] == loss.detach()
    _, grpo_stats, _ = grpo.ar_step_loss(model, model, record, 0, inputs, batch.adv, gcfg)
    assert set(grpo_stats) <= set(stats) and all(torch.equal(grpo_stats[k], stats[k]) for k in grpo_stats)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.zero_grad()
    batch.scores = torch.tensor([0.3, 0.3, 0.5, 0.5])  # every group ties: nothing to learn from
    loss, stats, _ = loss_module(model, batch, 0, gcfg, None)
    loss.backward()
    assert loss.item() == 0 and stats["raft_images"] == 0
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in model.parameters())


def _relation_sweep(folder, rates, cfgs=(None,)):
    """sweep.json as experiments.spatial --sweep writes it: rates {τ: (train, held out)} of the strict
    accuracy (relation right the same, relation | both 0.8 of the 100 images, 80 of them with both
    objects), its best chosen on the training split; with cfgs, w 3 scores 0.1 more everywhere."""
    folder.mkdir(parents=True, exist_ok=True)
    cells = []
    for t, (train_rate, held) in rates.items():
        for w in cfgs:
            up = 0.1 if w == 3.0 else 0.0
            for split, r in (("train", train_rate + up), ("heldout", held + up)):
                fails = {"correct": r, "missing object": 1 - r, "wrong count": 0.0, "extra object": 0.0,
                         "wrong relation": 0.0}
                cells.append(dict(temperature=t, cfg=w, split=split, n=100, accuracy=r, relation_right=r, both=80,
                                  relation_given_both=0.8, failures=fails))
    sweep = dict(cells=cells, choose_on="train", key="accuracy")
    sweep["best"] = evaluate.best_setting(sweep)
    (folder / "sweep.json").write_text(json.dumps(sweep))


def test_relation_study_runs_every_arm_and_seed_then_skips_what_is_done(tmp_path, monkeypatch):
    """Every arm × seed trains from the preset on the training split's spatial prompts with the
    study's reward (RAFT with its loss and learning rate), then is swept over τ; the base is swept
    once, over guidance too; finished runs and sweeps are not run again; a bad flag stops it before
    any run starts."""
    jobs = []
    monkeypatch.setattr(relation_study, "run_jobs", lambda js, who: jobs.extend(js))
    opts = SimpleNamespace(out=str(tmp_path / "rel"), seeds=2, steps=3, arms="", preset="relation",
                           reward="shapes_partial", base_cfgs="1,3")
    relation_study.run(opts, ["--group-size", "4"])
    assert [what for what, _, _ in jobs] == ["base"] + [f"{a} seed {s}" for a in relation_study.ARMS for s in (0, 1)]
    base_cmd = jobs[0][2]
    assert base_cmd.count(" --sweep ") == 1 and lab.RELATION_BASE in base_cmd and "--eval-cfgs 1,3" in base_cmd
    for what, _, cmd in jobs[1:]:
        assert "--preset relation" in cmd and "--reward shapes_partial" in cmd and "--group-size 4" in cmd
        assert cmd.count(" --sweep ") == 1 and "train_spatial.txt" in cmd and "--eval-cfgs" not in cmd
        assert ("--loss raft" in cmd and f"--lr {relation_study.RAFT_LR}" in cmd) == what.startswith("raft")
    lines = (tmp_path / "rel" / "train_spatial.txt").read_text().splitlines()
    assert lines == [m["prompt"] for m in spatial.spatial_prompts("train")]
    done = tmp_path / "rel" / "raft" / "seed1"  # a finished run, not yet swept
    (done / "ckpt").mkdir(parents=True)
    (done / "ckpt" / "step_000003.pt").write_bytes(b"")
    _relation_sweep(tmp_path / "rel" / "base", {1.0: (0.5, 0.5)})
    jobs.clear()
    relation_study.run(opts, [])
    raft_rest = [cmd for what, _, cmd in jobs if what == "raft seed 1"][0]
    assert "experiments.lab" not in raft_rest and raft_rest.count(" --sweep ") == 1
    assert "base" not in [what for what, _, _ in jobs] and len(jobs) == 2 * len(relation_study.ARMS)
    _relation_sweep(done, {1.0: (0.5, 0.5)})
    jobs.clear()
    relation_study.run(opts, [])
    assert "raft seed 1" not in [what for what, _, _ in jobs]
    with pytest.raises(ValueError, match="^--group-size 0: "):
        relation_study.run(opts, ["--group-size", "0"])


def test_relation_study_report_gains_at_each_ones_best_setting_and_tests_the_target(tmp_path):
    """The report: each model's best τ is the one with the highest training-split strict accuracy;
    the gain is held-out strict accuracy at the run's best τ over the base's at its best setting,
    guidance included; the target needs ≥ 10 points in every seed; spreads are sample standard
    deviations; the gradient norm's mean and std/mean and the last 10 steps' KL come from metrics."""
    root = tmp_path / "rel"
    _relation_sweep(root / "base", {1.0: (0.40, 0.30), 0.3: (0.45, 0.32)}, cfgs=(1.0, 3.0))  # best: τ 0.3, w 3
    runs = {("grpo", 0): {1.0: (0.60, 0.50), 0.3: (0.70, 0.55)},
            ("grpo", 1): {1.0: (0.72, 0.60), 0.3: (0.70, 0.65)},
            ("raft", 0): {1.0: (0.99, 0.80), 0.3: (0.95, 0.90)},
            ("raft", 1): {1.0: (0.50, 0.45), 0.3: (0.45, 0.50)}}
    for (arm, seed), rates in runs.items():
        _relation_sweep(root / arm / f"seed{seed}", rates)
        rows = [dict(step=i, grad_norm=float(1 + i % 2), kl=0.1 * i, reward_mean=0.5) for i in range(20)]
        (root / arm / f"seed{seed}" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    opts = SimpleNamespace(out=str(root), seeds=2)
    res = relation_study.report(opts, ["grpo", "raft", "mar-grpo"])
    assert res["base_best"]["setting"] == {"temperature": 0.3, "cfg": 3.0}
    assert res["base_best"]["heldout"]["accuracy"] == pytest.approx(0.42)
    assert res["base_best"]["unguided"]["setting"] == {"temperature": 0.3, "cfg": 1.0}
    grpo_runs = res["arms"]["grpo"]["runs"]
    assert [r["best"]["temperature"] for r in grpo_runs] == [0.3, 1.0]
    assert grpo_runs[0]["gain"] == pytest.approx(0.55 - 0.42) and grpo_runs[1]["gain"] == pytest.approx(0.60 - 0.42)
    assert grpo_runs[0]["gain_unguided"] == pytest.approx(0.55 - 0.32)  # the base at w 1, as the runs sample
    assert grpo_runs[0]["heldout_tau1"]["accuracy"] == pytest.approx(0.50)
    assert res["arms"]["grpo"]["heldout_best_std"] == pytest.approx(np.std([0.55, 0.60], ddof=1))
    assert grpo_runs[0]["grad_norm_mean"] == pytest.approx(1.5) and grpo_runs[0]["grad_norm_cv"] == pytest.approx(1 / 3)
    assert grpo_runs[0]["kl_last"] == pytest.approx(0.1 * np.mean(range(10, 20)))
    assert res["arms"]["grpo"]["target_met"] and not res["arms"]["raft"]["target_met"]  # raft's seed 1: +3 points
    assert "mar-grpo" not in res["arms"]  # no finished run
    md = (root / "relation.md").read_text()
    assert "| grpo | 0 | 0.3 | 50.0% ± 5.0% |" in md and "raft: held-out strict accuracy" in md
    assert "(sample std)" in md and (root / "relation.png").exists()
