"""Resident experts through torch's grouped GEMM (issue 14, item 4): `GroupedLinear` runs each matmul of a layer's
experts as one `torch.nn.functional.grouped_mm` over the rows of every expert, where torch provides it, and equals
the per-expert loop it replaces (outputs, input gradients, expert weight gradients), for MoE-GPT's own experts and
for transformers families through the package's path; elsewhere the loop runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_moe_offload.models.moe_gpt.moe_layer import MoEGPTExperts
from hf_moe_offload.models.moe_gpt.moe_ops import GroupedLinear
from hf_moe_offload.families.moe_path import sorted_experts

from moe_families import tiny_model
from test_offload import small_model

pytestmark = pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="this torch has no grouped GEMM")

COUNTS = [5, 0, 7, 3, 0, 9]  # six experts, two without tokens


def experts_module(family: str) -> torch.nn.Module:
    model = small_model(num_experts=6) if family == "moe_gpt" else tiny_model(family, num_experts=6)
    kind = MoEGPTExperts if family == "moe_gpt" else None
    return next(m for m in model.modules() if (isinstance(m, kind) if kind else hasattr(m, "has_gate")))


def forward_backward(run, module, x, g, autocast):
    module.zero_grad()
    x = x.detach().requires_grad_(True)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        y = run(x)
    y.backward(g.to(y.dtype))
    return y.detach().float(), x.grad.clone(), {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.fixture
def grouped_calls(monkeypatch):
    calls = []
    original = F.grouped_mm

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(F, "grouped_mm", counting)
    return calls


@pytest.mark.parametrize("family", ["moe_gpt", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_grouped_gemm_equals_the_per_expert_loop(family, autocast, grouped_calls, monkeypatch):
    """Fresh random rows and output gradients; two experts get no row. fp32: equal within 1e-5 (the same GEMMs,
    grouped; stated); bf16 autocast: within bf16 rounding of the largest value (2e-2 relative; stated)."""
    module = experts_module(family)
    # MoE-GPT's own sorted signature, and the package's path (every family): both take the grouped GEMM.
    runs = [module.sorted_forward] if family == "moe_gpt" else []
    runs.append(sorted_experts(module))
    hidden = module.fc1_weight.shape[2] if family == "moe_gpt" else sorted_experts(module).layout.hidden_size
    x = torch.randn(sum(COUNTS), hidden)
    g = torch.randn(sum(COUNTS), hidden)
    for run in runs:
        grouped_calls.clear()
        grouped = forward_backward(lambda x: run(x, COUNTS), module, x, g, autocast)
        assert len(grouped_calls) == 2  # one grouped GEMM per matmul of the FFN
        with monkeypatch.context() as m:
            m.setattr(GroupedLinear, "usable", staticmethod(lambda *a: False))
            grouped_calls.clear()
            loop = forward_backward(lambda x: run(x, COUNTS), module, x, g, autocast)
            assert not grouped_calls
        tol = 1e-5 if autocast is None else 2e-2
        for a, b in [(grouped[0], loop[0]), (grouped[1], loop[1]), *zip(grouped[2].values(), loop[2].values())]:
            scale = max(1.0, b.abs().max().item())
            assert (a - b).abs().max().item() <= tol * scale


def test_experts_given_in_order_take_the_grouped_gemm_others_the_loop(grouped_calls):
    """Rows of a subset of experts in ascending order (a partition, an expert-parallel rank) still form one grouped
    GEMM (the others get empty groups); rows not in expert order run the loop, with the same result."""
    module = experts_module("moe_gpt")
    x = torch.randn(12, module.fc1_weight.shape[2])
    ascending = module.sorted_forward(x, [4, 8], [1, 4])
    assert len(grouped_calls) == 2
    grouped_calls.clear()
    swapped = module.sorted_forward(torch.cat([x[4:], x[:4]]), [8, 4], [4, 1])
    assert not grouped_calls
    torch.testing.assert_close(torch.cat([swapped[8:], swapped[:8]]), ascending, atol=1e-6, rtol=0)


def test_grouped_gemm_takes_a_broadcast_gradient():
    """grouped_mm's backward refuses a stride-0 gradient (that of `.sum()`); `GroupedLinear` hands it a contiguous
    one."""
    module = experts_module("moe_gpt")
    x = torch.randn(sum(COUNTS), module.fc1_weight.shape[2], requires_grad=True)
    module.sorted_forward(x, COUNTS).sum().backward()
    assert x.grad is not None and module.fc1_weight.grad is not None


def test_grouped_gemm_on_the_cpu_needs_16_byte_rows_and_few_rows_per_expert():
    """torch's CPU grouped GEMM needs every row stride a multiple of 16 bytes: fp32 widths of 32 qualify, 30 do
    not (the loop runs); bf16 needs multiples of 8 elements. Experts with many rows each run the loop (faster there:
    one GEMM per expert)."""
    w = torch.zeros(4, 48, 32)
    assert GroupedLinear.usable(torch.zeros(8, 32), [w])
    many = GroupedLinear.CPU_MAX_ROWS_PER_EXPERT + 1
    assert GroupedLinear.usable(torch.zeros(2 * many, 32), [w], [many, 0, many - 2, 2])  # 3 experts with rows
    assert not GroupedLinear.usable(torch.zeros(2 * many, 32), [w], [many, 0, many, 0])
    assert not GroupedLinear.usable(torch.zeros(8, 30), [torch.zeros(4, 48, 30)])
    assert not GroupedLinear.usable(torch.zeros(8, 36, dtype=torch.bfloat16), [torch.zeros(4, 48, 36)])
    assert not GroupedLinear.usable(torch.zeros(8, 64)[:, :32], [w])  # not contiguous
    assert not GroupedLinear.usable(torch.zeros(0, 32), [w], [0, 0, 0, 0])  # no rows at all (a rank without tokens)
    assert not GroupedLinear.usable(torch.zeros(2, 32), [w], [1, 0, 1, 0])  # one decoded token, top-2: the loop
    # CUDA (no GPU here: the decision for given devices): bf16 on compute capability 8.0+ only.
    assert GroupedLinear.cuda_supports(torch.bfloat16, (8, 0)) and GroupedLinear.cuda_supports(torch.bfloat16, (9, 0))
    assert not GroupedLinear.cuda_supports(torch.bfloat16, (7, 5))
    assert not GroupedLinear.cuda_supports(torch.float32, (9, 0))
    with torch.no_grad():  # inference too (equal to the loop bit for bit: the test above)
        assert GroupedLinear.usable(torch.zeros(8, 32), [w])


@pytest.mark.parametrize("family", ["moe_gpt", "qwen3_moe"])
def test_in_inference_the_grouped_gemm_gives_the_loops_outputs_bit_for_bit(family, grouped_calls, monkeypatch):
    """Inference takes the grouped GEMM too: fp32 outputs equal the per-expert loop's exactly, at every row count
    (a batch of decoded tokens: one row per expert; a prompt: more), so KV-cached decoding gives the loop's tokens."""
    module = experts_module(family)
    run = sorted_experts(module)
    for counts in ([1, 0, 1, 1, 0, 1], [2, 1, 0, 0, 3, 1], COUNTS):
        x = torch.randn(sum(counts), run.layout.hidden_size)
        with torch.no_grad():
            grouped_calls.clear()
            grouped = run(x, counts)
            assert len(grouped_calls) == 2
            with monkeypatch.context() as m:
                m.setattr(GroupedLinear, "usable", staticmethod(lambda *a: False))
                loop = run(x, counts)
        assert torch.equal(grouped, loop)


