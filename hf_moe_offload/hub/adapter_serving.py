"""A LoRA adapter as a serving engine loads it: the expert layout it reads for the family, and the scaling it applies.

Rules read from the loaders' code (not run here: neither server installs on these machines): vLLM main at
7ca49fbe (2026-08-22, about the v0.29 line: `vllm/lora/{peft_helper,lora_model,model_manager,lora_weights}.py`) and
SGLang main at 18e6c61c (2026-08-06: `python/sglang/srt/lora/{lora,lora_config,mem_pool,utils}.py`).

- **Layout.** vLLM builds per-expert LoRA modules (`experts.{e}.gate_proj`, ...) for models whose experts are stored
  per expert on the Hub, and loads only peft's fused layout (`experts.base_layer.lora_*` = gate_up, `experts.lora_*` =
  down) for the models it marks `is_3d_moe_weight` (gpt-oss among ours). SGLang loads per-expert (or its own stacked)
  names for every family and drops peft's `base_layer` keys; it renames Mixtral's `w1`/`w3`/`w2` to
  `gate_proj`/`up_proj`/`down_proj`, which are its names.
- **Scaling.** Both multiply every module's `lora_B @ lora_A` by the global `lora_alpha / r`; neither reads
  `rank_pattern` or `alpha_pattern`, SGLang ignores `use_rslora`, and vLLM ignores it on per-expert experts (up to
  the version read). `fold_scaling` moves each module's difference from that scaling into its lora_B and pads every
  module to the adapter's largest rank (zero rows of lora_A, zero columns of lora_B: the product is unchanged), so
  that `lora_alpha / r * B @ A` is peft's delta of every module under any of these rules.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

import torch
from torch import nn

from .adapter_export import (PEFT_PREFIX, BaseModel, _base_config, _check_out_dir, _meta_model, _meta_peft_model,
                             _per_expert_layout, _read_adapter, _write_adapter, relayout_fused, relayout_per_expert)
from ..errors import UserError

logger = logging.getLogger(__name__)

SERVERS = ("vllm", "sglang")
LAYOUTS = ("per-expert", "fused")
LOADERS = {"vllm": "vLLM main 7ca49fbe (2026-08-22, about v0.29)", "sglang": "SGLang main 18e6c61c (2026-08-06)"}
# Model types vLLM marks `is_3d_moe_weight = True` (models/gpt_oss.py, qwen3_5.py, qwen3_vl_moe.py): their expert
# LoRA is loaded only in peft's fused layout, gate/up rows as the base weight orders them.
VLLM_FUSED_EXPERT_LORA = ("gpt_oss", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_vl_moe", "qwen3_vl_moe_text")
SGLANG_LEAVES = ("gate_proj", "up_proj", "down_proj")  # SGLang's per-expert names, whatever the family's


@dataclass(frozen=True)
class ServedAdapter:
    """What `export_adapter` wrote: the folder, the layout, why that layout, and the modules whose lora_B took their
    scaling's difference from the server's."""

    out_dir: str
    server: str
    layout: str
    reason: str
    folded: tuple[str, ...]


def served_layout(model_type: str, server: str) -> tuple[str, str]:
    """(the expert layout `server` loads for `model_type`, why)."""
    if server == "vllm":
        if model_type in VLLM_FUSED_EXPERT_LORA:
            return "fused", (f"vLLM loads expert LoRA on {model_type} only in peft's fused layout "
                             "(is_3d_moe_weight) and refuses per-expert keys at load")
        return "per-expert", (f"vLLM builds one LoRA module per expert and projection on {model_type} and fails on "
                              "peft's fused keys when the adapter is activated")
    if server == "sglang":
        return "per-expert", ("SGLang loads per-expert expert LoRA (gate_proj/up_proj/down_proj) for every family "
                              "and drops peft's fused experts.base_layer keys")
    raise UserError(f"unknown server {server!r}; choose one of {', '.join(SERVERS)}")


def sglang_leaf_names(model: nn.Module) -> dict[str, str]:
    """The family's per-expert leaf names -> SGLang's: a gate/up tensor's two modules in row order (gate first), a
    down tensor's one."""
    leaves = {}
    for modules in _per_expert_layout(model).values():
        if isinstance(modules, UserError):
            continue
        names = list(dict.fromkeys(m.name.rsplit(".", 1)[-1] for m in modules if m.expert == 0))
        targets = SGLANG_LEAVES[:2] if len(names) == 2 else SGLANG_LEAVES[2:]
        leaves.update(zip(names, targets))
    return leaves


