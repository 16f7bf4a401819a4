"""TP layers on gloo worlds against nn.Linear / nn.Embedding computed on every rank.

Each rank builds the single-device layer from the same full weights, runs the same
input and output gradient through it, and compares the TP layer's output, input
gradient and its block of the weight/bias gradients.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mpzero import parallel_state as ps
from mpzero.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_from_tensor_model_parallel_region,
)

TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.float64: {"rtol": 1e-12, "atol": 1e-12}}


def _randn(seed, *shape, dtype):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _block(t, dim, r, tp):
    return t.chunk(tp, dim)[r]


def _assert_block(got, full, dim, r, tp, tol):
    """``got`` is rank r's block of ``full`` and (when tp > 1) not a neighbour's."""
    torch.testing.assert_close(got, _block(full, dim, r, tp), **tol)
    if tp > 1:
        assert not torch.allclose(got, _block(full, dim, (r + 1) % tp, tp), **tol)


def _check_column(tp, r, dtype, bias, gather_output, skip_bias_add):
    tol, n_in, n_out = TOL[dtype], 8, 12
    ref = nn.Linear(n_in, n_out, bias=bias, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(_randn(1, n_out, n_in, dtype=dtype))
        if bias:
            ref.bias.copy_(_randn(2, n_out, dtype=dtype))
    x, grad = _randn(3, 2, 3, n_in, dtype=dtype), _randn(4, 2, 3, n_out, dtype=dtype)
    x_ref = x.clone().requires_grad_()
    ref(x_ref).backward(grad)

    layer = ColumnParallelLinear(n_in, n_out, bias=bias, gather_output=gather_output,
                                 skip_bias_add=skip_bias_add, params_dtype=dtype)
    assert layer.weight.shape == (n_out // tp, n_in) and layer.weight.dtype == dtype
    with torch.no_grad():
        layer.weight.copy_(_block(ref.weight, 0, r, tp))
        if bias:
            layer.bias.copy_(_block(ref.bias, 0, r, tp))
    x_tp = x.clone().requires_grad_()
    out, out_bias = layer(x_tp)
    if skip_bias_add:
        assert out_bias is layer.bias
        if bias:
            assert out.shape[-1] == layer.bias.shape[0] * (tp if gather_output else 1)
            # The returned bias is this rank's block; gathered outputs need the full one.
            out = out + (gather_from_tensor_model_parallel_region(out_bias) if gather_output
                         else out_bias)
    else:
        assert out_bias is None
    with torch.no_grad():
        y_ref = ref(x)
    if gather_output:
        torch.testing.assert_close(out, y_ref, **tol)
        out.backward(grad)
    else:
        _assert_block(out, y_ref, -1, r, tp, tol)
        out.backward(_block(grad, -1, r, tp))
    torch.testing.assert_close(x_tp.grad, x_ref.grad, **tol)  # full: all-reduced over TP
    _assert_block(layer.weight.grad, ref.weight.grad, 0, r, tp, tol)
    if bias:
        _assert_block(layer.bias.grad, ref.bias.grad, 0, r, tp, tol)


def _check_row(tp, r, dtype, bias, input_is_parallel, skip_bias_add):
    tol, n_in, n_out = TOL[dtype], 12, 8
    ref = nn.Linear(n_in, n_out, bias=bias, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(_randn(5, n_out, n_in, dtype=dtype))
        if bias:
            ref.bias.copy_(_randn(6, n_out, dtype=dtype))
    x, grad = _randn(7, 2, 3, n_in, dtype=dtype), _randn(8, 2, 3, n_out, dtype=dtype)
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    y_ref.backward(grad)

    layer = RowParallelLinear(n_in, n_out, bias=bias, input_is_parallel=input_is_parallel,
                              skip_bias_add=skip_bias_add, params_dtype=dtype)
    assert layer.weight.shape == (n_out, n_in // tp)
    with torch.no_grad():
        layer.weight.copy_(_block(ref.weight, 1, r, tp))
        if bias:
            layer.bias.copy_(ref.bias)
    x_tp = (_block(x, -1, r, tp) if input_is_parallel else x).clone().requires_grad_()
    out, out_bias = layer(x_tp)
    if skip_bias_add:
        assert out_bias is layer.bias
        if bias:
            assert not torch.allclose(out, y_ref, **tol)  # the bias really was left out
            out = out + out_bias
    else:
        assert out_bias is None
    torch.testing.assert_close(out, y_ref, **tol)
    out.backward(grad)
    if input_is_parallel:
        _assert_block(x_tp.grad, x_ref.grad, -1, r, tp, tol)
    else:
        torch.testing.assert_close(x_tp.grad, x_ref.grad, **tol)  # all-gathered
    _assert_block(layer.weight.grad, ref.weight.grad, 1, r, tp, tol)
    if bias:
        torch.testing.assert_close(layer.bias.grad, ref.bias.grad, **tol)


def _check_mlp(tp, r, dtype):
    """Column (no gather) -> GELU -> Row (input_is_parallel): the Megatron MLP block."""
    tol = TOL[dtype]
    ref = nn.Sequential(nn.Linear(8, 16, dtype=dtype), nn.GELU(), nn.Linear(16, 8, dtype=dtype))
    with torch.no_grad():
        for i, p in enumerate(ref.parameters()):  # O(1) activations, as in a real model
            p.copy_(_randn(10 + i, *p.shape, dtype=dtype) / p.shape[-1] ** 0.5)
    fc1 = ColumnParallelLinear(8, 16, params_dtype=dtype)
    fc2 = RowParallelLinear(16, 8, input_is_parallel=True, params_dtype=dtype)
    with torch.no_grad():
        fc1.weight.copy_(_block(ref[0].weight, 0, r, tp))
        fc1.bias.copy_(_block(ref[0].bias, 0, r, tp))
        fc2.weight.copy_(_block(ref[2].weight, 1, r, tp))
        fc2.bias.copy_(ref[2].bias)
    x, grad = _randn(20, 4, 8, dtype=dtype), _randn(21, 4, 8, dtype=dtype)
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(x_ref).backward(grad)
    out, _ = fc2(F.gelu(fc1(x_tp)[0]))
    out.backward(grad)
    torch.testing.assert_close(out, ref(x), **tol)
    torch.testing.assert_close(x_tp.grad, x_ref.grad, **tol)
    _assert_block(fc1.weight.grad, ref[0].weight.grad, 0, r, tp, tol)
    _assert_block(fc2.weight.grad, ref[2].weight.grad, 1, r, tp, tol)
    torch.testing.assert_close(fc2.bias.grad, ref[2].bias.grad, **tol)


def _check_embedding(tp, r, dtype):
    tol, vocab, dim = TOL[dtype], 16, 5
    ref = nn.Embedding(vocab, dim, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(_randn(30, vocab, dim, dtype=dtype))
    # Every id once (so every shard is hit) plus repeats (gradients accumulate).
    ids = torch.cat([torch.randperm(vocab, generator=torch.Generator().manual_seed(31)),
                     torch.tensor([3, 3, 15, 0, 8, 8, 8, 12])]).view(4, 6)
    grad = _randn(32, 4, 6, dim, dtype=dtype)
    ref(ids).backward(grad)

    emb = VocabParallelEmbedding(vocab, dim, params_dtype=dtype)
    assert emb.weight.shape == (vocab // tp, dim)
    assert (emb.vocab_start_index, emb.vocab_end_index) == (r * vocab // tp,
                                                            (r + 1) * vocab // tp)
    with torch.no_grad():
        emb.weight.copy_(_block(ref.weight, 0, r, tp))
    out = emb(ids)
    torch.testing.assert_close(out, ref(ids), **tol)
    out.backward(grad)
    _assert_block(emb.weight.grad, ref.weight.grad, 0, r, tp, tol)


def _check_attributes(tp):
    col, row = ColumnParallelLinear(4, 8), RowParallelLinear(8, 4)
    emb = VocabParallelEmbedding(8, 4)
    for p, dim in ((col.weight, 0), (col.bias, 0), (row.weight, 1), (emb.weight, 0)):
        assert p.tensor_model_parallel is True
        assert (p.partition_dim, p.partition_stride) == (dim, 1)
    assert not getattr(row.bias, "tensor_model_parallel", False)
    no_bias = ColumnParallelLinear(4, 8, bias=False)
    assert no_bias.bias is None and [n for n, _ in no_bias.named_parameters()] == ["weight"]
    out, b = RowParallelLinear(8, 4, bias=False, skip_bias_add=True)(torch.ones(2, 8))
    assert b is None and out.shape == (2, 4)
    # deepcopy (e.g. for an EMA model) shares the process group and copies the weights.
    clone = copy.deepcopy(col)
    assert clone.tp_group is col.tp_group and clone.tp_rank == col.tp_rank
    assert torch.equal(clone.weight, col.weight)
    assert clone.weight.data_ptr() != col.weight.data_ptr() and clone.weight.tensor_model_parallel
    torch.testing.assert_close(clone(torch.ones(2, 4))[0], col(torch.ones(2, 4))[0])


def _check_layers(tp):
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    r = ps.get_tensor_model_parallel_rank()
    flags = [(True, False, False), (True, True, False), (True, False, True), (True, True, True),
             (False, False, False), (False, True, True)]
    for dtype in (torch.float32, torch.float64):
        for bias, variant, skip in flags:
            _check_column(tp, r, dtype, bias, gather_output=variant, skip_bias_add=skip)
            _check_row(tp, r, dtype, bias, input_is_parallel=variant, skip_bias_add=skip)
        _check_mlp(tp, r, dtype)
        _check_embedding(tp, r, dtype)
    _check_attributes(tp)
    return True


@pytest.mark.parametrize("world_size,tp", [(1, 1), (2, 2), (4, 4), (4, 2)])
def test_layers_match_single_device(world, world_size, tp):
    assert all(world(world_size, _check_layers, tp))


def _build(seed, dtype=None):
    torch.manual_seed(seed)
    return [ColumnParallelLinear(16, 32, params_dtype=dtype),
            RowParallelLinear(32, 16, params_dtype=dtype),
            VocabParallelEmbedding(64, 16, params_dtype=dtype),
            ColumnParallelLinear(16, 8, init_method=lambda t: nn.init.uniform_(t, -1.0, 1.0),
                                 params_dtype=dtype)]


DIMS = (0, 1, 0, 0)


def _check_init_slices(tp):
    """TP layers built from one seed hold blocks of the TP=1 layers' weights."""
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    full = _build(1234)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    r = ps.get_tensor_model_parallel_rank()
    sharded = _build(1234)
    sharded_bf16 = _build(1234, torch.bfloat16)
    exact = {"rtol": 0, "atol": 0}
    for layer, ref, layer16, dim in zip(sharded, full, sharded_bf16, DIMS):
        _assert_block(layer.weight, ref.weight.detach(), dim, r, tp, exact)
        # The master is drawn in fp32 then cast: bf16 weights are the rounded fp32 ones.
        assert layer16.weight.dtype == torch.bfloat16
        assert torch.equal(layer16.weight, layer.weight.to(torch.bfloat16))
    for layer in sharded[:2]:
        assert torch.count_nonzero(layer.bias) == 0
    # The first layer's full weight is exactly one N(0, 0.02) draw of the full shape.
    torch.manual_seed(1234)
    master = torch.empty(32, 16).normal_(0.0, 0.02)
    assert torch.equal(full[0].weight, master)
    assert abs(full[1].weight.std().item() - 0.02) < 0.004
    assert full[3].weight.abs().max() <= 1.0 and full[3].weight.abs().max() > 0.5
    # The default RNG ends in the same state on every TP rank and at every TP size.
    state = torch.rand(1)
    got = [torch.empty(1) for _ in range(dist.get_world_size())]
    dist.all_gather(got, state)
    assert all(torch.equal(g, state) for g in got)
    # reset_parameters redraws from the current default RNG state.
    torch.manual_seed(1234)
    layer = sharded[0]
    with torch.no_grad():
        layer.weight.zero_()
    layer.reset_parameters()
    _assert_block(layer.weight, master, 0, r, tp, exact)
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_init_is_slice_of_full_weight(world, world_size):
    assert all(world(world_size, _check_init_slices, world_size))


