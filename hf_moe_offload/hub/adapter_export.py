"""peft LoRA on fused experts <-> one LoRA per expert and projection (which one a server loads: adapter_serving.py).

peft's `LoraConfig(target_parameters=[...])` trains one `ParamWrapper` per fused (E, ...) expert tensor
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`); several tensors of one experts module nest, the first in the
module's parameter order innermost (saved as `experts.base_layer.lora_A.weight`, the next as `experts.lora_A.weight`).
Each wrapper holds every expert's factors in one pair of matrices (peft 0.21, `ParamWrapper.get_delta_factors`):

    lora_A.weight  (r*E, in)   expert e's A_e = rows e*r .. e*r+r-1           (reshape (E, r, in))
    lora_B.weight  (out, r*E)  expert e's B_e = columns e, E+e, 2E+e, ...     (reshape (out, r, E))

and expert e's weight changes by `scaling * B_e @ A_e`, an (out, in) matrix in `nn.Linear`'s orientation (the
weight's own for tensors stored (E, out, in); its transpose for gpt-oss's (E, in, out)). Serving engines load MoE
LoRA per expert module for most families (`...mlp.experts.3.gate_proj.lora_A.weight`, Mixtral's
`...block_sparse_moe.experts.3.w1.lora_A.weight`), the names of the family's per-expert Hub checkpoint.

The export is a re-indexing: per expert and Hub module, lora_A = A_e and lora_B = the rows of B_e that are that
module's rows of the fused tensor, so `scaling * B @ A` is exactly the rows of the fused delta (no product is
formed, no SVD). A fused gate/up tensor's gate and up rows share A_e. Which rows go where is transformers' own rule:
the fused tensor's reverse checkpoint conversion (`revert_weight_conversion`, what `save_pretrained` runs) is applied
to a tensor of row numbers, so each per-expert key receives the numbers of its rows (Mixtral's `block_sparse_moe`
renaming and gate-before-up concatenation included). gpt-oss keeps its experts fused on the Hub; its gate and up rows
interleave (`GptOssExperts._apply_gate`: gate = even rows, up = odd), and its per-expert names are those vLLM's
gpt-oss model gives its experts (`gate_proj`, `up_proj`, `down_proj`). The import scatters the rows back, bit for bit.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Union

import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import UserError
from ..offload.stores.safetensors_io import fsync_directory, write_safetensors_streaming

if TYPE_CHECKING:
    from peft import LoraConfig
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

BaseModel = Union[str, os.PathLike, "PretrainedConfig", None]  # a folder or Hub id holding config.json, or a config

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
LAYOUT_METADATA_KEY = "hf_moe_offload.adapter_layout"

# Families whose Hub checkpoints keep the experts fused (no per-expert conversion in transformers): for each fused
# tensor, its per-expert modules as (name, first row, row step) of the rows of the (out, in) delta.
FUSED_ON_THE_HUB = {
    "gpt_oss": {"gate_up_proj": (("gate_proj", 0, 2), ("up_proj", 1, 2)), "down_proj": (("down_proj", 0, 1),)},
}


@dataclass(frozen=True)
class ExpertModule:
    """One expert's share of a fused expert tensor: a module of the per-expert layout and its rows of the expert's
    (out, in) delta."""

    name: str  # e.g. "model.layers.0.mlp.experts.3.gate_proj" (the Hub key without ".weight")
    expert: int
    rows: torch.Tensor  # (n,) int64 row numbers of the expert's delta


@dataclass
class FusedExpertLora:
    """One peft `ParamWrapper`: the LoRA of one fused expert tensor."""

    prefix: str  # adapter key prefix, e.g. "base_model.model.model.layers.0.mlp.experts.base_layer"
    tensor: str  # the model's tensor, e.g. "model.layers.0.mlp.experts.gate_up_proj"
    num_experts: int
    rank: int
    in_features: int
    out_features: int
    modules: list[ExpertModule]

    @property
    def keys(self) -> tuple[str, str]:
        return f"{self.prefix}.lora_A.weight", f"{self.prefix}.lora_B.weight"


# --- reading ---
def _read_adapter(folder: str) -> tuple[dict, dict[str, torch.Tensor], dict[str, str]]:
    """(adapter_config.json as a dict, the tensors, the safetensors metadata) of a saved peft adapter folder."""
    from safetensors import safe_open

    if not os.path.isdir(folder):
        raise UserError(f"{folder} is not a folder: pass the folder a peft adapter was saved to (it holds "
                        f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    missing = [n for n in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        raise UserError(f"{folder} is not a saved peft adapter: it lacks {', '.join(missing)} (save the adapter with "
                        "model.save_pretrained(folder) on the peft model, safe_serialization on)")
    try:
        with open(os.path.join(folder, ADAPTER_CONFIG)) as f:
            config = json.load(f)
    except ValueError as err:
        raise UserError(f"{os.path.join(folder, ADAPTER_CONFIG)} is not valid JSON ({err}); re-save the "
                        "adapter") from err
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise UserError(f"{folder} holds a {config.get('peft_type')!r} adapter; only LoRA adapters can be re-laid out")
    try:
        with safe_open(os.path.join(folder, ADAPTER_WEIGHTS), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            metadata = dict(f.metadata() or {})
    except Exception as err:  # noqa: BLE001 (safetensors raises its own error types for a corrupt file)
        raise UserError(f"{os.path.join(folder, ADAPTER_WEIGHTS)} cannot be read ({err}); re-save the adapter") from err
    return config, tensors, metadata


def _base_config(adapter_config: dict, base_model: BaseModel, folder: str) -> "PretrainedConfig":
    """The base model's transformers config: `base_model` (a config, or a folder or Hub id holding config.json), else
    the adapter's `base_model_name_or_path`."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(base_model, PretrainedConfig):
        return base_model
    source = base_model or adapter_config.get("base_model_name_or_path")
    if not source:
        raise UserError(f"{folder}'s adapter does not name its base model (base_model_name_or_path is empty): pass "
                        "the base model's folder or Hub id (base_model=..., --base-model)")
    try:
        return AutoConfig.from_pretrained(str(source))
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read the base model's config from {source!r} ({str(err).splitlines()[0]}); pass the "
                        "base model's folder or Hub id (base_model=..., --base-model)") from err


