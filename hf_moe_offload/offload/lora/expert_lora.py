"""peft's LoRA on streamed experts: the low-rank term applied in the experts' own pass, W + BA never formed.

peft's `LoraConfig(target_parameters=[...])` wraps an experts module in one `ParamWrapper` per adapted (E, ...)
tensor; while resident, the wrapper's forward turns the tensor into `W + scaling * lhs @ rhs` for every expert (a
parametrization) and the experts read that. Offloaded, the tensor's values are in the store and the module holds a
stand-in (offload/lora/stand_ins.py), so the parametrization is shapes only, and the streamed layer adds the adapter's
term to each matmul it computes:

    linear(x, W_e + s * lhs_e @ rhs_e) = linear(x, W_e) + s * linear(linear(x, first_e), second_e)

with (first, second) = (rhs, lhs) for weights stored (E, out, in) and (lhs, rhs) for (E, in, out) (`is_transposed`),
per expert row block, through the same linear the chunk uses (one grouped GEMM per factor over a chunk's experts, or
one expert's matmul). The factors come from the wrapper itself (`get_delta_factors`, peft's own reshaping of lora_A
and lora_B), and enter the layer's autograd function as inputs, so their gradients reach lora_A and lora_B as for any
parameter. Which adapters apply is peft's rule: the active ones, none while adapters are disabled; a merged adapter
cannot be (merging writes into offloaded experts, which the stand-in refuses).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ...families.moe_path import experts_layers, unwrapped_name


# A grouped GEMM takes matrices whose rows are 16-byte multiples (GroupedLinear.usable): ranks are padded with zeros
# to a multiple of 8 there (bf16, fp16 and fp32 alike), which adds nothing to the term and gives the padding no
# gradient that reaches the adapter.
RANK_MULTIPLE = 8


@dataclass(frozen=True)
class LoraTerm:
    first: torch.Tensor  # (E, r, in), or (E, in, r) for weights stored (E, in, out): applied to the matmul's input
    second: torch.Tensor  # (E, out, r), or (E, r, out)
    scaling: float
    transposed: bool  # the weight is stored (E, in, out)

    @classmethod
    def of(cls, first: torch.Tensor, second: torch.Tensor, scaling: float, transposed: bool) -> "LoraTerm":
        """The term with its factors as row-major blocks, the rank zero-padded to `RANK_MULTIPLE` (once per
        forward: every chunk takes its experts' blocks from these; peft's factors are permuted views)."""
        r = first.shape[-1] if transposed else first.shape[-2]
        pad = -r % RANK_MULTIPLE
        if pad:  # first: (E, in, r) when transposed, else (E, r, in); second the other way round
            first = torch.nn.functional.pad(first, (0, pad) if transposed else (0, 0, 0, pad))
            second = torch.nn.functional.pad(second, (0, 0, 0, pad) if transposed else (0, pad))
        return cls(first.contiguous(), second.contiguous(), scaling, transposed)

    def delta(self, e: int) -> torch.Tensor:
        """Expert e's `scaling * lhs @ rhs`: the adapter's change of the weight, in the weight's own orientation."""
        first, second = self.first[e], self.second[e]
        return self.scaling * (first @ second if self.transposed else second @ first)

    def detached(self) -> "LoraTerm":
        return LoraTerm(self.first.detach(), self.second.detach(), self.scaling, self.transposed)


class ExpertLora:
    """The active LoRA terms of one MoE layer's expert tensors, by tensor name."""

    def __init__(self, terms: dict[str, list[LoraTerm]]):
        self.terms = terms

    def tensors(self) -> list[torch.Tensor]:
        """Every factor: the inputs whose gradients the layer's backward returns."""
        return [t for terms in self.terms.values() for term in terms for t in (term.first, term.second)]

    def chunk(self, experts: list[int], grouped: bool, num_experts: int, leaves: bool,
              x: torch.Tensor | None = None) -> "ChunkLora":
        """The terms of a chunk's experts: (k, ...) factor blocks of a grouped chunk, one expert's factors otherwise.
        With `leaves` the blocks are detached leaves for the chunk's graph to be differentiated by (ChunkLora). `x`:
        the chunk's input (where factors kept elsewhere are brought: offload/lora/lora_store.py)."""
        everyone = grouped and experts == list(range(num_experts))
        index = None if not grouped or everyone else torch.tensor(experts, device=self.tensors()[0].device)

        def pick(factor: torch.Tensor) -> torch.Tensor:
            block = factor if everyone else factor.index_select(0, index) if grouped else factor[experts[0]]
            return block.detach().requires_grad_(True) if leaves else block

        terms = {name: [LoraTerm(pick(t.first), pick(t.second), t.scaling, t.transposed) for t in terms]
                 for name, terms in self.terms.items()}
        return ChunkLora(terms, None if everyone else index if grouped else experts[0])


