"""docs/migrating.md, tested: a DDP + torch.optim.AdamW training script and its
port to DistributedFusedAdam train identically on a real 2-rank gloo world.

The script has what real ones have: two param groups (decay / no decay), an LR
warm-up (LambdaLR), gradient accumulation over micro-batches (``no_sync()`` for all
but the last), a GradScaler (enabled or not; on CPU with fp32 it still scales,
unscales, skips a step with an inf gradient and grows its scale), gradient clipping,
evaluation, a checkpoint written the documented way and a resume from it.
Each rank runs both: the DDP reference and the mpzero port, side by side.
"""

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from mpzero import collective_check as cc
from mpzero import torch_compat as tc
from mpzero.optimizers import DistributedFusedAdam

pytestmark = pytest.mark.timeout(150)

STEPS, SAVE_AT, MICRO, BATCH = 100, 50, 3, 8
DIN, DH, DOUT = 8, 32, 4
LR, MAX_NORM = 3e-3, 1.0
INF_STEP = 37  # with the scaler: rank 1's first micro-batch loss is inf at this step
TOL = dict(rtol=1e-6, atol=1e-6)
BUCKET_MB = 512 * 4 / 2**20  # a few buckets, parameters split across them


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(DIN, DH)
        self.norm = torch.nn.LayerNorm(DH)
        self.fc2 = torch.nn.Linear(DH, DH)
        self.head = torch.nn.Linear(DH, DOUT)

    def forward(self, x):
        h = self.norm(F.gelu(self.fc1(x)))
        return self.head(h + F.gelu(self.fc2(h)))


def make_model(seed):
    torch.manual_seed(seed)
    return MLP()


