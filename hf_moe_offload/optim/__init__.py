"""Expert-wise CPU optimizer steps (ES-MoE §4.1) and their Trainer / accelerate integrations."""

from .callback import ExpertOptimizerCallback
from .expert_optimizer import ExpertAwareOptimizer, ExpertOptimizer, accelerate_sync_gradients

__all__ = ["ExpertOptimizer", "ExpertAwareOptimizer", "ExpertOptimizerCallback", "accelerate_sync_gradients"]