class ChunkLora(ExpertLora):
    """One chunk's LoRA terms. Its factor blocks, as leaves, are what the chunk's graph is differentiated by, and
    `accumulate` adds their gradients into the layer's whole factor gradients in place. Differentiating by the layer's
    factors themselves would have autograd's select/index backward make a zero tensor of a whole factor's shape per
    chunk and add it: per expert streamed one at a time, O(experts) memory traffic each, so O(experts^2) per layer
    (at Qwen3-30B-A3B's shape ~25 MB of fresh zeros per expert, most of a step's page faults)."""

    def __init__(self, terms: dict[str, list[LoraTerm]], where):
        super().__init__(terms)
        self.where = where  # the experts' place in the layer's factors: an index, a (k,) index tensor, None: all

    def linear(self, base: Callable, names: list[str], tensors: list[torch.Tensor]) -> Callable:
        """`base` (the chunk's linear) with each adapted weight's low-rank term added. `tensors` are the chunk's
        expert tensors in layout order (`names`), recognised by identity when the expert function passes them to its
        linear."""
        by_weight = {id(t): [(term.first, term.second, term.scaling) for term in self.terms[name]]
                     for name, t in zip(names, tensors) if name in self.terms}

        def adapted(x, w, b=None, *rest):
            y = base(x, w, b, *rest)
            for first, second, scaling in by_weight.get(id(w), ()):
                y = y + scaling * base(base(x, first, None, *rest), second, None, *rest)
            return y

        return adapted

    def accumulate(self, grads, layer_factors: list[torch.Tensor], into: list) -> None:
        """Add the gradients of this chunk's factor blocks (`tensors()` order; None: unused) into `into`, the
        layer's factor gradients (a zero tensor shaped as `layer_factors[j]` is made at the first)."""
        for j, g in enumerate(grads):
            if g is None:
                continue
            if self.where is None:  # every expert: the blocks are the whole factors
                into[j] = g if into[j] is None else into[j].add_(g)
                continue
            if into[j] is None:
                into[j] = torch.zeros_like(layer_factors[j])
            if isinstance(self.where, torch.Tensor):
                into[j].index_add_(0, self.where, g)
            else:
                into[j][self.where] += g


def active_expert_lora(outer: nn.Module, module: nn.Module) -> ExpertLora | None:
    """The LoRA terms peft's wrappers between `outer` (what sits at the experts module's place in the model) and the
    experts `module` apply now; None when nothing wraps it or no adapter is active."""
    terms: dict[str, list[LoraTerm]] = {}
    transposed = bool(getattr(module, "is_transposed", False))
    wrapper = outer
    while wrapper is not module:
        if not (hasattr(wrapper, "get_delta_factors") and hasattr(wrapper, "parameter_name")):
            raise TypeError(
                f"{type(wrapper).__name__} wraps the offloaded experts {type(module).__name__}: only peft's LoRA on "
                "expert tensors (LoraConfig(target_parameters=[...])) can adapt streamed experts")
        if not wrapper.disable_adapters:
            if wrapper.merged:
                raise RuntimeError("a LoRA adapter is merged into offloaded experts, which cannot hold it; unmerge it")
            for adapter in wrapper.active_adapters:
                if adapter not in wrapper.lora_A:
                    continue
                if wrapper.get_param().dim() != 3:
                    raise ValueError(f"LoRA on {wrapper.parameter_name}: only (E, ...) expert matrices can be adapted "
                                     "while the experts stream, not their biases")
                lhs, rhs, scaling = wrapper.get_delta_factors(adapter)
                first, second = (lhs, rhs) if transposed else (rhs, lhs)
                terms.setdefault(wrapper.parameter_name, []).append(LoraTerm.of(first, second, scaling, transposed))
        wrapper = wrapper.base_layer
    return ExpertLora(terms) if terms else None


def expert_target_parameters(model: nn.Module) -> list[str]:
    """`LoraConfig.target_parameters` for every expert matrix of the model's MoE layers (their biases left out), e.g.
    ["experts.down_proj", "experts.gate_up_proj"]: peft matches them as suffixes of each tensor's full name."""
    names = set()
    for name, _, layout in experts_layers(model):
        attr = unwrapped_name(name).rpartition(".")[2]
        names.update(f"{attr}.{t.name}" for t in layout.tensors if t.decay)
    return sorted(names)


__all__ = ["ChunkLora", "ExpertLora", "LoraTerm", "active_expert_lora", "expert_target_parameters"]
