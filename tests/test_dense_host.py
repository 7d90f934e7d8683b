"""The dense weights' optimizer on the host (optim/dense_host.py) against `torch.optim.AdamW`, on the CPU and the
simulated device, in fp32 and under bf16 autocast: equal weights, clipping, checkpoints, and the upload wait."""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext

import pytest
import torch

from hf_moe_offload import (ExpertAwareOptimizer, ExpertOptimizer, HostDenseAdamW, OffloadConfig,
                            enable_expert_offload)
from hf_moe_offload.offload.plan import dense_device_bytes, dense_on_host, dense_on_host_at
from hf_moe_offload.optim.adamw_step import clip_coefficient
from hf_moe_offload.runtime import HappensBeforeError, use_runtime
from hf_moe_offload.runtime.simulated import SimulatedRuntime

from numerics import assert_within_adam_drift
from test_expert_optimizer import param_groups, warmup_cosine
from test_offload import small_model

LR, WD, MICRO, STEPS = 1e-2, 0.1, 2, 3
AUTOCAST = pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
RUNTIME = pytest.mark.parametrize("simulated", [False, True], ids=["cpu", "simulated"])


def device(simulated: bool, seed: int = 0):
    return use_runtime(SimulatedRuntime(seed=seed, max_delay=0.002)) if simulated else nullcontext(None)


def loss_of(model, x, autocast):
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        return model(x, labels=x).loss / MICRO


def reference_clip_(params, max_norm: float) -> float:
    """`clip_grad_norm_`'s coefficient in the arithmetic the package uses (a float64 sum of the squares, optim/
    grad_norms.py `global_clip`), so that the reference can be bit-equal; returns the norm."""
    total = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None))
    coef = clip_coefficient(total, max_norm)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef)
    return total


