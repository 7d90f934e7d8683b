"""The MoE families of the installed transformers, built tiny, for the table-driven tests (in the manner of peft's
common tester: one generic recipe, every family).

A family is every model type whose modeling file decorates an experts class with `@use_experts_implementation` (the
experts signature `experts(hidden_states, top_k_index, top_k_weights)` that hf_moe_offload serves). Its tiny model is
a generic shrink of the default config: every size-like field the config has is set small, dropouts and router noise
to 0. Composite configs (vision-language, audio: sub-configs) and configs the shrink cannot satisfy are skipped, with
the reason. A model type without a causal-LM head can be built as its base model (`causal_lm=False`).
"""

from __future__ import annotations

import copy
import importlib.util
from functools import cache

import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB = 96
LAYERS = 2

# field -> tiny value; set only where the family's config has the field.
SHRINK = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 24,
    "expert_intermediate_size": 24,
    "shared_expert_intermediate_size": 24,
    "shared_intermediate_size": 24,
    "first_dense_intermediate_size": 48,
    "ffn_hidden_size": 48,
    "expert_ffn_hidden_size": 24,
    "num_hidden_layers": LAYERS,
    "num_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "num_experts": 6,
    "num_local_experts": 6,
    "n_routed_experts": 6,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "n_group": 1,
    "topk_group": 1,
    "n_shared_experts": 1,
    "zero_expert_num": 2,
    "max_position_embeddings": 64,
    "first_k_dense_replace": 0,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "sliding_window": 16,
    "router_jitter_noise": 0.0,
    "use_cache": False,
}


def experts_families() -> list[str]:
    """Model types whose modeling file uses transformers' experts interface, sorted."""
    out = []
    for model_type in CONFIG_MAPPING_NAMES:
        module = model_type.replace("-", "_")
        try:
            spec = importlib.util.find_spec(f"transformers.models.{module}.modeling_{module}")
        except ModuleNotFoundError:  # a model type served by another model's package
            continue
        if spec is None or spec.origin is None:
            continue
        with open(spec.origin) as f:
            if "@use_experts_implementation" in f.read():
                out.append(model_type)
    return sorted(out)


class Unshrinkable(Exception):
    """The family cannot be built tiny by the generic recipe (the reason is the message)."""


def tiny_config(model_type: str, causal_lm: bool = True):
    """The family's tiny config: a fresh copy on every call (callers change fields: a vocabulary, a context), of the
    one built and checked once (with its causal LM, or with its base model where `causal_lm` is False)."""
    return copy.deepcopy(_checked_config(model_type, causal_lm))


@cache
def _checked_config(model_type: str, causal_lm: bool = True):
    if causal_lm and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise Unshrinkable("no causal-LM head in transformers")
    default = AutoConfig.for_model(model_type)
    if getattr(default, "sub_configs", None):
        raise Unshrinkable(f"composite config (sub-configs {sorted(default.sub_configs)})")
    fields = default.to_dict()
    overrides = {k: v for k, v in SHRINK.items() if k in fields}
    n_default = fields.get("num_hidden_layers") or fields.get("num_layers")
    for k, v in fields.items():
        if "dropout" in k and isinstance(v, float):
            overrides[k] = 0.0
        elif isinstance(v, (list, str)) and n_default and len(v) == n_default and k not in overrides:
            # A per-layer pattern (layer types, hybrid patterns): keep the last layers (dense layers come first).
            overrides[k] = v[-LAYERS:]
        elif k.endswith("token_id") and isinstance(v, int) and v >= VOCAB:
            overrides[k] = 0
    try:
        cfg = AutoConfig.for_model(model_type, **overrides)
        model = (AutoModelForCausalLM if causal_lm else AutoModel).from_config(cfg)
        ids = torch.zeros(1, 4, dtype=torch.long)
        with torch.no_grad():
            model(ids)
    except Exception as err:  # noqa: BLE001 (any failure of the generic shrink means: not shrinkable this way)
        raise Unshrinkable(f"{type(err).__name__}: {str(err).splitlines()[0][:160]}") from None
    if not any(hasattr(m, "has_gate") for m in model.modules()):
        raise Unshrinkable("the shrunk model has no MoE layer")
    return cfg


def tiny_model(model_type: str, seed: int = 0, causal_lm: bool = True, **overrides):
    """The family's tiny causal LM (its base model, `AutoModel`, where `causal_lm` is False: the families without a
    causal-LM head), fp32, eager experts, random weights (seeded), in train mode. `overrides` set config fields (only
    those the family's config has: e.g. num_experts=7 reaches num_local_experts too)."""
    config = tiny_config(model_type, causal_lm)
    aliases = {"num_experts": ("num_experts", "num_local_experts", "n_routed_experts")}
    if "num_layers" in config.to_dict():  # longcat_flash: num_hidden_layers counts two sublayers per decoder layer
        aliases["num_hidden_layers"] = ("num_layers",)
    for key, value in overrides.items():
        for name in aliases.get(key, (key,)):
            if hasattr(config, name):
                if key == "num_hidden_layers" and name in vars(config):
                    # A count of its own (not one derived from a pattern, as nemotron_h's): per-layer patterns (layer
                    # types) keep their last `value` layers.
                    before = getattr(config, name)
                    for field, pattern in list(vars(config).items()):
                        if isinstance(pattern, list) and len(pattern) == before and field not in overrides:
                            setattr(config, field, pattern[-value:])
                setattr(config, name, value)
    torch.manual_seed(seed)
    model = (AutoModelForCausalLM if causal_lm else AutoModel).from_config(config, experts_implementation="eager")
    with torch.no_grad():  # some families initialise experts to zero (or leave them empty): give every tensor values
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
    return model.train()
