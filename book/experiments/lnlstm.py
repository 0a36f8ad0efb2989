"""The LayerNorm LSTM of chapter 10, and its training on the adding problem.

Chapter 10 shows this code and imports it; ``lstm_adding.py`` trains it over
several seeds and settings.  NumPy only, with numbanorm's LayerNorm forward
and backward inside backpropagation through time.
"""

import numpy as np

import numbanorm as nn


def sigmoid(z):
    return 1 / (1 + np.exp(-z))


class LSTM:
    """An LSTM layer; with ln=True, the LayerNorm LSTM of Ba et al. (2016)."""

    def __init__(self, n_in, n_hidden, ln, seed=0, dtype=np.float32):
        r = np.random.default_rng(seed)
        H = self.H = n_hidden
        self.ln = ln
        self.p = {"Wx": r.standard_normal((n_in, 4 * H)) / np.sqrt(n_in),
                  "Wh": r.standard_normal((H, 4 * H)) / np.sqrt(H),
                  "b": np.r_[np.ones(H), np.zeros(3 * H)]}  # forget bias 1
        if ln:
            for k, n in [("x", 4 * H), ("h", 4 * H), ("c", H)]:
                self.p["gamma_" + k] = np.ones(n)
                self.p["beta_" + k] = np.zeros(n)
        self.p = {k: v.astype(dtype) for k, v in self.p.items()}

    def _norm(self, z, k):
        if not self.ln:
            return z, None
        y, mean, rstd = nn.layer_norm_forward(
            z, z.shape[-1], self.p["gamma_" + k], self.p["beta_" + k])
        return y, (z, mean, rstd)

    def _norm_backward(self, dy, saved, k, grads):
        if not self.ln:
            return dy
        z, mean, rstd = saved
        dz, dgamma, dbeta = nn.layer_norm_backward(
            dy, z, mean, rstd, z.shape[-1], self.p["gamma_" + k])
        grads["gamma_" + k] += dgamma
        grads["beta_" + k] += dbeta
        return dz

    def forward(self, xs):
        """xs: (T, B, n_in) -> last hidden state (B, H)."""
        T, B, _ = xs.shape
        H, p = self.H, self.p
        ax, self.saved_x = self._norm(xs @ p["Wx"], "x")   # all steps at once
        h = np.zeros((B, H), xs.dtype)
        c = np.zeros((B, H), xs.dtype)
        self.xs, self.steps = xs, []
        for t in range(T):
            ah, saved_h = self._norm(h @ p["Wh"], "h")
            a = ax[t] + ah + p["b"]
            f, i, o = (sigmoid(a[:, k * H:(k + 1) * H]) for k in range(3))
            g = np.tanh(a[:, 3 * H:])
            c_new = f * c + i * g
            cn, saved_c = self._norm(c_new, "c")
            tc = np.tanh(cn)
            self.steps.append((h, c, saved_h, f, i, o, g, saved_c, tc))
            h, c = o * tc, c_new
        return h

    def backward(self, dh):
        """Gradients of every parameter, given dL/dh_T."""
        p, H = self.p, self.H
        grads = {k: np.zeros_like(v) for k, v in p.items()}
        dc = np.zeros_like(dh)
        da_all = np.empty(self.xs.shape[:2] + (4 * H,), dh.dtype)
        for t in reversed(range(len(self.steps))):
            h, c, saved_h, f, i, o, g, saved_c, tc = self.steps[t]
            do = dh * tc
            dcn = dh * o * (1 - tc * tc)
            dc = dc + self._norm_backward(dcn, saved_c, "c", grads)
            da = np.concatenate([dc * c * f * (1 - f), dc * g * i * (1 - i),
                                 do * o * (1 - o), dc * i * (1 - g * g)],
                                axis=1)
            dc = dc * f
            da_all[t] = da
            grads["b"] += da.sum(axis=0)
            dzh = self._norm_backward(da, saved_h, "h", grads)
            grads["Wh"] += h.T @ dzh
            dh = dzh @ p["Wh"].T
        dzx = self._norm_backward(da_all, self.saved_x, "x", grads)  # 1 call
        grads["Wx"] += np.einsum("tbi,tbj->ij", self.xs, dzx)
        return grads


def adding_problem(r, batch, T, scale=1.0):
    """Sequences of (value, marker) pairs, two markers set; target: the sum
    of the two marked values.  ``scale`` multiplies the value channel only:
    the target is the sum of the unscaled values."""
    values = r.uniform(0, 1, (T, batch))
    markers = np.zeros((T, batch))
    for b in range(batch):
        markers[r.choice(T, 2, replace=False), b] = 1
    xs = np.stack([scale * values, markers], axis=2).astype(np.float32)
    target = (values * markers).sum(axis=0)[:, None]
    return xs, target.astype(np.float32)


def train_adding(ln, steps=1200, T=30, batch=32, H=32, lr=3e-3, seed=0,
                 scale=1.0):
    """Adam on the adding problem; the per-step training MSE."""
    r = np.random.default_rng(seed)
    cell = LSTM(2, H, ln, seed=seed)
    Wo = (r.standard_normal((H, 1)) / np.sqrt(H)).astype(np.float32)
    params = dict(cell.p, Wo=Wo, bo=np.zeros(1, np.float32))
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v = {k: np.zeros_like(v) for k, v in params.items()}
    losses = []
    for step in range(1, steps + 1):
        xs, target = adding_problem(r, batch, T, scale)
        h = cell.forward(xs)
        err = h @ params["Wo"] + params["bo"] - target
        losses.append(float(np.mean(err ** 2)))
        dpred = 2 * err / batch
        grads = cell.backward(dpred @ params["Wo"].T)
        grads["Wo"], grads["bo"] = h.T @ dpred, dpred.sum(axis=0)
        for k, p in params.items():                     # Adam
            m[k] = 0.9 * m[k] + 0.1 * grads[k]
            v[k] = 0.999 * v[k] + 0.001 * grads[k] ** 2
            m_hat = m[k] / (1 - 0.9 ** step)
            v_hat = v[k] / (1 - 0.999 ** step)
            p -= (lr * m_hat / (np.sqrt(v_hat) + 1e-8)).astype(np.float32)
    return np.array(losses)
