"""The one-pass AdamW + compute-copy kernel (hf_moe_offload/optim/fused_adam.py) and the threads that run it."""

from __future__ import annotations

import copy
import threading
import time

import numpy as np
import pytest
import torch
from torch.optim.adam import adam

from hf_moe_offload import ExpertAwareOptimizer, ExpertOptimizer, OffloadConfig, enable_expert_offload
from hf_moe_offload.optim import fused_adam

from numerics import assert_within_adam_drift
from test_expert_optimizer import param_groups, step_both
from test_offload import small_model

EPS32 = torch.finfo(torch.float32).eps


def _state(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3, torch.randn(n, generator=g) * 1e-3,
            torch.rand(n, generator=g) * 1e-6]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decoupled", [True, False])
def test_kernel_steps_like_torch_fused_adamw_and_writes_the_copy(dtype, decoupled):
    """Three steps on fresh random state (odd sizes: vector body and tail), against torch's fused AdamW: the copy is
    exactly the new weights cast (round to nearest even); weights and moments within a few fp32 roundings of the
    values involved (each element: 8 ulp of |w| + lr for the weights, of |m| + |g| and v + g² for the moments, g
    with its L2 term; the
    kernel computes in fp32 element by element, torch's vectorized, and they may round an operation differently)."""
    lr, wd = 1e-3, 0.1
    for n in (1, 17, 100_003):
        ours, ref = _state(n, n), _state(n, n)
        grads = [torch.randn(n, generator=torch.Generator().manual_seed(s)) * 1e-3 for s in range(3)]
        copy_ = torch.empty(n, dtype=dtype)
        for step, g in enumerate(grads, start=1):
            before = [t.clone() for t in ref]
            fused_adam.adamw_many([ours[0]], [g], [ours[2]], [ours[3]], [copy_], [step], [True], lr=lr, beta1=0.9,
                                  beta2=0.999, eps=1e-8, weight_decay=wd, decoupled=decoupled)
            adam([ref[0]], [g.clone()], [ref[2]], [ref[3]], [], [torch.tensor(float(step - 1))], fused=True,
                 amsgrad=False, beta1=0.9, beta2=0.999, lr=lr, weight_decay=wd, eps=1e-8, maximize=False,
                 decoupled_weight_decay=decoupled)
            assert torch.equal(copy_, ours[0].to(dtype))
            assert ((ours[0] - ref[0]).abs() <= 8 * EPS32 * (ref[0].abs() + lr)).all()
            g = g if decoupled else g + wd * before[0]  # Adam's (L2) gradient includes the decay
            assert ((ours[2] - ref[2]).abs() <= 8 * EPS32 * (before[2].abs() + g.abs())).all()
            assert ((ours[3] - ref[3]).abs() <= 8 * EPS32 * (before[3] + g * g)).all()
            ours[0].copy_(ref[0]), ours[2].copy_(ref[2]), ours[3].copy_(ref[3])  # each step from the same state


def test_only_what_fits_the_kernel_goes_through_it():
    p, g, m, v = _state(8, 0)
    c = torch.empty(8, dtype=torch.bfloat16)
    assert fused_adam.fits([p], [g], [m], [v], [c])
    assert not fused_adam.fits([p.double()], [g], [m], [v], [c])
    assert not fused_adam.fits([torch.randn(4, 4).t()], [g], [m], [v], [c])  # not contiguous
    assert not fused_adam.fits([p], [g], [m], [v], [c.float()])  # the copy is fp32: no copy to write


@pytest.mark.parametrize("clip", [None, 0.05])
def test_host_steps_write_the_copies_in_the_same_pass(clip, monkeypatch):
    """The host tier with bf16 copies (`compute_dtype=torch.bfloat16`): each expert step goes through the kernel
    (counted), its copy is its new weights cast, and three windows of two micro-steps train like torch.optim.AdamW
    (weights within what Adam can move an element, lr/10 for all but 10%: bf16 GEMMs on both sides); the two-pass
    path (kernel unavailable) gives the same weights within a few roundings."""
    calls = {"n": 0}
    kernel = fused_adam.kernel()

    class Counting:
        def adamw_many_(self, *args):
            calls["n"] += 1
            return kernel.adamw_many_(*args)

    results = []
    for available in (True, False):
        monkeypatch.setattr(fused_adam, "_kernel", Counting() if available else False)
        reference = small_model(seed=5)
        model = copy.deepcopy(reference)
        engine = enable_expert_offload(model, OffloadConfig(mode="host", compute_dtype=torch.bfloat16))
        ref_opt = torch.optim.AdamW(param_groups(reference, 0.1), lr=1e-2)
        boundary = [False]
        experts = ExpertOptimizer(engine, lr=1e-2, weight_decay=0.1, max_grad_norm=clip,
                                  boundary_fn=lambda: boundary[0])
        opt = ExpertAwareOptimizer(torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2), experts)
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            for micro in range(2):
                boundary[0] = micro == 1
                x = torch.randint(0, 101, (2, 11), generator=g)
                for m in (reference, model):
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = m(x, labels=x).loss / 2
                    loss.backward()
            step_both(reference, ref_opt, opt, clip)
        engine.synchronize()
        for key in engine.store.keys():
            record = engine.store.acquire(key)
            assert torch.equal(record.compute, record.param.to(torch.bfloat16)), key
            engine.store.release(key)
        assert_within_adam_drift(model, reference, 1e-2, 3, weight_decay=0.1, outliers=0.1)
        results.append({key: engine.store.read_param(key) for key in engine.store.keys()})
        experts.close()
        if available:
            assert calls["n"] > 0
    for key, w in results[0].items():
        assert ((w - results[1][key]).abs() <= 3 * 8 * EPS32 * (w.abs() + 1e-2)).all(), key


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    """torch waits forever on the build lock a killed build left: one older than `STALE_LOCK_SECONDS` is removed
    before building; a fresh one (another process building now) is left for torch to wait on."""
    import os
    import time

    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = "hf_moe_offload_lock_test"
    lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
    assert not fused_adam.clear_stale_lock(name)  # no lock: nothing to do
    open(lock, "w").close()
    assert not fused_adam.clear_stale_lock(name) and os.path.exists(lock)
    old = time.time() - fused_adam.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    assert fused_adam.clear_stale_lock(name) and not os.path.exists(lock)


