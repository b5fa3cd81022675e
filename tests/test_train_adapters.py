"""train.py end to end on Harmon and NOVA (`--model harmon|nova --preset adapter_smoke`), in this
process, on the CPU, with tiny random models saved to a temp folder in their released formats and
loaded through the same code path real weights take:

- Harmon: `torch.save(model.state_dict())` as `harmon_*.pth` is, its config as a JSON file
  (--model-config), a word-level tokenizer folder (--tokenizer), an LDM-format KL VAE .ckpt of
  stride 16 with the MAR's 16 latent channels (--vae);
- NOVA: a pipeline folder (transformer/ config.json + safetensors, scheduler/, vae/ a diffusers
  AutoencoderKL) for both heads (DDPM, flow SDE), and a --prompt-embeds file.

Each run is 2 GRPO steps then the base/tuned evaluation; the tests check the metrics (finite,
recorded = recomputed log-probabilities), the checkpoint (it reloads through loading.load_policy)
and that exactly the parameters the released trainers train have moved. Then the one-line errors
(exit status 2) for a missing tokenizer, missing prompt embeddings and a prompt without one.
"""

import json
import math

import pytest
import torch
from diffusers import AutoencoderKL

import train
from models import loading
from tests import test_nova
from tests.helpers import ADAPTER_PROMPTS

torch.set_num_threads(1)  # tiny ops: threads only add contention on a 2-core machine

DDPM = {"_class_name": "DDPMScheduler", "beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012,
        "clip_sample": False, "timestep_spacing": "trailing"}
FLOW = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}


