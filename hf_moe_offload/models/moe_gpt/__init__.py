from .configuration_moe_gpt import MOE_GPT_PRESETS, MoEGPTConfig
from .modeling_moe_gpt import (
    DispatchPlan,
    MoEGPTExperts,
    MoEGPTForCausalLM,
    MoEGPTForSequenceClassification,
    MoEGPTModel,
    MoEGPTPreTrainedModel,
    MoEGPTRouter,
    MoEGPTSparseMoeBlock,
    run_moe,
)
