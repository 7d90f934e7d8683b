from .configuration_moe_gpt import MOE_GPT_PRESETS, MoEGPTConfig
from .modeling_moe_gpt import (
    MoEGPTExperts,
    MoEGPTForCausalLM,
    MoEGPTForSequenceClassification,
    MoEGPTModel,
    MoEGPTPreTrainedModel,
    MoEGPTRouter,
    MoEGPTSparseMoeBlock,
)
from .moe_ops import DispatchPlan, run_moe