def _check_errors():
    ps.initialize_model_parallel(tensor_model_parallel_size=4)
    with pytest.raises(ValueError, match=r"output_size \(10\).*\(4\)"):
        ColumnParallelLinear(8, 10)
    with pytest.raises(ValueError, match=r"input_size \(6\)"):
        RowParallelLinear(6, 8)
    with pytest.raises(ValueError, match=r"num_embeddings \(50\)"):
        VocabParallelEmbedding(50, 8)
    with pytest.raises(ValueError, match="last dimension"):
        RowParallelLinear(8, 4)(torch.ones(2, 6))
    # Only the split dimension has to divide.
    ColumnParallelLinear(10, 8), RowParallelLinear(8, 10), VocabParallelEmbedding(52, 3)
    # An explicit group is honoured: the data-parallel group has one rank here.
    layer = ColumnParallelLinear(8, 10, tp_group=ps.get_data_parallel_group())
    assert layer.tp_size == 1 and layer.weight.shape == (10, 8)
    return True


def test_errors_name_the_argument(world):
    assert all(world(4, _check_errors))


def test_single_process_without_distributed():
    if dist.is_initialized():
        pytest.skip("needs a process without torch.distributed")
    torch.manual_seed(0)
    layer = ColumnParallelLinear(4, 6, gather_output=True)
    out, bias = layer(torch.ones(3, 4))
    assert out.shape == (3, 6) and bias is None and layer.tp_size == 1


