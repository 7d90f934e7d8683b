"""The end of a run: the run record's parts (hardware, command line, training figures, offload and experts
summaries) and `finish_run`, which saves the model and tokenizer, plots, `metrics.json` and the card, and pushes."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import sys
import time
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from ..hub.cards import EXPERT_WISE, RECORD_FILE, write_model_card
from ..hub.upload import push_to_hub
from ..offload import get_offload_engine
from ..offload.saving import save_offloaded_pretrained
from ..optim import ExpertOptimizerCallback
from .run_stats import ExpertLoadCallback, OffloadTotalsCallback, plot_expert_load, plot_training_curves
from .arguments import EXPERT_STORE_DIR
from .distribution import world


def hardware() -> dict[str, Any]:
    if torch.cuda.is_available():
        desc = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    else:
        desc = f"CPU only ({os.cpu_count()} cores, {platform.machine()}), no GPU"
    return {"description": desc, "torch": torch.__version__, "python": platform.python_version()}


def command_line() -> str:
    prog = os.path.basename(sys.argv[0])
    if prog in ("hf-moe-offload", "main.py", "__main__.py"):
        prog = "hf-moe-offload"
    elif sys.argv[0].endswith(".py"):
        prog = f"python {os.path.relpath(sys.argv[0])}" if os.path.exists(sys.argv[0]) else prog
    _, world_size = world()
    launch = f"accelerate launch --num_processes {world_size} " if world_size > 1 else ""
    if launch and prog.startswith("python "):
        prog = prog[len("python "):]
    return launch + " ".join([prog, *map(shlex.quote, sys.argv[1:])])


def train_figures(trainer, train_output, tokens_per_step: int | None) -> dict[str, Any]:
    """Loss at the first and last log, run average, tokens/s and runtime from the Trainer's history."""
    losses = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    runtime = train_output.metrics.get("train_runtime")
    steps = trainer.state.global_step
    return {
        "train_steps": steps,
        "train_loss_first": losses[0][1] if losses else None,
        "train_loss_last": losses[-1][1] if losses else None,
        "train_loss": train_output.training_loss,
        "train_loss_curve": losses,
        "train_runtime_s": runtime,
        "train_tokens": tokens_per_step * steps if tokens_per_step else None,
        "tokens_per_second": (tokens_per_step * steps / runtime) if tokens_per_step and runtime else None,
        "train_samples_per_second": train_output.metrics.get("train_samples_per_second"),
    }


def offload_summary(engine, args: argparse.Namespace) -> dict[str, Any] | None:
    """What the card and metrics say about the offload settings actually used."""
    if engine is None:
        return None
    summary: dict[str, Any] = {"mode": engine.tier, "requested_mode": args.offload}
    if engine.store is None:
        return summary
    store = engine.store
    keys = store.keys()
    record_bytes = store.record_bytes()  # fp32 [param | grad | exp_avg | exp_avg_sq], or [param] when frozen
    cache = getattr(store, "cache_experts", None)
    summary.update(
        experts_total=len(keys),
        params_per_expert=store.numel,
        expert_state_MB=round(len(keys) * record_bytes / 2**20, 2),
        prefetch_depth=args.prefetch_depth,
        effective_prefetch_depth=engine.depth,
        pin_fraction=args.pin_fraction,
        compute_dtype=str(store.compute_dtype).replace("torch.", ""),
        expert_state_rows=_stored_rows(store),
    )
    if cache is not None:
        summary.update(host_cache_experts=cache, host_cache_MB=round(cache * record_bytes / 2**20, 2),
                       host_cache_fraction=round(cache / len(keys), 4))
    return summary


