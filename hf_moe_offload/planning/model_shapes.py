"""The config of a model named on the Hub, read offline: from the local Hugging Face cache, else from a bundled table
of the shapes of common MoE releases.

`hf-moe-offload estimate Qwen/Qwen3-30B-A3B` needs only the config, and no download: a config.json the Hugging Face
cache already holds (`huggingface_hub.try_to_load_from_cache`, which never goes to the network) is read as it is;
otherwise the name is looked up in `SHAPES`, the fields of the release's public config.json that decide the
parameters' shapes (widths, layers, heads, experts, top-k, shared experts, dense layers, MLA ranks, biases), built
into a config with transformers' `AutoConfig.for_model`. Routing details that leave the shapes alone (scaling
factors, rope settings, token ids) are left at transformers' defaults: the estimate counts bytes and FLOPs, not
outputs.

Each row names its release's config.json on the Hub. The values were read from copies of those files in public code
repositories (found with a code search; the Hub is out of reach from where the table was written), and are checked
by tests/test_model_shapes.py: every row's parameter total is the release's published one within 1%, and the rows
whose release is the default config of its transformers family (DeepSeek-V3, gpt-oss-120b, Mixtral-8x7B) give that
default's parameter shapes, tensor for tensor.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from ..errors import UserError

logger = logging.getLogger(__name__)

SOURCE_FOLDER = "local folder"
SOURCE_CACHE = "local Hugging Face cache"
SOURCE_TABLE = "bundled table of public configs"


@dataclass(frozen=True)
class ModelShape:
    """The shape-deciding fields of one release's config.json."""

    model_type: str
    fields: dict = field(default_factory=dict)
    source: str = ""  # the public config.json the fields come from

    def config(self):
        from transformers import AutoConfig

        return AutoConfig.for_model(self.model_type, **self.fields)


def _hub(repo: str) -> str:
    return f"https://huggingface.co/{repo}/blob/main/config.json"


_QWEN3_MOE = dict(num_key_value_heads=4, head_dim=128, vocab_size=151936, num_experts=128, num_experts_per_tok=8,
                  max_position_embeddings=40960, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)
_MIXTRAL = dict(num_key_value_heads=8, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
                tie_word_embeddings=False)
_GPT_OSS = dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                vocab_size=201088, num_experts_per_tok=4, attention_bias=True, sliding_window=128,
                max_position_embeddings=131072, tie_word_embeddings=False)
_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, tie_word_embeddings=False,
            max_position_embeddings=163840)

# Hub name -> the shape of its config.json. The LoRA, MXFP4 and FP8 variants of a release (e.g. -Instruct, -FP8)
# share its shape; they are not listed separately.
SHAPES: dict[str, ModelShape] = {
    "Qwen/Qwen3-30B-A3B": ModelShape("qwen3_moe", dict(
        _QWEN3_MOE, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32), _hub("Qwen/Qwen3-30B-A3B")),
    "Qwen/Qwen3-235B-A22B": ModelShape("qwen3_moe", dict(
        _QWEN3_MOE, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94,
        num_attention_heads=64), _hub("Qwen/Qwen3-235B-A22B")),
    "mistralai/Mixtral-8x7B-v0.1": ModelShape("mixtral", dict(
        _MIXTRAL, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        max_position_embeddings=32768), _hub("mistralai/Mixtral-8x7B-v0.1")),
    "mistralai/Mixtral-8x22B-v0.1": ModelShape("mixtral", dict(
        _MIXTRAL, hidden_size=6144, intermediate_size=16384, num_hidden_layers=56, num_attention_heads=48,
        max_position_embeddings=65536), _hub("mistralai/Mixtral-8x22B-v0.1")),
    "openai/gpt-oss-20b": ModelShape("gpt_oss", dict(
        _GPT_OSS, num_hidden_layers=24, num_local_experts=32), _hub("openai/gpt-oss-20b")),
    "openai/gpt-oss-120b": ModelShape("gpt_oss", dict(
        _GPT_OSS, num_hidden_layers=36, num_local_experts=128), _hub("openai/gpt-oss-120b")),
    "deepseek-ai/DeepSeek-V2-Lite": ModelShape("deepseek_v2", dict(
        _MLA, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, vocab_size=102400, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, first_k_dense_replace=1, q_lora_rank=None), _hub("deepseek-ai/DeepSeek-V2-Lite")),
    "deepseek-ai/DeepSeek-V3": ModelShape("deepseek_v3", dict(
        _MLA, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, vocab_size=129280, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, first_k_dense_replace=3, q_lora_rank=1536, n_group=8, topk_group=4),
        _hub("deepseek-ai/DeepSeek-V3")),
    "allenai/OLMoE-1B-7B-0924": ModelShape("olmoe", dict(
        hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=50304, num_experts=64, num_experts_per_tok=8, max_position_embeddings=4096,
        tie_word_embeddings=False), _hub("allenai/OLMoE-1B-7B-0924")),
    "zai-org/GLM-4.5-Air": ModelShape("glm4_moe", dict(
        hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46,
        num_attention_heads=96, num_key_value_heads=8, head_dim=128, vocab_size=151552, n_routed_experts=128,
        n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1, partial_rotary_factor=0.5,
        attention_bias=True, use_qk_norm=False, n_group=1, topk_group=1, max_position_embeddings=131072,
        tie_word_embeddings=False), _hub("zai-org/GLM-4.5-Air")),
}


