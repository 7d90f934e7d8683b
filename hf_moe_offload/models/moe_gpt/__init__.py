"""MoE-GPT, the package's own model: its config, the model classes, one MoE layer (`moe_layer`) and the MoE operations
(`moe_ops`). The four files are saved beside every MoE-GPT checkpoint as remote code, so they import nothing of the
package but each other.

May import: nothing of the package.
"""

from .configuration_moe_gpt import MOE_GPT_PRESETS, MoEGPTConfig
from .modeling_moe_gpt import MoEGPTForCausalLM, MoEGPTForSequenceClassification, MoEGPTModel, MoEGPTPreTrainedModel
from .moe_layer import MoEGPTExperts, MoEGPTRouter, MoEGPTSparseMoeBlock
from .moe_ops import DispatchPlan, run_moe
