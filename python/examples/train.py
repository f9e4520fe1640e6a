"""Train one small decoder-only transformer several times on a copy task, with PyTorch's SDPA (flash
backend; seeds 0, 1, 2 and 3) and with flash_stages (seeds 0 and 1: the same initial weights and
data as SDPA's runs of those seeds), and write every logged step of every run to a CSV
(plots/data/<gpu>_training.csv; plots/training.gp draws it, plots/tables.py tables it). The
SDPA runs of different seeds show how far the loss moves by chance alone: a flash_stages run
trains as well as SDPA when its final loss lies within their spread.

The task: a sequence of S tokens whose first half holds S/2 distinct tokens drawn at random from
the vocabulary and whose second half repeats the first. The loss counts the second half from its
second token on: each of those tokens follows, in the first half, the one token equal to its
predecessor, so it is determined by what came before and the best achievable loss is 0 nats. A
model gets there by learning to look the predecessor up and copy what followed it (an induction
head, over a distance of S/2). Rotary position embeddings give the attention relative positions.

    python python/examples/train.py --sdpa-seeds 0,1,2        # the runs the README shows
    python python/examples/train.py --steps 300 --seq 1024 --sdpa-seeds 0 --flash-stages-seeds 0   # a quick look
"""

import argparse
import csv
import pathlib
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    import flash_stages  # installed: pip install . (repository root)
except ImportError:  # or straight from the source tree, with the libraries of its build/lib
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import flash_stages


