"""What fine-tuning asks of the routers, for every MoE family: freeze them, and keep the load-balancing loss on.

The router of a MoE layer is found next to its experts module (the one entry of hf_moe_offload.families.moe_path): the sibling
module named `gate` (Qwen, Mixtral, OLMoE, DeepSeek, GLM, ...) or `router` (gpt-oss, Granite, Jamba, MoE-GPT, ...).

transformers' MoE causal LMs add `router_aux_loss_coef * load_balancing_loss` to the loss only when
`output_router_logits` is on, which is off by default, so a fine-tune that sets a coefficient silently trains
without it (transformers#44242). `keep_load_balancing_loss` turns it on whenever the coefficient is non-zero.
"""

from __future__ import annotations

import logging

from torch import nn

from .moe_path import find_experts_modules

logger = logging.getLogger(__name__)

ROUTER_NAMES = ("gate", "router")


def router_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, router) of every MoE layer, in forward order; an error names a layer whose router is not found."""
    model = getattr(model, "module", model)
    out = []
    for name, _experts in find_experts_modules(model):
        parent_name = name.rpartition(".")[0]
        parent = model.get_submodule(parent_name)
        found = [(n, m) for n, m in parent.named_children() if n in ROUTER_NAMES]
        if len(found) != 1:
            raise ValueError(f"MoE layer {parent_name or type(model).__name__}: expected one router module named "
                             f"{' or '.join(ROUTER_NAMES)} next to its experts, found {[n for n, _ in found]}")
        child, module = found[0]
        out.append((f"{parent_name}.{child}" if parent_name else child, module))
    return out


def freeze_routers(model: nn.Module) -> list[str]:
    """Stop training every router (gating weights and biases): `requires_grad=False`. Returns the frozen parameter
    names. Routing then stays what the checkpoint learned, a common choice when fine-tuning on little data."""
    names = []
    for prefix, router in router_modules(model):
        for n, p in router.named_parameters():
            p.requires_grad_(False)
            names.append(f"{prefix}.{n}")
    logger.info("froze %d router parameters in %d MoE layers", len(names), len(router_modules(model)))
    return names


def _moe_configs(model: nn.Module) -> list:
    """The model's config and its sub-configs (a composite model's text config holds the MoE fields)."""
    config = getattr(getattr(model, "module", model), "config", None)
    if config is None:
        return []
    subs = [getattr(config, k, None) for k in getattr(config, "sub_configs", {}) or {}]
    return [config, *(s for s in subs if s is not None)]


def keep_load_balancing_loss(model: nn.Module) -> bool:
    """Make the loss include the load-balancing term whenever its coefficient is non-zero (`output_router_logits`
    on). Returns whether anything was switched on."""
    switched = False
    for config in _moe_configs(model):
        coef = getattr(config, "router_aux_loss_coef", 0.0) or 0.0
        if coef and getattr(config, "output_router_logits", None) is False:
            config.output_router_logits = True
            switched = True
            logger.info("%s: router_aux_loss_coef=%g, so the load-balancing loss is added to the training loss "
                        "(output_router_logits turned on)", config.model_type, coef)
    return switched


__all__ = ["ROUTER_NAMES", "freeze_routers", "keep_load_balancing_loss", "router_modules"]
