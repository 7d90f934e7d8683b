"""The training terminal (one progress bar) and the logged gradient norm over every parameter (issue 14, item 6)."""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset
from transformers import ProgressCallback, Trainer, TrainingArguments, default_data_collator

from hf_moe_offload import ExpertOptimizerCallback, OffloadConfig, enable_expert_offload
from hf_moe_offload.jobs.run_stats import OffloadTotalsCallback, TrainingProgressCallback, use_progress_bar

from test_offload import small_model


def _trainer(model, tmp_path, data, callbacks, max_grad_norm=1.0, steps=2, **kwargs):
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=steps, per_device_train_batch_size=len(data),
                             learning_rate=1e-3, weight_decay=0.0, max_grad_norm=max_grad_norm, logging_steps=1,
                             use_cpu=True, report_to=[], save_strategy="no", **kwargs)
    return Trainer(model=model, args=args, train_dataset=data, eval_dataset=data, data_collator=default_data_collator,
                   callbacks=callbacks)


def _data(seed: int, rows: int = 4, length: int = 12) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 101, (rows, length), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_logged_grad_norm_covers_experts_and_equals_the_plain_model(tier, tmp_path):
    """The Trainer's `grad_norm` of step 1 is the norm over all parameters, offloaded experts included: equal to
    `clip_grad_norm_` over every parameter of a resident copy on the same batch (rtol 1e-5)."""
    reference = small_model(seed=3)
    model = copy.deepcopy(reference)
    enable_expert_offload(model, OffloadConfig(mode=tier, offload_dir=str(tmp_path / "experts"),
                                               host_cache_experts=4))
    data = _data(seed=11)  # one batch: the step sees every row, whatever the sampler's order
    trainer = _trainer(model, tmp_path, data, [ExpertOptimizerCallback()], steps=1)
    trainer.train()
    logged = next(h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h)

    batch = torch.tensor(data["input_ids"])
    reference(input_ids=batch, labels=batch).loss.backward()
    expected = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0))
    non_expert = float(torch.nn.utils.clip_grad_norm_(
        [p for n, p in reference.named_parameters() if ".experts." not in n], float("inf")))
    assert logged == pytest.approx(expected, rel=1e-5)
    assert abs(expected - non_expert) > 1e-3 * expected  # the experts' share is visible in the figure
    assert not any("grad_norm_non_expert" in h for h in trainer.state.log_history)


def test_without_clipping_the_partial_norm_is_named_as_such(tmp_path):
    model = small_model(seed=3)
    enable_expert_offload(model, OffloadConfig(mode="host"))
    trainer = _trainer(model, tmp_path, _data(seed=12), [ExpertOptimizerCallback()], max_grad_norm=0.0, steps=1)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and all("grad_norm" not in h for h in logged)
    assert all(h["grad_norm_non_expert"] > 0 for h in logged)


def test_one_progress_bar_with_loss_throughput_and_hit_rate(tmp_path, capsys):
    """The default bar is replaced: no per-log dict is printed; the bar shows loss, tokens/s and the disk cache hit
    rate; each evaluation is one line; the logs themselves are all still recorded."""
    model = small_model(seed=4)
    enable_expert_offload(model, OffloadConfig(mode="disk", offload_dir=str(tmp_path / "experts"),
                                               host_cache_experts=3))
    totals = OffloadTotalsCallback()
    data = _data(seed=13)
    trainer = _trainer(model, tmp_path, data, [totals, ExpertOptimizerCallback()], steps=4,
                       eval_strategy="steps", eval_steps=2)
    bar = use_progress_bar(trainer, tokens_per_step=4 * 12, offload_totals=totals)
    kinds = [type(cb) for cb in trainer.callback_handler.callbacks]
    assert ProgressCallback not in kinds and kinds.count(TrainingProgressCallback) == 1
    trainer.train()
    out = capsys.readouterr()
    printed = out.out + out.err
    assert "{'loss'" not in printed and "offload/disk_read_MB" not in printed
    assert "loss=" in out.err and "tok/s=" in out.err and "hit=" in out.err, out.err[-2000:]
    assert out.out.count(": eval loss") == 2, out.out
    assert any("offload/disk_read_MB" in h for h in trainer.state.log_history)  # still recorded
    assert bar.training_bar is None  # closed at the end of training


def test_disable_tqdm_keeps_the_trainers_printer(tmp_path):
    model = small_model(seed=5)
    trainer = _trainer(model, tmp_path, _data(seed=14), [], disable_tqdm=True)
    assert use_progress_bar(trainer) is None
    assert not any(isinstance(cb, TrainingProgressCallback) for cb in trainer.callback_handler.callbacks)
