"""The experts' LoRA factors kept with the experts (`OffloadConfig.lora_in_store`): fp32 masters, gradients and Adam
moments in host memory, each chunk's factors sent where it computes in the compute dtype, their gradients sent home.

peft's `target_parameters` LoRA gives every adapted (E, ...) expert tensor a lora_A (r*E, in) and a lora_B (out, r*E)
parameter: per expert a rank-r pair, state of that expert exactly as its own Adam moments are (ES-MoE §4.1 keeps such
state on the host and steps it there). At a layer's first forward with the store on, each of its wrappers'
factors is adopted: copied into the layer's `LayerFactors` rows [param | grad | exp_avg | exp_avg_sq] and the module's
lora_A / lora_B weights swapped in place for stand-ins (offload/lora/stand_ins.py: shape, dtype and device, no values), so
that a dense optimizer holding them keeps nothing on the device and gets no gradient to step. `state_dict()` shows the
masters under the parameters' own names (a module state-dict hook), and `load_state_dict` writes into them: peft's
`save_pretrained` / `get_peft_model_state_dict` / `set_peft_model_state_dict` see a normal adapter.

Per call, a chunk's experts' factors are taken from the masters (`StoredExpertLora.chunk`), cast to the compute dtype
on the host and sent to the device; its backward adds their gradients, in fp32, into the layer's gradient row
(`StoredChunkLora.accumulate`). The expert optimizer steps a layer's factors (hf_moe_offload/optim/lora_steps.py) when
the layer's gradients are final, under the same window, learning rate, clipping and checkpoints as the experts. The
rows are laid out slot by slot (a slot: one wrapper's adapter), each factor one contiguous (E, ...) block, so a step
is per tensor as torch's AdamW steps lora_A and lora_B.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from ...precision import compute_dtype
from .expert_lora import ChunkLora, ExpertLora, LoraTerm
from .stand_ins import is_stand_in, stand_in_parameter

ROWS = 4  # param, grad, exp_avg, exp_avg_sq (as an expert record's, offload/stores/store.py)
PARAM, GRAD, EXP_AVG, EXP_AVG_SQ = range(ROWS)


@dataclass
class Slot:
    """One wrapper's adapter in a layer's rows: the factors of every expert, A (E, r, in) then B (E, out, r), peft's
    per-expert orientation (`ParamWrapper.get_delta_factors` before its transposes)."""

    wrapper: nn.Module
    adapter: str
    experts: int
    a_shape: tuple[int, int]  # (r, in) per expert
    b_shape: tuple[int, int]  # (out, r) per expert
    offset: int = 0

    @property
    def numel(self) -> int:
        return self.experts * (self.a_shape[0] * self.a_shape[1] + self.b_shape[0] * self.b_shape[1])

    def views(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of every expert over `row`, a layer's flat row."""
        n_a = self.experts * self.a_shape[0] * self.a_shape[1]
        a = row[self.offset : self.offset + n_a].view(self.experts, *self.a_shape)
        b = row[self.offset + n_a : self.offset + self.numel].view(self.experts, *self.b_shape)
        return a, b


class LayerFactors:
    """One MoE layer's adopted factors: `rows` (4, P) fp32, the Adam step count and whether a gradient arrived since
    the last step (changed through these methods and the store's)."""

    def __init__(self, slots: list[Slot]):
        offset = 0
        for slot in slots:
            slot.offset, offset = offset, offset + slot.numel
        self.slots = slots
        self.rows = torch.zeros(ROWS, offset)
        self.steps = 0
        self.has_grad = False

    def tensors(self, row: int) -> list[torch.Tensor]:
        """Row `row` per tensor (A, B of each slot in order): what a step sees."""
        return [t for slot in self.slots for t in slot.views(self.rows[row])]

    def slot(self, wrapper: nn.Module, adapter: str) -> Slot | None:
        return next((s for s in self.slots if s.wrapper is wrapper and s.adapter == adapter), None)