def _meta_model(base_config, task_type: str | None) -> nn.Module:
    """The base model on the meta device (no memory): its names, shapes and conversion rules."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    classes = {None: AutoModelForCausalLM, "CAUSAL_LM": AutoModelForCausalLM,
               "SEQ_CLS": AutoModelForSequenceClassification}
    if task_type not in classes:
        raise UserError(f"adapters of task_type {task_type!r} are not supported; supported: CAUSAL_LM, SEQ_CLS")
    with torch.device("meta"):
        return classes[task_type].from_config(base_config)


def _lora_config(config: dict) -> "LoraConfig":
    from peft import LoraConfig

    fields = set(LoraConfig.__dataclass_fields__)
    return LoraConfig(**{k: v for k, v in config.items() if k in fields})


# --- which rows of a fused expert tensor belong to which per-expert module ---
@cache
def _per_expert_families() -> tuple[str, ...]:
    """Model types whose Hub checkpoints transformers fuses expert by expert, and the fused-on-the-Hub ones."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import MergeModulelist, WeightConverter
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    found = set(FUSED_ON_THE_HUB)
    for model_type in CONFIG_MAPPING_NAMES:
        try:
            mapping = get_checkpoint_conversion_mapping(model_type) or []
        except Exception:  # noqa: BLE001 (a model type transformers cannot describe is simply not listed)
            continue
        if any(isinstance(t, WeightConverter) and any(isinstance(op, MergeModulelist) for op in t.operations)
               and any("experts" in p for p in t.target_patterns) for t in mapping):
            found.add(model_type)
    return tuple(sorted(found))


def _unsupported(model: nn.Module, tensor: str, why: str) -> UserError:
    family = getattr(model.config, "model_type", type(model).__name__)
    families = _per_expert_families()
    return UserError(f"no per-expert layout for {family!r} ({tensor}: {why}); supported are the families whose Hub "
                     f"checkpoints hold one tensor per expert in transformers' conversion_mapping and gpt_oss: "
                     f"{', '.join(families)}")