def cli(capsys, *flags):
    """Run train.py's entry point in-process. Returns (exit status, stdout, stderr)."""
    capsys.readouterr()
    code = train.cli([str(f) for f in flags])
    out, err = capsys.readouterr()
    return code, out, err


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def check_run(out, code, err):
    """The common assertions on a finished adapter_smoke run in `out`; returns the final checkpoint."""
    assert code == 0, err[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        for key in ("reward_mean", "loss", "kl", "grad_norm"):
            assert math.isfinite(r[key]), (key, r)
        assert r["logp_parity_err"] < 1e-4, r  # the recorded ℓ is recomputed by the policy update
        assert r["skipped"] == 0 and r["reward_std"] > 0  # a real update, from distinct images
    assert rows[1]["kl"] > 0  # step 0's update moved the policy away from the reference
    final = out / "ckpt" / "latest.pt"
    assert final.is_file()
    report = json.loads((out / "eval" / "summary.json").read_text())
    assert set(report) == {"base", "tuned"}
    for tag in ("base", "tuned"):  # the file's prompts, at the run's τ alone (the preset's sweep)
        assert report[tag]["best"] == {"temperature": 1.0, "cfg": None}
        results = (out / "eval" / tag / "tau1" / "train" / "scores.jsonl").read_text().splitlines()
        assert len(results) == len(ADAPTER_PROMPTS)
        assert all(math.isfinite(json.loads(line)["jpeg_incompressibility"]) for line in results)
    return final


def changed_keys(base_sd, tuned_sd):
    assert set(base_sd) == set(tuned_sd)
    return {k for k in base_sd if not torch.equal(base_sd[k].float(), tuned_sd[k].float())}


# -----------------------------------------------------------------------------
# Harmon

def harmon_flags(f, out, *more):
    return ["--preset", "adapter_smoke", "--model", "harmon", "--init", f["init"], "--model-config", f["config"],
            "--vae", f["vae"], "--tokenizer", f["tok"], "--prompts", f["prompts"], "--out", out, *more]


def test_harmon_grpo_end_to_end(harmon_files, tmp_path, capsys):
    out = tmp_path / "run"
    flags = harmon_flags(harmon_files, out)
    code, _, err = cli(capsys, *flags)
    final = check_run(out, code, err)

    # the checkpoint holds the trained parameters only, and reloads over its base through the run's
    # own loader, with its config
    args = train.parse_args([str(f) for f in flags])
    tuned = loading.load_policy(args, str(final))
    ckpt = load(final)
    assert ckpt["base"] == str(harmon_files["init"].absolute())
    assert all(torch.equal(tuned.state_dict()[k], v) for k, v in ckpt["model"].items())
    assert tuned.seq_len == 9 and tuned.token_embed_dim == 16

    # only the MAR encoder/decoder trained (less its unused class table): the LLM, proj_in, proj_out
    # and the diffusion head are neither saved nor moved
    assert set(ckpt["model"]) == {k for k, _ in tuned.named_parameters() if k.startswith("mar.") and not k.startswith(
        ("mar.diffloss.", "mar.class_emb."))}
    changed = changed_keys(load(harmon_files["init"]), tuned.state_dict())
    assert changed and all(k.startswith("mar.") and not k.startswith("mar.diffloss.") for k in changed), changed
    assert any(k.startswith("mar.encoder_blocks.") for k in changed)  # gradients reach the encoder through the LLM
    assert any(k.startswith("mar.decoder_blocks.") for k in changed)


# -----------------------------------------------------------------------------
# NOVA

def save_nova_pipeline(folder, scheduler, seed):
    """A NOVA pipeline folder as released: transformer/, scheduler/, and vae/ (a diffusers
    AutoencoderKL whose 4 downsamplings give the config's image_stride 16, with its 8 latent
    channels, and a latent scale and shift)."""
    model = test_nova.tiny_nova(scheduler, seed=seed)
    config = test_nova.tiny_config(scheduler)
    test_nova.save_pipeline(model, folder, config)
    t = config["transformer"]
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 5, up_block_types=("UpDecoderBlock2D",) * 5,
                        block_out_channels=(8,) * 5, layers_per_block=1, latent_channels=t["image_dim"],
                        norm_num_groups=4, sample_size=t["image_size"][0], scaling_factor=0.6, shift_factor=0.1)
    assert 2 ** (len(vae.config.block_out_channels) - 1) == t["image_stride"]
    assert [s // t["image_stride"] for s in t["image_size"]] == t["image_base_size"]  # patch size 1
    vae.save_pretrained(str(folder / "vae"))
    return model, config


def nova_flags(pipe, common, out, *more):
    return ["--preset", "adapter_smoke", "--model", "nova", "--init", pipe, "--prompt-embeds", common["embeds"],
            "--prompts", common["prompts"], "--out", out, *more]


@pytest.mark.parametrize("kind", ["ddpm", "flow"])
def test_nova_grpo_end_to_end(kind, nova_common, tiny_archs, tmp_path, capsys):
    pipe = tmp_path / "pipe"
    base, _ = save_nova_pipeline(pipe, DDPM if kind == "ddpm" else FLOW, seed=41)
    out = tmp_path / "run"
    flags = nova_flags(pipe, nova_common, out)
    code, _, err = cli(capsys, *flags)
    final = check_run(out, code, err)

    args = train.parse_args([str(f) for f in flags])
    tuned = loading.load_policy(args, str(final))
    tuned_sd = load(final)["model"]
    assert all(torch.equal(tuned.state_dict()[k], v) for k, v in tuned_sd.items())
    assert type(tuned.diffloss) is type(base.diffloss) and tuned.diffloss.num_sampling_steps == args.num_sampling_steps

    # everything but the diffusion MLP (and the video encoder's unused patch embedding) trains and is
    # saved; image_decoder.* did not move, the transformer did
    assert set(tuned_sd) == {k for k, _ in base.named_parameters() if not k.startswith(("image_decoder.", "video_encoder.patch_embed."))}
    changed = changed_keys(base.state_dict(), tuned.state_dict())
    assert changed and not any(k.startswith("image_decoder.") for k in changed), changed
    assert any(k.startswith("image_encoder.blocks.") for k in changed)
    assert any(k.startswith("video_encoder.") for k in changed)  # through the condition c


# -----------------------------------------------------------------------------
# One-line errors, exit status 2, nothing written

def assert_bad_input(capsys, out, flags, *words):
    code, _, err = cli(capsys, *flags)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert all(w in lines[0] for w in words), lines[0]
    assert not (out / "metrics.jsonl").exists() and not (out / "ckpt").exists()


def test_harmon_without_tokenizer(harmon_files, tmp_path, capsys):
    out = tmp_path / "run"
    flags = harmon_flags(harmon_files, out)
    i = flags.index("--tokenizer")
    del flags[i:i + 2]
    assert_bad_input(capsys, out, flags, "--tokenizer", "harmon")


def test_nova_without_prompt_embeds_or_with_a_prompt_missing(nova_common, tiny_archs, tmp_path, capsys):
    pipe = tmp_path / "pipe"
    save_nova_pipeline(pipe, FLOW, seed=43)
    out = tmp_path / "run"
    flags = nova_flags(pipe, nova_common, out)
    i = flags.index("--prompt-embeds")
    assert_bad_input(capsys, out, flags[:i] + flags[i + 2:], "--prompt-embeds", "nova")
    more = tmp_path / "more.txt"
    more.write_text("\n".join(ADAPTER_PROMPTS + ["a blue cube"]) + "\n")
    flags[flags.index("--prompts") + 1] = more
    assert_bad_input(capsys, out, flags, "--prompt-embeds", str(nova_common["embeds"]), "'a blue cube'")