@pytest.mark.parametrize("dropped", [False, True])
def test_gathering_dispatch_and_combine_equal_index_add(dropped):
    """The gathering combine (`DispatchPlan(gathers=True)`, every device: dispatch's backward and the combine sum each
    token's rows by gathering them through the inverse permutation; no atomic index_add_) gives the index_add_ path's
    output and gradients (x, routing weights, experts) in fp64 within 1e-12: only the order of a token's k terms
    differs. Run on the CPU here; on a GPU by tests/test_cuda.py through the model. `dropped`: some assignments go
    to no expert (id E), as a capacity limit or another rank's experts leave them."""
    from hf_moe_offload.models.moe_gpt.moe_ops import DispatchPlan, run_moe

    gen = torch.Generator().manual_seed(3)
    S, H, E, k = 13, 8, 5, 2
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(S)])
    if dropped:
        ids[::3, 1] = E
    w_expert = torch.randn(E, H, H, dtype=torch.float64, generator=gen)
    x0 = torch.randn(S, H, dtype=torch.float64, generator=gen)
    r0 = torch.rand(S, k, dtype=torch.float64, generator=gen)
    g = torch.randn(S, H, dtype=torch.float64, generator=gen)

    def experts(w):
        def run(x_sorted, counts):
            return torch.cat([xs @ w[e] for e, xs in enumerate(x_sorted.split(counts))])
        return run

    results = []
    for gathers in (False, True):
        x, r, w = (t.clone().requires_grad_(True) for t in (x0, r0, w_expert))
        plan = DispatchPlan.build(r, ids, E, gathers=gathers)
        assert (plan.inverse is not None) == gathers
        out = run_moe(x, plan, experts(w))
        out.backward(g)
        results.append((out, x.grad, r.grad, w.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_expert_bias_gradient_is_each_experts_row_sum():
    """`_ExpertBias` (CUDA's bias add in the grouped GEMM): forward `y + b[rows]`, gradients by autograd's gradcheck
    (fp64), the bias gradient computed as one GEMM with the 0/1 membership matrix."""
    from hf_moe_offload.models.moe_gpt.moe_ops import _ExpertBias

    rows = torch.tensor([0, 0, 0, 2, 2, 3])
    members = F.one_hot(rows, 4).T.to(torch.float64)
    y = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(_ExpertBias.apply(y, b, rows, members), y + b[rows], atol=0, rtol=0)
    assert torch.autograd.gradcheck(lambda y, b: _ExpertBias.apply(y, b, rows, members), (y, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segment_bias_equals_index_select_bit_for_bit(dtype):
    """`_SegmentBias` (the CPU's bias add in the grouped GEMM: in place, one expert's rows at a time, expert 1 with no
    rows) gives `y + b[rows]` and the same gradients as `index_select` exactly (fresh random inputs; tolerance 0), and
    passes gradcheck in fp64."""
    from hf_moe_offload.models.moe_gpt.moe_ops import _SegmentBias

    counts = [3, 0, 2, 4]
    rows = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    y0, b0, g = torch.randn(9, 5, dtype=dtype), torch.randn(4, 5, dtype=dtype), torch.randn(9, 5, dtype=dtype)
    outs = []
    for fn in (lambda y, b: y + b.index_select(0, rows), lambda y, b: _SegmentBias.apply(y, b, counts, rows)):
        w = torch.ones(9, 5, dtype=dtype, requires_grad=True)  # y is a non-leaf, as grouped_mm's output
        b = b0.clone().requires_grad_(True)
        y = y0 * w
        out = fn(y, b)
        (out * g).sum().backward()
        outs.append((out.detach(), w.grad, b.grad))
    for a, c in zip(*outs):
        torch.testing.assert_close(a, c, atol=0, rtol=0)
    y = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda y, b: _SegmentBias.apply(y.clone(), b, counts, rows), (y, b))
