"""Train a small Hugging Face transformers Llama in bf16 with SDPA and with flash_stages, in one
invocation, and write each step's loss and time to a CSV (plots/data/<gpu>_llama.csv; plots/tables.py
tables it, plots/llama.gp draws it).

Random weights and synthetic data, nothing downloaded: for each configuration (head dim 128, a
sequence length, all heads or grouped K/V heads) one model is built and copied, so that the
SDPA copy and the flash_stages copy (config._attn_implementation "sdpa" and "flash_stages",
flash_stages.transformers) start from the same weights, and both see the same batch of random
tokens at each step. The two copies train in turns, a step each, so that both are timed under the
same conditions; a step (forward, backward, AdamW) is timed with CUDA events, and its loss is read
back. Where the two losses stay close step after step, flash_stages trains the model as SDPA does;
the median step times compare their speed inside a whole model, where transformers hands the
attention [B, H, S, D] views of [B, S, H, D] projections.

    python python/examples/llama.py                    # the configurations the README shows
    python python/examples/llama.py --steps 10 --seqs 2048 --kv-heads 16   # a quick look
"""

import argparse
import copy
import csv
import os
import pathlib
import statistics
import sys

import torch

try:
    import flash_stages  # installed: pip install . (repository root)
except ImportError:  # or straight from the source tree, with the libraries of its build/lib
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import flash_stages
import flash_stages.transformers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from train import default_csv  # noqa: E402  (the same CSV naming as the training example)

COLUMNS = ["gpu", "seq", "heads", "kv_heads", "head_dim", "batch", "layers", "impl", "stage", "step", "loss", "step_ms",
           "commit"]


def build_models(args, seq, kv_heads):
    """The SDPA model and its flash_stages copy, with the same random weights, in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.heads * 128, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=seq)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    sdpa = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    ours = copy.deepcopy(sdpa)
    ours.config._attn_implementation = flash_stages.transformers.NAME  # the copy's layers share its config
    return {"sdpa": sdpa, "flash_stages": ours}


def train(args, seq, kv_heads, gpu, writer):
    models = build_models(args, seq, kv_heads)
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=args.lr) for name, m in models.items()}
    gen = torch.Generator(device="cuda").manual_seed(1)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = {name: [] for name in models}
    stage = flash_stages.default_stage()
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, seq), device="cuda", generator=gen)
        for name, model in models.items():
            start.record()
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            stop.record()
            stop.synchronize()
            ms = start.elapsed_time(stop)
            if step >= args.warmup:
                times[name].append(ms)
            writer.writerow([gpu, seq, args.heads, kv_heads, 128, args.batch, args.layers, name,
                             stage if name == "flash_stages" else "", step, f"{loss.item():.5f}",
                             f"{ms:.3f}" if step >= args.warmup else "", os.environ.get("FLASH_STAGES_COMMIT", "")])
    sdpa_ms, ours_ms = statistics.median(times["sdpa"]), statistics.median(times["flash_stages"])
    print(f"llama: S={seq} heads={args.heads} kv_heads={kv_heads}: step {sdpa_ms:.2f} ms with SDPA, {ours_ms:.2f} ms "
          f"with flash_stages ({stage}): {sdpa_ms / ours_ms:.3f}x")
    del models, optimizers
    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--heads", type=int, default=16, help="query heads of D = 128 (width = 128 heads)")
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[16, 4], help="K/V heads: each value a run")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--out", default=None, help="CSV path (default plots/data/<gpu>_llama.csv)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("llama: no CUDA device; nothing to train")
        return 0
    flash_stages.transformers.register()
    gpu = torch.cuda.get_device_name()
    out = args.out or str(default_csv(gpu, "llama"))
    with open(out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        for seq in args.seqs:
            for kv_heads in args.kv_heads:
                train(args, seq, kv_heads, gpu, writer)
    print(f"llama: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
