"""The compositional rewards' models: GroundingDINO, GIT-VQA and BLIP-VQA load strictly from tiny random
folders in the Hugging Face layout (built below: config, safetensors, processor and tokenizer files),
a wrong folder is a one-line error naming it; the detector's caption, spans and positive map by hand;
git_vqa against a direct computation; NOVA trained on the released records with the released mix;
T2I-CompBench's scores and table.

The tokenizer of the tiny models is a BERT WordPiece vocabulary written by `bert_tokenizer`: the ids
that the models or the released scorers name keep their bert-base-uncased values ([CLS] 101, [SEP]
102, "." 1012, "?" 1029, which GroundingDINO's text masks look for; "yes" 2748, "no" 2053).
"""

import json
import math
import re

import numpy as np
import pytest
import torch

from infra import prompt_records
from scorers import composition_rules as cr
from scorers import detector, hf_folders, registry
from tables import paper
from tests.helpers import FIXTURES
from tests.test_composition import box


VOCAB = 3000
FIXED_IDS = {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103, ".": 1012, "?": 1029, "a": 1037,
             "the": 1996, "of": 1997, "and": 1998, "on": 2006, "no": 2053, "yes": 2748}
WORDS = ("red green blue black white round square wooden metal ball cube cat dog bird birds car cars book bench "
         "bowl cake vase horse photo left right top above below near is sitting two three").split()


def bert_tokenizer(folder):
    """A BertTokenizer over a written vocab.txt in `folder` (FIXED_IDS where they are, WORDS after 2100)."""
    from transformers import BertTokenizer
    from transformers.models.bert.tokenization_bert import load_vocab
    tokens = [f"[unused{i}]" for i in range(VOCAB)]
    for token, i in FIXED_IDS.items():
        tokens[i] = token
    for i, word in enumerate(WORDS):
        tokens[2100 + i] = word
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(tokens) + "\n")
    return BertTokenizer(vocab=dict(load_vocab(str(folder / "vocab.txt"))))


def save_gdino(folder, seed=0):
    """A GroundingDINO of a few hundred thousand weights (Swin 8 wide, BERT 8 wide, 10 queries)."""
    from transformers import (GroundingDinoConfig, GroundingDinoForObjectDetection, GroundingDinoImageProcessor,
                              GroundingDinoProcessor, SwinConfig)
    tok = bert_tokenizer(folder / "vocab")
    swin = SwinConfig(window_size=7, embed_dim=8, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1], image_size=64,
                      out_indices=[2, 3, 4])
    config = GroundingDinoConfig(
        backbone_config=swin, d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=10, num_feature_levels=4,
        encoder_n_points=2, decoder_n_points=2, max_text_len=32,  # d_model: a multiple of 32 (its GroupNorm)
        text_config=dict(model_type="bert", vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=8, max_position_embeddings=64))
    torch.manual_seed(seed)  # transformers initialises from the global generator; tests only
    GroundingDinoForObjectDetection(config).eval().save_pretrained(folder)
    GroundingDinoProcessor(GroundingDinoImageProcessor(size={"shortest_edge": 128, "longest_edge": 192}), tok).save_pretrained(folder)
    return folder


def save_git(folder, seed=0):
    """A GIT captioner/VQA model 32 wide over 32-px images."""
    from transformers import CLIPImageProcessor, GitConfig, GitForCausalLM, GitProcessor
    tok = bert_tokenizer(folder / "vocab")
    config = GitConfig(vision_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                                          image_size=32, patch_size=8, projection_dim=32),
                       vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                       max_position_embeddings=64, bos_token_id=101, eos_token_id=102, pad_token_id=0)
    torch.manual_seed(seed)
    GitForCausalLM(config).eval().save_pretrained(folder)
    GitProcessor(CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}), tok).save_pretrained(folder)
    return folder


