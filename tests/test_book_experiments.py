"""The book's experiment scripts still run, and the committed results hold
what the chapters read.

Chapters 8 and 10 plot JSON written by ``book/experiments/*.py`` and committed
in ``book/results/``; the book build never reruns the training.  Each script's
``--quick`` mode (seconds) is run here into a temporary folder, so a change to
numbanorm or to a script that breaks it fails a test instead of the next
regeneration.  (The numbers of a quick run mean nothing; only their shape is
checked.)
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # (the default test set leaves this file out: tests/README.md)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = os.path.join(ROOT, "book", "experiments")
RESULTS = os.path.join(ROOT, "book", "results")

# script: (modules it needs, keys of every run that the chapters read)
SCRIPTS = {
    "warmup": (["torch"], {"placement", "warmup", "lr", "seed", "final_loss",
                           "test_accuracy", "curve"}),
    "lstm_adding": ([], {"ln", "T", "scale", "seed", "final_mse", "curve"}),
    "conv_batch": (["torch", "sklearn"], {"norm", "batch", "seed", "test_accuracy",
                                          "train_loss"}),
}
SETTINGS = {"warmup": {"lrs", "seeds", "steps", "warmup", "layers", "smooth"},
            "lstm_adding": {"conditions", "seeds", "steps", "smooth", "final_window"},
            "conv_batch": {"batches", "norms", "seeds", "epochs", "base_lr",
                           "base_batch", "size"}}

# the settings chapters 8 and 10 describe in prose: a rerun with other settings
# must update the prose too (the results themselves reach the prose by glue)
PROSE = {
    "warmup": dict(layers=6, d=64, heads=4, ffn=128, length=16, vocab=16, steps=300,
                   batch=32, warmup=75, lrs=[1e-3, 1e-2], seeds=[0, 1, 2]),
    "lstm_adding": dict(conditions=[[30, 1.0], [30, 10.0], [60, 1.0]], steps=1000,
                        lr=3e-3, seeds=[0, 1, 2, 3, 4], H=32, batch=32),
    "conv_batch": dict(size=16, epochs=8, base_lr=0.1, base_batch=32,
                       batches=[2, 4, 8, 16, 32, 64], seeds=[0, 1, 2]),
}


def check_document(doc, name, quick):
    need_run = SCRIPTS[name][1]
    assert doc["experiment"] == name
    assert doc["quick"] is quick
    assert {"numbanorm", "numpy", "numba"} <= set(doc["versions"])
    assert SETTINGS[name] <= set(doc["settings"])
    assert doc["results"], "no runs"
    for run in doc["results"]:
        assert need_run <= set(run), sorted(need_run - set(run))
    if name == "conv_batch":     # the chapter's dashed line
        assert all("test_accuracy_batch_stats" in r for r in doc["results"]
                   if r["norm"] == "BatchNorm")


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_quick_run_writes_what_the_chapter_reads(name, tmp_path):
    for module in SCRIPTS[name][0]:
        pytest.importorskip(module)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    done = subprocess.run(
        [sys.executable, os.path.join(EXPERIMENTS, name + ".py"), "--quick",
         "--out", str(tmp_path)], env=env, capture_output=True, text=True,
        timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / (name + ".json")) as f:
        check_document(json.load(f), name, quick=True)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_committed_results_are_full_runs(name):
    with open(os.path.join(RESULTS, name + ".json")) as f:
        doc = json.load(f)
    check_document(doc, name, quick=False)
    settings = doc["settings"]
    assert {k: settings[k] for k in PROSE[name]} == PROSE[name]
    seeds = len(settings["seeds"])
    if name == "warmup":             # every (lr, placement, warm-up) has every seed
        assert seeds >= 3
        assert len(doc["results"]) == len(settings["lrs"]) * 4 * seeds
    elif name == "lstm_adding":
        assert seeds >= 5
        assert len(doc["results"]) == len(settings["conditions"]) * 2 * seeds
    else:
        assert seeds >= 3
        assert min(settings["batches"]) == 2 and max(settings["batches"]) == 64
        assert len(doc["results"]) == (len(settings["batches"])
                                       * len(settings["norms"]) * seeds)