class LoraStore:
    """Every MoE layer's adopted LoRA factors (`layers`: layer -> LayerFactors), with the state a resume brought
    before a layer was adopted (`_pending`)."""

    def __init__(self):
        self.layers: dict[int, LayerFactors] = {}
        self._pending: dict[int, tuple[torch.Tensor, int]] = {}
        self._on_modules: list[nn.Parameter] = []  # adopted factors whose values the module still holds

    def release_modules(self) -> None:
        """Swap each adopted factor's parameter in place for a stand-in (the same object: a dense optimizer holding
        it keeps no values), where nothing but the module holds it: not inside peft's forward, whose views of
        lora_A / lora_B live until it returns (the swap waits for the layer's backward then)."""
        kept = []
        for weight in self._on_modules:
            try:
                torch.utils.swap_tensors(weight, stand_in_parameter(weight.shape, weight.dtype, weight.device))
            except RuntimeError:  # still viewed
                kept.append(weight)
        self._on_modules = kept

    # --- adoption, per call ---
    def active(self, layer: int, outer: nn.Module, module: nn.Module) -> "StoredExpertLora | None":
        """The terms of the adapters active now on `module`'s tensors (`outer`: what sits at its place in the model),
        their factors adopted into the store on first sight; None when no adapter is active. peft's rules as
        `active_expert_lora`'s: the active adapters, none while disabled, a merged one refused."""
        transposed = bool(getattr(module, "is_transposed", False))
        self.release_modules()
        terms, new = [], []
        wrapper = outer
        while wrapper is not module:
            if not (hasattr(wrapper, "get_delta_factors") and hasattr(wrapper, "parameter_name")):
                raise TypeError(f"{type(wrapper).__name__} wraps the offloaded experts {type(module).__name__}: only "
                                "peft's LoRA on expert tensors (LoraConfig(target_parameters=[...])) can adapt "
                                "streamed experts")
            for adapter in wrapper.lora_A:
                factors = self.layers.get(layer)
                if factors is None or factors.slot(wrapper, adapter) is None:
                    new.append(_slot_of(wrapper, adapter))
            if not wrapper.disable_adapters:
                if wrapper.merged:
                    raise RuntimeError("a LoRA adapter is merged into offloaded experts, which cannot hold it; "
                                       "unmerge it")
                terms += [(wrapper, a, wrapper.scaling[a]) for a in wrapper.active_adapters if a in wrapper.lora_A]
            wrapper = wrapper.base_layer
        if new:
            self._adopt(layer, new)
        if not terms:
            return None
        factors = self.layers[layer]
        return StoredExpertLora(factors, [(factors.slot(w, a), s, w.parameter_name) for w, a, s in terms], transposed)

    def _adopt(self, layer: int, new: list[Slot]) -> None:
        """Take `new` slots' factors into the layer's rows (beside those adopted before, whose state is kept) and
        leave stand-ins on their modules."""
        old = self.layers.get(layer)
        factors = LayerFactors([*(old.slots if old is not None else []), *new])
        if old is not None:
            factors.rows[:, : old.rows.shape[1]] = old.rows
            factors.steps, factors.has_grad = old.steps, old.has_grad
        for slot in new:
            a, b = slot.views(factors.rows[PARAM])
            a_mod, b_mod = slot.wrapper.lora_A[slot.adapter], slot.wrapper.lora_B[slot.adapter]
            a.copy_(_a_experts(a_mod.weight.detach(), slot))
            b.copy_(_b_experts(b_mod.weight.detach(), slot))
            for mod, side in ((a_mod, 0), (b_mod, 1)):
                mod.weight.requires_grad_(False)
                mod.weight.grad = None
                self._on_modules.append(mod.weight)
                loaded: set[str] = set()
                mod._register_state_dict_hook(functools.partial(_state_dict_hook, store=self, layer=layer, slot=slot,
                                                                side=side))
                mod._register_load_state_dict_pre_hook(functools.partial(
                    _load_pre_hook, store=self, layer=layer, slot=slot, side=side, loaded=loaded))
                mod.register_load_state_dict_post_hook(functools.partial(_load_post_hook, loaded=loaded))
        self.layers[layer] = factors
        pending = self._pending.pop(layer, None)
        if pending is not None:
            self._restore(layer, *pending)

    # --- the values peft sees ---
    def weight(self, layer: int, slot: Slot, side: int, like: torch.Tensor) -> torch.Tensor:
        """lora_A (side 0) or lora_B (side 1) of `slot` as peft holds it, from the masters, in `like`'s dtype and on
        its device."""
        a, b = slot.views(self.layers[layer].rows[PARAM])
        E = slot.experts
        flat = a.reshape(E * slot.a_shape[0], slot.a_shape[1]) if side == 0 else \
            b.permute(1, 2, 0).reshape(slot.b_shape[0], slot.b_shape[1] * E)
        return flat.to(like.device, like.dtype, copy=True)

    def write(self, layer: int, slot: Slot, side: int, value: torch.Tensor) -> None:
        """Load lora_A (side 0) or lora_B (side 1) of `slot` into the masters (moments kept, as loading a resident
        parameter leaves its optimizer's state alone)."""
        a, b = slot.views(self.layers[layer].rows[PARAM])
        (a if side == 0 else b).copy_(_a_experts(value, slot) if side == 0 else _b_experts(value, slot))

    # --- gradients and steps (hf_moe_offload/optim/lora_steps.py) ---
    def with_grad(self) -> list[int]:
        return [layer for layer, f in self.layers.items() if f.has_grad]

    def stepped(self, layer: int) -> None:
        """`layer`'s factors were stepped from their gradient: counted, the gradient zeroed."""
        factors = self.layers[layer]
        factors.steps += 1
        factors.rows[GRAD].zero_()
        factors.has_grad = False

    def zero_grad(self) -> None:
        for factors in self.layers.values():
            if factors.has_grad:
                factors.rows[GRAD].zero_()
                factors.has_grad = False

    def reset_optimizer_state(self) -> None:
        """Moments zero and step counts 0, the factors kept: what a new `torch.optim.AdamW` starts from."""
        for factors in self.layers.values():
            factors.rows[[EXP_AVG, EXP_AVG_SQ]] = 0.0
            factors.steps = 0
        self._pending = {layer: (torch.cat([rows[:1], torch.zeros_like(rows[1:])]), 0)
                         for layer, (rows, _) in self._pending.items()}

    # --- checkpoints (offload/checkpoint.py) ---
    def state(self) -> dict[int, tuple[torch.Tensor, int]]:
        """layer -> ((3, P) fp32 [param, exp_avg, exp_avg_sq], step count): the layers adopted and those a resume
        brought that no forward adopted yet."""
        out = dict(self._pending)
        out.update({layer: (f.rows[[PARAM, EXP_AVG, EXP_AVG_SQ]], f.steps) for layer, f in self.layers.items()})
        return out

    def load(self, state: dict[int, tuple[torch.Tensor, int]]) -> None:
        """Restore `state()`: adopted layers now (their sizes checked first), the others at their adoption."""
        for layer, (rows, _) in state.items():
            if layer in self.layers and rows.shape != (3, self.layers[layer].rows.shape[1]):
                raise ValueError(f"the saved LoRA factors of MoE layer {layer} hold {rows.shape[1]} values, the "
                                 f"adapters here {self.layers[layer].rows.shape[1]}: another LoRA config?")
        for layer, (rows, steps) in state.items():
            if layer in self.layers:
                self._restore(layer, rows, steps)
            else:
                self._pending[layer] = (rows.clone(), steps)

    def _restore(self, layer: int, rows: torch.Tensor, steps: int) -> None:
        factors = self.layers[layer]
        if rows.shape != (3, factors.rows.shape[1]):
            raise ValueError(f"the saved LoRA factors of MoE layer {layer} hold {rows.shape[1]} values, the adapters "
                             f"here {factors.rows.shape[1]}: another LoRA config?")
        factors.rows[[PARAM, EXP_AVG, EXP_AVG_SQ]] = rows
        factors.rows[GRAD].zero_()
        factors.steps, factors.has_grad = steps, False


