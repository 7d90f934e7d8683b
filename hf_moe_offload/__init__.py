"""hf_moe_offload: train Mixture-of-Experts models larger than GPU memory with the Hugging Face stack.

Importing the package registers MoE-GPT with transformers' Auto classes.
"""

# First, before anything imports peft (transformers' Trainer does), which imports bitsandbytes: importing `quiet`
# drops the one warning bitsandbytes logs at import on a CPU without the optional `kernels` package.
from . import quiet  # noqa: F401

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)

from .models.moe_gpt import (
    MOE_GPT_PRESETS,
    MoEGPTConfig,
    MoEGPTForCausalLM,
    MoEGPTForSequenceClassification,
    MoEGPTModel,
    MoEGPTPreTrainedModel,
)

from .offload import (
    OffloadConfig,
    disable_expert_offload,
    enable_expert_offload,
    get_offload_engine,
    reference_copy,
)
from .offload.checkpoint import load_offloaded_pretrained
from .offload.lora.expert_lora import expert_target_parameters
from .offload.saving import save_merged_lora, save_offloaded_pretrained
from .hub.adapter_check import check_adapter
from .hub.adapter_export import import_per_expert_adapter
from .hub.adapter_serving import export_adapter, export_per_expert_adapter
from .families.lm_loss import ChunkedLossTrainer, chunked_causal_lm_loss
from .trainer import OffloadTrainer
from .optim import (ExpertAwareOptimizer, ExpertOptimizer, ExpertOptimizerCallback, HostDenseAdamW,
                    latest_complete_checkpoint)

__version__ = "0.1.0"

AutoConfig.register("moe_gpt", MoEGPTConfig, exist_ok=True)
AutoModel.register(MoEGPTConfig, MoEGPTModel, exist_ok=True)
AutoModelForCausalLM.register(MoEGPTConfig, MoEGPTForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(MoEGPTConfig, MoEGPTForSequenceClassification, exist_ok=True)

# Saved models carry their modeling code, so they load with trust_remote_code=True where this package is absent.
MoEGPTConfig.register_for_auto_class()
MoEGPTModel.register_for_auto_class("AutoModel")
MoEGPTForCausalLM.register_for_auto_class("AutoModelForCausalLM")
MoEGPTForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")

__all__ = [
    "MOE_GPT_PRESETS",
    "MoEGPTConfig",
    "MoEGPTModel",
    "MoEGPTForCausalLM",
    "MoEGPTForSequenceClassification",
    "MoEGPTPreTrainedModel",
    "OffloadConfig",
    "enable_expert_offload",
    "disable_expert_offload",
    "get_offload_engine",
    "reference_copy",
    "save_offloaded_pretrained",
    "save_merged_lora",
    "expert_target_parameters",
    "check_adapter",
    "export_adapter",
    "export_per_expert_adapter",
    "import_per_expert_adapter",
    "load_offloaded_pretrained",
    "ExpertOptimizer",
    "ExpertAwareOptimizer",
    "ExpertOptimizerCallback",
    "HostDenseAdamW",
    "latest_complete_checkpoint",
    "OffloadTrainer",
    "ChunkedLossTrainer",
    "chunked_causal_lm_loss",
]