def rotate(x, cos, sin):
    """Rotary position embedding of x [B, H, S, D]: each pair (x_i, x_i+D/2) turned by a
    position-dependent angle, so that q·k depends on the distance between positions. The result
    is a new, contiguous [B, H, S, D] tensor."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # autocast's type: attention takes fp16 or bf16
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, width, heads, attention):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width, bias=False)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, cos, sin):
        batch, seq, width = x.shape
        # [B, S, H, D] seen as [B, H, S, D]: strided views. Rotating q and k writes them out
        # contiguous; v stays strided (SDPA and stage 10 read the strides; other stages copy it).
        qkv = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, width // self.heads)
        q, k, v = qkv.transpose(1, 3).unbind(2)  # [B, H, 3, S, D] -> three [B, H, S, D]
        o = self.attention(rotate(q, cos, sin), rotate(k, cos, sin), v)
        x = x + self.proj(o.transpose(1, 2).reshape(batch, seq, width))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, vocab, width, heads, layers, attention):
        super().__init__()
        self.head_dim = width // heads
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads, attention) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        seq, half = tokens.shape[1], self.head_dim // 2
        frequencies = 10000.0 ** (-torch.arange(half, device=tokens.device) / half)
        angles = torch.arange(seq, device=tokens.device)[:, None] * frequencies  # [S, D/2]
        cos, sin = angles.cos(), angles.sin()
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def sdpa_flash(q, k, v):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def batches(args, seed):
    gen = torch.Generator(device="cuda").manual_seed(1000 + seed)
    half = args.seq // 2
    while True:
        # S/2 distinct tokens per sequence: the first S/2 of a random permutation of the vocabulary.
        first = torch.rand(args.batch, args.vocab, generator=gen, device="cuda").argsort(dim=1)[:, :half]
        yield torch.cat([first, first], dim=1)


def train(args, run, attention, seed, writer):
    torch.manual_seed(seed)
    model = Decoder(args.vocab, args.width, args.heads, args.layers, attention).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    dtype = DTYPES[args.dtype]
    # fp16's narrow range needs the loss scaled so that small gradients do not flush to zero;
    # bf16 has float32's range and needs no scaling (the scaler is then a pass-through).
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    data = batches(args, seed)
    half = args.seq // 2
    tokens_per_step = args.batch * args.seq
    window_start, window_steps = None, 0
    for step in range(1, args.steps + 1):
        if step == args.warmup + 1:
            torch.cuda.synchronize()
            window_start, window_steps = time.perf_counter(), 0
        lr = args.lr * min(1.0, step / args.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        tokens = next(data)
        with torch.autocast("cuda", dtype=dtype):
            logits = model(tokens[:, :-1])
            # Logit t predicts token t + 1; the loss counts targets S/2 + 1 .. S - 1.
            loss = F.cross_entropy(logits[:, half:].float().reshape(-1, args.vocab),
                                   tokens[:, half + 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        if window_start is not None:
            window_steps += 1
        if step % args.log_every == 0 or step == args.steps:
            torch.cuda.synchronize()
            rate = ""
            if window_start is not None and window_steps > 0:
                rate = f"{window_steps * tokens_per_step / (time.perf_counter() - window_start):.0f}"
            writer.writerow([args.gpu, run, seed, step, f"{loss.item():.5f}", rate, args.dtype])
            print(f"{run} seed {seed} step {step:5d}  loss {loss.item():.4f}  tokens/s {rate}", flush=True)
            torch.cuda.synchronize()
            window_start, window_steps = time.perf_counter(), 0


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def seed_list(text):
    """--sdpa-seeds 0,1,2,3 -> [0, 1, 2, 3]; an empty string is no run."""
    try:
        return [int(seed) for seed in text.split(",") if seed.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds must be integers separated by commas, got {text!r}") from None


def default_csv(gpu, kind="training"):
    """plots/data/<gpu>_<kind>.csv, <gpu> named by plots/gpu_slug.sh as the benchmark names it."""
    root = pathlib.Path(__file__).resolve().parents[2]
    slug = subprocess.run(["bash", "-c", 'source plots/gpu_slug.sh && gpu_slug "$1"', "gpu_slug", gpu],
                          cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    return root / "plots" / "data" / f"{slug}_{kind}.csv"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--warmup", type=int, default=100, help="steps of linear learning-rate warm-up, untimed")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=16, help="large enough that the GPU, not Python, sets the pace")
    parser.add_argument("--vocab", type=int, default=4096, help="at least S/2")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4, help="head dim = width / heads (64 or 128)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="autocast's type (default bf16)")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--sdpa-seeds", type=seed_list, default=[0, 1, 2, 3],
                        help="seeds of the SDPA flash runs, comma-separated (their spread is the noise)")
    parser.add_argument("--flash-stages-seeds", type=seed_list, default=[0, 1],
                        help="seeds of the flash_stages runs, comma-separated")
    parser.add_argument("--stage", default=None, help="flash_stages stage (default: the fastest this GPU runs)")
    parser.add_argument("--out", default=None, help="CSV path (default plots/data/<gpu>_training.csv)")
    args = parser.parse_args()
    if args.seq % 2 or args.vocab < args.seq // 2 or args.width // args.heads not in (64, 128):
        parser.error("--seq must be even, --vocab at least seq / 2, and width / heads 64 or 128")
    for option, seeds in (("--sdpa-seeds", args.sdpa_seeds), ("--flash-stages-seeds", args.flash_stages_seeds)):
        if len(set(seeds)) != len(seeds):  # a run is named by its kernel and seed in the CSV
            parser.error(f"{option} names a seed twice: {seeds}")
    if not args.sdpa_seeds and not args.flash_stages_seeds:
        parser.error("no run: --sdpa-seeds and --flash-stages-seeds are both empty")
    args.gpu = torch.cuda.get_device_name()
    stage = args.stage or flash_stages.default_stage()
    out = pathlib.Path(args.out) if args.out else default_csv(args.gpu)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{args.gpu}: {args.layers} layers, width {args.width}, {args.heads} heads of {args.width // args.heads}, "
          f"S = {args.seq}, batch {args.batch}, vocab {args.vocab}, {args.dtype}; flash_stages stage {stage}; best loss 0; "
          f"{args.steps} steps per run; SDPA seeds {args.sdpa_seeds}, flash_stages seeds {args.flash_stages_seeds}")

    def ours(q, k, v):
        return flash_stages.attention(q, k, v, causal=True, stage=stage)

    # Interleaved (SDPA seed 0, flash_stages seed 0, SDPA seed 1, ...), so that a drift of the GPU's
    # clocks over the minutes of the runs does not favour either kernel's throughput.
    runs = []
    for i in range(max(len(args.sdpa_seeds), len(args.flash_stages_seeds))):
        if i < len(args.sdpa_seeds):
            runs.append(("sdpa_flash", sdpa_flash, args.sdpa_seeds[i]))
        if i < len(args.flash_stages_seeds):
            runs.append((f"flash_stages_{stage}", ours, args.flash_stages_seeds[i]))
    with open(out, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["gpu", "run", "seed", "step", "loss", "tokens_per_s", "dtype"])
        for run, attention, seed in runs:
            start = time.perf_counter()
            train(args, run, attention, seed, writer)
            f.flush()
            print(f"{run} seed {seed}: {args.steps} steps in {time.perf_counter() - start:.0f} s", flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
