"""Checkpoint keys in the layout transformers saves (the Hub layout), mapped onto the model, one expert at a time.

transformers v5 holds a layer's experts as fused (E, ...) tensors (`mlp.experts.gate_up_proj`) but saves many families,
and the Hub holds them, with one tensor per expert and projection (`mlp.experts.0.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.0.w1.weight`). Its `conversion_mapping` says how those fuse (a `WeightConverter`: merge the
per-expert list, concatenate gate and up, transpose, ...) and how other keys are renamed (`WeightRenaming`). We use
those same rules instead of a table of our own, but per expert: the converter's operations run on one expert's
source tensors (a list of one), which gives that expert's slice of the fused tensor, so a layer's experts are never
all in memory at once.

A checkpoint released quantized (offload/stores/prequantized.py) adds transformers' quantizer to those rules: its dequantize op
runs first in the family's converter (per-expert FP8 weights and their `weight_scale_inv`), and its own converters
(`ConvertedSource`) turn a fused layer's MXFP4 `*_blocks` and `*_scales` into the expert tensor, read and converted
one expert's slice at a time, and the FP8 non-expert weights, read whole.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import nn

from ...errors import CheckpointError


def _convert(converter, collected: dict[str, list[torch.Tensor]], target: str, model) -> torch.Tensor:
    """The converter's operations on `collected` (source pattern -> tensors), as transformers' loader runs them; the
    one tensor they give (some ops wrap it in an `nn.Parameter`: it comes back detached)."""
    with torch.no_grad():
        for op in converter.operations:
            collected = op.convert(collected, source_patterns=converter.source_patterns,
                                   target_patterns=converter.target_patterns, full_layer_name=target, model=model,
                                   config=model.config, missing_keys=None)
    if len(collected) != 1:
        raise CheckpointError(f"{target}: the checkpoint conversion gave {sorted(collected)}, not one tensor")
    (tensor,) = collected.values()
    return (tensor[0] if isinstance(tensor, list) else tensor).detach()


def _one_expert(target: str, fused: torch.Tensor) -> torch.Tensor:
    if fused.shape[0] != 1:
        raise CheckpointError(f"{target}: the checkpoint conversion does not act on experts one by one "
                              f"(one expert gave a leading dimension of {fused.shape[0]})")
    return fused[0]


@dataclass
class PerExpertSource:
    """The checkpoint keys of one fused expert tensor, one per expert and source pattern, and the converter that fuses
    them."""

    target: str  # the model's tensor name, e.g. "model.layers.0.mlp.experts.gate_up_proj"
    converter: object  # transformers' WeightConverter
    keys: dict[str, dict[int, str]] = field(default_factory=lambda: defaultdict(dict))  # pattern -> expert -> key
    optional: frozenset[str] = frozenset()  # patterns a checkpoint may lack (a quantized weight's scales)

    def expert(self, e: int, read: Callable[[str], torch.Tensor], model) -> torch.Tensor:
        """Expert e's slice of the fused tensor, built by the converter's own operations from e's tensors alone."""
        required = [p for p in self.converter.source_patterns if p not in self.optional]
        missing = [p for p in required if e not in self.keys.get(p, {})]
        missing += [p for p, by_expert in self.keys.items() if e not in by_expert and p not in missing]
        if missing:
            raise CheckpointError(f"the checkpoint lacks expert {e}'s tensors of {self.target} "
                                  f"(patterns {self.converter.source_patterns})")
        collected = {p: [read(by_expert[e])] for p, by_expert in self.keys.items()}
        return _one_expert(self.target, _convert(self.converter, collected, self.target, model))


@dataclass
class ConvertedSource:
    """A model tensor that a converter builds from whole checkpoint tensors (one key per source pattern): a
    quantizer's (MXFP4 blocks and scales of a fused expert tensor, an FP8 weight and its scales)."""

    target: str
    converter: object  # transformers' WeightConverter
    keys: dict[str, str] = field(default_factory=dict)  # pattern -> key
    optional: frozenset[str] = frozenset()

    def _check(self) -> None:
        missing = [p for p in self.converter.source_patterns if p not in self.keys and p not in self.optional]
        if missing:
            raise CheckpointError(f"the checkpoint lacks {missing} of {self.target} (it has {sorted(self.keys)})")

    def whole(self, read: Callable[[str], torch.Tensor], model) -> torch.Tensor:
        """The tensor, converted from its sources read whole."""
        self._check()
        return _convert(self.converter, {p: [read(k)] for p, k in self.keys.items()}, self.target, model)

    def expert(self, e: int, read_slice: Callable[[str, int], torch.Tensor], model) -> torch.Tensor:
        """Expert e's slice of a fused (E, ...) tensor, converted from the e-th slices of its sources alone."""
        self._check()
        collected = {p: [read_slice(k, e).unsqueeze(0)] for p, k in self.keys.items()}
        return _one_expert(self.target, _convert(self.converter, collected, self.target, model))