def run_windows(models_steps, autocast, seed: int, windows: int = STEPS, boundary=None):
    """`windows` accumulation windows of MICRO micro-steps on fresh random batches; `models_steps`: (model, close)
    pairs, `close()` ending a window."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(windows):
        for micro in range(MICRO):
            x = torch.randint(0, 101, (2, 9), generator=g)
            if boundary is not None:
                boundary["now"] = micro == MICRO - 1
            for model, _ in models_steps:
                loss_of(model, x, autocast).backward()
        for _, close in models_steps:
            close()


@RUNTIME
@AUTOCAST
@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clip"])
def test_fp32_weights_equal_torch_adamw(simulated, autocast, clip):
    """fp32 weights on the device: the host step is torch's fused AdamW per tensor, so the weights are bit-equal to
    `torch.optim.AdamW(fused=True)`'s after accumulation windows with weight decay groups, a schedule and global
    clipping (the reference clips with the package's float64 norm: `clip_grad_norm_`'s coefficient up to rounding,
    which tests/test_expert_optimizer.py bounds)."""
    reference = small_model(seed=1)
    model = copy.deepcopy(reference)
    ref_opt = torch.optim.AdamW(param_groups(reference, WD), lr=LR, fused=True)
    ref_sched = warmup_cosine(ref_opt)
    boundary = {"now": False}
    with device(simulated) as rt:
        opt = HostDenseAdamW(param_groups(model, WD), lr=LR, max_grad_norm=clip, boundary_fn=lambda: boundary["now"])
        sched = warmup_cosine(opt)

        def close_reference():
            if clip:
                reference_clip_(list(reference.parameters()), clip)
            ref_opt.step(), ref_sched.step(), ref_opt.zero_grad()

        def close():
            opt.step(), sched.step(), opt.zero_grad()

        run_windows([(reference, close_reference), (model, close)], autocast, seed=2, boundary=boundary)
        opt.synchronize()
        assert opt.eager is (clip is None)
        if rt is not None:
            assert rt.copies > 0 and rt.checks > 0  # the transfers went through the simulated device
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p, q), name
        if clip:
            assert opt.last_grad_norm > clip  # clipping bit
        opt.close()


@RUNTIME
@AUTOCAST
def test_bf16_device_weights_equal_mixed_precision_adamw(simulated, autocast):
    """bf16 weights and gradients on the device, fp32 masters on the host: the mixed-precision recipe with
    `torch.optim.AdamW(fused=True)` over fp32 masters (gradients widened, weights rounded back to bf16) gives the same
    masters to the one-pass kernel's last-bit rounding (optim/fused_adam.py; measured: 1.5e-8 at most after 3 steps)
    and the same bf16 weights but where that last bit crosses a bf16 rounding boundary (measured: 0.011% of a
    tensor at most)."""
    base = small_model(seed=3)
    masters = [p.detach().clone().requires_grad_() for p in base.parameters()]
    reference = copy.deepcopy(base).to(torch.bfloat16)
    ref_opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WD, fused=True)
    model = copy.deepcopy(base)
    boundary = {"now": False}
    with device(simulated, seed=1):
        opt = HostDenseAdamW(model.parameters(), lr=LR, weight_decay=WD, device_dtype=torch.bfloat16,
                             max_grad_norm=0.05, boundary_fn=lambda: boundary["now"])
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())

        def close_reference():
            grads = [p.grad.float() for p in reference.parameters()]
            for m, g in zip(masters, grads):
                m.grad = g
            # The norm of the bf16 gradients, applied to the widened ones (as the host step reads them).
            coef = clip_coefficient(math.sqrt(sum(float(p.grad.double().pow(2).sum())
                                                  for p in reference.parameters())), 0.05)
            torch._foreach_mul_(grads, coef)
            ref_opt.step(), ref_opt.zero_grad(), reference.zero_grad()
            with torch.no_grad():
                for m, p in zip(masters, reference.parameters()):
                    p.copy_(m)

        run_windows([(reference, close_reference), (model, lambda: (opt.step(), opt.zero_grad()))], autocast, seed=4,
                    boundary=boundary)
        opt.synchronize()
        # Between steps the device holds the bf16 weights only: every gradient went home and was given back.
        assert all(p.dtype == torch.bfloat16 and p.grad is None for p in model.parameters())
        state = opt.state_dict()["state"]
        for i, (m, p, q) in enumerate(zip(masters, model.parameters(), reference.parameters())):
            ours = state[i]["master"]
            # A few fp32 ulps of the largest weight per step: the kernels' last bits, and the gradients of the
            # rare bf16 weights that rounded the other way (numerics.py's drift bound is for runs whose GEMMs round
            # differently from the first step on; these share every kernel but the step).
            ulp = torch.finfo(torch.float32).eps * max(1.0, m.detach().abs().max().item())
            torch.testing.assert_close(ours, m.detach(), atol=8 * STEPS * ulp, rtol=0)
            mismatched = (p.float() != q.float()).float().mean().item()
            assert mismatched <= 0.01, f"parameter {i}: {mismatched:.2%} of the bf16 weights differ"
        opt.close()


@RUNTIME
def test_with_offloaded_experts_one_global_norm(simulated, tmp_path):
    """Full fine-tuning with offloaded experts: the expert optimizer and the dense one on the host share the workers
    and one global norm (`clip_grad_norm_` over the whole model); the weights match plain AdamW within what Adam
    can move an element (tests/numerics.py: the host tier's grouped GEMMs round differently)."""
    reference = small_model(seed=5)
    model = copy.deepcopy(reference)
    ref_opt = torch.optim.AdamW(param_groups(reference, WD), lr=LR, fused=True)
    boundary = {"now": False}
    with device(simulated, seed=2):
        engine = enable_expert_offload(model, OffloadConfig(mode="host"))
        dense = HostDenseAdamW(param_groups(model, WD), lr=LR)
        experts = ExpertOptimizer(engine, lr=LR, weight_decay=WD, max_grad_norm=0.05,
                                  boundary_fn=lambda: boundary["now"])
        wrapped = ExpertAwareOptimizer(dense, experts)
        assert dense.max_grad_norm == 0.05 and dense._queue.executor is experts._queue.pool
        norms = []

        def close_reference():
            norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)))
            ref_opt.step(), ref_opt.zero_grad()

        def close():
            wrapped.step(), wrapped.zero_grad()
            norms.append(dense.last_grad_norm)

        run_windows([(reference, close_reference), (model, close)], None, seed=6, boundary=boundary)
        engine.synchronize()
        dense.synchronize()
        assert set(engine.store.steps.values()) == {STEPS}
        torch.testing.assert_close(norms[1::2], norms[0::2], rtol=1e-5, atol=0)  # the norm over every gradient
        assert_within_adam_drift(model, reference, LR, STEPS, WD, atol=2e-6)
        experts.close()
        dense.close()