def sglang_names(model: nn.Module, tensors: dict[str, torch.Tensor], back: bool = False) -> dict[str, torch.Tensor]:
    """Per-expert keys renamed to SGLang's leaf names (Mixtral's w1 / w3 / w2 -> gate_proj / up_proj / down_proj), or
    `back` to the family's Hub names."""
    leaves = sglang_leaf_names(model)
    if back:
        leaves = {v: k for k, v in leaves.items()}
    out = {}
    for key, value in tensors.items():
        module, _, suffix = key.rpartition(".lora_")
        owner, _, leaf = module.rpartition(".")
        if ".experts." in module and owner.rpartition(".")[2].isdigit() and leaf in leaves:
            key = f"{owner}.{leaves[leaf]}.lora_{suffix}"
        out[key] = value
    return out


def fold_scaling(model: nn.Module, config: dict, tensors: dict[str, torch.Tensor],
                 folder: str) -> tuple[dict, dict[str, torch.Tensor], list[str]]:
    """(config, tensors, folded modules): the peft adapter with every module's scaling folded into its lora_B and its
    rank padded to the largest, so that the global `lora_alpha / r` of the new config times `B @ A` is peft's delta of
    each module (peft's own `scaling` and `r` per module, from its model over the meta base `model`).

    lora_B's new values are computed in float64 and rounded once to lora_B's dtype: each element is the exact
    product rounded once (relative error at most 2^-24 in fp32, 2^-8 in bf16, 2^-11 in fp16); a module whose scaling
    already is the server's keeps lora_B bit for bit. Padding adds zero rows / columns, exact."""
    peft_model = _meta_peft_model(model, config)
    adapter = "default"
    modules = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "scaling") and adapter in module.scaling:
            modules[name] = (float(module.scaling[adapter]), int(module.r[adapter]),
                             int(getattr(module, "num_experts", 1) or 1))
    if not modules:
        raise UserError(f"{folder}'s adapter has no LoRA module on the base model: nothing to serve")
    rank = max(r for _, r, _ in modules.values())
    alpha = config["lora_alpha"]
    server_scaling = alpha / rank
    out = dict(tensors)
    folded = []
    for name, (scaling, r, experts) in modules.items():
        keys = [(f"{name}.lora_A.weight", f"{name}.lora_B.weight"),
                (f"{name}.lora_embedding_A", f"{name}.lora_embedding_B")]
        found = [(a, b) for a, b in keys if a in tensors and b in tensors]
        if not found:
            continue
        key_a, key_b = found[0]
        a, b = tensors[key_a], tensors[key_b]
        if a.shape[0] != r * experts or b.shape[1] != r * experts:
            raise UserError(f"{folder}: {key_a} {tuple(a.shape)} / {key_b} {tuple(b.shape)} do not hold rank {r} for "
                            f"{experts} expert(s): the adapter was saved for another base model or config")
        ratio = scaling / server_scaling
        if ratio != 1.0:
            b = (b.double() * ratio).to(b.dtype)
            folded.append(name.removeprefix(PEFT_PREFIX))
        if r != rank:
            # peft's fused factors: lora_A rows expert-major (E, r, in), lora_B columns expert-minor (out, r, E).
            a_e = a.reshape(experts, r, a.shape[1])
            b_e = b.reshape(b.shape[0], r, experts)
            a = torch.cat([a_e, a_e.new_zeros(experts, rank - r, a.shape[1])], 1).reshape(experts * rank, -1)
            b = torch.cat([b_e, b_e.new_zeros(b.shape[0], rank - r, experts)], 1).reshape(b.shape[0], -1)
        out[key_a], out[key_b] = a, b
    new = dict(config)
    new.update(r=rank, lora_alpha=alpha, use_rslora=False, rank_pattern={}, alpha_pattern={})
    return new, out, folded


