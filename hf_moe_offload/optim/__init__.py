"""Expert-wise CPU optimizer steps (ES-MoE §4.1), their Trainer / accelerate integrations, Trainer checkpoints
that hold the offloaded experts, and the non-expert weights' AdamW on the host (`HostDenseAdamW`).

May import: `errors`, `host_threads`, `offload`, `runtime`.
"""

from .callback import ExpertOptimizerCallback
from .checkpoints import checkpoint_problems, clean_interrupted_saves, latest_complete_checkpoint
from .dense_host import HostDenseAdamW
from .expert_optimizer import ExpertAwareOptimizer, ExpertOptimizer, accelerate_sync_gradients

__all__ = [
    "ExpertOptimizer",
    "ExpertAwareOptimizer",
    "ExpertOptimizerCallback",
    "HostDenseAdamW",
    "accelerate_sync_gradients",
    "checkpoint_problems",
    "clean_interrupted_saves",
    "latest_complete_checkpoint",
]
