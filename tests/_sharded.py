"""numbanorm.torch's functions on DTensors (tensor and sequence parallelism), against the same
calls on the full tensors: imported by ``test_torch.py`` on one rank, run as a script on each
rank of a gloo group by its test on two (``python tests/_sharded.py RANK WORLD STORE``)."""

import sys

import torch

import numbanorm.torch as nt  # (before DTensor: the operators' splits are registered as it is imported)
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

CALLS = {  # each norm on (4, 6, 8) tensors: x (and residual) split as the test places them, w and b replicated
    "layer_norm": lambda x, r, w, b: nt.layer_norm(x, [8], w, b),
    "rms_norm": lambda x, r, w, b: nt.rms_norm(x, [8], w),
    "group_norm": lambda x, r, w, b: nt.group_norm(x, 2, w[:6], b[:6]),
    "add_layer_norm": lambda x, r, w, b: nt.add_layer_norm(x, r, [8], w, b),
    "add_rms_norm": lambda x, r, w, b: nt.add_rms_norm(x, r, [8], w),
}


def check(mesh):
    """Every norm's outputs and gradients on DTensors placed each way equal those on plain
    tensors (float64; the weight's gradient is a sum in another order); a batch dimension's
    split stays split through the forward and backward, and the weight's gradient is a
    partial sum of the shards' (a split the norm reduces over is gathered first); and a
    call traced by torch.compile, whose first call on DTensors was traced there."""
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(4, 6, 8, dtype=torch.float64, generator=g) for _ in range(2))
    w = torch.rand(8, dtype=torch.float64, generator=g) + 0.5
    b = torch.randn(8, dtype=torch.float64, generator=g)
    for name, call in CALLS.items():
        kept = 1 if name == "group_norm" else 2  # the dimensions a split may keep
        for placement in (Replicate(), Shard(0), Shard(1), Shard(2)):
            kept_split = isinstance(placement, Shard) and placement.dim < kept
            plain = [t.clone().requires_grad_() for t in (x, r, w, b)]
            placed = [distribute_tensor(t, mesh, [placement if t.dim() == 3 else Replicate()]).requires_grad_()
                      for t in (x, r, w, b)]
            outs = []
            for args in (plain, placed):
                out = call(*args)
                out = out if isinstance(out, tuple) else (out,)
                sum(o.sum() * (k + 1) for k, o in enumerate(out)).backward()
                outs.append(out)
            for a, e in zip(outs[1], outs[0]):
                torch.testing.assert_close(a.full_tensor(), e.detach(), rtol=1e-12, atol=1e-12)
                if kept_split:  # (else DTensor picks how to gather it)
                    assert a.placements == (placement,), (name, placement, a.placements)
            for a, e in zip(placed, plain):
                if e.grad is None:  # (r, b of the unfused or weightless calls)
                    assert a.grad is None, name
                    continue
                torch.testing.assert_close(a.grad.full_tensor(), e.grad, rtol=1e-12, atol=1e-12)
            if kept_split or placement == Replicate():
                want = Partial() if kept_split else Replicate()
                assert placed[2].grad.placements == (want,), (name, placement, placed[2].grad.placements)
    # traced by torch.compile, the first call of its operator on DTensors included
    step = torch.compile(lambda x, w: nt.rms_norm(x, [8], w, 1e-6) * 2, backend="aot_eager", fullgraph=True)
    placed = [distribute_tensor(t, mesh, [p]).requires_grad_() for t, p in ((x, Shard(1)), (w, Replicate()))]
    y = step(*placed)
    y.sum().backward()
    assert y.placements == (Shard(1),) and placed[1].grad.placements == (Partial(),)
    torch.testing.assert_close(y.full_tensor(), nt.rms_norm(x, [8], w, 1e-6) * 2, rtol=1e-12, atol=1e-12)


if __name__ == "__main__":
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{store}")
    try:
        check(init_device_mesh("cpu", (world,)))
    finally:
        dist.destroy_process_group()
