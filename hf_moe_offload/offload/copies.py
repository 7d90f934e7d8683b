"""Copies of an offloaded model: what `copy.deepcopy(model)` (and `reference_copy`, offload/api.py) give.

A copy is a model of its own. Its non-expert weights are copied as any module's are; its experts are in a store of
its own, filled from the original's records, and an engine of its own, unbound (it binds at its first forward,
whichever model runs first). Nothing mutable is shared: the original's expert optimizer, its pending updates, its
device copies and its disk files stay with it, so a copy kept as a frozen reference never sees the original's
updates, and training the copy never touches the original.

What a copy costs: the host tier's copy holds every record again (a trained store: fp32 weights, gradient and two
Adam moments, 16 bytes per expert parameter, plus the compute-dtype copies a bf16/fp16 model streams); the disk
tier's copy writes every expert file again, into a directory of its own next to the original's (removed when the
copy's store is garbage-collected), and holds a host cache as large as the original's. A frozen copy
(`frozen_row_dtype`) keeps weights only, in that dtype (a bf16 model's reference: 2 bytes per expert parameter).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import tempfile
import weakref

import torch

from .stores.disk_store import DiskExpertStore
from .lora.lora_store import LoraStore
from .stores.store import ExpertStore, HostExpertStore
from .telemetry import OffloadStats


def copy_engine(engine, memo: dict, frozen_row_dtype: torch.dtype | None = None):
    """The engine of a copy of the model (`copy.deepcopy` calls this through `OffloadEngine.__deepcopy__` with its
    `memo`, which maps the original's modules to the copy's). `frozen_row_dtype`: the copy's experts are frozen
    (`train_experts=False`) and kept weights only, in this dtype."""
    if engine.coordinator is not None or type(engine.store) not in (HostExpertStore, DiskExpertStore):
        raise RuntimeError(
            "this model's experts are in a store shared between processes (hf_moe_offload.distributed), which a copy "
            "cannot duplicate: copy the model before distributing it, or disable_expert_offload(model) first")
    if engine.lora.layers:
        raise RuntimeError(
            "this model's expert LoRA factors are in the expert store (OffloadConfig.lora_in_store), which a copy "
            "cannot share with peft's modules: copy the model before its first training forward, or save the "
            "adapter and load it into a copy")
    engine.synchronize()  # the store current: updates in flight done, device-pinned experts home
    cls = type(engine)
    new = cls.__new__(cls)
    memo[id(engine)] = new  # the copy's layers, hooks and path refer to the new engine
    stats = OffloadStats()
    memo[id(engine.stats)] = stats
    frozen = frozen_row_dtype is not None
    store = memo[id(engine.store)] = copy_store(engine.store, stats, engine.config.io_threads, frozen_row_dtype)
    new.config = dataclasses.replace(engine.config, train_experts=engine.train_experts and not frozen)
    new.stats = stats
    new.layers = copy.deepcopy(engine.layers, memo)
    new.lora = LoraStore()
    new._compose(store, copy.deepcopy(engine.decoding.pregate, memo))
    return new


def copy_store(store: ExpertStore, stats: OffloadStats, io_threads: int,
               frozen_row_dtype: torch.dtype | None = None) -> ExpertStore:
    """A store of the same tier and experts holding copies of `store`'s records (every row, step counts and
    gradient flags; with `frozen_row_dtype`, weights only in that dtype)."""
    weights_only = frozen_row_dtype is not None and store.trainable
    rows = 1 if weights_only else store.state_rows
    row_dtype = frozen_row_dtype if weights_only else store.row_dtype
    args = (store.keys(), store.numel, store.compute_dtype, stats)
    if store.tier == "host":
        new = HostExpertStore(*args, rows, row_dtype, store.quantization)
    else:
        parent, name = os.path.split(os.path.abspath(store.dir).rstrip(os.sep))
        directory = tempfile.mkdtemp(prefix=f"{name}.copy-", dir=parent)
        new = DiskExpertStore(*args, directory, store.cache_experts, io_threads, state_rows=rows,
                              row_dtype=row_dtype, quantization=store.quantization)
        weakref.finalize(new, shutil.rmtree, directory, True)  # the copy's files go with it
    for key in store.keys():
        src = store.acquire(key)
        try:
            if weights_only:
                new.write_param(key, src.param)  # fp32 masters rounded to the row dtype, as their compute copies are
                continue
            if src.grad is not None:
                src.current_grad()  # a lazily cleared gradient reads as zero from here on: copied as such
            new.write_param(key, src.weights(torch.float32))  # the record claimed; its rows replaced just below
            dst = new.acquire(key)
            try:
                dst.buffer.copy_(src.buffer)  # every row exactly (quantized bytes too, not re-encoded)
                dst.refresh_compute()
            finally:
                new.release(key, dirty=True)
            new.steps[key], new.has_grad[key] = store.steps[key], store.has_grad[key]
        finally:
            store.release(key)
    new.flush()
    return new


__all__ = ["copy_engine", "copy_store"]
