"""The one entry through which every feature of this package reaches every MoE family.

transformers sends each experts module decorated with `@use_experts_implementation` (Mixtral, Qwen3-MoE, OLMoE,
gpt-oss, DeepSeek, GLM, Granite, ... and MoE-GPT) through one signature, `experts(hidden_states, top_k_index,
top_k_weights)`, and picks the function from the `ExpertsInterface` registry by `config._experts_implementation`.
This module registers ours there, "hf_moe_offload", and runs every MoE layer of a model through one pipeline:

    plan (DispatchPlan: rows sorted by expert, dropped assignments removed)
      -> exchange + partitions: the layer's executor, if any
             expert parallelism (static, dynamic placement, PPMoE: hf_moe_offload.distributed)
             MPMoE micro-batch partitions over that exchange (hf_moe_offload.pipelining)
         or run_moe (dispatch -> experts -> weighted combine)
      -> experts(x_sorted, counts, expert_ids): resident (the module's own tensors through its `ExpertLayout`) or
         streamed from the expert store (hf_moe_offload.offload)

A `MoEPath` is installed on a model as one object when the first feature is enabled (offload, pipelining, expert
parallelism) and removed with the last one, which gives back the model's previous experts implementation. Modules
are never patched: the path maps each experts module to its `MoELayer`, and the features change a layer only through
its methods.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from transformers.integrations.moe import ExpertsInterface

from .models.moe_gpt.modeling_moe_gpt import (
    DispatchPlan,
    grouped_expert_counts,
    run_moe,
)
from .offload.layout import ExpertLayout, is_experts_interface_module, layout_for

IMPLEMENTATION = "hf_moe_offload"
PATH_ATTR = "_hf_moe_path"

# experts module -> its MoELayer, for the modules of every installed path (weak: a dropped model leaves no trace).
_LAYERS: "weakref.WeakKeyDictionary[nn.Module, MoELayer]" = weakref.WeakKeyDictionary()


class ResidentExperts:
    """`experts(x_sorted, counts, expert_ids)` over the module's own (E, ...) parameters: one grouped GEMM per matmul
    where torch provides it (`GroupedLinear.usable`), else one expert after another."""

    def __init__(self, module: nn.Module, layout: ExpertLayout):
        self.module = module
        self.layout = layout

    @property
    def training(self) -> bool:
        return self.module.training

    def expert_parameters(self) -> list[nn.Parameter]:
        """The (E, ...) parameters, in layout order (none while the experts are offloaded to a store)."""
        params = self.module._parameters
        return [params[t.name] for t in self.layout.tensors if t.name in params]

    def __call__(self, x_sorted: torch.Tensor, counts: list[int], expert_ids: list[int] | None = None) -> torch.Tensor:
        # NOTE: unbind once instead of indexing W[e] per expert: each indexing op's backward would materialise a full
        # (E, ...) gradient, O(E^2) memory traffic per layer; unbind's backward stacks the slices once.
        # getattr, not the parameters themselves: a parametrized tensor (peft's `target_parameters` LoRA on expert
        # tensors) reads as its effective value, weight + the adapter's delta.
        tensors = [getattr(self.module, t.name) for t in self.layout.tensors]
        full = grouped_expert_counts(x_sorted, self.layout.matrices(tensors), counts, expert_ids, self.module)
        if full is not None:
            return self.layout.grouped_forward(x_sorted, full, tensors)
        per_expert = [t.unbind(0) for t in tensors]
        outputs, start = [], 0
        for i, n in enumerate(counts):
            if n == 0:
                continue
            e = i if expert_ids is None else expert_ids[i]
            outputs.append(self.layout.forward(x_sorted[start : start + n], [w[e] for w in per_expert]))
            start += n
        if not outputs:
            return x_sorted[:0].clone()
        return torch.cat(outputs)


def sorted_experts(module: nn.Module) -> ResidentExperts:
    """A resident experts module in the sorted signature `experts(x_sorted, counts, expert_ids)` (what executors
    and `run_moe` call)."""
    return ResidentExperts(module, layout_for(module))


class MoELayer:
    """One MoE layer on the path: its experts module, layout and what the enabled features put in its pipeline."""

    def __init__(self, index: int, name: str, module: nn.Module, layout: ExpertLayout):
        self.index = index
        self.name = name
        self.module = module
        self.layout = layout
        self.resident = ResidentExperts(module, layout)
        self.streamed = None  # the offload engine's OffloadedExpertsLayer, when the experts live in a store
        self.parallel = None  # expert parallelism's executor (exchange across ranks)
        self.pipelined = None  # MPMoE's PartitionedExecutor (over `parallel`'s exchange when both are on)

    @property
    def num_experts(self) -> int:
        return self.layout.num_experts

    @property
    def experts(self):
        return self.streamed if self.streamed is not None else self.resident

    @property
    def executor(self):
        return self.pipelined or self.parallel or run_moe

    def set_streamed(self, streamed) -> None:
        self.streamed = streamed

    def set_parallel(self, executor) -> None:
        self.parallel = executor

    def set_pipelined(self, executor) -> None:
        self.pipelined = executor

    def idle(self) -> bool:
        return self.streamed is None and self.parallel is None and self.pipelined is None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        # The inverse permutation serves run_moe's gathering combine; partitions and the exchange combine their own way.
        plan = DispatchPlan.build(top_k_weights, top_k_index, self.num_experts,
                                  gathers=self.pipelined is None and self.parallel is None)
        if self.streamed is not None:  # offloaded: inference's mode, use scores, pre-gating of the next layer
            self.streamed.on_route(hidden_states, top_k_index, plan.counts)
        return self.executor(hidden_states, plan, self.experts)


def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The function registered as experts implementation "hf_moe_offload"."""
    layer = _LAYERS.get(module)
    if layer is None:
        raise RuntimeError(
            f"{type(module).__name__} runs experts_implementation={IMPLEMENTATION!r} but is not on an installed "
            "hf_moe_offload path (its features were disabled on another model object, or the module was moved); set "
            "another implementation with model.set_experts_implementation(...)"
        )
    return layer.forward(hidden_states, top_k_index, top_k_weights)


