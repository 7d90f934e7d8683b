"""Will vLLM or SGLang load this LoRA adapter folder, and serve the delta it was trained with?

`check_adapter` reads `adapter_config.json` and `adapter_model.safetensors` and holds them against the loader rules of
adapter_serving.py's module docstring (vLLM main 7ca49fbe, SGLang main 18e6c61c, read, not run), with the base
model's config for names and shapes (built on the meta device: no weights are read). Each problem names its rule, what
the server does with it (fails at load or activation, or silently drops or mis-scales) and the fix. vLLM checks
suffixes only and drops a module whose full path matches nothing, so full module paths are compared here.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

import torch
from torch import nn

from .adapter_export import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, OLD_TRANSPOSED, PEFT_PREFIX, BaseModel, _base_config,
                             _meta_model, _per_expert_layout, is_old_transposed)
from .adapter_serving import LOADERS, SERVERS, served_layout, sglang_leaf_names
from ..errors import UserError

VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py MaxLoRARanks
VLLM_DEFAULT_MAX_LORA_RANK = 16
SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_embedding_A", ".lora_embedding_B")
IGNORED = (".embed_tokens.base_layer.weight", ".lm_head.base_layer.weight")  # vLLM skips these keys


@dataclass(frozen=True)
class Problem:
    rule: str
    message: str
    fix: str
    error: bool = True  # False: a note (nothing fails or is mis-served)

    def __str__(self) -> str:
        return f"{'error' if self.error else 'note'} [{self.rule}] {self.message}\n    fix: {self.fix}"


@dataclass(frozen=True)
class _Module:
    """A module the server can adapt: its kind, its experts module (None for plain ones), (in, out), experts."""

    kind: str  # "per-expert" | "fused" | "plain"
    owner: str | None
    in_features: int
    out_features: int
    experts: int = 1


def _export_fix(folder: str, server: str) -> str:
    return f"hf-moe-offload export-adapter {folder} OUT --server {server} (from the adapter as peft saved it)"


def _expected_modules(model: nn.Module, server: str) -> dict[str, _Module]:
    """Every module path an adapter of this base model may hold, in either expert layout (the layout rule is checked
    separately): per-expert Hub names (and SGLang's leaf names on SGLang), peft's fused keys, Linear / Embedding."""
    from ..families.moe_path import experts_layers

    found: dict[str, _Module] = {}
    leaves = sglang_leaf_names(model) if server == "sglang" else {}
    for tensor, modules in _per_expert_layout(model).items():
        if isinstance(modules, UserError):
            continue
        param = model.get_parameter(tensor)
        transposed = bool(getattr(model.get_submodule(tensor.rpartition(".")[0]), "is_transposed", False))
        in_features = param.shape[1] if transposed else param.shape[2]
        for m in modules:
            owner, _, leaf = m.name.rpartition(".")
            owner = owner.rpartition(".")[0]
            for name in {m.name, f"{m.name.rpartition('.')[0]}.{leaves.get(leaf, leaf)}"}:
                found[name] = _Module("per-expert", owner, in_features, m.rows.numel())
    experts_names = set()
    for name, module, layout in experts_layers(model):
        experts_names.add(name)
        transposed = bool(getattr(module, "is_transposed", False))
        weights = [n for n, _ in module.named_parameters(recurse=False) if n in layout.names()
                   and next(t for t in layout.tensors if t.name == n).decay]
        # peft nests the wrappers in the module's parameter order, the first innermost: gate_up under base_layer.
        for key, weight in zip((f"{name}.base_layer", name), weights):
            E, d1, d2 = getattr(module, weight).shape
            found[key] = _Module("fused", name, d1 if transposed else d2, d2 if transposed else d1, E)
    for name, module in model.named_modules():
        if any(name.startswith(f"{e}.") for e in experts_names):
            continue
        if isinstance(module, nn.Linear):
            found[name] = _Module("plain", None, module.in_features, module.out_features)
        elif isinstance(module, nn.Embedding):
            found[name] = _Module("plain", None, module.num_embeddings, module.embedding_dim)
    return found


def _config_problems(config: dict, folder: str, server: str, max_lora_rank: int | None) -> list[Problem]:
    out = []
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in config]
    if missing:
        out.append(Problem("config-fields", f"{ADAPTER_CONFIG} lacks {', '.join(missing)}; {server} refuses to load it",
                           "save the adapter with peft's save_pretrained, which writes every field"))
    r = config.get("r")
    if "r" in config and (not isinstance(r, int) or isinstance(r, bool) or r <= 0):
        out.append(Problem("rank", f"r is {r!r}; {server} needs a positive integer", "save the adapter with peft"))
    elif isinstance(r, int):
        limit = max_lora_rank or (VLLM_DEFAULT_MAX_LORA_RANK if server == "vllm" else None)
        if limit is not None and r > limit:
            need = next((x for x in VLLM_MAX_LORA_RANKS if x >= r), r) if server == "vllm" else r
            out.append(Problem("rank", f"r = {r} is above the server's --max-lora-rank {limit}; {server} refuses it",
                               f"start {server} with --max-lora-rank {need} (and check with --max-lora-rank {need})"))
    for field, bad, why in (("bias", lambda v: v not in (None, "none"), "adapter biases"),
                            ("use_dora", bool, "DoRA"), ("modules_to_save", bool, "modules_to_save")):
        if bad(config.get(field)):
            out.append(Problem("unsupported", f"{field} = {config[field]!r}: {server} does not load {why}",
                               "train without it, or serve a merged checkpoint (save_merged_lora)"))
    if server == "sglang" and str(config.get("peft_type", "")).upper() != "LORA":
        out.append(Problem("peft-type", f"peft_type is {config.get('peft_type')!r}; SGLang loads only LORA",
                           "save a LoRA adapter with peft"))
    alpha = config.get("lora_alpha")
    differing = {f"rank_pattern[{k!r}]": v for k, v in (config.get("rank_pattern") or {}).items() if v != r}
    differing.update({f"alpha_pattern[{k!r}]": v for k, v in (config.get("alpha_pattern") or {}).items()
                      if v != alpha})
    if differing:
        out.append(Problem("patterns", f"{', '.join(f'{k} = {v}' for k, v in differing.items())}: {server} ignores "
                                       f"rank and alpha patterns and scales every module by lora_alpha / r = "
                                       f"{alpha}/{r}, so these modules are served with another delta than trained",
                           _export_fix(folder, server) + ": it folds each module's scaling into lora_B"))
    return out


def _rslora_problem(config: dict, folder: str, server: str, has_per_expert: bool) -> list[Problem]:
    if not config.get("use_rslora"):
        return []
    if server == "sglang":
        why = "SGLang ignores use_rslora and scales by lora_alpha / r"
    elif has_per_expert:
        why = (f"vLLM ({LOADERS['vllm']}) scales per-expert experts by lora_alpha / r, not lora_alpha / sqrt(r); "
               "later versions may honour it")
    else:
        return []
    return [Problem("rslora", f"use_rslora is true: {why}, so the delta served is not the trained one",
                    _export_fix(folder, server) + ": it folds the rsLoRA scaling into lora_B")]


def _key_problems(tensors: dict[str, torch.Tensor]) -> tuple[list[Problem], dict[str, dict[str, torch.Tensor]]]:
    """Problems of the key names and pairs; the LoRA modules found: module path -> {"A": tensor, "B": tensor}."""
    out, modules = [], {}
    for key, value in tensors.items():
        if key.endswith(IGNORED):
            continue
        suffix = next((s for s in SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            why = ("DoRA's magnitude" if "lora_magnitude_vector" in key
                   else "modules_to_save" if "modules_to_save" in key
                   else "a LoRA bias (lora_bias)" if key.endswith(".bias")
                   else "it holds an adapter name (peft's in-memory key)" if ".lora_A." in key or ".lora_B." in key
                   else "an unsupported LoRA weight")
            out.append(Problem("key-name", f"{key}: {why}; vLLM refuses the adapter ('is unsupported LoRA weight'), "
                                           "SGLang drops it",
                               "save with peft's save_pretrained, without lora_bias, DoRA or modules_to_save"))
            continue
        if not value.is_floating_point():
            out.append(Problem("dtype", f"{key} is {value.dtype}; LoRA factors must be floating point",
                               "save the adapter's factors in fp32, bf16 or fp16"))
        module = key[: -len(suffix)].removeprefix(PEFT_PREFIX)
        modules.setdefault(module, {})["A" if suffix.endswith("A") or "_A." in suffix else "B"] = value
    for module, pair in modules.items():
        if len(pair) != 2:
            have, lack = ("A", "B") if "A" in pair else ("B", "A")
            out.append(Problem("pairs", f"{module} has lora_{have} but no lora_{lack}; the server fails to load it",
                               "save the adapter again with peft (every module has both factors)"))
    return out, {m: p for m, p in modules.items() if len(p) == 2}


def _shape_problems(name: str, pair: dict, spec: _Module, r, folder: str, server: str) -> list[Problem]:
    a, b = pair["A"], pair["B"]
    E = spec.experts
    if spec.kind == "fused" and is_old_transposed(a.shape, b.shape, spec.in_features, spec.out_features):
        return [Problem("transposed", f"{name}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)} are {OLD_TRANSPOSED}",
                        f"then {_export_fix(folder, server)}")]
    rank = a.shape[0] // E if a.dim() == 2 else -1
    want_a, want_b = (rank * E, spec.in_features), (spec.out_features, rank * E)
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] % E or tuple(a.shape) != want_a or tuple(b.shape) != want_b:
        return [Problem("shape", f"{name}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}; the base model wants "
                                 f"({'E*r' if E > 1 else 'r'}, {spec.in_features}) and ({spec.out_features}, "
                                 f"{'E*r' if E > 1 else 'r'}) with E = {E}: the server fails on it or copies part",
                        "check against the base model the adapter was trained on (--base-model)")]
    if isinstance(r, int) and rank != r:
        return [Problem("rank-mismatch", f"{name} has rank {rank}, the config's r is {r}: {server} scales it by "
                                         "lora_alpha / r, so it is served with another delta than trained",
                        _export_fix(folder, server) + ": it pads every module to one rank and folds the scaling")]
    return []


def check_adapter(folder: str, server: str = "vllm", base_model: BaseModel = None,
                  max_lora_rank: int | None = None) -> list[Problem]:
    """Every problem `server` ("vllm", "sglang") would have with the adapter folder: errors (it fails to load or
    serves another delta than trained) and notes. `base_model`: the base model's folder, Hub id or config (default:
    the adapter's base_model_name_or_path; without one, names and shapes go unchecked, said in a note).
    `max_lora_rank`: the server's --max-lora-rank (vLLM's default 16 when None)."""
    from safetensors import safe_open

    if server not in SERVERS:
        raise UserError(f"unknown server {server!r}; choose one of {', '.join(SERVERS)}")
    if not os.path.isdir(folder):
        raise UserError(f"{folder} is not a folder: pass an adapter folder (it holds {ADAPTER_CONFIG} and "
                        f"{ADAPTER_WEIGHTS})")
    try:
        with open(os.path.join(folder, ADAPTER_CONFIG)) as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        return [Problem("config-file", f"{ADAPTER_CONFIG} cannot be read ({err}); the server refuses the folder",
                        "save the adapter with peft's save_pretrained")]
    problems = _config_problems(config, folder, server, max_lora_rank)
    try:
        with safe_open(os.path.join(folder, ADAPTER_WEIGHTS), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:  # noqa: BLE001 (a missing file, or safetensors' own error types for a corrupt one)
        return problems + [Problem("weights-file", f"{ADAPTER_WEIGHTS} cannot be read ({err})",
                                   "save the adapter with peft's save_pretrained (safe_serialization on)")]
    key_problems, modules = _key_problems(tensors)
    problems += key_problems
    try:
        model = _meta_model(_base_config(config, base_model, folder), config.get("task_type"))
    except UserError as err:
        problems += _rslora_problem(config, folder, server, any(".experts." in m for m in modules))
        return problems + [Problem("base-model", f"module names and shapes not checked: {err}",
                                   "pass --base-model (the base model's folder or Hub id)", error=False)]
    family = getattr(model.config, "model_type", type(model).__name__)
    expected = _expected_modules(model, server)
    layout, reason = served_layout(family, server)
    kinds: dict[str, list[str]] = {}
    for name, pair in modules.items():
        spec = expected.get(name)
        if spec is None:
            stacked = ".experts." in name and name.rsplit(".", 1)[-1] in ("gate_up_proj", "down_proj")
            if stacked and server == "sglang":
                problems.append(Problem("not-checked", f"{name}: SGLang's stacked expert layout is not checked here",
                                        _export_fix(folder, server) + " writes the per-expert layout", error=False))
            else:
                problems.append(Problem("module", f"{name} is no module {server} builds for {family} (wrong prefix, "
                                                  "layer or expert index, or name): it is refused or silently dropped",
                                        f"{_export_fix(folder, server)}; or check --base-model"))
            continue
        kinds.setdefault(spec.kind, []).append(name)
        problems += _shape_problems(name, pair, spec, config.get("r"), folder, server)
    for kind in ("per-expert", "fused"):
        if kinds.get(kind) and kind != layout:
            what = ("fails when the adapter is activated" if server == "vllm" and kind == "fused" else
                    "refuses the adapter at load" if server == "vllm" else "drops these keys: the experts go unadapted")
            problems.append(Problem("layout", f"{len(kinds[kind])} expert module(s) in the {kind} layout (e.g. "
                                              f"{kinds[kind][0]}); {server} {what}: {reason}",
                                    _export_fix(folder, server)))
    if server == "vllm" and kinds.get(layout):
        problems += _completeness(expected, set(kinds[layout]), layout, folder)
    problems += _rslora_problem(config, folder, server, bool(kinds.get("per-expert")))
    if server == "sglang" and (kinds.get("per-expert") or kinds.get("fused")):
        targets = config.get("target_modules")
        names = set(targets) if isinstance(targets, list) else set()
        if targets not in ("all", "all-linear") and not set(("gate_proj", "up_proj", "down_proj")) <= names:
            problems.append(Problem("target-modules", f"target_modules {targets!r} does not name gate_proj, up_proj "
                                                      "and down_proj: SGLang wraps the experts only then (a list, or "
                                                      "'all' / 'all-linear')", _export_fix(folder, server)))
    return problems


def _completeness(expected: dict[str, _Module], present: set[str], layout: str, folder: str) -> list[Problem]:
    """vLLM stacks every expert's factors of a layer (per-expert) or needs both fused pairs: a layer with some of its
    expert modules needs all of them."""
    out = []
    by_owner: dict[str, list[str]] = {}
    for name, spec in expected.items():
        if spec.kind == layout:
            by_owner.setdefault(spec.owner, []).append(name)
    for owner, names in sorted(by_owner.items()):
        missing = sorted(set(names) - present)
        if missing and len(missing) < len(names):
            out.append(Problem("completeness", f"{owner}: {len(missing)} of its {len(names)} expert modules lack LoRA "
                                               f"(e.g. {missing[0]}); vLLM fails to stack the layer or leaves it "
                                               "unadapted", _export_fix(folder, "vllm")))
    return out


# --- command line ---
def _run_cli(args: argparse.Namespace) -> None:
    problems = check_adapter(args.adapter_dir, args.server, args.base_model, args.max_lora_rank)
    for problem in problems:
        print(problem)
    errors = sum(p.error for p in problems)
    if errors:
        raise UserError(f"{args.adapter_dir}: {errors} problem(s) that make {args.server} fail on the adapter or "
                        f"serve another delta than trained (rules of {LOADERS[args.server]}); fixes above")
    print(f"{args.adapter_dir}: no problem found for {args.server} (rules of {LOADERS[args.server]})")


def add_cli(sub) -> None:
    """`hf-moe-offload check-adapter DIR --server vllm|sglang [--base-model M] [--max-lora-rank N]`."""
    p = sub.add_parser("check-adapter", help="check a LoRA adapter folder against what vLLM or SGLang loads, and "
                                             "print each problem with its fix (exit code 2 on any)")
    p.add_argument("adapter_dir", help="the adapter folder (adapter_config.json, adapter_model.safetensors)")
    p.add_argument("--server", choices=SERVERS, default="vllm", help="the server that is to load it")
    p.add_argument("--base-model", default=None,
                   help="the base model's folder or Hub id (default: the adapter's base_model_name_or_path)")
    p.add_argument("--max-lora-rank", type=int, default=None,
                   help="the server's --max-lora-rank (default: vLLM's 16; SGLang's is set from the adapters)")
    p.set_defaults(func=_run_cli)


__all__ = ["Problem", "check_adapter"]
