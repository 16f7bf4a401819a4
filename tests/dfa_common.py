"""Shared pieces of the DistributedFusedAdam tests: models, data, the DDP+AdamW reference.

Every rank builds the same model from one seed, and knows every rank's data
(drawn from a seeded generator), so each rank computes the reference on its own:
the gradient of the mean (or sum) over ranks of the per-rank micro-batch losses,
followed by ``torch.optim.AdamW``/``Adam`` — exactly what DDP + torch's optimizer does.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from mpzero import parallel_state as ps
from mpzero.optimizers import DistributedFusedAdam

RTOL, ATOL = 1.3e-6, 1e-5


class Net(torch.nn.Module):
    """Odd-sized parameters so they fragment across tiny buckets."""

    def __init__(self, din=7, dh=13, dout=5, unused=False, dtype=torch.float32):
        super().__init__()
        self.fc1 = torch.nn.Linear(din, dh, dtype=dtype)
        self.norm = torch.nn.LayerNorm(dh, dtype=dtype)
        self.fc2 = torch.nn.Linear(dh, dh, dtype=dtype)
        self.head = torch.nn.Linear(dh, dout, dtype=dtype)
        self.unused = torch.nn.Linear(3, 3, dtype=dtype) if unused else None

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        h = self.norm(h)
        h = torch.nn.functional.gelu(self.fc2(h)) + h
        return self.head(h)


def make_model(seed=1234, **kw) -> Net:
    """Initialized on the CPU from ``seed``, then moved to the default device."""
    torch.manual_seed(seed)
    with torch.device("cpu"):
        net = Net(**kw)
    return net.to(torch.get_default_device())


def batches(world, steps, micro, batch=4, din=7, seed=99, dtype=torch.float32):
    """data[step][rank][micro] = (x, y), identical on every rank."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dev = torch.get_default_device()
    return [[[(torch.randn(batch, din, generator=g, device="cpu").to(dev, dtype),
               torch.randn(batch, 5, generator=g, device="cpu").to(dev, dtype))
              for _ in range(micro)] for _ in range(world)] for _ in range(steps)]


def loss_fn(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y, reduction="sum")


def groups_for(grid: str):
    """Optimizer process-group kwargs for a grid name: 'flat' or 'DxR'."""
    if grid == "flat":
        return {}
    ps.destroy_model_parallel()
    d, r = (int(v) for v in grid.split("x"))
    assert d * r == dist.get_world_size()
    ps.initialize_model_parallel(distributed_optimizer_size=d)
    return ps.get_optimizer_process_groups()


def param_groups(model, mode):
    """Two groups with different hyperparameters (mode 'two') or one."""
    if mode == "one":
        return [{"params": list(model.parameters())}]
    decay = [model.fc1.weight, model.fc2.weight, model.head.weight]
    no_decay = [p for p in model.parameters() if all(p is not q for q in decay)]
    return [{"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3, "betas": (0.8, 0.99),
             "eps": 1e-6}]



def train_split_steps(model, opt, data, steps, global_micro):
    """Steps whose loss sums ``global_micro`` micro-batches (``data[s][i][0]``), split
    evenly over the current ranks, with ``no_sync()`` for all but each rank's last."""
    world, rank = dist.get_world_size(), dist.get_rank()
    per = global_micro // world
    for s in steps:
        opt.zero_grad()
        for j in range(per):
            x, y = data[s][rank * per + j][0]
            loss = loss_fn(model, x, y) * (world / global_micro)
            if j < per - 1:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()

def reference_step(ref, ref_opt, data_step, world, average=True, clip=None):
    ref_opt.zero_grad()
    total = 0
    for r in range(world):
        for x, y in data_step[r]:
            total = total + loss_fn(ref, x, y)
    (total / world if average else total).backward()
    norm = None
    if clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    ref_opt.step()
    return norm


def train_compare(grid="flat", steps=3, micro=3, adam_w=True, groups="two", overlap=True,
                  average=True, bucket_cap_mb=24 * 4 / 2**20, clip=None, no_sync=True,
                  wd=0.05, **opt_kw):
    """Train the DFA model and the reference side by side; return max abs param diff."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    ref = copy.deepcopy(model)
    kw = groups_for(grid)
    opt = DistributedFusedAdam(param_groups(model, groups), lr=1e-2, adam_w_mode=adam_w,
                               weight_decay=wd,
                               overlap_grad_sync=overlap, average_grad_sync=average,
                               bucket_cap_mb=bucket_cap_mb, **kw, **opt_kw)
    ref_cls = torch.optim.AdamW if adam_w else torch.optim.Adam
    ref_opt = ref_cls(param_groups(ref, groups), lr=1e-2, weight_decay=wd)
    data = batches(world, steps, micro)
    norms = []
    for s in range(steps):
        opt.zero_grad()
        for m, (x, y) in enumerate(data[s][rank]):
            last = m == micro - 1
            ctx = opt.no_sync() if (no_sync and not last) else _null()
            with ctx:
                loss_fn(model, x, y).backward()
        norm = opt.clip_grad_norm(clip) if clip is not None else None
        opt.step()
        ref_norm = reference_step(ref, ref_opt, data[s], world, average, clip)
        if clip is not None:
            norms.append((norm.item(), ref_norm.item()))
    diffs = [(p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())]
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    # Outputs and input gradients of the trained models agree too.
    x = torch.randn(3, 7, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    out, out_ref = model(x), ref(x2)
    torch.testing.assert_close(out, out_ref, rtol=RTOL, atol=ATOL)
    out.sum().backward()
    out_ref.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=RTOL, atol=ATOL)
    for a, b in norms:
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (a, b)
    opt.zero_grad()
    return max(diffs)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# The optimizer-state storage modes an offload test runs in (with the fp32 default).
STATE_MODES = {
    "fp32": {},
    "remainders": dict(store_params=False, store_param_remainders=True,
                       param_sync_dtype=torch.bfloat16),
    "scaled": dict(with_scaled_states=True, dtype=torch.bfloat16,
                   param_sync_dtype=torch.bfloat16),
    "remainders_scaled": dict(store_params=False, store_param_remainders=True,
                              with_scaled_states=True, param_sync_dtype=torch.bfloat16),
}
