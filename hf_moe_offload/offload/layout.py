"""The expert layouts live in `hf_moe_offload.layouts` (every feature uses them, not only offload); this module keeps
the old import path working."""

from ..layouts import (  # noqa: F401
    ExpertLayout,
    ExpertTensor,
    experts_interface_layout,
    is_experts_interface_module,
    layout_for,
    moe_gpt_layout,
)
