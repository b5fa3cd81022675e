"""A Harmon-1.5B-sized GRPO step with `--lora`, on a CPU machine, with its peak memory (docs/memory.md).

    python -m benchmarks.harmon_lora_step --work /tmp/harmon15            # --lora 32, the measured run
    python -m benchmarks.harmon_lora_step --work /tmp/harmon15 --lora 0   # without LoRA (~32 GiB, modelled)

The released Harmon-1.5B architecture (harmon.CONFIGS["harmon_1.5b"]: Qwen2.5-1.5B + MAR-H, 2.49B
parameters) with random weights, written to --work as the released files are laid out: a plain
state dict (`harmon_1.5b_random.pth`, 10 GB in fp32), a JSON config, an LDM-format KL-16 VAE of the
released architecture (random), a word-level tokenizer folder standing in for Qwen2.5's, a prompt file.
Then one GRPO step of `train.py --preset harmon`, reduced where the released settings would take
hours on two cores: the image (--side × --side tokens, 16 px each), the AR and diffusion steps, the
trained AR steps and the group; everything else is the preset's (CFG 3, K = 10, S = 5, lr, the
MAR-GRPO method). The reward is JPEG compressibility, which needs no weight file.

What it prints: train.py's exit status, the step's seconds, and the peak resident memory of the
train.py process (VmHWM, read every 0.2 s from /proc) while loading (until the GRPO loop starts)
and in the GRPO stage (the peak reset as it starts). A random MAR-H's head ends in zero-initialised
layers (the released init), so every policy gradient is exactly 0 on these weights; the whole
backward still runs and allocates as with trained weights, which is what the figure measures.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import torch

from benchmarks import memory
from models import harmon
from benchmarks.stand_ins import KL16, random_ldm_sd, save_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["a red circle", "two blue squares", "a green triangle left of a red circle"]


def write_inputs(work, side, seed=0):
    """The random Harmon-1.5B, its config at a side × side grid, the VAE, tokenizer and prompts; paths."""
    os.makedirs(work, exist_ok=True)
    paths = {k: os.path.join(work, name) for k, name in dict(
        init="harmon_1.5b_random.pth", config=f"harmon_1.5b_{side}x{side}.json", vae="kl16_random.ckpt",
        tokenizer="tokenizer", prompts="prompts.txt").items()}
    config = dict(harmon.CONFIGS["harmon_1.5b"], image_shape=[side, side])
    with open(paths["config"], "w") as f:
        json.dump(config, f)
    if not os.path.exists(paths["init"]):
        torch.manual_seed(seed)
        model = harmon.build(config)
        print(f"built Harmon-1.5B: {sum(p.numel() for p in model.parameters()) / 1e6:,.1f}M parameters", flush=True)
        torch.save(model.state_dict(), paths["init"] + ".tmp")
        os.replace(paths["init"] + ".tmp", paths["init"])
        del model
    if not os.path.exists(paths["vae"]):
        sd = random_ldm_sd(KL16, seed=seed + 1, dtype=torch.float32)
        torch.save({"model": sd}, paths["vae"])
    if not os.path.exists(paths["tokenizer"]):
        save_tokenizer(pathlib.Path(paths["tokenizer"]))
    with open(paths["prompts"], "w") as f:
        f.write("\n".join(PROMPTS) + "\n")
    return paths


def peak_bytes(pid):
    """The process's peak resident memory so far (VmHWM), bytes; 0 once it has exited."""
    try:
        return memory.proc_status("VmHWM", pid)
    except (OSError, StopIteration):
        return 0


def run_step(cmd, log_path):
    """Run train.py, reading its peak memory until the GRPO loop's progress bar appears (loading), then
    resetting the peak (/proc/PID/clear_refs) and reading it again until exit (the GRPO stage).
    Returns (exit status, seconds, loading GiB, GRPO-stage GiB)."""
    t0 = time.time()
    loading = grpo = 0
    in_grpo = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        while proc.poll() is None:
            hwm = peak_bytes(proc.pid)
            if in_grpo:
                grpo = max(grpo, hwm)
            else:
                loading = max(loading, hwm)
                with open(log_path) as f:
                    in_grpo = "grpo:" in f.read()
                if in_grpo:
                    memory.reset_peak(proc.pid)
            time.sleep(0.2)
    return proc.returncode, time.time() - t0, loading / 2 ** 30, grpo / 2 ** 30


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True, help="folder for the random weights (10 GB) and the run")
    p.add_argument("--lora", type=int, default=32, help="LoRA rank; 0: the full policy (no adapters)")
    p.add_argument("--side", type=int, default=8, help="tokens per image side (8: 128 px)")
    p.add_argument("--num-iter", type=int, default=4, help="AR steps")
    p.add_argument("--num-sampling-steps", type=int, default=12, help="diffusion steps")
    p.add_argument("--train-ar-steps", type=int, default=2, help="trained AR steps")
    p.add_argument("--group-size", type=int, default=4, help="G (the released G)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    opts = p.parse_args(argv)
    paths = write_inputs(opts.work, opts.side)
    out = os.path.join(opts.work, f"run_lora{opts.lora}")
    cmd = [sys.executable, "train.py", "--preset", "harmon", "--init", paths["init"], "--model-config", paths["config"],
           "--vae", paths["vae"], "--tokenizer", paths["tokenizer"], "--prompts", paths["prompts"],
           "--reward", "jpeg_compressibility", "--steps", "1", "--prompts-per-step", "1",
           "--group-size", str(opts.group_size), "--num-iter", str(opts.num_iter),
           "--num-sampling-steps", str(opts.num_sampling_steps), "--train-ar-steps", str(opts.train_ar_steps),
           "--threads", str(opts.threads), "--out", out]
    if opts.lora:
        cmd += ["--lora", str(opts.lora)]
    print(" ".join(cmd), flush=True)
    rc, seconds, loading, grpo = run_step(cmd, out + ".log")
    print(f"exit {rc}; {seconds / 60:.1f} min; peak resident memory {loading:.2f} GiB loading, "
          f"{grpo:.2f} GiB in the GRPO stage (log: {out}.log)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
