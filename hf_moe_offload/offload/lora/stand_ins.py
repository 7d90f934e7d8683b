"""What a frozen offloaded expert tensor leaves on its module: a stand-in with its shape, dtype and device, no values.

peft's `target_parameters` LoRA finds the tensors it adapts among a module's `nn.Parameter`s, sizes its adapters by
their shape and puts them on their device in their dtype, and during its forward registers a parametrization on them
(`W + scaling * lhs @ rhs`, evaluated once to check it). Frozen experts in the weights-only store (LoRA's case:
`OffloadConfig(train_experts=False)`) therefore keep an `ExpertStandIn` under each tensor's name, a frozen parameter
whose storage is one element: every computation on it runs on the meta device (shapes and dtypes only) and gives
another stand-in, so peft's parametrization costs nothing; writing into it is an error (its values are in the store);
moving it (`model.to(...)`, `.cuda()`, `.half()`) gives a stand-in on the new device or in the new dtype. The
streamed layer applies the adapters itself (hf_moe_offload/offload/lora/expert_lora.py). `state_dict()` shows the stored
experts under the same names (offload/api.py), never the stand-ins.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

# Methods that only read metadata: they run on the stand-in itself.
_METADATA = {
    torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.element_size, torch.Tensor.stride,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.requires_grad_, torch.Tensor.__format__,
    torch.Tensor.__reduce_ex__, torch.Tensor.is_contiguous, torch.Tensor.storage_offset, torch.Tensor.data_ptr,
    torch.Tensor.untyped_storage, torch.Tensor.get_device, torch.Tensor.__hash__, torch.Tensor.__len__,
}
# Moves: a stand-in on the new device / in the new dtype.
_MOVES = {torch.Tensor.to: None, torch.Tensor.cuda: "cuda", torch.Tensor.cpu: "cpu", torch.Tensor.float: torch.float32,
          torch.Tensor.half: torch.float16, torch.Tensor.bfloat16: torch.bfloat16, torch.Tensor.double: torch.float64}


class ExpertStandIn(torch.Tensor):
    """A frozen offloaded expert tensor's place on its module (module docstring)."""

    @staticmethod
    def __new__(cls, shape, dtype: torch.dtype, device) -> "ExpertStandIn":
        one = torch.zeros((), dtype=dtype, device=device)
        return torch.Tensor._make_subclass(cls, one.expand(tuple(shape)), False)

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"ExpertStandIn(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}: in the expert store)"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, ExpertStandIn))
        name = getattr(func, "__name__", "")
        reads_data = name == "__get__" and getattr(func, "__self__", None) is torch.Tensor.data
        if func in _METADATA or (name == "__get__" and not reads_data) or name == "__set__":
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if reads_data or func is torch.Tensor.detach:
            return ExpertStandIn(self.shape, self.dtype, self.device)
        if func is torch.Tensor.__deepcopy__:
            return stand_in_parameter(self.shape, self.dtype, self.device, self.requires_grad)
        if func in _MOVES:
            return _moved(self, _MOVES[func], args[1:], kwargs)
        if (name.endswith("_") and not name.startswith("__")) or name.startswith("__i") or name == "__setitem__":
            raise RuntimeError(
                f"{name} writes into an offloaded expert tensor, whose values live in the expert store (peft's merge "
                "cannot fold an adapter into offloaded experts: save the adapter, or disable_expert_offload(model) "
                "first)")
        return _on_meta(func, args, kwargs, self.device)


def _moved(self: ExpertStandIn, target, args, kwargs) -> ExpertStandIn:
    device, dtype = self.device, self.dtype
    if isinstance(target, torch.dtype):
        dtype = target
    elif target == "cpu":
        device = torch.device("cpu")
    elif target == "cuda":
        device = torch.device("cuda", args[0]) if args and isinstance(args[0], int) else torch.device(
            kwargs.get("device") or "cuda")
    else:  # Tensor.to(device=None, dtype=None, ...) in any of its forms
        to_device, to_dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        device, dtype = to_device or device, to_dtype or dtype
    return ExpertStandIn(self.shape, dtype, device)


def _on_meta(func, args, kwargs, device):
    """Any other computation: run on meta tensors of the same shapes and dtypes; meta results become stand-ins."""
    def to_meta(t):
        if isinstance(t, torch.Tensor):
            with torch._C.DisableTorchFunctionSubclass():
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return t

    with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
        out = func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
    return tree_map(lambda t: ExpertStandIn(t.shape, t.dtype, device)
                    if isinstance(t, torch.Tensor) and t.device.type == "meta" else t, out)


def stand_in_parameter(shape, dtype: torch.dtype, device, requires_grad: bool = False) -> nn.Parameter:
    """A frozen `nn.Parameter` that is an `ExpertStandIn`."""
    return nn.Parameter(ExpertStandIn(shape, dtype, device), requires_grad=requires_grad)


def is_stand_in(t) -> bool:
    return isinstance(t, ExpertStandIn)


def keep_stand_ins_out_of_ddp(model: nn.Module) -> list[str]:
    """Tell DDP to leave the stand-ins of `model` (the module it will wrap) alone: at its start DDP broadcasts every
    parameter into place, which a stand-in of one element cannot take. `OffloadTrainer` calls this; a custom loop
    calls it on the model it hands to `accelerator.prepare` / `DistributedDataParallel`. Returns their names."""
    names = [name for name, p in model.named_parameters() if is_stand_in(p)]
    if names:
        from torch.nn.parallel import DistributedDataParallel

        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    return names


__all__ = ["ExpertStandIn", "is_stand_in", "keep_stand_ins_out_of_ddp", "stand_in_parameter"]
