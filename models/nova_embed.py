"""NOVA's prompt embeddings, computed once per prompt file: the pipeline's Phi-2 text encoder from a
local folder, each prompt's hidden states padded as the NOVA pipeline pads them. train.py reads the
file this writes (`--prompt-embeds`) and never runs Phi-2 itself.

    python -m models.nova_embed --init NOVA_DIR --text-encoder NOVA_DIR/text_encoder --prompts FILE --out FILE.pt
"""

import os
import sys
from pathlib import Path

import torch
import transformers

from infra.checkpoints import atomic_save, check_writable
from infra.processes import Parser, cli
from models.prompts import prompt_text, read_prompt_file
from models import nova


@torch.no_grad()
def embed_prompts(prompts, text_encoder_dir, model, tokenizer_dir=None, device="cpu"):
    """Phi-2 prompt embeddings as the NOVA pipeline makes them, from LOCAL folders.

    prompts: list of str; text_encoder_dir: the pipeline's text_encoder/ folder (Phi-2 weights and
    config); model: the NOVA whose text_embed pads the rows; tokenizer_dir: default the sibling
    tokenizer/ folder, else text_encoder_dir. Each prompt is tokenised with truncation to
    text_token_len T; its n hidden states (after the final LayerNorm) are padded with
    text_embed.weight[n:T]. returns (B, T, D_text) on the model's device, for `condition`.
    Load once for all prompts (it reads the encoder from disk).
    """
    text_dir = Path(text_encoder_dir)
    if not text_dir.is_dir():
        raise FileNotFoundError(f"embed_prompts: no such text encoder folder: {text_dir}")
    sibling = text_dir.parent / "tokenizer"
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else (sibling if sibling.is_dir() else text_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    encoder = transformers.PhiModel.from_pretrained(str(text_dir), dtype=torch.float32, local_files_only=True).to(device).eval()
    T = model.text_embed.num_tokens
    rows = []
    for prompt in prompts:
        ids = tokenizer(prompt, max_length=T, truncation=True, return_tensors="pt").input_ids.to(device)  # (1, n)
        # (n, D_text); "" has no tokens: all padding, i.e. the null prompt
        rows.append(encoder(input_ids=ids).last_hidden_state[0] if ids.shape[1] else model.text_embed.weight[:0])
    return model.text_embed.pad(rows)


def main(argv=None):
    """Embed a prompt file with NOVA's text encoder into the `--prompt-embeds` file train.py reads for
    --model nova: {"prompts": [str], "embeds": (N, T, D)}."""
    p = Parser(prog="python -m models.nova_embed", description=main.__doc__)
    p.add_argument("--init", required=True, help="NOVA pipeline folder (transformer/, scheduler/)")
    p.add_argument("--text-encoder", required=True, help="local Phi-2 folder (the pipeline's text_encoder/)")
    p.add_argument("--tokenizer", default=None, help="local tokenizer folder (default: beside the text encoder)")
    p.add_argument("--prompts", required=True, help="prompt file, one per line (or the released .jsonl metadata)")
    p.add_argument("--out", required=True, help="output .pt file")
    args = p.parse_args(argv)
    if os.path.isdir(args.out):
        raise ValueError(f"--out {args.out}: a folder; give the .pt file to write")
    check_writable(os.path.dirname(os.path.abspath(args.out)), "--out")
    prompts = [prompt_text(it) for it in read_prompt_file(args.prompts, "text")]  # a .jsonl file's records: their prompts
    model = nova.load_nova(args.init)
    embeds = embed_prompts(prompts, args.text_encoder, model, args.tokenizer)  # (N, T, D)
    atomic_save({"prompts": prompts, "embeds": embeds}, args.out)
    print(f"{len(prompts)} prompt embeddings {tuple(embeds.shape)} -> {args.out}")


if __name__ == "__main__":
    sys.exit(cli(main))