def _op_by_op(p, g, m, v, step, lr, wd, decoupled, grad_scale, clip_coef, dtype):
    """The kernel's arithmetic as separate fp32 NumPy operations, each an IEEE rounding of its own, in the kernel's
    order (what the per-tensor kernel with `prepare_grads_`'s separate unscale and clip passes computed, checked bit
    for bit against it once when this kernel replaced it): the reference of the bit-for-bit test. (NumPy, not torch:
    torch's vectorized CPU sqrt is not correctly rounded in every element.)"""
    f = np.float32
    p, g, m, v = (t.numpy() for t in (p, g, m, v))
    g = g * f(1.0 / grad_scale) if grad_scale is not None else g
    g = g * f(clip_coef) if clip_coef is not None else g
    w = p * f(1 - lr * wd if decoupled else 1.0)
    gi = g + f(0.0 if decoupled else wd) * p
    mi = m + f(1 - 0.9) * (gi - m)
    vi = f(0.999) * v + f(1 - 0.999) * gi * gi
    denom = np.sqrt(vi) / f((1 - 0.999 ** step) ** 0.5) + f(1e-8)
    w = w - f(lr / (1 - 0.9 ** step)) * mi / denom
    w, mi, vi = (torch.from_numpy(np.ascontiguousarray(x, dtype=f)) for x in (w, mi, vi))
    return w, mi, vi, w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("scaling", [(None, None), (1024.0, 0.37)])
def test_one_call_steps_many_tensors_bit_for_bit_whatever_the_team(dtype, decoupled, scaling):
    """Every tensor of a call (each with its own step count and decay flag, odd sizes so that thread ranges split
    tensors mid-way and vector bodies meet scalar tails) in one parallel region, the gradient unscaled and clipped in
    the same pass: bit for bit the operation-by-operation fp32 reference, for teams of 1 to 3 threads; the gradients
    are left as they were."""
    grad_scale, clip_coef = scaling
    sizes, steps, decays = [1, 17, 100_003, 4096, 70_001], [1, 3, 7, 2, 5], [True, False, True, True, False]
    gen = torch.Generator().manual_seed(11)
    state = [[torch.randn(n, generator=gen) * s for n in sizes] for s in (1.0, 1e-3, 1e-3)]
    state.append([torch.rand(n, generator=gen) * 1e-6 for n in sizes])
    expected = [_op_by_op(p, g, m, v, step, 1e-3, 0.1 if d else 0.0, decoupled, grad_scale, clip_coef, dtype)
                for p, g, m, v, step, d in zip(*state, steps, decays)]
    for threads in (1, 2, 3):
        p, g, m, v = ([t.clone() for t in column] for column in state)
        copies = [torch.empty(n, dtype=dtype) for n in sizes]
        fused_adam.adamw_many(p, g, m, v, copies, steps, decays, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                              weight_decay=0.1, decoupled=decoupled, grad_scale=grad_scale, clip_coef=clip_coef,
                              threads=threads)
        for i, want in enumerate(expected):
            for got, ref in zip((p[i], m[i], v[i], copies[i]), want):
                assert torch.equal(got, ref), (threads, i)
            assert torch.equal(g[i], state[1][i])


def test_the_kernel_call_releases_the_gil():
    """While one thread runs the kernel (about 0.1 s or more here), another Python thread keeps running: it records
    a time stamp in the middle half of the call. A call that held the GIL would leave that span empty."""
    n = 8_000_000
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    copy_ = torch.empty(n, dtype=torch.bfloat16)
    fused_adam.adamw_many([p], [g], [m], [v], [copy_], [1], [True], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                          weight_decay=0.0, decoupled=True, threads=1)  # built and warm
    stamps, done = [], threading.Event()

    def loop():
        while not done.is_set():
            stamps.append(time.perf_counter())

    other = threading.Thread(target=loop)
    other.start()
    try:
        time.sleep(0.01)
        for _ in range(3):
            start = time.perf_counter()
            fused_adam.adamw_many([p], [g], [m], [v], [copy_], [2], [True], lr=1e-3, beta1=0.9, beta2=0.999,
                                  eps=1e-8, weight_decay=0.0, decoupled=True, threads=1)
            end = time.perf_counter()
            lo, hi = start + (end - start) / 4, end - (end - start) / 4
            if any(lo <= t <= hi for t in stamps[-200_000:]):
                break
        else:
            raise AssertionError(f"no Python progress during three calls of {end - start:.3f} s")
    finally:
        done.set()
        other.join()