@RUNTIME
def test_eager_steps_run_in_backward_once(simulated):
    """Without clipping each parameter is stepped as its gradient is final, during the window's last backward (its
    device gradient given back at once); `step()` only waits, and steps nothing twice."""
    model = small_model(seed=15)
    with device(simulated, seed=4):
        opt = HostDenseAdamW(model.parameters(), lr=LR)
        x = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(16))
        model(x, labels=x).loss.backward()
        assert all(p.grad is None for p in model.parameters())
        opt._finish()  # the backward's jobs, without closing the window
        assert all(s.step == 1 for s in opt._slots.values())
        opt.step()
        assert {s["step"] for s in opt.state_dict()["state"].values()} == {1}
        opt.close()


def test_checkpoint_resumes_bit_exactly(tmp_path):
    """Saved (atomically, `save`) after one window and restored into a new model and optimizer, the next windows give
    the weights and state of the uninterrupted run bit for bit; `state_dict` round-trips through `torch.save` too."""
    boundary = {"now": False}
    model = small_model(seed=7)
    opt = HostDenseAdamW(param_groups(model, WD), lr=LR, device_dtype=torch.bfloat16,
                         boundary_fn=lambda: boundary["now"])
    run_windows([(model, lambda: (opt.step(), opt.zero_grad()))], torch.bfloat16, seed=8, windows=1,
                boundary=boundary)
    opt.save(str(tmp_path))
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    resumed = {}
    for how in ("save", "state_dict"):
        fresh = small_model(seed=9)  # other initial weights: all come from the checkpoint
        fresh.load_state_dict(model.state_dict(), strict=False)
        fresh_opt = HostDenseAdamW(param_groups(fresh, WD), lr=LR, device_dtype=torch.bfloat16,
                                   boundary_fn=lambda: boundary["now"])
        if how == "save":
            fresh_opt.load(str(tmp_path))
        else:
            fresh_opt.load_state_dict(torch.load(tmp_path / "optimizer.pt"))
        resumed[how] = (fresh, fresh_opt)
    for m, o in [(model, opt), *resumed.values()]:
        run_windows([(m, lambda o=o: (o.step(), o.zero_grad()))], torch.bfloat16, seed=10, windows=2,
                    boundary=boundary)
    want = opt.state_dict()
    for fresh, fresh_opt in resumed.values():
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))
        got = fresh_opt.state_dict()
        for i, s in want["state"].items():
            assert got["state"][i]["step"] == s["step"] == 3
            assert all(torch.equal(got["state"][i][k], s[k]) for k in ("master", "exp_avg", "exp_avg_sq"))
    assert not list(tmp_path.glob("*.tmp*"))  # the atomic write left no temporary


def test_deleting_the_upload_wait_fails(monkeypatch):
    """The compute stream waits for each upload before the next forward reads the weights: without that wait the
    simulated device refuses the read."""

    def wait_without_event(self, slots):  # HostDenseAdamW._wait_uploads minus its `wait_event`
        for slot in slots:
            self.runtime.access(slot.param)

    monkeypatch.setattr(HostDenseAdamW, "_wait_uploads", wait_without_event)
    model = small_model(seed=11)
    with device(True, seed=3):
        boundary = {"now": False}
        opt = HostDenseAdamW(model.parameters(), lr=LR, boundary_fn=lambda: boundary["now"])
        with pytest.raises(HappensBeforeError, match="not ordered after its write"):
            run_windows([(model, opt.step)], None, seed=12, windows=1, boundary=boundary)


