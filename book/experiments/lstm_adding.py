"""LSTM vs LayerNorm LSTM on the adding problem, over several seeds.

Two settings: the chapter's well-scaled inputs, and the same sequences with
the whole input multiplied by 10 (badly scaled inputs, which saturate the
plain LSTM's gates at initialization; the LayerNorm LSTM's normalized
pre-activations do not see the scale).  Each seed gives both networks the
same initial weights and the same batches.

    python book/experiments/lstm_adding.py            # the book's results
    python book/experiments/lstm_adding.py --quick    # smoke test (seconds)
"""

import time

import common
import numpy as np

from lnlstm import train_adding


def main():
    args = common.parse_args(__doc__.splitlines()[0])
    started = time.perf_counter()
    cfg = dict(T=30, batch=32, H=32, lr=3e-3, steps=1000, seeds=[0, 1, 2, 3, 4],
               scales=[1.0, 10.0], smooth=20, final_window=100)
    if args.quick:
        cfg.update(T=5, steps=4, seeds=[0], smooth=2, final_window=2)
    runs = []
    for scale in cfg["scales"]:
        for ln in (False, True):
            for seed in cfg["seeds"]:
                t0 = time.perf_counter()
                losses = train_adding(ln, steps=cfg["steps"], T=cfg["T"],
                                      batch=cfg["batch"], H=cfg["H"],
                                      lr=cfg["lr"], seed=seed, scale=scale)
                w = cfg["smooth"]
                curve = np.convolve(losses, np.ones(w) / w, mode="valid")[::w]
                runs.append({"ln": ln, "scale": scale, "seed": seed,
                             "final_mse": float(losses[-cfg["final_window"]:].mean()),
                             "curve": [round(float(c), 6) for c in curve],
                             "seconds": round(time.perf_counter() - t0, 1)})
                r = runs[-1]
                print(f"scale {scale:g} {'LN-LSTM' if ln else 'LSTM':7s} seed {seed}:"
                      f" final MSE {r['final_mse']:.4f} ({r['seconds']}s)", flush=True)
    common.write(args.out, "lstm_adding", args.quick, cfg, runs, started)


if __name__ == "__main__":
    main()