def _check_replicated_linear(sequence_parallel: bool) -> bool:
    """Rank r applies rows ``r*k:(r+1)*k`` of the whole weight; the weight and bias
    gradients are the sums over the ranks (all-reduced in the graph) and the input
    gradient too (copy region), or each rank's chunk of it (sequence parallel)."""
    from mpzero.tensor_parallel import ReplicatedLinear

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    r, k = ps.get_tensor_model_parallel_rank(), 3
    torch.manual_seed(0)
    layer = ReplicatedLinear(5, 2 * k, k, sequence_parallel=sequence_parallel, sequence_dim=0)
    with torch.no_grad():
        layer.bias.normal_()
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    x_full = _randn(1, 4, 5, dtype=torch.float32)
    x = (x_full.chunk(2, 0)[r] if sequence_parallel else x_full).clone().requires_grad_()
    y = layer(x, r)
    rows = slice(r * k, (r + 1) * k)
    torch.testing.assert_close(y, F.linear(x_full, w[rows], b[rows]))
    g = [_randn(10 + q, 4, k, dtype=torch.float32) for q in range(2)]
    y.backward(g[r])
    want_w = torch.zeros_like(w)
    want_b = torch.zeros_like(b)
    want_x = torch.zeros_like(x_full)
    for q in range(2):
        rq = slice(q * k, (q + 1) * k)
        want_w[rq] += g[q].t() @ x_full
        want_b[rq] += g[q].sum(0)
        want_x += g[q] @ w[rq]
    torch.testing.assert_close(layer.weight.grad, want_w, **TOL[torch.float32])
    torch.testing.assert_close(layer.bias.grad, want_b, **TOL[torch.float32])
    want_x = want_x.chunk(2, 0)[r] if sequence_parallel else want_x
    torch.testing.assert_close(x.grad, want_x, **TOL[torch.float32])
    assert layer.weight.tensor_model_parallel is False and layer.weight.sequence_parallel
    ps.destroy_model_parallel()
    return True


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_replicated_linear_sums_the_ranks_gradients(world, sequence_parallel):
    assert all(world(2, _check_replicated_linear, sequence_parallel))