def experts_summary(model: nn.Module, engine, callbacks: list) -> dict[str, Any]:
    """How the run treated its experts, for the card and metrics.json: trained or frozen, what stepped them (the
    expert-wise CPU optimizer only when its callback is among the Trainer's `callbacks`), where and how they were
    stored (`storage`: the per-parameter format of their weights: fp32, bf16, int8, nf4)."""
    from ..families.moe_path import find_experts_modules

    offloaded = engine is not None and engine.store is not None
    expert_wise = any(isinstance(c, ExpertOptimizerCallback) for c in callbacks)
    if offloaded:
        store = engine.store
        trained = store.trainable
        storage = (store.quantization.storage if store.quantization is not None
                   else "fp32" if trained else _DTYPE_NAMES.get(store.row_dtype, str(store.row_dtype)))
        stored = _stored_rows(store)
    else:
        weights = [p for _, module in find_experts_modules(model) for p in module.parameters(recurse=False)]
        trained = any(p.requires_grad for p in weights)
        storage = _DTYPE_NAMES.get(weights[0].dtype, str(weights[0].dtype)) if weights else "n/a"
        stored = f"{storage} weights, resident"
    stepped_by = None
    if trained:
        stepped_by = EXPERT_WISE if expert_wise else "Trainer's optimizer"
    return {"trained": trained, "stepped_by": stepped_by, "storage": storage, "stored": stored,
            "tier": engine.tier if engine is not None else "device"}


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _stored_rows(store) -> str:
    """What the store keeps per expert, for the card."""
    if store.trainable:
        return "fp32 weights, gradients, Adam moments"
    q = store.quantization
    if q is not None:
        return f"{q.storage} weights (frozen; bitsandbytes, {q.bytes_per_parameter:.3f} bytes/parameter)"
    return f"{_DTYPE_NAMES.get(store.row_dtype, store.row_dtype)} weights (frozen)"


def finish_run(trainer, model: nn.Module, tokenizer: PreTrainedTokenizerBase, record: dict, args: argparse.Namespace,
               load: ExpertLoadCallback, totals: OffloadTotalsCallback, started: float,
               save_model=None) -> dict:
    """Save model + tokenizer, plots, `metrics.json` and the card into `args.output_dir`; push if asked.

    `record` already holds the job's own parts (task, data, training, metrics); this adds the expert load,
    offload telemetry, plots and runtime. Files are written by the main process; every process must call this.
    `save_model(folder)` overrides how the model is saved (default: streaming `save_offloaded_pretrained`).
    """
    out = args.output_dir
    main = trainer.is_world_process_zero()
    engine = get_offload_engine(model)
    if main:
        os.makedirs(out, exist_ok=True)
        (save_model or (lambda folder: save_offloaded_pretrained(model, folder)))(out)
        tokenizer.save_pretrained(out)
    trainer.accelerator.wait_for_everyone()
    if not main:
        return record
    record.setdefault("training", {}).setdefault("trainer", type(trainer).__name__)
    record["expert_load"] = load.summary()
    record["expert_load_history"] = load.history
    record["telemetry"] = totals.as_dict() if totals.tier in ("host", "disk") else None
    record.setdefault("plots", {})
    title = os.path.basename(os.path.normpath(out))
    if load.history:
        record["plots"]["expert_load"] = os.path.basename(
            plot_expert_load(load.history, load.layer_names, os.path.join(out, "expert_load.png"),
                             title=f"{title}: expert load per MoE layer"))
    record["plots"]["training_curves"] = os.path.basename(
        plot_training_curves(trainer.state.log_history, os.path.join(out, "training_curves.png"), title=title))
    record["metrics"]["total_runtime_s"] = round(time.perf_counter() - started, 1)
    record["output_dir"] = out
    record["log_history"] = trainer.state.log_history
    record["versions"] = _versions()
    if args.push_to_hub:
        record["hub_model_id"] = args.hub_model_id or os.path.basename(os.path.normpath(out))
    with open(os.path.join(out, RECORD_FILE), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2, default=str)
    write_model_card(out, record)
    _, world_size = world()
    if engine is not None and engine.store is not None and args.offload_dir is None and world_size == 1:
        engine.store.close()
        shutil.rmtree(os.path.join(out, EXPERT_STORE_DIR), ignore_errors=True)  # the saved model holds every weight
    if args.push_to_hub:
        record["hub_url"] = push_to_hub(out, record["hub_model_id"], private=args.hub_private)
    return record


def _versions() -> dict[str, str]:
    import accelerate
    import transformers

    from .. import __version__

    return {"hf_moe_offload": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "accelerate": accelerate.__version__}
