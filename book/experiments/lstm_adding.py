"""LSTM vs LayerNorm LSTM on the adding problem, over several seeds.

Three settings: the chapter's well-scaled sequences of T = 30 steps; the same
sequences with the value channel multiplied by 10 and the markers left at 0 and 1
(badly scaled inputs, like those that saturate the plain LSTM's gates at
initialization; not a rescaling of the whole input, to which the LayerNorm LSTM
is invariant); and sequences twice as long.
Each seed gives both networks the same initial weights and the same batches.

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
    # (sequence length T, input scale) per setting
    cfg = dict(conditions=[[30, 1.0], [30, 10.0], [60, 1.0]], batch=32, H=32,
               lr=3e-3, steps=1000, seeds=[0, 1, 2, 3, 4], smooth=20,
               final_window=100)
    if args.quick:
        cfg.update(conditions=[[5, 1.0], [5, 10.0]], steps=4, seeds=[0], smooth=2,
                   final_window=2)
    runs = []
    for T, scale in cfg["conditions"]:
        for ln in (False, True):
            for seed in cfg["seeds"]:
                t0 = time.perf_counter()
                losses = train_adding(ln, steps=cfg["steps"], T=T,
                                      batch=cfg["batch"], H=cfg["H"],
                                      lr=cfg["lr"], seed=seed, scale=scale)
                w = cfg["smooth"]
                curve = np.convolve(losses, np.ones(w) / w, mode="valid")[::w]
                runs.append({"ln": ln, "T": T, "scale": scale, "seed": seed,
                             "final_mse": float(losses[-cfg["final_window"]:].mean()),
                             "curve": [round(float(c), 6) for c in curve],
                             "seconds": round(time.perf_counter() - t0, 1)})
                r = runs[-1]
                print(f"T {T} scale {scale:g} {'LN-LSTM' if ln else 'LSTM':7s} seed {seed}:"
                      f" final MSE {r['final_mse']:.4f} ({r['seconds']}s)", flush=True)
    common.write(args.out, "lstm_adding", args.quick, cfg, runs, started)


if __name__ == "__main__":
    main()
