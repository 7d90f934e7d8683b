"""Mixed precision on every path (issue 12): CPU autocast runs the same dtype logic as CUDA autocast.

Every tier (device, host, disk) x MPMoE (off, S1-S4) trains under bf16 autocast and under fp16 autocast with the
GradScaler; losses stay within a stated tolerance of the plain fp32 run, and no float32 GEMM runs in the backward of
an autocast forward (counted with a TorchDispatchMode). bf16 model weights with fp32 masters in the store, the
Trainer with `bf16=True`, and the main job with `--precision bf16` on every `--offload` value work end to end.
Expert parallelism under autocast runs in tests/test_distributed.py (two gloo processes).
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_moe_offload import ExpertAwareOptimizer, ExpertOptimizer, OffloadConfig, enable_expert_offload
from hf_moe_offload.pipelining import enable_micro_batch_pipelining
from hf_moe_offload.precision import GemmCounter

from small_corpus import write_corpus
from test_offload import small_model

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Loss after each of 3 steps vs the fp32 run of the same model and data. Measured: bf16 0.0023, fp16 0.0002 (the
# same for every tier and strategy); the bounds leave ~4x room. Against the plain model under the same autocast
# (same roundings, another op order) the difference is far smaller.
LOSS_TOL_VS_FP32 = {"bf16": 1e-2, "fp16": 1e-3}
LOSS_TOL_VS_PLAIN_AUTOCAST = {"bf16": 2e-3, "fp16": 2e-4}
STEPS = 3


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 101, (3, 11), generator=torch.Generator().manual_seed(step))


def train(tier: str, strategy: str | None, precision: str, tmp_path, model=None,
          device: str = "cpu") -> tuple[list[float], int]:
    """STEPS AdamW steps on `device` (tests/test_cuda.py runs them on a GPU); returns (losses, float32 GEMMs counted
    in the backward passes)."""
    torch.manual_seed(0)
    model = model if model is not None else small_model()
    engine = enable_expert_offload(model, OffloadConfig(mode=tier, offload_dir=str(tmp_path / "experts"),
                                                        host_cache_experts=4, pin_fraction=0.25))
    model.to(device)  # the non-expert weights (all of them on the device tier)
    if strategy is not None:
        enable_micro_batch_pipelining(model, n=2, strategy=strategy)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dtype = DTYPES.get(precision)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**8) if precision == "fp16" else None
    opt = inner
    if engine.store is not None:
        opt = ExpertAwareOptimizer(inner, ExpertOptimizer(engine, lr=1e-2, grad_scaler=scaler))
    losses, fp32_gemms = [], 0
    for step in range(STEPS):
        x = _batch(step).to(device)
        with torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = model(x, labels=x).loss
        with GemmCounter() as gemms:
            (scaler.scale(loss) if scaler is not None else loss).backward()
        fp32_gemms += gemms.by_dtype[torch.float32]
        if scaler is not None and engine.store is None:
            scaler.step(inner)
            scaler.update()
        else:
            opt.step()  # ExpertAwareOptimizer does the scaler's part for the offloaded experts too
        opt.zero_grad()
        losses.append(loss.item())
    if engine.store is not None:
        opt.expert_optimizer.close()
    return losses, fp32_gemms


_reference: dict = {}


def reference_losses(precision: str, tmp_path, device: str = "cpu") -> list[float]:
    """The plain model (device tier, no pipelining) in `precision`; computed once per precision and device."""
    if (precision, device) not in _reference:
        _reference[precision, device] = train("device", None, precision, tmp_path / f"ref-{precision}",
                                              device=device)[0]
    return _reference[precision, device]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("strategy", [None, "S1", "S2", "S3", "S4"])
@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_autocast_trains_on_every_tier_and_strategy(tier, strategy, precision, tmp_path):
    autocast_trains(tier, strategy, precision, tmp_path)


def autocast_trains(tier: str, strategy: str | None, precision: str, tmp_path, device: str = "cpu") -> None:
    losses, fp32_gemms = train(tier, strategy, precision, tmp_path, device=device)
    assert fp32_gemms == 0, f"{fp32_gemms} float32 GEMMs in the backward of an autocast forward"
    fp32 = reference_losses("fp32", tmp_path, device)
    plain = reference_losses(precision, tmp_path, device)
    assert max(abs(a - b) for a, b in zip(losses, fp32)) <= LOSS_TOL_VS_FP32[precision], (losses, fp32)
    assert max(abs(a - b) for a, b in zip(losses, plain)) <= LOSS_TOL_VS_PLAIN_AUTOCAST[precision], (losses, plain)


def test_offloaded_backward_recompute_runs_under_the_forwards_autocast(tmp_path):
    """The failure this guards against: the engine's backward recomputed the experts outside autocast, so every
    expert GEMM of backward ran in fp32 (216 of them over 3 steps of this model). Counted per dtype here."""
    model = small_model()
    enable_expert_offload(model, OffloadConfig(mode="host"))
    x = _batch(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, labels=x).loss
    with GemmCounter() as gemms:
        loss.backward()
    assert gemms.by_dtype[torch.bfloat16] > 0 and gemms.by_dtype[torch.float32] == 0, dict(gemms.by_dtype)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_bf16_model_weights_with_fp32_masters(tier, tmp_path):
    """`model.to(torch.bfloat16)` before offloading: bf16 compute copies are streamed, the store keeps fp32 masters
    (and Adam moments), and training follows the fp32 run within bf16 rounding."""
    model = small_model().to(torch.bfloat16)
    losses, fp32_gemms = train(tier, None, "fp32", tmp_path, model=model)
    engine_fp32 = reference_losses("fp32", tmp_path)
    assert fp32_gemms == 0
    assert max(abs(a - b) for a, b in zip(losses, engine_fp32)) <= 5e-2, (losses, engine_fp32)

    model = small_model().to(torch.bfloat16)
    engine = enable_expert_offload(model, OffloadConfig(mode=tier, offload_dir=str(tmp_path / "e2")))
    assert engine.store.compute_dtype == torch.bfloat16
    opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), ExpertOptimizer(engine, lr=1e-2))
    x = _batch(0)
    model(x, labels=x).loss.backward()
    opt.step()
    engine.synchronize()
    record = engine.store.acquire((0, 0))
    try:
        assert record.param.dtype == torch.float32 and record.exp_avg_sq.abs().sum() > 0
        assert torch.equal(record.compute, record.param.to(torch.bfloat16))  # the streamed copy follows the master
    finally:
        engine.store.release((0, 0))
    opt.expert_optimizer.close()


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_trainer_bf16_on_cpu_with_expert_optimizer(tier, tmp_path):
    """`Trainer(bf16=True, use_cpu=True)` (accelerate's CPU autocast) with offloaded experts and
    ExpertOptimizerCallback: trains, steps every expert, and follows the fp32 Trainer run."""
    losses16, engine, gemms = trainer_run(tier, True, tmp_path, use_cpu=True)
    assert gemms.by_dtype[torch.bfloat16] > 0  # accelerate's autocast was on
    assert set(engine.store.steps.values()) == {4}  # every expert stepped at every optimizer step
    losses32, _, _ = trainer_run(tier, False, tmp_path, use_cpu=True)
    assert len(losses16) == 4 and all(abs(a - b) <= 2e-2 for a, b in zip(losses16, losses32)), (losses16, losses32)


def trainer_run(tier: str, bf16: bool, tmp_path, use_cpu: bool):
    """4 Trainer steps of the small model (resident with torch AdamW where `tier` is "device", else offloaded with
    ExpertOptimizerCallback) -> (logged losses, engine or None, GEMMs counted by dtype)."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from hf_moe_offload import ExpertOptimizerCallback

    ids = torch.randint(0, 101, (16, 11), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    model, engine, callbacks = small_model(), None, []
    if tier != "device":
        engine = enable_expert_offload(model, OffloadConfig(mode=tier, offload_dir=str(tmp_path / f"e{bf16}"),
                                                            host_cache_experts=4))
        callbacks = [ExpertOptimizerCallback()]
    args = TrainingArguments(output_dir=str(tmp_path / f"out-{tier}-{bf16}"), max_steps=4, per_device_train_batch_size=4,
                             learning_rate=1e-2, bf16=bf16, use_cpu=use_cpu, report_to=[], logging_steps=1,
                             save_strategy="no", max_grad_norm=1.0, seed=0, data_seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    with GemmCounter() as gemms:
        trainer.train()
    if engine is not None:
        engine.synchronize()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, engine, gemms


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["auto", "device", "host", "disk"])
def test_main_job_bf16_on_every_offload_value(offload, tmp_path):
    """`hf-moe-offload train --short --precision bf16 --offload X` (few steps, small model: the CLI path). A few KB
    of text in blocks of 32 tokens (tests/small_corpus.py): the bf16 path of each tier is the same at any size."""
    from hf_moe_offload.cli.main import main

    out = tmp_path / "run"
    corpus = write_corpus(tmp_path / "corpus.txt")
    assert main(["train", "--short", "--precision", "bf16", "--offload", offload, "--steps", "3",
                 "--max-eval-blocks", "2", "--num-experts", "4", "--block-size", "32", "--batch-size", "2",
                 "--train-file", str(corpus), "--output-dir", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    losses = [h["loss"] for h in metrics["log_history"] if "loss" in h]
    assert losses and all(torch.isfinite(torch.tensor(v)) for v in losses)
    if offload != "auto":
        assert metrics["offload"]["mode"] == offload, metrics["offload"]
