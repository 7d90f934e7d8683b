"""A job's Trainer: `TrainingArguments` from the training flags, `--resume`, the callbacks (the expert-wise CPU
optimizer among them), the perplexity metrics and `--short`."""

from __future__ import annotations

import argparse
import logging
import math
import os
from typing import Any

import torch
import torch.nn.functional as F
from transformers import TrainingArguments

from ..errors import UserError
from ..optim import ExpertOptimizerCallback
from .run_stats import ExpertLoadCallback, OffloadTotalsCallback
from .arguments import RESUME_LATEST

logger = logging.getLogger(__name__)


def training_arguments(args: argparse.Namespace, **overrides: Any) -> TrainingArguments:
    """TrainingArguments from the shared flags. Creating them initialises the process group under a launcher."""
    if args.precision == "fp16" and not torch.cuda.is_available():
        raise UserError("--precision fp16 needs a CUDA GPU; on CPU use --precision bf16 or fp32")
    resume = getattr(args, "resume", None)  # checked fully in resume_checkpoint; here what needs no model, early
    if resume is not None and resume != RESUME_LATEST and not os.path.isdir(resume):
        raise UserError(f"--resume {resume}: no such checkpoint folder")
    if resume == RESUME_LATEST:
        from ..optim.checkpoints import list_checkpoints

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



def resume_checkpoint(args: argparse.Namespace, callbacks: list) -> str | None:
    """The checkpoint `--resume` asks for (None without the flag): PATH as given, or the latest complete checkpoint in
    `--output-dir`; a one-line error when it is missing or incomplete (naming what is missing). `callbacks`: the
    Trainer's (`training_callbacks`): a checkpoint holds the experts' state where the expert optimizer's callback
    saves it, not for LoRA on frozen experts."""
    from ..optim.checkpoints import checkpoint_problems, describe_checkpoints, latest_complete_checkpoint

    resume = getattr(args, "resume", None)
    if resume is None:
        return None
    experts = any(isinstance(c, ExpertOptimizerCallback) for c in callbacks)
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


def training_callbacks(engine, trainable_experts: bool = True) -> tuple[list, ExpertLoadCallback, OffloadTotalsCallback]:
    """(callbacks for the Trainer, the expert-load recorder, the offload-totals recorder)."""
    load, totals = ExpertLoadCallback(), OffloadTotalsCallback()
    callbacks: list = [load, totals]
    # The experts' own state, or their LoRA factors kept in the store (OffloadConfig.lora_in_store): both are stepped
    # by the expert optimizer.
    if engine is not None and engine.store is not None and (trainable_experts or engine.config.lora_in_store):
        callbacks.append(ExpertOptimizerCallback())
    return callbacks, load, totals


# Evaluation: exact LM perplexity (the Trainer's eval_loss also holds the router's auxiliary losses).
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


def short_run(args: argparse.Namespace, steps: int = 12, logging_steps: int = 2) -> None:
    """`--short`: a few steps, frequent logs, two evaluations (tests and a first try)."""
    args.steps = min(args.steps, steps)
    args.logging_steps = min(args.logging_steps, logging_steps)
    args.eval_steps = max(1, args.steps // 2)
