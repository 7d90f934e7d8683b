"""The one entry through which every feature of this package reaches every MoE family.

transformers sends each experts module decorated with `@use_experts_implementation` (Mixtral, Qwen3-MoE, OLMoE,
gpt-oss, DeepSeek, GLM, Granite, ... and MoE-GPT) through one signature, `experts(hidden_states, top_k_index,
top_k_weights)`, and picks the function from the `ExpertsInterface` registry by `config._experts_implementation`.
This module registers ours there, "hf_moe_offload", and runs every MoE layer of a model through one pipeline (a
model that only chose it, `experts_implementation="hf_moe_offload"`, runs its resident experts through the same
dispatch, grouped experts and combine):

    plan (DispatchPlan: rows sorted by expert, dropped assignments removed)
      -> exchange + partitions: the layer's executor, if any
             expert parallelism (static, dynamic placement, PPMoE: hf_moe_offload.distributed)
             MPMoE micro-batch partitions over that exchange (hf_moe_offload.pipelining)
         or run_moe (dispatch -> experts -> weighted combine)
      -> experts(x_sorted, counts, expert_ids): resident (the module's own tensors through its `ExpertLayout`) or
         streamed from the expert store (hf_moe_offload.offload)

A `MoEPath` is attached to a model as one object (its only attribute on the model) when the first feature is enabled
(offload, pipelining, expert parallelism) and removed with the last one, which gives back the model's previous
experts implementation. It holds what the features install: each layer's executors and streamed experts
(`MoELayer`), the offload engine (`engine`) and the expert-parallel coordinator (`expert_parallel`). Modules are
never patched: the path maps each experts module to its `MoELayer`, and the features change a layer only through its
methods. The path serves the layers (the experts implementation is "hf_moe_offload") while any layer has a feature;
a device-tier offload engine alone keeps it attached without serving.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from transformers.integrations.moe import ExpertsInterface

from .layouts import ExpertLayout, is_experts_interface_module, layout_for
from ..models.moe_gpt.moe_ops import DispatchPlan, run_moe, run_sorted_experts

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
        # getattr, not the parameters themselves: a parametrized tensor (peft's `target_parameters` LoRA on expert
        # tensors) reads as its effective value, weight + the adapter's delta.
        tensors = [getattr(self.module, t.name) for t in self.layout.tensors]
        return run_sorted_experts(
            x_sorted, counts, expert_ids, tensors, self.layout.matrices(tensors), self.module,
            expert_fn=self.layout.forward,
            grouped_fn=lambda x, full: self.layout.grouped_forward(x, full, tensors),
        )


def sorted_experts(module: nn.Module) -> ResidentExperts:
    """A resident experts module in the sorted signature `experts(x_sorted, counts, expert_ids)` (what executors
    and `run_moe` call)."""
    return ResidentExperts(module, layout_for(module))


def unwrapped_name(name: str) -> str:
    """A module's name without peft's trailing `.base_layer`s: where its outermost wrapper sits."""
    while name.endswith(".base_layer"):
        name = name[: -len(".base_layer")]
    return name


class MoELayer:
    """One MoE layer on the path: its experts module, layout and what the enabled features put in its pipeline."""

    def __init__(self, index: int, name: str, module: nn.Module, layout: ExpertLayout, model: nn.Module | None = None):
        self.index = index
        self.name = name
        self.module = module
        self.layout = layout
        # Where the experts module sits in the model (its parent and attribute, past peft's `base_layer` wrappers):
        # what is there now may be peft's LoRA wrappers around it (`place`).
        parent, _, self._attr = unwrapped_name(name).rpartition(".")
        self._parent = model.get_submodule(parent) if model is not None else None
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

    def place(self) -> nn.Module:
        """What sits at the experts module's place in the model now: the module, or peft's wrappers around it."""
        return getattr(self._parent, self._attr) if self._parent is not None else self.module

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
        executor = self.executor
        if self.streamed is not None:  # offloaded: inference's mode, use scores, pre-gating of the next layer
            self.streamed.on_route(hidden_states, top_k_index, plan.counts, self.place())
            if executor is run_moe:
                # ES-MoE §4.1: the first reads start before the token permutation and overlap it. An exchange or
                # partitions run other rows than the plan's; their executors ask for what they run.
                self.streamed.prefetch(plan.counts)
        return executor(hidden_states, plan, self.experts)


# NOTE: torch.compile runs this eagerly (one graph break before and after each MoE layer's experts): the tokens per
# expert it reads back, the store's records and the engine's bookkeeping change every call, and guards on them would
# recompile every call; the compiled graphs are the attention, norms and routers between.
@torch.compiler.disable
def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The function registered as experts implementation "hf_moe_offload": the module's layer on its installed path,
    or, where no feature is installed (`from_pretrained(..., experts_implementation="hf_moe_offload")`,
    `set_experts_implementation("hf_moe_offload")`), the resident experts through the same dispatch and combine."""
    layer = _LAYERS.get(module)
    if layer is not None:
        return layer.forward(hidden_states, top_k_index, top_k_weights)
    experts = sorted_experts(module)
    plan = DispatchPlan.build(top_k_weights, top_k_index, experts.layout.num_experts)
    return run_moe(hidden_states, plan, experts)


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
    """Every MoE layer of one model on the "hf_moe_offload" experts implementation, and what the features hold
    (module docstring). Attached to the model as its one attribute `_hf_moe_path`; `remove()` takes it all back."""

    def __init__(self, model: nn.Module):
        found = experts_layers(model)
        if not found:
            raise ValueError(
                f"{type(model).__name__} has no experts module that hf_moe_offload can serve: it needs an experts "
                "module decorated with transformers' @use_experts_implementation (called as experts(hidden_states, "
                "top_k_index, top_k_weights)) whose tensors an ExpertLayout describes (hf_moe_offload/families/layouts.py)"
            )
        self.layers = [MoELayer(i, name, module, layout, model) for i, (name, module, layout) in enumerate(found)]
        self._model = model
        self._previous: str | None = None  # the experts implementation before the path served the layers
        self.serving = False
        self.engine = None  # the offload engine (hf_moe_offload.offload), while expert offload is on
        self.expert_parallel = None  # the ExpertParallelCoordinator (hf_moe_offload.distributed), while on

    def __repr__(self) -> str:
        features = [name for name, on in (("offload", self.engine is not None),
                                          ("expert_parallel", self.expert_parallel is not None),
                                          ("pipelined", any(layer.pipelined is not None for layer in self.layers)))
                    if on]
        return (f"MoEPath({type(self._model).__name__}, {len(self.layers)} MoE layers, serving={self.serving}, "
                f"features={features})")

    def __setstate__(self, state: dict) -> None:
        # copy.deepcopy(model) copies the path with the model: the copy's experts modules join the registry.
        self.__dict__.update(state)
        if self.serving:
            for layer in self.layers:
                _LAYERS[layer.module] = layer

    def attach(self) -> None:
        """Hold the path on its model (what `attached_path` finds), without serving the layers yet."""
        setattr(self._model, PATH_ATTR, self)

    def install(self) -> None:
        """Attach the path and serve every MoE layer through it (experts implementation "hf_moe_offload")."""
        model = self._model
        if not hasattr(model, "set_experts_implementation"):
            raise ValueError(f"{type(model).__name__} is not a transformers PreTrainedModel; its experts implementation "
                             "cannot be set")
        if not self.serving:
            self._previous = model.get_experts_implementation()
        for layer in self.layers:
            _LAYERS[layer.module] = layer
        model.set_experts_implementation(IMPLEMENTATION)
        self.serving = True
        unserved = [layer.name for layer in self.layers
                    if getattr(getattr(layer.module, "config", None), "_experts_implementation", None) != IMPLEMENTATION]
        if unserved:
            self.remove()
            raise ValueError(f"{type(model).__name__}: set_experts_implementation({IMPLEMENTATION!r}) did not reach the "
                             f"experts of {', '.join(unserved)} (their config is not the model's or a sub-config)")
        self.attach()

    def _stop_serving(self) -> None:
        if not self.serving:
            return
        for layer in self.layers:
            _LAYERS.pop(layer.module, None)
        self._model.set_experts_implementation(self._previous)
        self.serving = False

    def remove(self) -> None:
        """Give back the model's previous experts implementation and take the path off the model."""
        self._stop_serving()
        self._model.__dict__.pop(PATH_ATTR, None)

    def remove_if_idle(self) -> None:
        """After a feature was turned off: stop serving once no layer has a feature, and leave the model once the
        path holds nothing either."""
        if all(layer.idle() for layer in self.layers):
            self._stop_serving()
            if self.engine is None and self.expert_parallel is None:
                self.remove()


def attached_path(model: nn.Module) -> MoEPath | None:
    """The path attached to the model, serving or not (one holding only a device-tier offload engine)."""
    model = getattr(model, "module", model)  # DDP-wrapped
    return getattr(model, PATH_ATTR, None)


def get_moe_path(model: nn.Module) -> MoEPath | None:
    """The model's path if it serves the MoE layers, else None."""
    path = attached_path(model)
    return path if path is not None and path.serving else None


def holding_path(model: nn.Module) -> MoEPath:
    """The model's attached path, attaching a new one (not serving) if needed: for a feature that holds state on the
    path without changing how the layers run."""
    path = attached_path(model)
    if path is None:
        path = MoEPath(getattr(model, "module", model))
        path.attach()
    return path


def moe_path(model: nn.Module) -> MoEPath:
    """The model's serving path, installing it first if needed."""
    path = holding_path(model)
    if not path.serving:
        path.install()
    return path


__all__ = ["IMPLEMENTATION", "MoELayer", "MoEPath", "ResidentExperts", "attached_path", "experts_forward",
           "experts_layers", "find_experts_modules", "get_moe_path", "holding_path", "moe_path", "sorted_experts",
           "unwrapped_name"]
