"""A small conv net with BatchNorm, GroupNorm or LayerNorm at batch sizes 2-64.

Wu and He (2018) trained ResNet-50 with per-GPU batches of 32 down to 2:
BatchNorm's error rose steeply at small batches, GroupNorm's did not.  This
is the same sweep at toy scale: scikit-learn's handwritten digits (shipped
with the library), upsampled to 16x16, a five-convolution net, SGD with
momentum for a fixed number of epochs and Wu & He's linear learning-rate
scaling (lr proportional to the batch size).  BatchNorm is torch's; GroupNorm
and LayerNorm are numbanorm.torch's modules.  Test accuracy is measured as the
model is deployed, BatchNorm in eval mode with its running statistics; for
BatchNorm the JSON also holds the accuracy with statistics of test batches of
the training batch size, to show where the gap comes from.

    python book/experiments/conv_batch.py            # the book's results
    python book/experiments/conv_batch.py --quick    # smoke test (seconds)
"""

import copy
import time

import common
import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import numbanorm.torch as nt


def digits(size):
    d = load_digits()
    x = torch.tensor(d.data / 16, dtype=torch.float32).view(-1, 1, 8, 8)
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    x = (x - x.mean()) / x.std()
    y = torch.tensor(d.target)
    idx_train, idx_test = train_test_split(np.arange(len(y)), test_size=0.2,
                                           random_state=0, stratify=d.target)
    return x[idx_train], y[idx_train], x[idx_test], y[idx_test]


def norm_layer(kind, channels, side):
    if kind == "BatchNorm":
        return torch.nn.BatchNorm2d(channels)
    if kind == "GroupNorm":     # 4 channels per group
        return nt.GroupNorm(channels // 4, channels)
    return nt.LayerNorm([channels, side, side])   # over (C, H, W), per element affine


class ConvNet(torch.nn.Module):
    """conv-norm-ReLU x5 (two 2x2 max-pools), global average pool, linear."""

    def __init__(self, kind, size, widths=(16, 16, 32, 32, 64)):
        super().__init__()
        layers, c_in, side = [], 1, size
        for i, c in enumerate(widths):
            layers += [torch.nn.Conv2d(c_in, c, 3, padding=1, bias=False),
                       norm_layer(kind, c, side), torch.nn.ReLU()]
            if i in (1, 3):
                layers.append(torch.nn.MaxPool2d(2))
                side //= 2
            c_in = c
        self.body = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(c_in, 10)

    def forward(self, x):
        return self.head(self.body(x).mean(dim=(2, 3)))


def accuracy(model, x, y, batch=256):
    with torch.no_grad():
        return float(torch.cat([model(x[i:i + batch]).argmax(1)
                                for i in range(0, len(x), batch)]).eq(y)
                     .float().mean())


def train(kind, batch, seed, cfg, data):
    x_train, y_train, x_test, y_test = data
    torch.manual_seed(seed)
    model = ConvNet(kind, cfg["size"])
    lr = cfg["base_lr"] * batch / cfg["base_batch"]      # linear scaling rule
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    order = torch.Generator().manual_seed(100 + seed)
    losses = []
    for _ in range(cfg["epochs"]):
        model.train()
        perm = torch.randperm(len(x_train), generator=order)
        total, count = 0.0, 0
        for start in range(0, len(perm) - batch + 1, batch):
            idx = perm[start:start + batch]
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, count = total + loss.item(), count + 1
        losses.append(total / count)
    model.eval()                       # BatchNorm: running statistics
    result = {"train_loss": losses, "test_accuracy": accuracy(model, x_test, y_test)}
    if kind == "BatchNorm":
        # the same weights, normalized with statistics of test batches of the
        # training batch size (a copy: the running averages stay untouched)
        batch_stats = copy.deepcopy(model).train()
        result["test_accuracy_batch_stats"] = accuracy(batch_stats, x_test, y_test,
                                                       batch=batch)
    return result


def main():
    args = common.parse_args(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    started = time.perf_counter()
    cfg = dict(size=16, epochs=8, base_lr=0.1, base_batch=32,
               batches=[2, 4, 8, 16, 32, 64], seeds=[0, 1, 2],
               norms=["BatchNorm", "GroupNorm", "LayerNorm"])
    data = digits(cfg["size"])
    if args.quick:
        cfg.update(epochs=1, batches=[2, 64], seeds=[0])
        data = (data[0][:64], data[1][:64], data[2][:64], data[3][:64])
    runs = []
    for batch in cfg["batches"]:
        for kind in cfg["norms"]:
            for seed in cfg["seeds"]:
                t0 = time.perf_counter()
                r = train(kind, batch, seed, cfg, data)
                r.update(norm=kind, batch=batch, seed=seed,
                         seconds=round(time.perf_counter() - t0, 1))
                runs.append(r)
                extra = (f", with test-batch statistics "
                         f"{r['test_accuracy_batch_stats']:.3f}"
                         if kind == "BatchNorm" else "")
                print(f"batch {batch:2d} {kind:9s} seed {seed}: test accuracy "
                      f"{r['test_accuracy']:.3f}{extra} ({r['seconds']}s)", flush=True)
    common.write(args.out, "conv_batch", args.quick, cfg, runs, started)


if __name__ == "__main__":
    main()