def expert_modules(model: nn.Module, tensor: str, transposed: bool) -> list[ExpertModule]:
    """The per-expert modules of the model's fused expert `tensor` (a full state-dict name) and their rows of each
    expert's (out, in) delta, in expert order: transformers' reverse checkpoint conversion applied to row numbers."""
    from transformers.core_model_loading import revert_weight_conversion

    family = getattr(model.config, "model_type", None)
    param = model.get_parameter(tensor)
    num_experts = param.shape[0]
    out = param.shape[2] if transposed else param.shape[1]
    owner, _, attr = tensor.rpartition(".")
    if family in FUSED_ON_THE_HUB:
        if attr not in FUSED_ON_THE_HUB[family]:
            raise _unsupported(model, tensor, f"{family}'s per-expert names cover {sorted(FUSED_ON_THE_HUB[family])}")
        return [ExpertModule(f"{owner}.{e}.{name}", e, torch.arange(start, out, step))
                for e in range(num_experts) for name, start, step in FUSED_ON_THE_HUB[family][attr]]
    if transposed:
        raise _unsupported(model, tensor, "its experts are stored (E, in, out)")
    # Row numbers in the weight's own (E, out, in) orientation, its input width collapsed to 1: every op of the
    # conversion (merging experts, concatenating gate and up) moves whole rows, so each per-expert key receives the
    # numbers of the fused rows it is made of.
    codes = torch.arange(num_experts * out, dtype=torch.int64).reshape(num_experts, out, 1)
    reverted = revert_weight_conversion(model, {tensor: codes})
    if list(reverted) == [tensor]:
        raise _unsupported(model, tensor, "transformers keeps it fused in the Hub checkpoint")
    modules = []
    for key, value in reverted.items():
        if not key.endswith(".weight") or value.dim() != 2 or value.shape[1] != 1:
            raise _unsupported(model, tensor, f"its checkpoint conversion gives {key} {tuple(value.shape)}")
        experts = (value[:, 0] // out).unique()
        if experts.numel() != 1:
            raise _unsupported(model, tensor, f"the checkpoint key {key} mixes experts")
        modules.append(ExpertModule(key.removesuffix(".weight"), int(experts), value[:, 0] % out))
    for e in range(num_experts):  # every row of every expert exactly once
        rows = torch.cat([m.rows for m in modules if m.expert == e]) if modules else torch.empty(0)
        if rows.numel() != out or not torch.equal(rows.sort().values, torch.arange(out)):
            raise _unsupported(model, tensor, f"its checkpoint conversion does not split expert {e}'s rows")
    return sorted(modules, key=lambda m: m.expert)


def _per_expert_layout(model: nn.Module) -> dict[str, list[ExpertModule] | UserError]:
    """Every expert matrix of the (unwrapped) model -> its per-expert modules, or the error saying why it has none."""
    from ..families.moe_path import experts_layers

    layout: dict[str, list[ExpertModule] | UserError] = {}
    for name, module, tensors in experts_layers(model):
        for t in tensors.tensors:
            if t.decay:
                tensor = f"{name}.{t.name}"
                try:
                    layout[tensor] = expert_modules(model, tensor, bool(getattr(module, "is_transposed", False)))
                except UserError as err:
                    layout[tensor] = err
    return layout


def _fused_expert_loras(peft_model: nn.Module, layout: dict) -> list[FusedExpertLora]:
    """Every peft `ParamWrapper` of the (meta) peft model, with its per-expert modules (`layout`)."""
    found = []
    for name, wrapper in peft_model.named_modules():
        if not (hasattr(wrapper, "parameter_name") and hasattr(wrapper, "get_delta_factors")):
            continue
        owner = name.removeprefix(PEFT_PREFIX).replace(".base_layer", "")
        tensor = f"{owner}.{wrapper.parameter_name}"
        modules = layout.get(tensor)
        if modules is None:
            raise UserError(f"LoRA on {tensor}: only the (E, ...) expert matrices of transformers' experts modules "
                            "can be laid out per expert (not their biases, nor other tensors)")
        if isinstance(modules, UserError):
            raise modules
        adapter = wrapper.active_adapters[0]
        a, b = wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight
        found.append(FusedExpertLora(name, tensor, wrapper.num_experts, wrapper.r[adapter], a.shape[1], b.shape[0],
                                     modules))
    return found


def _meta_peft_model(model: nn.Module, config: dict) -> nn.Module:
    """peft's model of the adapter `config` over the meta `model`: where peft puts each LoRA tensor, its shapes."""
    from peft import get_peft_model

    from ..quiet import peft_wrapping

    with torch.device("meta"), peft_wrapping():  # on a copy: peft wraps the model's modules in place
        return get_peft_model(copy.deepcopy(model), _lora_config(config))


def _check_modules(peft_model: nn.Module, keys, folder: str) -> None:
    """Every LoRA tensor among `keys` belongs to a LoRA module of `peft_model` (else the adapter is another model's)."""
    modules = {name for name, module in peft_model.named_modules() if hasattr(module, "lora_A")}
    for key in keys:
        if ".lora_" in key and key.rsplit(".lora_", 1)[0] not in modules:
            raise UserError(f"{folder} holds {key}, which no LoRA module of the base model has: the adapter was "
                            "saved for another base model (pass the right one with base_model=..., --base-model)")


OLD_TRANSPOSED = ("in the layout peft <= 0.19.0 saved for fused experts (in and out swapped); load the adapter with "
                  "the peft version that saved it and save it again with peft >= 0.19.1, which writes lora_A "
                  "(E*r, in) and lora_B (out, E*r)")


def is_old_transposed(a_shape, b_shape, in_features: int, out_features: int) -> bool:
    """Fused-expert factors of shapes `a_shape`, `b_shape` are peft <= 0.19.0's (lora_A (E*r, out), lora_B (in, E*r))
    where the tensor's (out, in) differ, so that the two layouts cannot be told apart otherwise."""
    return (in_features != out_features and len(a_shape) == 2 and len(b_shape) == 2
            and a_shape[1] == out_features and b_shape[0] == in_features and a_shape[0] == b_shape[1])


def _leaf_modules(keys) -> list[str]:
    """The last name of every module that has LoRA factors among `keys`."""
    return sorted({k.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in keys if ".lora_" in k})


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...], folder: str) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise UserError(f"{folder}: {name} is {tuple(tensor.shape)}, the base model wants {tuple(shape)}: the adapter "
                        "was saved for another base model (pass the right one with base_model=..., --base-model)")