ExpertsInterface.register(IMPLEMENTATION, experts_forward)


def experts_layers(model: nn.Module) -> list[tuple[str, nn.Module, ExpertLayout]]:
    """(name, experts module, layout) of every MoE layer in forward order: an installed path's layers (offloaded
    tensors are in the store), else every module a layout adapter describes."""
    path = get_moe_path(model)
    if path is not None:
        return [(layer.name, layer.module, layer.layout) for layer in path.layers]
    found = []
    for name, module in model.named_modules():
        try:
            layout = layout_for(module)
        except TypeError as err:
            if is_experts_interface_module(module):  # on transformers' experts interface, but not a layout we know
                family = getattr(getattr(module, "config", None), "model_type", None) or type(model).__name__
                raise ValueError(f"hf_moe_offload cannot serve the experts of {family!r} ({name}): {err}") from None
            continue
        found.append((name, module, layout))
    return found


def find_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Experts modules in forward order (see `experts_layers`)."""
    return [(name, module) for name, module, _ in experts_layers(model)]


class MoEPath:
    """Every MoE layer of one model on the "hf_moe_offload" experts implementation (module docstring)."""

    def __init__(self, model: nn.Module):
        found = experts_layers(model)
        if not found:
            raise ValueError(
                f"{type(model).__name__} has no experts module that hf_moe_offload can serve: it needs an experts "
                "module decorated with transformers' @use_experts_implementation (called as experts(hidden_states, "
                "top_k_index, top_k_weights)) whose tensors an ExpertLayout describes (hf_moe_offload/offload/layout.py)"
            )
        self.layers = [MoELayer(i, name, module, layout) for i, (name, module, layout) in enumerate(found)]
        if not hasattr(model, "set_experts_implementation"):
            raise ValueError(f"{type(model).__name__} is not a transformers PreTrainedModel; its experts implementation "
                             "cannot be set")
        self._model = model
        self._previous = model.get_experts_implementation()

    def __setstate__(self, state: dict) -> None:
        # copy.deepcopy(model) copies the path with the model: the copy's experts modules join the registry.
        self.__dict__.update(state)
        for layer in self.layers:
            _LAYERS[layer.module] = layer

    def install(self) -> None:
        model = self._model
        for layer in self.layers:
            _LAYERS[layer.module] = layer
        model.set_experts_implementation(IMPLEMENTATION)
        unserved = [layer.name for layer in self.layers
                    if getattr(getattr(layer.module, "config", None), "_experts_implementation", None) != IMPLEMENTATION]
        if unserved:
            self.remove()
            raise ValueError(f"{type(model).__name__}: set_experts_implementation({IMPLEMENTATION!r}) did not reach the "
                             f"experts of {', '.join(unserved)} (their config is not the model's or a sub-config)")
        setattr(model, PATH_ATTR, self)

    def remove(self) -> None:
        for layer in self.layers:
            _LAYERS.pop(layer.module, None)
        self._model.set_experts_implementation(self._previous)
        self._model.__dict__.pop(PATH_ATTR, None)

    def remove_if_idle(self) -> None:
        if all(layer.idle() for layer in self.layers):
            self.remove()


def get_moe_path(model: nn.Module) -> MoEPath | None:
    model = getattr(model, "module", model)  # DDP-wrapped
    return getattr(model, PATH_ATTR, None)


def moe_path(model: nn.Module) -> MoEPath:
    """The model's installed path, installing it first if needed."""
    path = get_moe_path(model)
    if path is None:
        path = MoEPath(getattr(model, "module", model))
        path.install()
    return path


__all__ = ["IMPLEMENTATION", "MoELayer", "MoEPath", "ResidentExperts", "experts_forward", "experts_layers",
           "find_experts_modules", "get_moe_path", "moe_path", "sorted_experts"]