def save_blip_vqa(folder, seed=0):
    """A BLIP-VQA model 32 wide over 32-px images, with BLIP's [DEC] (decoder start) and [ENC] tokens."""
    from transformers import BlipConfig, BlipForQuestionAnswering, BlipImageProcessor, BlipProcessor
    tok = bert_tokenizer(folder / "vocab")
    tok.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
    config = BlipConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64, bos_token_id=tok.convert_tokens_to_ids("[DEC]"),
                         pad_token_id=0, sep_token_id=102, eos_token_id=102),
        vision_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                           patch_size=8, initializer_range=0.02),  # its default 1e-10 leaves a random model blind
        projection_dim=32, image_text_hidden_size=32)
    torch.manual_seed(seed)
    BlipForQuestionAnswering(config).eval().save_pretrained(folder)
    BlipProcessor(BlipImageProcessor(size={"height": 32, "width": 32}), tok).save_pretrained(folder)
    return folder



# -----------------------------------------------------------------------------
# The models, from tiny folders in the Hugging Face layout

@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("composition")
    return dict(gdino=save_gdino(d / "gdino"), git=save_git(d / "git"), blip=save_blip_vqa(d / "blip"))


def images(seed, b=4, size=32):
    return torch.rand(b, 3, size, size, generator=torch.Generator().manual_seed(seed))


def records_of(*tasks):
    by_task = {json.loads(line)["task_type"]: json.loads(line)
               for line in (FIXTURES / "composition_prompts.jsonl").read_text().splitlines()}
    return [by_task[t] for t in tasks]


def test_the_detector_scores_each_noun_by_the_mean_of_its_tokens(folders):
    from transformers import GroundingDinoForObjectDetection
    det = detector.Detector(str(folders["gdino"]), "--reward-ckpt gdino", threshold=0.0)
    nouns = [["cat", "red car"], ["dog"], [], ["ball", "cube", "bird"]]
    found = det.detect(images(1), nouns)
    assert found[2].labels == [] and found[0].labels.count("red car") == 10  # every query passes threshold 0
    # by hand for image 0: tokens [CLS] cat . red car . [SEP] -> cat = token 1, red car = tokens 3, 4
    model = GroundingDinoForObjectDetection.from_pretrained(str(folders["gdino"])).eval()
    tok = det.processor.tokenizer("cat . red car.", return_tensors="pt")
    word = lambda w: 2100 + WORDS.index(w)
    assert tok["input_ids"][0].tolist() == [101, word("cat"), 1012, word("red"), word("car"), 1012, 102]
    pix = det.processor.image_processor(hf_folders.pixel_arrays(images(1)[:1]), return_tensors="pt")
    with torch.no_grad():
        out = model(**pix, **tok)
    p = out.logits[0].sigmoid()                                                   # (queries, max_text_len)
    want = torch.cat([p[:, 1] / (1 + 1e-6), (p[:, 3] + p[:, 4]) / (2 + 1e-6)])  # nouns in order, queries in order
    assert torch.allclose(found[0].scores, want, atol=1e-5)
    assert torch.allclose(found[0].boxes, out.pred_boxes[0].repeat(2, 1), atol=1e-5)
    # batched with padding = one image at a time
    alone = det.detect(images(1)[3:], nouns[3:])[0]
    assert alone.labels == found[3].labels and torch.allclose(alone.scores, found[3].scores, atol=1e-5)


def test_git_vqa_is_the_yes_share_of_the_next_token(folders):
    from transformers import GitForCausalLM, GitProcessor
    reward = registry.build_reward("git_vqa", weights={"git_vqa": str(folders["git"])})
    recs = records_of("color", "spatial", "non", "numeracy")
    scores, info = reward(images(2), [r["prompt"] for r in recs], recs)
    model = GitForCausalLM.from_pretrained(str(folders["git"])).eval()
    proc = GitProcessor.from_pretrained(str(folders["git"]))

    def by_hand(image, phrase):
        ids = [101] + proc.tokenizer(phrase + "?", add_special_tokens=False).input_ids
        with torch.no_grad():
            logits = model(pixel_values=proc.image_processor(hf_folders.pixel_arrays(image[None]), return_tensors="pt")["pixel_values"],
                           input_ids=torch.tensor([ids])).logits[0, -1]
        return torch.sigmoid(logits[2748] - logits[2053]).item()  # P(yes) / (P(yes) + P(no))
    x = images(2)
    assert scores[0] == pytest.approx((by_hand(x[0], "green bench") + by_hand(x[0], "blue bowl")) / 2, abs=1e-5)
    assert scores[2] == pytest.approx((by_hand(x[2], "dog") + by_hand(x[2], "cat")) / 2, abs=1e-5)  # no attr_nouns: nouns
    assert scores[1] == 0 and scores[3] == 0 and 0 < scores[0] < 1
    assert info["means"]["git_vqa"] == pytest.approx(scores.mean().item())