# --- export: fused -> per expert ---
def relayout_per_expert(model: nn.Module, config: dict, tensors: dict[str, torch.Tensor],
                        folder: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of the peft adapter (`config`, `tensors`: LoRA on fused experts, `target_parameters`) over the
    meta base `model` with one lora_A / lora_B per expert and projection, under the family's per-expert Hub names.

    Expert e's `scaling * lora_B @ lora_A` of each per-expert module equals the rows of the fused adapter's delta for
    e exactly (the factors are sliced, nothing is computed); gate and up of a fused gate/up tensor share lora_A. Other
    LoRA tensors (attention) are copied unchanged. `folder` names the adapter in errors."""
    if not config.get("target_parameters"):
        raise UserError(f"{folder}'s adapter has no LoRA on expert tensors (its target_parameters is empty): it "
                        "is already in the per-module layout servers load; serve it as it is")
    layout = _per_expert_layout(model)
    peft_model = _meta_peft_model(model, config)
    _check_modules(peft_model, tensors, folder)
    fused = _fused_expert_loras(peft_model, layout)
    out: dict[str, torch.Tensor] = {}
    taken = set()
    for lora in tqdm(fused, desc="per-expert adapter", unit="tensor"):
        key_a, key_b = lora.keys
        for key in (key_a, key_b):
            if key not in tensors:
                raise UserError(f"{folder} lacks {key}: the adapter was saved for another base model or "
                                "config (pass the right base model with base_model=..., --base-model)")
        E, r = lora.num_experts, lora.rank
        if is_old_transposed(tensors[key_a].shape, tensors[key_b].shape, lora.in_features, lora.out_features):
            raise UserError(f"{folder}: {key_a} {tuple(tensors[key_a].shape)} and {key_b} "
                            f"{tuple(tensors[key_b].shape)} are {OLD_TRANSPOSED}")
        _check_shape(key_a, tensors[key_a], (r * E, lora.in_features), folder)
        _check_shape(key_b, tensors[key_b], (lora.out_features, r * E), folder)
        a = tensors[key_a].reshape(E, r, lora.in_features)  # expert e's A_e = a[e]
        b = tensors[key_b].reshape(lora.out_features, r, E)  # expert e's B_e = b[:, :, e]
        for module in lora.modules:
            out[f"{PEFT_PREFIX}{module.name}.lora_A.weight"] = a[module.expert].clone()
            out[f"{PEFT_PREFIX}{module.name}.lora_B.weight"] = b[module.rows, :, module.expert].contiguous()
        taken.update((key_a, key_b))
    for key, value in tensors.items():
        if key in taken:
            continue
        if any(key.startswith(f"{lora.prefix}.lora_") for lora in fused):
            raise UserError(f"{folder} holds {key}: only lora_A and lora_B of expert tensors can be laid out "
                            "per expert (no lora_bias, DoRA or other variants on the experts)")
        out[key] = value
    new = dict(config)
    new["target_parameters"] = None
    new["target_modules"] = _leaf_modules(out)
    return new, out


# --- import: per expert -> fused ---
def import_per_expert_adapter(per_expert_dir: str, out_dir: str, base_model: BaseModel = None) -> str:
    """Write the per-expert adapter in `per_expert_dir` (what `export_per_expert_adapter` writes) to `out_dir` as a
    peft adapter with LoRA on the fused expert tensors (`target_parameters`), which peft loads onto the transformers
    model and this package trains while the experts stream. The exact inverse of the export: every factor lands
    where the export took it from. Gate and up of a fused gate/up tensor must share lora_A (peft's fused layout has
    one A_e per expert and tensor). Written atomically. Returns `out_dir`."""
    _check_out_dir(per_expert_dir, out_dir)
    config, tensors, _ = _read_adapter(per_expert_dir)
    model = _meta_model(_base_config(config, base_model, per_expert_dir), config.get("task_type"))
    fused_config, out = relayout_fused(model, config, tensors, per_expert_dir)
    _write_adapter(out_dir, fused_config, out, "fused", per_expert_dir)
    logger.info("wrote the fused adapter of %s to %s", per_expert_dir, out_dir)
    return out_dir


def relayout_fused(model: nn.Module, config: dict, tensors: dict[str, torch.Tensor],
                   folder: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of the per-expert adapter (`config`, `tensors`) over the meta base `model` in peft's fused
    layout: the exact inverse of `relayout_per_expert`."""
    if config.get("target_parameters"):
        raise UserError(f"{folder}'s adapter already has LoRA on fused expert tensors (target_parameters "
                        f"{config['target_parameters']}): it is in the fused layout")
    for field in ("rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise UserError(f"{folder}'s per-expert adapter sets {field} {config[field]}, whose module names have no "
                            "counterpart in peft's fused layout; save it with one r and lora_alpha")
    layout = _per_expert_layout(model)
    # Per-expert module -> its fused tensor (a tensor without a per-expert layout cannot be in this adapter either).
    owner: dict[str, tuple[str, ExpertModule]] = {
        m.name: (tensor, m) for tensor, modules in layout.items() if not isinstance(modules, UserError)
        for m in modules}
    found: dict[str, dict[str, ExpertModule]] = {}  # fused tensor -> its per-expert modules in the adapter
    for key in tensors:
        module = key.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0]
        if module in owner:
            tensor, m = owner[module]
            found.setdefault(tensor, {})[m.name] = m
    if not found:
        raise UserError(f"{folder}'s adapter has no per-expert LoRA of this base model's experts (keys like "
                        f"{PEFT_PREFIX}{next(iter(owner), 'model.layers.0.mlp.experts.0.gate_proj')}.lora_A.weight); "
                        "nothing to fuse")
    fused_config = dict(config)
    fused_config["target_parameters"] = _target_parameters(found, list(layout))
    plain = [k for k in tensors if k.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] not in owner]
    fused_config["target_modules"] = _leaf_modules(plain)
    peft_model = _meta_peft_model(model, fused_config)
    _check_modules(peft_model, plain, folder)
    out = {k: tensors[k] for k in plain}
    for lora in tqdm(_fused_expert_loras(peft_model, layout), desc="fused adapter", unit="tensor"):
        out.update(zip(lora.keys, _fuse(lora, tensors, folder)))
    return fused_config, out