def param_groups(model):
    """The usual split: matrices decay, biases and norm weights do not."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0}]


def warmup(step):
    return min(1.0, (step + 1) / 10)


def data(steps=STEPS):
    """data[step][rank][micro] = (x, y), the same on every rank."""
    g = torch.Generator().manual_seed(7)
    world = dist.get_world_size()
    return [[[(torch.randn(BATCH, DIN, generator=g), torch.randn(BATCH, DOUT, generator=g))
              for _ in range(MICRO)] for _ in range(world)] for _ in range(steps)]


EVAL = None


def evaluate(model):
    global EVAL
    if EVAL is None:
        g = torch.Generator().manual_seed(11)
        EVAL = (torch.randn(64, DIN, generator=g), torch.randn(64, DOUT, generator=g))
    model.eval()
    with torch.no_grad():
        loss = F.mse_loss(model(EVAL[0]), EVAL[1])
    model.train()
    return loss.item()


def make_scaler(enabled):
    return torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=10,
                                enabled=enabled)


# ---------------------------------------------------------------------- the two scripts
def ddp_setup(seed, scaler_on):
    model = DDP(make_model(seed))  # broadcasts rank 0's parameters
    opt = torch.optim.AdamW(param_groups(model.module), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    return model, opt, sched, make_scaler(scaler_on)


def mpzero_setup(seed, scaler_on):
    model = make_model(seed)  # no DDP wrapper; rank 0's parameters are broadcast
    opt = DistributedFusedAdam(param_groups(model), lr=LR, module=model,
                               bucket_cap_mb=BUCKET_MB)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    return model, opt, sched, make_scaler(scaler_on)


def train(impl, model, opt, sched, scaler, batches, steps, log, torch_unscale=False):
    """One training loop for both; the lines that differ are marked."""
    rank = dist.get_rank()
    for s in steps:
        opt.zero_grad(set_to_none=True)
        for m in range(MICRO):
            x, y = batches[s][rank][m]
            last = m == MICRO - 1
            if impl == "ddp":
                ctx = model.no_sync() if not last else _Null()          # DDP
            else:
                ctx = opt.no_sync() if not last else _Null()            # mpzero
            with ctx:
                loss = F.mse_loss(model(x), y) / MICRO
                if scaler.is_enabled() and s == INF_STEP and rank == 1 and m == 0:
                    loss = loss * math.inf
                scaler.scale(loss).backward()
        if impl == "ddp":
            scaler.unscale_(opt)                                        # DDP
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        else:
            if torch_unscale:
                scaler.unscale_(opt)   # torch's call: must work or fail clearly
            else:
                opt.unscale_grads(grad_scaler=scaler)                   # mpzero
            norm = opt.clip_grad_norm(MAX_NORM)                         # mpzero
        scaler.step(opt)
        scaler.update()
        sched.step()
        log["norm"].append(norm.item())
        log["scale"].append(scaler.get_scale() if scaler.is_enabled() else 1.0)
        log["lr"].append(opt.param_groups[0]["lr"])


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def save(path, model, opt, sched, scaler, step):
    """The documented checkpoint: state_dict() on EVERY rank, the file on rank 0."""
    core = model.module if isinstance(model, DDP) else model
    optim_sd = opt.state_dict()  # mpzero: collective, every rank calls it
    if dist.get_rank() == 0:
        torch.save({"model": core.state_dict(), "optimizer": optim_sd,
                    "scheduler": sched.state_dict(), "scaler": scaler.state_dict(),
                    "step": step}, path)
    dist.barrier()


def resume(path, model, opt, sched, scaler):
    ck = torch.load(path, map_location="cpu", weights_only=True)
    core = model.module if isinstance(model, DDP) else model
    core.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    sched.load_state_dict(ck["scheduler"])
    scaler.load_state_dict(ck["scaler"])
    return ck["step"]


def _new_log():
    return {"norm": [], "scale": [], "lr": [], "eval": []}


def _params(model):
    core = model.module if isinstance(model, DDP) else model
    return [p.detach().clone() for p in core.parameters()]


# ---------------------------------------------------------------------- rank functions
def _reference(tmp, scaler_on, seed_of_rank, steps=STEPS):
    """DDP + AdamW, uninterrupted; its checkpoint at SAVE_AT is kept for the resume tests."""
    batches = data(steps)
    model, opt, sched, scaler = ddp_setup(seed_of_rank(dist.get_rank()), scaler_on)
    log = _new_log()
    train("ddp", model, opt, sched, scaler, batches, range(min(SAVE_AT, steps)), log)
    log["eval"].append(evaluate(model))
    if steps > SAVE_AT:
        save(os.path.join(tmp, "ddp.pt"), model, opt, sched, scaler, SAVE_AT)
        train("ddp", model, opt, sched, scaler, batches, range(SAVE_AT, steps), log)
        log["eval"].append(evaluate(model))
    return _params(model), log


def _same_seed(rank):
    return 1234


def _seed_per_rank(rank):
    return 1000 + rank  # an unseeded script: every rank initializes differently


def _compare(tmp, scaler_on):
    """The port: train to SAVE_AT, checkpoint, rebuild everything, resume, finish."""
    ref_params, ref_log = _reference(tmp, scaler_on, _same_seed)
    batches = data()
    model, opt, sched, scaler = mpzero_setup(1234, scaler_on)
    log = _new_log()
    train("mpzero", model, opt, sched, scaler, batches, range(SAVE_AT), log)
    log["eval"].append(evaluate(model))
    path = os.path.join(tmp, "mpzero.pt")
    save(path, model, opt, sched, scaler, SAVE_AT)
    del model, opt, sched, scaler
    model, opt, sched, scaler = mpzero_setup(999, scaler_on)  # other init: all is loaded
    start = resume(path, model, opt, sched, scaler)
    train("mpzero", model, opt, sched, scaler, batches, range(start, STEPS), log)
    log["eval"].append(evaluate(model))
    return _check(_params(model), log, ref_params, ref_log)


def _check(params, log, ref_params, ref_log):
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q, **TOL)
    for key in ("scale", "lr"):
        assert log[key] == ref_log[key], (key, log[key], ref_log[key])
    for a, b in zip(log["norm"], ref_log["norm"]):
        if math.isfinite(b):
            assert abs(a - b) <= 1e-5 * max(1.0, b), (a, b)
        else:
            assert not math.isfinite(a), (a, b)
    torch.testing.assert_close(torch.tensor(log["eval"]), torch.tensor(ref_log["eval"]),
                               **TOL)
    finite = [n for n in ref_log["norm"] if math.isfinite(n)]
    return {"clipped": sum(n > MAX_NORM for n in finite), "steps": len(ref_log["norm"]),
            "scales": sorted(set(ref_log["scale"])),
            "backoff": any(b < a for a, b in zip(ref_log["scale"], ref_log["scale"][1:])),
            "max_diff": max((p - q).abs().max().item() for p, q in zip(params, ref_params))}


def _broadcast(tmp, steps):
    """Every rank initializes differently: DDP broadcasts rank 0's parameters at
    construction, mpzero when it lays out its buckets. Same result."""
    ref_params, ref_log = _reference(tmp, False, _seed_per_rank, steps=steps)
    batches = data(steps)
    model, opt, sched, scaler = mpzero_setup(_seed_per_rank(dist.get_rank()), False)
    log = _new_log()
    train("mpzero", model, opt, sched, scaler, batches, range(steps), log)
    log["eval"].append(evaluate(model))
    return _check(_params(model), log, ref_params, ref_log)


def _resume_from_torch(tmp, scaler_on):
    """A DDP + AdamW checkpoint resumed by the port: optimizer.load_state_dict() of the
    torch.optim.AdamW state dict."""
    ref_params, ref_log = _reference(tmp, scaler_on, _same_seed)
    batches = data()
    model, opt, sched, scaler = mpzero_setup(999, scaler_on)
    start = resume(os.path.join(tmp, "ddp.pt"), model, opt, sched, scaler)
    log = {k: list(v[:SAVE_AT]) for k, v in ref_log.items() if k != "eval"}
    log["eval"] = ref_log["eval"][:1]
    train("mpzero", model, opt, sched, scaler, batches, range(start, STEPS), log)
    log["eval"].append(evaluate(model))
    return _check(_params(model), log, ref_params, ref_log)


def _torch_unscale(tmp):
    """``scaler.unscale_(optimizer)`` (torch's spelling) either gives the same training
    or fails at once with an error that names ``optimizer.unscale_grads(grad_scaler=...)``.
    Never a silent wrong result."""
    ref_params, ref_log = _reference(tmp, True, _same_seed, steps=SAVE_AT)
    batches = data(SAVE_AT)
    model, opt, sched, scaler = mpzero_setup(1234, True)
    log = _new_log()
    try:
        train("mpzero", model, opt, sched, scaler, batches, range(SAVE_AT), log,
              torch_unscale=True)
    except Exception as e:  # noqa: BLE001 - the message is what is tested
        if "unscale_grads(grad_scaler=" not in str(e):
            raise
        return {"raised": str(e)}
    log["eval"].append(evaluate(model))
    return _check(_params(model), log, ref_params, ref_log)


def _torch_clip_is_noop():
    """Why the guide says optimizer.clip_grad_norm(): after the synchronizing backward
    every param.grad is freed, so torch's clip_grad_norm_ sees nothing and returns 0."""
    model, opt, _, _ = mpzero_setup(1234, False)
    x, y = data(1)[0][dist.get_rank()][0]
    F.mse_loss(model(x), y).backward()
    noop = all(p.grad is None for p in model.parameters())
    torch_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
    norm = opt.clip_grad_norm(MAX_NORM).item()
    opt.zero_grad()
    return noop, torch_norm, norm


# ---------------------------------------------------------------------- tests
@pytest.mark.parametrize("scaler_on", [False, True], ids=["no_scaler", "grad_scaler"])
def test_port_matches_ddp_adamw(world, tmp_path, scaler_on):
    res = world(2, _compare, str(tmp_path), scaler_on, timeout=120)
    out = res[0]
    assert 0 < out["clipped"] < out["steps"], out  # clipping is exercised, not always on
    if scaler_on:
        assert len(out["scales"]) >= 3 and out["backoff"], out  # grew; backed off at INF_STEP


def test_port_broadcasts_initial_parameters(world, tmp_path):
    world(2, _broadcast, str(tmp_path), 20, timeout=120)


def test_port_resumes_torch_adamw_checkpoint(world, tmp_path):
    world(2, _resume_from_torch, str(tmp_path), True, timeout=120)


def test_torch_scaler_unscale_works_or_fails_clearly(world, tmp_path):
    world(2, _torch_unscale, str(tmp_path), timeout=120)


def test_torch_clip_grad_norm_sees_no_gradients(world):
    for noop, torch_norm, norm in world(2, _torch_clip_is_noop, timeout=60):
        assert noop and torch_norm == 0.0 and norm > 0.0, (noop, torch_norm, norm)



# ---------------------------------------------------------------------- the wiring
# These check that DistributedFusedAdam calls the torch_compat helpers (see their
# docstrings for the places); they fail until it does.
def test_optimizer_rejects_unknown_param_group_key():
    model = make_model(1)
    groups = param_groups(model)
    groups[0]["weight_dacay"] = groups[0].pop("weight_decay")
    with pytest.raises(ValueError, match="unknown key 'weight_dacay'"):
        DistributedFusedAdam(groups, lr=LR)
    with pytest.raises(ValueError, match="maximize=True"):
        DistributedFusedAdam([{"params": list(model.parameters()), "maximize": True}])
    opt = DistributedFusedAdam(param_groups(model), lr=LR)
    torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)  # adds keys: fine
    with pytest.raises(ValueError, match="'momentum'"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))],
                             "momentum": 0.9})