def test_gdino_reward_and_its_released_variant(folders):
    recs = records_of("spatial", "numeracy", "color", "object")
    fixed = registry.build_reward("gdino", weights={"gdino": str(folders["gdino"])})
    released = registry.build_reward("gdino_released", weights={"gdino": str(folders["gdino"])})
    a, _ = fixed(images(3), [r["prompt"] for r in recs], recs)
    b, _ = released(images(3), [r["prompt"] for r in recs], recs)
    det = detector.Detector(str(folders["gdino"]), "--reward-ckpt gdino").detect(images(3), [r["nouns"] for r in recs])
    assert a.tolist() == pytest.approx([cr.gdino_score(r, d, cr.FIXED) for r, d in zip(recs, det)], abs=1e-6)
    assert b.tolist() == pytest.approx([cr.gdino_score(r, d, cr.RELEASED) for r, d in zip(recs, det)], abs=1e-6)
    with pytest.raises(ValueError, match="reads the released prompt metadata"):
        fixed(images(3)[:1], ["a cat"], [{"prompt": "a cat"}])


def test_a_wrong_folder_is_one_line_naming_it(folders, tmp_path):
    import shutil
    for name, key, folder in (("gdino", "gdino", folders["git"]), ("git_vqa", "git_vqa", folders["gdino"])):
        with pytest.raises(ValueError, match=rf"--reward-ckpt {key}={re.escape(str(folder))}: config.json is a"):
            registry.build_reward(name, weights={key: str(folder)})
    with pytest.raises(FileNotFoundError, match=r"--reward-ckpt gdino=FOLDER is required"):
        registry.build_reward("gdino")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        registry.build_reward("gdino", weights={"gdino": str(empty)})
    # weights that lack a tensor: refused, not started from random values
    broken = tmp_path / "broken"
    shutil.copytree(folders["git"], broken)
    from safetensors.torch import load_file, save_file
    sd = load_file(broken / "model.safetensors")
    sd.pop(next(k for k in sd if k.endswith("output.weight")))
    save_file(sd, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"the weights do not fit its config.json \(GitForCausalLM\): missing") as e:
        registry.build_reward("git_vqa", weights={"git_vqa": str(broken)})
    assert "\n" not in str(e.value)
    no_tok = tmp_path / "no_tok"
    shutil.copytree(folders["git"], no_tok)
    for f in no_tok.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ValueError, match=r"no tokenizer files \(tokenizer.json or vocab.txt\)"):
        registry.build_reward("git_vqa", weights={"git_vqa": str(no_tok)})


# -----------------------------------------------------------------------------
# train.py end to end: NOVA on the released records with the released mix

TINY_CLIP = "composition-test-clip"


@pytest.fixture
def hps_tiny(tmp_path, monkeypatch):
    """A tiny open_clip architecture's HPS file, `--reward hpsv2` built on it through its real loading path."""
    from tests import test_evaluate
    path = test_evaluate.save_tiny_hps(tmp_path, TINY_CLIP, layers=1, seed=4)
    test_evaluate.tiny_hps(monkeypatch, TINY_CLIP)
    return path


