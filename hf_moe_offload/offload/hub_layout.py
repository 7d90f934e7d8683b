"""Checkpoint keys in the layout transformers saves (the Hub layout), mapped onto the model, one expert at a time.

transformers v5 holds a layer's experts as fused (E, ...) tensors (`mlp.experts.gate_up_proj`) but saves many families,
and the Hub holds them, with one tensor per expert and projection (`mlp.experts.0.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.0.w1.weight`). Its `conversion_mapping` says how those fuse (a `WeightConverter`: merge the
per-expert list, concatenate gate and up, transpose, ...) and how other keys are renamed (`WeightRenaming`). We use
those same rules instead of a table of our own, but per expert: the converter's operations run on one expert's
source tensors (a list of one), which gives that expert's slice of the fused tensor, so a layer's experts are never
all in memory at once.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import CheckpointError


@dataclass
class PerExpertSource:
    """The checkpoint keys of one fused expert tensor, one per expert and source pattern, and the converter that fuses
    them."""

    target: str  # the model's tensor name, e.g. "model.layers.0.mlp.experts.gate_up_proj"
    converter: object  # transformers' WeightConverter
    keys: dict[str, dict[int, str]] = field(default_factory=lambda: defaultdict(dict))  # pattern -> expert -> key

    def expert(self, e: int, read: Callable[[str], torch.Tensor], model: nn.Module) -> torch.Tensor:
        """Expert e's slice of the fused tensor, built by the converter's own operations from e's tensors alone."""
        missing = [p for p, by_expert in self.keys.items() if e not in by_expert]
        if missing or len(self.keys) != len(self.converter.source_patterns):
            raise CheckpointError(f"the checkpoint lacks expert {e}'s tensors of {self.target} "
                                  f"(patterns {self.converter.source_patterns})")
        collected = {p: [read(by_expert[e])] for p, by_expert in self.keys.items()}
        for op in self.converter.operations:
            collected = op.convert(collected, source_patterns=self.converter.source_patterns,
                                   target_patterns=self.converter.target_patterns, full_layer_name=self.target,
                                   model=model, config=model.config, missing_keys=None)
        if len(collected) != 1:
            raise CheckpointError(f"{self.target}: the checkpoint conversion gave {sorted(collected)}, not one tensor")
        (fused,) = collected.values()
        if fused.shape[0] != 1:
            raise CheckpointError(f"{self.target}: the checkpoint conversion does not act on experts one by one "
                                  f"(one expert gave a leading dimension of {fused.shape[0]})")
        return fused[0]


@dataclass
class CheckpointPlan:
    """Where each of the model's tensors comes from in a checkpoint."""

    direct: dict[str, str]  # model tensor -> checkpoint key holding it as is (after renaming)
    per_expert: dict[str, PerExpertSource]  # fused expert tensor -> its per-expert sources

    def covers(self, name: str) -> bool:
        return name in self.direct or name in self.per_expert


def _expert_index(pattern: str, key: str) -> int:
    """The number the pattern's `*` matched in key (the expert index)."""
    match = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
    if match is None:
        raise CheckpointError(f"checkpoint key {key} matched the conversion pattern {pattern} without an expert index")
    return int(match.group(1))


def plan_checkpoint(model: nn.Module, checkpoint_keys: Iterable[str], model_tensors: Iterable[str]) -> CheckpointPlan:
    """Map checkpoint keys onto `model_tensors` (full state-dict names) with transformers' conversion rules for the
    model (renamings, and converters for per-expert tensors)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, apply_renamings, rename_source_key

    transforms = get_model_conversion_mapping(model) if hasattr(model, "config") else []
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    known = dict.fromkeys(model_tensors, True)
    prefix = getattr(model, "base_model_prefix", None) or None
    plan = CheckpointPlan({}, {})
    for key in checkpoint_keys:
        target, pattern = rename_source_key(key, renamings, converters, prefix, known)
        if pattern is None:
            plan.direct[target] = key
            continue
        renamed = apply_renamings(key, renamings)
        converter = next(c for c in converters if pattern in c.source_patterns)
        source = plan.per_expert.setdefault(target, PerExpertSource(target, converter))
        source.keys[pattern][_expert_index(pattern, renamed)] = key
    return plan


__all__ = ["CheckpointPlan", "PerExpertSource", "plan_checkpoint"]
