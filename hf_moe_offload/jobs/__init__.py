"""The pieces every training job of this package shares: the main job (`hf-moe-offload train`) and the recipes.

In the order a job uses them:
1. argument groups (`arguments`: `add_model_arguments`, `add_offload_arguments` (a flag per `OffloadConfig` field),
   `add_method_arguments`, `add_pipelining_arguments`, `add_training_arguments`), then `training_arguments(args)`
   (`training`), which also creates the process group under `accelerate launch`;
2. `load_tokenizer`, then `prepare_model` (`model`): a preset built from scratch, or `--model-path` loaded with its
   experts streamed straight into the offload store (`load_offloaded_pretrained`), offloaded per
   `offload_config(args)`; `apply_lora` for `--method lora` (`lora`);
3. `distribute(model, engine)` (`distribution`): under several processes, offloaded experts go to one node-shared
   store with ES-MoE dynamic placement (§4.2); resident experts stay plain data-parallel; then
   `pipeline(model, args)`: MPMoE micro-batch pipelining of the MoE layers (over the expert-parallel exchange when
   there is one);
4. `training_callbacks(engine)` (`training`): expert load, offload totals and, when experts are offloaded and
   trained, the expert-wise CPU optimizer (`ExpertOptimizerCallback`, required: without it offloaded experts never
   update);
5. `finish_run(...)` (`report`): save model + tokenizer (streaming save), plots, `metrics.json`, the model card, and
   push.

May import: `cli.flags`, `data`, `distributed`, `errors`, `families`, `host_allocator`, `hub`, `models`, `offload`,
`optim`, `pipelining`, `planning`, `quiet`.
"""

from __future__ import annotations

from .arguments import (
    EXPERT_STORE_DIR,
    JOB_PRESETS,
    PRECISIONS,
    RESUME_LATEST,
    add_method_arguments,
    add_model_arguments,
    add_offload_arguments,
    add_pipelining_arguments,
    add_training_arguments,
    check_expert_storage,
    offload_config,
    offload_dir,
    tune_host_memory,
)
from .distribution import distribute, pipeline, pipelining_summary, world
from .lora import apply_lora, freeze_offloaded_experts, save_lora_run
from .model import _has_tokenizer, _ready_for_training, checkpoint_activations, load_tokenizer, prepare_model, preset_config
from .report import command_line, experts_summary, finish_run, hardware, offload_summary, train_figures
from .training import (
    lm_nll_per_sequence,
    perplexity_metrics,
    resume_checkpoint,
    short_run,
    training_arguments,
    training_callbacks,
)

__all__ = [
    "EXPERT_STORE_DIR",
    "JOB_PRESETS",
    "PRECISIONS",
    "RESUME_LATEST",
    "add_model_arguments",
    "add_offload_arguments",
    "add_pipelining_arguments",
    "add_training_arguments",
    "add_method_arguments",
    "check_expert_storage",
    "offload_config",
    "offload_dir",
    "tune_host_memory",
    "training_arguments",
    "load_tokenizer",
    "preset_config",
    "prepare_model",
    "checkpoint_activations",
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
    "hardware",
    "command_line",
    "train_figures",
    "offload_summary",
    "experts_summary",
    "finish_run",
    "short_run",
    "world",
]