def _target_parameters(found: dict[str, dict], every_tensor: list[str]) -> list[str]:
    """`target_parameters` naming the fused tensors in `found`: as suffixes (`experts.gate_up_proj`, how
    `expert_target_parameters` names them) where a suffix covers exactly those tensors, else their full names."""
    names = []
    for suffix in sorted({".".join(t.split(".")[-2:]) for t in found}):
        matched = {t for t in every_tensor if t.endswith(f".{suffix}")}
        if matched <= set(found):
            names.append(suffix)
        else:
            names.extend(sorted(t for t in found if t.endswith(f".{suffix}")))
    return names


def _fuse(lora: FusedExpertLora, tensors: dict[str, torch.Tensor], folder: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora_A, lora_B) of one fused tensor in peft's layout, from its per-expert modules' factors."""
    E, r = lora.num_experts, lora.rank
    a = b = None
    seen_a = torch.zeros(E, dtype=torch.bool)
    filled = torch.zeros(lora.out_features, E, dtype=torch.bool)
    for module in lora.modules:
        key_a, key_b = (f"{PEFT_PREFIX}{module.name}.lora_{x}.weight" for x in "AB")
        for key in (key_a, key_b):
            if key not in tensors:
                raise UserError(f"{folder} lacks {key}: a per-expert adapter needs every expert's factors of every "
                                f"projection of {lora.tensor}")
        _check_shape(key_a, tensors[key_a], (r, lora.in_features), folder)
        _check_shape(key_b, tensors[key_b], (module.rows.numel(), r), folder)
        if a is None:
            a = torch.empty(E, r, lora.in_features, dtype=tensors[key_a].dtype)  # peft's lora_A, reshaped
            b = torch.empty(lora.out_features, r, E, dtype=tensors[key_b].dtype)  # peft's lora_B, reshaped
        if seen_a[module.expert]:
            if not torch.equal(a[module.expert], tensors[key_a]):
                raise UserError(f"{folder}: {key_a} differs from the lora_A of the other projections of expert "
                                f"{module.expert} in {lora.tensor}; peft's LoRA on the fused tensor has one lora_A per "
                                "expert, so only per-expert adapters whose fused projections share lora_A (as "
                                "export_per_expert_adapter writes them) can be fused")
        else:
            a[module.expert] = tensors[key_a]
            seen_a[module.expert] = True
        b[module.rows, :, module.expert] = tensors[key_b]
        filled[module.rows, module.expert] = True
    if not bool(filled.all()):
        raise UserError(f"{folder}: the per-expert factors do not cover every row of {lora.tensor}")
    return a.reshape(E * r, lora.in_features), b.reshape(lora.out_features, r * E)


# --- writing ---
def _check_out_dir(source: str, out_dir: str) -> str:
    """`out_dir` made absolute, once it is known to be writable without losing anything: not the input adapter, and
    new, empty, or an earlier adapter (which the new one replaces)."""
    out_dir = os.path.abspath(out_dir)
    if os.path.abspath(source) == out_dir:
        raise UserError(f"the output folder {out_dir} is the input adapter's folder: write to another folder")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"{out_dir} is a file: write to a new or empty folder")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not os.path.isfile(os.path.join(out_dir, ADAPTER_CONFIG)):
        raise UserError(f"{out_dir} exists and holds something other than an adapter: write to a new or empty folder")
    return out_dir


def _write_adapter(out_dir: str, config: dict, tensors: dict[str, torch.Tensor], layout: str, source: str) -> None:
    """adapter_config.json + adapter_model.safetensors into a temporary folder beside `out_dir`, then renamed into
    place: `out_dir` holds the whole adapter or none (an earlier adapter there is replaced after the new one is
    complete)."""
    out_dir = _check_out_dir(source, out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out_dir)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        specs = [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
        write_safetensors_streaming(os.path.join(tmp, ADAPTER_WEIGHTS), specs, lambda k: [tensors[k]],
                                    {"format": "pt", LAYOUT_METADATA_KEY: layout})
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        old = None
        if os.path.isdir(out_dir):
            old = os.path.join(parent, f".{os.path.basename(out_dir)}.old-{os.getpid()}")
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        fsync_directory(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["OLD_TRANSPOSED", "ExpertModule", "FusedExpertLora", "expert_modules", "import_per_expert_adapter",
           "is_old_transposed", "relayout_fused", "relayout_per_expert"]