def test_auto_choice_and_device_bytes():
    """Where the device has room the state stays there; where the resident state would take more than half of the
    budget, it goes to the host; on the CPU (nothing to save) and by an explicit setting as asked."""
    n = 1_000_000
    assert dense_device_bytes(n, torch.bfloat16, on_host=False) == 16 * n
    assert dense_device_bytes(n, torch.bfloat16, on_host=True) == 4 * n
    assert not dense_on_host(None, n, torch.bfloat16, budget=64 * n, asynchronous=True)
    assert dense_on_host(None, n, torch.bfloat16, budget=24 * n, asynchronous=True)
    assert not dense_on_host(None, n, torch.bfloat16, budget=None, asynchronous=True)
    assert not dense_on_host(None, n, torch.bfloat16, budget=n, asynchronous=False)
    assert dense_on_host(True, n, torch.bfloat16, budget=None, asynchronous=False)
    assert not dense_on_host(False, n, torch.bfloat16, budget=n, asynchronous=True)
    # What OffloadTrainer asks: the device's memory free, unless device_budget_bytes says otherwise.
    small_device = SimulatedRuntime(free_memory=24 * n)
    assert dense_on_host_at(OffloadConfig(mode="host"), small_device, n, torch.bfloat16)
    assert not dense_on_host_at(OffloadConfig(mode="host", device_budget_bytes=64 * n), small_device, n,
                                torch.bfloat16)


@pytest.mark.slow
def test_trainer_steps_the_dense_weights_on_the_host_and_resumes(tmp_path):
    """`OffloadTrainer` with `dense_optimizer_on_host=True` and the expert callback (accumulation, global clipping)
    gives the weights of the same run with the Trainer's own fused AdamW on the device, bit for bit (one global norm,
    the same per-tensor arithmetic); resumed from its checkpoint in a new model, it ends on the same weights too."""
    from datasets import Dataset
    from transformers import TrainingArguments

    from hf_moe_offload import ExpertOptimizerCallback, OffloadTrainer, get_offload_engine

    ids = torch.randint(0, 101, (12, 9), generator=torch.Generator().manual_seed(13))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})

    def run(out, on_host: bool, resume=None):
        model = small_model(seed=14)
        enable_expert_offload(model, OffloadConfig(mode="host", dense_optimizer_on_host=on_host))
        args = TrainingArguments(output_dir=str(out), max_steps=3, per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, learning_rate=LR, weight_decay=WD, max_grad_norm=0.05,
                                 save_strategy="steps", save_steps=2, report_to=[], use_cpu=True, seed=0,
                                 disable_tqdm=True, optim="adamw_torch_fused")
        trainer = OffloadTrainer(model=model, args=args, train_dataset=data, callbacks=[ExpertOptimizerCallback()])
        trainer.train(resume_from_checkpoint=resume)
        inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        assert isinstance(inner, HostDenseAdamW) is on_host
        if on_host:
            inner.synchronize()
        engine = get_offload_engine(model)
        engine.synchronize()
        experts = {k: engine.store.read_param(k) for k in engine.store.keys()}
        return dict(model.named_parameters()), experts

    plain, plain_experts = run(tmp_path / "plain", False)
    ours, our_experts = run(tmp_path / "ours", True)
    resumed, resumed_experts = run(tmp_path / "ours", True, resume=str(tmp_path / "ours" / "checkpoint-2"))
    for name, p in plain.items():
        assert torch.equal(ours[name], p), name
        assert torch.equal(resumed[name], p), name
    assert all(torch.equal(our_experts[k], v) and torch.equal(resumed_experts[k], v) for k, v in plain_experts.items())