def _ddp_wrapped_warns():
    import warnings

    inner = make_model(1)
    ddp = DDP(inner)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        DistributedFusedAdam(param_groups(inner), lr=LR, module=ddp)
    return [(x.category.__name__, str(x.message), x.filename) for x in w]


def test_optimizer_warns_when_module_is_ddp(world):
    for got in world(2, _ddp_wrapped_warns, timeout=60):
        ours = [g for g in got if g[0] == "MigrationWarning"]
        assert len(ours) == 1 and "DistributedDataParallel" in ours[0][1], got
        assert ours[0][2] == __file__, got  # points at the user's line


def _ddp_wrapped_after_optimizer():
    """nanoGPT's order: the optimizer is built on the bare model, then the model is
    wrapped in DDP. The first backward must refuse (both would reduce the gradients)."""
    model = make_model(1)
    opt = DistributedFusedAdam(param_groups(model), lr=LR, bucket_cap_mb=BUCKET_MB)
    model = DDP(model)
    x, y = data(1)[0][dist.get_rank()][0]
    try:
        F.mse_loss(model(x), y).backward()
    except tc.DoubleReductionError as e:
        msg = str(e)
    else:
        msg = None
    # The bare model (the fix the message asks for) trains.
    bare = model.module
    del model
    opt.zero_grad()
    import gc

    gc.collect()  # the dropped wrapper is gone
    F.mse_loss(bare(x), y).backward()
    opt.step()
    return msg


