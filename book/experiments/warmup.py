"""Post-LN vs Pre-LN Transformers trained with Adam, with and without warm-up.

A tiny encoder-only Transformer (numbanorm.torch.LayerNorm in every block)
learns to sort sequences of random tokens: output position i must name the
i-th smallest input token, which needs attention over the whole sequence.
Each (placement, warm-up, learning rate, seed) run trains from the same
initialization and data stream as its counterparts; the JSON keeps every
run's smoothed loss curve, final loss and held-out token accuracy.

    python book/experiments/warmup.py            # the book's results (minutes)
    python book/experiments/warmup.py --quick    # smoke test (seconds)
"""

import time

import common
import numpy as np
import torch
import torch.nn.functional as F

import numbanorm.torch as nt


class Block(torch.nn.Module):
    """Self-attention and a ReLU MLP, each with a residual and a LayerNorm."""

    def __init__(self, d, heads, ffn, post_ln):
        super().__init__()
        self.heads, self.post_ln = heads, post_ln
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ff1, self.ff2 = torch.nn.Linear(d, ffn), torch.nn.Linear(ffn, d)
        self.ln1, self.ln2 = nt.LayerNorm(d), nt.LayerNorm(d)

    def attention(self, h):
        B, T, d = h.shape
        q, k, v = (t.view(B, T, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(h).chunk(3, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v)      # bidirectional
        return self.proj(a.transpose(1, 2).reshape(B, T, d))

    def mlp(self, h):
        return self.ff2(torch.relu(self.ff1(h)))

    def forward(self, h):
        if self.post_ln:      # the original Transformer: normalize the sum
            h = self.ln1(h + self.attention(h))
            return self.ln2(h + self.mlp(h))
        h = h + self.attention(self.ln1(h))   # Pre-LN: normalize the branch input
        return h + self.mlp(self.ln2(h))


class Transformer(torch.nn.Module):
    def __init__(self, vocab, length, d, heads, ffn, layers, post_ln):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(0.02 * torch.randn(length, d))
        self.blocks = torch.nn.ModuleList(
            Block(d, heads, ffn, post_ln) for _ in range(layers))
        # Pre-LN's residual stream is never normalized: one LN before the head
        self.final = torch.nn.Identity() if post_ln else nt.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos
        for block in self.blocks:
            h = block(h)
        return self.head(self.final(h))


def batch(gen, size, length, vocab):
    x = torch.randint(vocab, (size, length), generator=gen)
    return x, x.sort(dim=1).values


def train(post_ln, lr, warmup, seed, cfg):
    torch.manual_seed(seed)             # same init for every (placement, lr, warm-up)
    model = Transformer(cfg["vocab"], cfg["length"], cfg["d"], cfg["heads"],
                        cfg["ffn"], cfg["layers"], post_ln)
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98))
    # linear warm-up over the first `warmup` steps, then constant
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    data = torch.Generator().manual_seed(1000 + seed)   # same data stream too
    losses = []
    for _ in range(cfg["steps"]):
        x, y = batch(data, cfg["batch"], cfg["length"], cfg["vocab"])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    test = torch.Generator().manual_seed(99)
    x, y = batch(test, 512, cfg["length"], cfg["vocab"])
    with torch.no_grad():
        acc = (model(x).argmax(-1) == y).float().mean().item()
    return np.array(losses), acc


def main():
    args = common.parse_args(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    started = time.perf_counter()
    cfg = dict(vocab=16, length=16, d=64, heads=4, ffn=128, layers=6,
               batch=32, steps=300, warmup=75, lrs=[1e-3, 1e-2],
               seeds=[0, 1, 2], smooth=10)
    if args.quick:
        cfg.update(layers=2, steps=6, warmup=3, lrs=[1e-3], seeds=[0], smooth=2)
    runs = []
    for lr in cfg["lrs"]:
        for post_ln in (True, False):
            for warm in (False, True):
                for seed in cfg["seeds"]:
                    t0 = time.perf_counter()
                    losses, acc = train(post_ln, lr, cfg["warmup"] if warm else 0,
                                        seed, cfg)
                    w = cfg["smooth"]
                    curve = np.convolve(losses, np.ones(w) / w, mode="valid")[::w]
                    runs.append({
                        "placement": "Post-LN" if post_ln else "Pre-LN",
                        "warmup": warm, "lr": lr, "seed": seed,
                        # NaN (a diverged run) is written as null
                        "final_loss": None if not np.isfinite(losses[-50:].mean())
                        else float(losses[-50:].mean()),
                        "test_accuracy": acc,
                        "curve": [None if not np.isfinite(c) else round(float(c), 5)
                                  for c in curve],
                        "seconds": round(time.perf_counter() - t0, 1)})
                    r = runs[-1]
                    print(f"lr {lr:g} {r['placement']:7s} warm-up {warm!s:5s} "
                          f"seed {seed}: loss {r['final_loss']}, "
                          f"accuracy {acc:.3f} ({r['seconds']}s)", flush=True)
    common.write(args.out, "warmup", args.quick, cfg, runs, started)


if __name__ == "__main__":
    main()