class StoredExpertLora(ExpertLora):
    """The active terms of one layer's call, their factors in the store: no factor is an input of the layer's
    autograd function (`tensors()` is empty); each chunk takes its experts' factors from the masters."""

    def __init__(self, factors: LayerFactors, active: list[tuple[Slot, float, str]], transposed: bool):
        super().__init__({})
        self.factors, self.active, self.transposed = factors, active, transposed

    def tensors(self) -> list[torch.Tensor]:
        return []

    def whole(self) -> ExpertLora:
        """Every expert's terms, fp32 on the host (a merged save forms each expert's W + BA from them)."""
        experts = self.factors.slots[0].experts
        return ExpertLora(self.chunk(list(range(experts)), True, experts, leaves=False).terms)

    def chunk(self, experts: list[int], grouped: bool, num_experts: int, leaves: bool,
              x: torch.Tensor | None = None) -> "StoredChunkLora":
        index = torch.tensor(experts)
        device = x.device if x is not None else torch.device("cpu")
        dtype = compute_dtype(x) if x is not None else torch.float32
        terms: dict[str, list[LoraTerm]] = {}
        for slot, scaling, name in self.active:
            a, b = slot.views(self.factors.rows[PARAM])
            # On the host in the compute dtype first: half the bytes up under bf16.
            a, b = (t.index_select(0, index).to(dtype).to(device) for t in (a, b))
            first, second = (a.transpose(-2, -1), b.transpose(-2, -1)) if self.transposed else (a, b)
            term = LoraTerm.of(first, second, scaling, self.transposed)
            if not grouped:
                term = LoraTerm(term.first[0], term.second[0], scaling, self.transposed)
            if leaves:
                term = LoraTerm(term.first.requires_grad_(True), term.second.requires_grad_(True), scaling,
                                self.transposed)
            terms.setdefault(name, []).append(term)
        order = [(slot, name) for name in terms for slot, _, n in self.active if n == name]
        return StoredChunkLora(terms, index, self.factors, order, self.transposed, grouped)