def bundled_shape(name: str) -> tuple[str, ModelShape] | None:
    """The table's row for `name`: its Hub name, case aside, or the part after the organization
    ('Qwen3-30B-A3B'). None where the table lacks it."""
    want = name.strip().lower()
    for key, shape in SHAPES.items():
        if want in (key.lower(), key.split("/", 1)[1].lower()):
            return key, shape
    return None


def cached_config_path(repo_id: str, cache_dir: str | None = None) -> str | None:
    """The config.json of `repo_id` in the local Hugging Face cache (HF_HUB_CACHE / HF_HOME), at the revision its
    `main` ref names; None if the cache lacks it. Never goes to the network."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir)
    except HFValidationError:  # not a repo id (e.g. a path that does not exist)
        return None
    return found if isinstance(found, str) else None


def load_config(model: str, cache_dir: str | None = None):
    """(config, where it came from) for `model`: a model folder or a config.json; else a Hub name whose config.json
    the local Hugging Face cache holds; else a Hub name of the bundled table. Reads no weights, downloads nothing."""
    from transformers import AutoConfig

    from .. import models  # noqa: F401  (registers MoE-GPT with the Auto classes)

    folder = os.path.dirname(model) if model.endswith(".json") else model
    if os.path.isfile(model) or os.path.isfile(os.path.join(folder, "config.json")):
        return AutoConfig.from_pretrained(folder if os.path.isdir(folder) else model), f"{SOURCE_FOLDER} ({model})"
    if os.path.exists(model):
        raise UserError(f"{model}: no config.json there (give a model folder, a config.json or a Hub name)")
    cached = cached_config_path(model, cache_dir)
    if cached is not None:
        return AutoConfig.from_pretrained(os.path.dirname(cached)), f"{SOURCE_CACHE} ({cached})"
    row = bundled_shape(model)
    if row is not None:
        key, shape = row
        return shape.config(), f"{SOURCE_TABLE} ({key}: {shape.source})"
    raise UserError(
        f"{model!r} is not a model folder or config.json, the local Hugging Face cache has no config.json for it, "
        f"and the bundled table of public configs does not list it. Give a folder holding the model's config.json "
        f"(weights are not needed: `hf download {model} config.json` fetches it alone, into the cache), "
        f"or one of the bundled names: {', '.join(SHAPES)}")


__all__ = ["SHAPES", "SOURCE_CACHE", "SOURCE_FOLDER", "SOURCE_TABLE", "ModelShape", "bundled_shape",
           "cached_config_path", "load_config"]