def export_adapter(adapter_dir: str, out_dir: str, server: str = "vllm", layout: str | None = None,
                   base_model: BaseModel = None) -> ServedAdapter:
    """Write the peft adapter in `adapter_dir` (fused or per-expert experts) to `out_dir` as `server` loads it: the
    layout it reads for the family (`layout` to insist on one; refused, with the reason, where the server does not
    load it), its names, and every module's scaling folded into lora_B (`fold_scaling`), rank and alpha patterns and
    rsLoRA removed from the config. `server="peft"`: the layout asked (default fused, for training again), scaling as
    saved. Written atomically."""
    _check_out_dir(adapter_dir, out_dir)
    config, tensors, _ = _read_adapter(adapter_dir)
    model = _meta_model(_base_config(config, base_model, adapter_dir), config.get("task_type"))
    family = getattr(model.config, "model_type", type(model).__name__)
    if server == "peft":
        layout, reason = layout or "fused", "peft loads either layout; scaling and patterns kept as trained"
    else:
        wanted, reason = served_layout(family, server)
        if layout is not None and layout != wanted:
            other = next(s for s in SERVERS if s != server)
            alt = (f" ({other} loads {layout} here)" if served_layout(family, other)[0] == layout else "")
            raise UserError(f"{server} does not load the {layout} expert layout for {family}: {reason}; pass --layout "
                            f"{wanted} (or leave --layout out){alt}, or --server peft for peft's own layouts")
        layout = wanted
    experts = bool(config.get("target_parameters")) or any(".experts." in k for k in tensors)
    if not experts:
        layout, reason = "no expert", "the adapter has no LoRA on the experts (its other modules keep their names)"
    elif not config.get("target_parameters"):  # a per-expert adapter, under the Hub's or SGLang's names
        config, tensors = relayout_fused(model, config, sglang_names(model, tensors, back=True), adapter_dir)
    folded: list[str] = []
    if server != "peft":
        config, tensors, folded = fold_scaling(model, config, tensors, adapter_dir)
    if layout == "per-expert":
        config, tensors = relayout_per_expert(model, config, tensors, adapter_dir)
        if server == "sglang":
            tensors = sglang_names(model, tensors)
            config["target_modules"] = sorted({k.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in tensors})
    _write_adapter(out_dir, config, tensors, layout, adapter_dir)
    message = f"wrote {out_dir}: the {layout} layout for {server}, because {reason}"
    if folded:
        message += (f"; the scaling of {len(folded)} module(s) (rank/alpha patterns, rsLoRA) folded into lora_B for "
                    f"the global lora_alpha/r = {config['lora_alpha']}/{config['r']}")
    logger.info(message)
    return ServedAdapter(_check_out_dir(adapter_dir, out_dir), server, layout, reason, tuple(folded))


def export_per_expert_adapter(adapter_dir: str, out_dir: str, base_model: BaseModel = None) -> str:
    """Write the peft adapter in `adapter_dir` (LoRA on fused experts, `target_parameters`) to `out_dir` with one
    lora_A / lora_B per expert and projection, under the family's per-expert Hub names, every module's scaling folded
    into lora_B (`fold_scaling`). Whatever the family: `export_adapter` picks the layout a server loads (vLLM wants
    gpt-oss fused). Returns `out_dir`."""
    _check_out_dir(adapter_dir, out_dir)
    config, tensors, _ = _read_adapter(adapter_dir)
    model = _meta_model(_base_config(config, base_model, adapter_dir), config.get("task_type"))
    if not config.get("target_parameters"):
        raise UserError(f"{adapter_dir}'s adapter has no LoRA on expert tensors (its target_parameters is empty): it "
                        "is already in the per-module layout servers load; serve it as it is")
    config, tensors, _ = fold_scaling(model, config, tensors, adapter_dir)
    config, tensors = relayout_per_expert(model, config, tensors, adapter_dir)
    _write_adapter(out_dir, config, tensors, "per-expert", adapter_dir)
    return out_dir


# --- command line ---
def _run_cli(args: argparse.Namespace) -> None:
    done = export_adapter(args.adapter_dir, args.out_dir, server=args.server, layout=args.layout,
                          base_model=args.base_model)
    print(f"wrote the {done.layout} layout for {done.server}: {done.reason}")
    if done.folded:
        print(f"folded the scaling of {len(done.folded)} module(s) into lora_B (rank/alpha patterns, rsLoRA), so the "
              "server's global lora_alpha / r gives the trained delta")
    print(done.out_dir)


def add_cli(sub) -> None:
    """`hf-moe-offload export-adapter ADAPTER_DIR OUT_DIR [--server vllm|sglang|peft] [--layout per-expert|fused]`."""
    p = sub.add_parser("export-adapter", help="write a LoRA adapter on the experts as a server loads it (vLLM, SGLang: "
                                              "layout, names, scaling) or as peft trains it")
    p.add_argument("adapter_dir", help="a saved peft adapter folder (adapter_config.json, adapter_model.safetensors)")
    p.add_argument("out_dir", help="where to write the adapter (a new folder, or an earlier adapter's)")
    p.add_argument("--server", choices=(*SERVERS, "peft"), default="vllm",
                   help="the server that loads it: the layout it reads for the family, its names, its scaling "
                        "(lora_alpha / r) folded in; peft: the layout asked, as trained")
    p.add_argument("--layout", choices=LAYOUTS, default=None,
                   help="per-expert: one LoRA per expert and projection; fused: peft's LoRA on the fused expert "
                        "tensors (default: the server's; refused where the server does not load it)")
    p.add_argument("--base-model", default=None,
                   help="the base model's folder or Hub id (default: the adapter's base_model_name_or_path)")
    p.set_defaults(func=_run_cli)


__all__ = ["LOADERS", "SERVERS", "ServedAdapter", "export_adapter", "export_per_expert_adapter", "fold_scaling",
           "served_layout", "sglang_leaf_names", "sglang_names"]