class StoredChunkLora(ChunkLora):
    """One chunk's terms from the store: its factor blocks' gradients go home into the layer's gradient row."""

    def __init__(self, terms, index: torch.Tensor, factors: LayerFactors, order: list, transposed: bool,
                 grouped: bool):
        super().__init__(terms, index)
        self.factors, self.order, self.transposed, self.grouped = factors, order, transposed, grouped

    def accumulate(self, grads, layer_factors, into) -> None:
        """Add this chunk's factor gradients (`tensors()` order) into the layer's fp32 gradient row, on the host
        (`layer_factors` and `into` are the device path's, unused here)."""
        pairs = list(zip(grads[0::2], grads[1::2]))
        grad_row = self.factors.rows[GRAD]
        for (slot, _), (g_first, g_second) in zip(self.order, pairs):
            a, b = slot.views(grad_row)
            r = slot.a_shape[0]
            for g, dst, is_first in ((g_first, a, True), (g_second, b, False)):
                if g is None:
                    continue
                if not self.grouped:
                    g = g.unsqueeze(0)
                # unpadded, in peft's orientation: A (k, r, in), B (k, out, r)
                if self.transposed:
                    g = g[..., :r].transpose(-2, -1) if is_first else g[:, :r, :].transpose(-2, -1)
                else:
                    g = g[:, :r, :] if is_first else g[..., :r]
                dst.index_add_(0, self.where, g.to("cpu", torch.float32))
        self.factors.has_grad = True


def _slot_of(wrapper: nn.Module, adapter: str) -> Slot:
    a, b = wrapper.lora_A[adapter], wrapper.lora_B[adapter]
    if getattr(b, "bias", None) is not None:
        raise ValueError("OffloadConfig.lora_in_store keeps LoRA matrices only: an adapter with lora_bias=True "
                         "stays with lora_in_store=False")
    if is_stand_in(a.weight):
        raise RuntimeError(f"the LoRA factors of {wrapper.parameter_name} ({adapter}) are in another engine's store")
    E = wrapper.num_experts
    r = a.weight.shape[0] // E
    return Slot(wrapper, adapter, E, (r, a.weight.shape[1]), (b.weight.shape[0], r))


def _a_experts(weight: torch.Tensor, slot: Slot) -> torch.Tensor:
    """lora_A (r*E, in) -> (E, r, in), fp32 on the host (peft's reshape)."""
    return weight.detach().to("cpu", torch.float32).reshape(slot.experts, *slot.a_shape)


def _b_experts(weight: torch.Tensor, slot: Slot) -> torch.Tensor:
    """lora_B (out, r*E) -> (E, out, r), fp32 on the host (peft's reshape and permute)."""
    out, r = slot.b_shape
    return weight.detach().to("cpu", torch.float32).reshape(out, r, slot.experts).permute(2, 0, 1)


def _state_dict_hook(module, state_dict, prefix, local_metadata, store, layer, slot, side):
    state_dict[prefix + "weight"] = store.weight(layer, slot, side, module.weight)
    return state_dict


def _load_pre_hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs, store,
                   layer, slot, side, loaded):
    name = prefix + "weight"
    if name not in state_dict:
        return
    value = state_dict.pop(name)
    expected = ((slot.experts * slot.a_shape[0], slot.a_shape[1]) if side == 0
                else (slot.b_shape[0], slot.b_shape[1] * slot.experts))
    if tuple(value.shape) != expected:
        error_msgs.append(f"size mismatch for {name}: copying {tuple(value.shape)}, the adapter has {expected}")
        return
    store.write(layer, slot, side, value)
    loaded.add(name)


def _load_post_hook(module, incompatible_keys, loaded: set[str]) -> None:
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in loaded]
    loaded.clear()


__all__ = ["LayerFactors", "LoraStore", "Slot", "StoredChunkLora", "StoredExpertLora"]