def test_ddp_wrapped_after_optimizer_fails_at_first_backward(world):
    for msg in world(2, _ddp_wrapped_after_optimizer, timeout=60):
        assert msg is not None, "no error although DDP reduces the gradients too"
        assert "reduced twice" in msg and "model = DDP(model" in msg, msg


def _state_dict_on_rank0_only():
    import time

    os.environ[cc.COLLECTIVE_CHECK_ENV] = "3"
    try:
        model, opt, _, _ = mpzero_setup(1234, False)
        x, y = data(1)[0][dist.get_rank()][0]
        F.mse_loss(model(x), y).backward()
        opt.step()
        t = time.perf_counter()
        if dist.get_rank() == 0:
            try:
                opt.state_dict()
            except cc.CollectiveMismatchError as e:
                return str(e), time.perf_counter() - t
            return None, time.perf_counter() - t
        return "not called", 0.0
    finally:
        del os.environ[cc.COLLECTIVE_CHECK_ENV]


@pytest.mark.slow
def test_state_dict_on_rank0_only_fails_in_bounded_time(world):
    """The DDP habit ``if rank == 0: torch.save(optimizer.state_dict(), ...)``: an error
    within the timeout that says every rank must call it, not a hang."""
    (msg, took), _ = world(2, _state_dict_on_rank0_only, timeout=25)
    assert msg and "every rank" in msg and "state_dict" in msg, msg
    assert took < 20, took