def test_nova_trains_on_the_released_records_with_hps_git_and_gdino(folders, hps_tiny, tiny_archs, tmp_path, capsys):
    from tests import test_nova
    from tests import test_train_adapters as adapters
    pipe = tmp_path / "pipe"
    adapters.save_nova_pipeline(pipe, adapters.FLOW, seed=45)
    prompts = FIXTURES / "composition_prompts.jsonl"
    texts = [r["prompt"] for r in prompt_records.read_records(prompts)]
    t = test_nova.tiny_config(None)["transformer"]
    embeds = torch.randn(len(texts), t["text_token_len"], t["text_token_dim"], generator=torch.Generator().manual_seed(46))
    torch.save({"prompts": texts, "embeds": embeds}, tmp_path / "embeds.pt")
    out = tmp_path / "run"
    flags = ["--preset", "adapter_smoke", "--model", "nova", "--init", pipe, "--prompt-embeds", tmp_path / "embeds.pt",
             "--prompts", prompts, "--out", out, "--reward", "hpsv2,git_vqa,gdino", "--reward-ckpt", f"hpsv2={hps_tiny}",
             "--reward-ckpt", f"git_vqa={folders['git']}", "--reward-ckpt", f"gdino={folders['gdino']}"]
    code, _, err = adapters.cli(capsys, *flags)
    assert code == 0, err[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:  # each component's mean is logged; the reward is their unweighted sum
        parts = [r[f"reward/{name}"] for name in ("hpsv2", "git_vqa", "gdino")]
        assert all(math.isfinite(p) for p in parts) and r["reward_mean"] == pytest.approx(sum(parts), abs=1e-5)
        assert r["logp_parity_err"] < 1e-4 and r["skipped"] == 0
    scores = out / "eval" / "tuned" / "tau1" / "train" / "scores.jsonl"
    results = [json.loads(line) for line in scores.read_text().splitlines()]
    assert [r["prompt"] for r in results] == texts  # evaluation runs over the file's records

    # a metadata reward without the records is refused before any work, in one line
    txt = tmp_path / "prompts.txt"
    txt.write_text("\n".join(texts) + "\n")
    flags[flags.index("--prompts") + 1] = txt
    out2 = tmp_path / "run2"
    flags[flags.index("--out") + 1] = out2
    adapters.assert_bad_input(capsys, out2, flags, "--reward git_vqa", "--prompts FILE.jsonl", str(txt))


# -----------------------------------------------------------------------------
# T2I-CompBench

def test_compbench_spatial_and_numeracy_rules_by_hand():
    from scorers import compbench
    info = {"obj1": "cat", "obj2": "dog", "locality": "on the left of"}
    det = cr.Detections(torch.tensor([box(0.2, 0.5), box(0.8, 0.5), box(0.3, 0.5)]), torch.tensor([0.6, 0.8, 0.9]),
                        ["cat", "dog", "cat"])
    # the most confident cat (0.9 at x 0.3) is left of the dog: 0.25 (0.9 + 0.8) + 1/2
    assert compbench.spatial_score(det, info) == pytest.approx(0.25 * 1.7 + 0.5)
    assert compbench.spatial_score(det, dict(info, locality="on the right of")) == 0   # 0.425 < 0.5: cut to 0
    assert compbench.spatial_score(cr.Detections(det.boxes[:1], det.scores[:1], ["cat"]), info) == 0
    # counting: a box inside a kept one (> 90 % of it covered) is the same object; apart ones count
    cars = cr.Detections(torch.tensor([box(0.5, 0.5, 0.4, 0.4), box(0.5, 0.5, 0.3, 0.3), box(0.1, 0.1), box(0.9, 0.9)]),
                         torch.tensor([0.5, 0.9, 0.7, 0.6]), ["car"] * 4)
    assert compbench.count(cars, "car") == 3 and compbench.count(cars, "bus") == 0
    items = [{"obj_name": "car", "num": 3}, {"obj_name": "bus", "num": 1}, {"obj_name": "car", "num": 2}]
    assert compbench.numeracy_score(cars, items) == pytest.approx((0.5 + 0.5) / 3 + 0 + 0.5 / 3)


@pytest.fixture
def compbench_weights(folders, hps_tiny):
    return {"blip_vqa": str(folders["blip"]), "gdino": str(folders["gdino"]), "clip": str(hps_tiny)}


def test_compbench_scores_each_image_by_its_category(compbench_weights):
    from scorers import compbench
    bench = compbench.CompBench(compbench_weights, clip_model=TINY_CLIP)
    recs = records_of("color", "spatial", "non", "numeracy", "complex", "shape")
    x = images(5, b=6)
    scores, info = bench(x, [r["prompt"] for r in recs], recs)
    assert info["category"] == [r["task_type"] for r in recs]
    # color: the product over its phrases, each asked alone (no padding) as in the benchmark's loop
    alone = [bench.blip.p_yes(x[:1], [f"{p}?"]).item() for p in recs[0]["attr_nouns"]]
    assert scores[0] == pytest.approx(alone[0] * alone[1], abs=1e-5) and 0 < alone[0] < 1
    found = bench.detector.detect(x, [r["nouns"] for r in recs])
    assert scores[1] == pytest.approx(compbench.spatial_score(found[1], recs[1]["spatial_info"]), abs=1e-6)
    assert scores[3] == pytest.approx(compbench.numeracy_score(found[3], recs[3]["numeracy_info"]), abs=1e-6)
    cos = bench.clip(x[2:3], [recs[2]["prompt"]])[0].item() / 100
    assert scores[2] == pytest.approx(cos, abs=1e-6) and abs(cos) < 1
    book = bench.blip.p_yes(x[4:5], ["book?"]).item() * bench.blip.p_yes(x[4:5], ["vase?"]).item()  # no attr_nouns
    assert scores[4] == pytest.approx((book + compbench.spatial_score(found[4], recs[4]["spatial_info"])) / 2, abs=1e-5)


def test_evaluate_prints_the_compbench_table(compbench_weights, folders, hps_tiny, tiny_archs, tmp_path, capsys, monkeypatch):
    from scorers import compbench
    from tests import test_nova
    from tests import test_train_adapters as adapters
    monkeypatch.setattr(compbench.CompBench.__init__, "__defaults__", ("cpu", TINY_CLIP))
    pipe = tmp_path / "pipe"
    adapters.save_nova_pipeline(pipe, adapters.FLOW, seed=47)
    prompts = FIXTURES / "composition_prompts.jsonl"
    recs = prompt_records.read_records(prompts)
    t = test_nova.tiny_config(None)["transformer"]
    embeds = torch.randn(len(recs), t["text_token_len"], t["text_token_dim"], generator=torch.Generator().manual_seed(48))
    torch.save({"prompts": [r["prompt"] for r in recs], "embeds": embeds}, tmp_path / "embeds.pt")
    out = tmp_path / "table"
    flags = ["--ckpt", f"base={pipe}", "--compbench", *[f"--compbench-ckpt={k}={v}" for k, v in compbench_weights.items()],
             "--preset", "adapter_smoke", "--model", "nova", "--prompt-embeds", tmp_path / "embeds.pt", "--prompts", prompts,
             "--images-per-prompt", 2, "--batch-size", 4, "--out", out]
    capsys.readouterr()
    assert paper.cli([str(f) for f in flags]) == 0, capsys.readouterr().err[-2000:]
    printed = capsys.readouterr().out
    table = json.loads((out / "table.json").read_text())
    rows = [json.loads(line) for line in (out / "base" / "scores.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * (len(recs) - 1)  # the `object` record has no category
    assert [c["label"] for c in table["columns"]] == list(compbench.CATEGORIES.values())
    for c in table["columns"]:  # each cell: mean ± SEM over its category's images, from scores.jsonl
        x = np.array([r["compbench"] for r in rows if r["task_type"] == c["task"]])
        cell = table["rows"][0]["cells"][c["id"]]
        assert cell["n"] == len(x) and cell["mean"] == pytest.approx(x.mean(), abs=1e-9)
        assert cell["sem"] == pytest.approx(x.std(ddof=1) / math.sqrt(len(x)), abs=1e-9)
        assert f"{cell['mean']:.4f} ± {cell['sem']:.4f}" in printed
    assert "| checkpoint | Color | Shape | Texture | Spatial | Non-spatial | Complex | Numeracy |" in printed
    assert "GroundingDINO" in printed  # the departures are printed under the table
    # the table needs the records and its three weights, said in one line before any work
    code = paper.cli([str(f) for f in flags[:2] + ["--compbench"] + flags[6:]])
    err = capsys.readouterr().err
    assert code == 2 and "--compbench-ckpt blip_vqa=PATH is required" in err and len(err.strip().splitlines()) == 1

