"""End to end: a Llama-style decoder on the CPU with PyTorch's norms and with numbanorm's.

    python -m benchmarks.e2e --json benchmarks/results/e2e-cpu.json     # defaults: hidden 2048, 2 layers
    python -m benchmarks.e2e --dtypes float32 bfloat16 --layers 4 --rounds 5 --vocab 32000

A ``transformers`` ``LlamaForCausalLM`` built from its config (random weights, no
download) is timed in three variants on the same threads, round-robin in one
process with ``numbanorm.measure.time_runners`` (so the machine's noise hits all
three alike):

* ``torch``     the model as ``transformers`` builds it (``LlamaRMSNorm``);
* ``numbanorm`` the same weights after ``numbanorm.torch.replace_norms``;
* ``no-norm``   the norms replaced by the identity: what the model would cost
  if its norms were free, so ``(torch - no-norm) / torch`` is the share of the
  step spent in PyTorch's norms, measured, and the most any norm kernel can save.

Workloads: a prefill of ``--prefill`` tokens (batch 1, logits of the last token,
as generation does), ``--decode`` single-token steps after that prefill (the KV
cache cropped back before each sample), and one training step (forward and
backward over the first ``--train`` tokens with next-token labels, then SGD).  Besides
the ablation, a ``torch.profiler`` run of the numbanorm variant gives the share
of its time inside numbanorm's operators.  Training runs in float32 only (CPU
training is float32 or autocast); bfloat16 inference needs numbanorm's CPU
bfloat16 kernels and is skipped, and recorded as skipped, where they are absent.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys

import torch

import numbanorm.torch as nt

from . import measure

VARIANTS = ("torch", "numbanorm", "no-norm")


class Identity(torch.nn.Module):
    def forward(self, hidden_states):
        return hidden_states


def build(a, dtype):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=4096,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).to(dtype)
    models = {"torch": base, "numbanorm": nt.replace_norms(copy.deepcopy(base), strict=True)}
    none = copy.deepcopy(base)
    for layer in none.model.layers:
        layer.input_layernorm = Identity()
        layer.post_attention_layernorm = Identity()
    none.model.norm = Identity()
    models["no-norm"] = none
    return models


def workloads(models, a, dtype):
    """``{workload: {variant: zero-argument step}}`` and tokens per call of each workload."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, a.vocab, (1, a.prefill), generator=g)
    train_ids = ids[:, :a.train]
    steps = {"prefill": {}, "decode": {}, "train": {}}
    for name, m in models.items():
        m.eval()

        def prefill(m=m):
            with torch.inference_mode():
                return m(input_ids=ids, logits_to_keep=1, use_cache=False).logits

        with torch.inference_mode():
            cache = m(input_ids=ids, logits_to_keep=1, use_cache=True).past_key_values
        nxt = torch.randint(0, a.vocab, (a.decode, 1, 1), generator=g)

        def decode(m=m, cache=cache):
            extra = cache.get_seq_length() - a.prefill
            if extra:
                cache.crop(-extra)  # back to the prefill's tokens
            with torch.inference_mode():
                for t in range(a.decode):
                    out = m(input_ids=nxt[t], past_key_values=cache, use_cache=True, logits_to_keep=1)
            return out.logits

        steps["prefill"][name], steps["decode"][name] = prefill, decode
        if dtype == torch.float32:
            opt = torch.optim.SGD(m.parameters(), lr=1e-6)

            def train(m=m, opt=opt):
                opt.zero_grad(set_to_none=True)
                loss = m(input_ids=train_ids, labels=train_ids).loss
                loss.backward()
                opt.step()
                return loss

            steps["train"][name] = train
    return {k: v for k, v in steps.items() if v}, {"prefill": a.prefill, "decode": a.decode, "train": a.train}


def numbanorm_share(step):
    """Share of the profiled CPU time of one call of ``step`` spent in numbanorm's operators."""
    from torch.profiler import ProfilerActivity, profile

    step()
    for _ in range(2):  # a profiled call takes numbanorm.torch's operator path, whose first use is slower
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    ours = sum(e.self_cpu_time_total for e in events if e.key.startswith("numbanorm::"))
    return ours / total if total else None


def bf16_kernels():
    """Whether numbanorm's CPU kernels take bfloat16 in this build."""
    try:
        nt.rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), 8)
        return True
    except Exception:
        return False


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)  # 32000 would add a large LM head to training
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--train", type=int, default=128, help="tokens of the training step")
    ap.add_argument("--decode", type=int, default=4, help="single-token steps per decode sample")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=2, help="round-robin rounds per workload")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--note", default="", help="recorded with the results (e.g. that the machine was shared)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)

    a.train = min(a.train, a.prefill)
    threads = measure.set_threads(a.threads)
    load_before = measure.loadavg()
    print(f"# {measure.cpu_model()}, {threads} thread(s), load average {os.getloadavg()[0]:.1f}")
    results, skipped = [], {}
    for dt_name in a.dtypes:
        dtype = getattr(torch, dt_name)
        if dtype == torch.bfloat16 and not bf16_kernels():
            skipped[dt_name] = "numbanorm's CPU kernels take no bfloat16 in this build"
            print(f"{dt_name}: skipped ({skipped[dt_name]})")
            continue
        models = build(a, dtype)
        steps, tokens = workloads(models, a, dtype)
        with torch.inference_mode():  # the same model: the swap changes no output beyond rounding
            ys = {k: steps["prefill"][k]().float() for k in ("torch", "numbanorm")}
        diff = float((ys["numbanorm"] - ys["torch"]).abs().max() / ys["torch"].abs().max())
        for wl, by_variant in steps.items():
            runners = [measure.Runner(v, "alloc", by_variant[v]) for v in VARIANTS]
            measure.time_runners(runners, repeats=a.rounds, min_sample_s=0)
            share = numbanorm_share(by_variant["numbanorm"])
            med = {r.impl: r.quantiles()[1] for r in runners}
            best = {r.impl: min(r.samples) for r in runners}
            for r in runners:
                row = {"dtype": dt_name, "workload": wl, "variant": r.impl, "tokens": tokens[wl],
                       "min_s": best[r.impl], "median_s": med[r.impl], "samples_s": r.samples,
                       "tokens_per_s": tokens[wl] / med[r.impl],
                       "torch/this (median)": med["torch"] / med[r.impl],
                       "torch/this (min)": best["torch"] / best[r.impl]}
                if r.impl == "torch":
                    row["norm share (ablation, median)"] = (med["torch"] - med["no-norm"]) / med["torch"]
                if r.impl == "numbanorm":
                    row["numbanorm op share (profile)"] = share
                    row["max rel. difference of logits vs torch"] = diff
                results.append(row)
                print(f"{dt_name:9s} {wl:8s} {r.impl:10s} median {med[r.impl]:8.3f} s  "
                      f"{row['tokens_per_s']:8.1f} tok/s  torch/this {row['torch/this (median)']:.3f}x")
        del models, steps
    if a.json:
        import transformers

        versions = dict(measure.versions(), transformers=transformers.__version__)
        meta = {"date": datetime.date.today().isoformat(), "machine": measure.machine_info(include_gpu=False),
                "versions": versions, "threads": threads, "loadavg_before": load_before,
                "loadavg_after": measure.loadavg(), "rounds": a.rounds, "note": a.note,
                "config": {k: getattr(a, k) for k in ("hidden", "intermediate", "layers", "heads", "kv_heads",
                                                       "vocab", "prefill", "decode", "train")},
                "skipped": skipped}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