class TensorsView:
    """The model as transformers' conversion ops look at it. They find the target tensor through its module
    (`get_module_from_name`: `get_submodule`, then the attribute) for its dtype (`Mxfp4Dequantize`, `Fp8Dequantize`)
    or shape (`Transpose`); offloaded experts are no longer attributes of their module, so here they are meta tensors
    of their shape and dtype."""

    def __init__(self, model: nn.Module, tensors: dict[str, tuple[torch.Size, torch.dtype]]):
        self.config = model.config
        self._model = model
        self._modules: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
        for name, (shape, dtype) in tensors.items():
            module, _, attr = name.rpartition(".")
            self._modules[module][attr] = torch.empty(shape, dtype=dtype, device="meta")

    def get_submodule(self, name: str):
        if name in self._modules:
            return SimpleNamespace(**self._modules[name])
        return self._model.get_submodule(name)

    def get_parameter(self, name: str):
        module, _, attr = name.rpartition(".")
        if attr in self._modules.get(module, {}):
            return self._modules[module][attr]
        return self._model.get_parameter(name)


@dataclass
class CheckpointPlan:
    """Where each of the model's tensors comes from in a checkpoint."""

    direct: dict[str, str]  # model tensor -> checkpoint key holding it as is (after renaming)
    per_expert: dict[str, PerExpertSource]  # fused expert tensor -> its per-expert sources
    converted: dict[str, ConvertedSource] = field(default_factory=dict)  # model tensor -> whole sources to convert

    def covers(self, name: str) -> bool:
        return name in self.direct or name in self.per_expert or name in self.converted


def _expert_index(pattern: str, key: str) -> int:
    """The number the pattern's `*` matched in key (the expert index)."""
    match = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
    if match is None:
        raise CheckpointError(f"checkpoint key {key} matched the conversion pattern {pattern} without an expert index")
    return int(match.group(1))


def _optional_patterns(converter, hf_quantizer) -> frozenset[str]:
    """The converter's source patterns a checkpoint may lack: a quantizer's companions of a tensor that can also be
    stored plain (FP8's `weight_scale_inv` and `activation_scale` beside `weight`: a norm or a router has none)."""
    optional: set[str] = set()
    for param, names in (getattr(hf_quantizer, "serialized_names", None) or {}).items():
        if param in names:
            optional.update(n for n in names if n != param)
    return frozenset(p for p in converter.source_patterns
                     if any(p == n or p.endswith(f".{n}") for n in optional))


def plan_checkpoint(model: nn.Module, checkpoint_keys: Iterable[str], model_tensors: Iterable[str],
                    hf_quantizer=None) -> CheckpointPlan:
    """Map checkpoint keys onto `model_tensors` (full state-dict names) with transformers' conversion rules for the
    model (renamings, and converters for per-expert tensors); `hf_quantizer`: transformers' quantizer of a checkpoint
    released quantized, set to dequantize (offload/stores/prequantized.py), whose rules join the family's."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, apply_renamings, rename_source_key

    transforms = (get_model_conversion_mapping(model, hf_quantizer=hf_quantizer) if hasattr(model, "config")
                  else [])
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
        converter = next(c for c in converters if pattern in c.source_patterns)
        optional = _optional_patterns(converter, hf_quantizer)
        if "*" not in pattern:  # whole tensors, converted together
            source = plan.converted.setdefault(target, ConvertedSource(target, converter, optional=optional))
            if pattern in source.keys:
                raise CheckpointError(f"checkpoint keys {source.keys[pattern]} and {key} both map onto {target}")
            source.keys[pattern] = key
            continue
        renamed = apply_renamings(key, renamings)
        source = plan.per_expert.setdefault(target, PerExpertSource(target, converter, optional=optional))
        source.keys[pattern][_expert_index(pattern, renamed)] = key
    return plan


__all__ = ["CheckpointPlan", "ConvertedSource", "PerExpertSource", "TensorsView", "plan_checkpoint"]
