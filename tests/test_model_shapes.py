"""`estimate` by Hub name, offline (hf_moe_offload/planning/model_shapes.py), and docs/hardware.md (hf_moe_offload/planning/hardware_table.py).

The bundled shapes are checked against the releases' published parameter totals (their model cards and papers), the
local Hugging Face cache against a cache laid out here in the layout huggingface_hub reads, and the hardware page
against what the code generates now.
"""

from __future__ import annotations

import json
import os

import huggingface_hub.constants
import pytest
from transformers import AutoConfig

from hf_moe_offload.cli.main import main
from hf_moe_offload.errors import UserError
from hf_moe_offload.planning.estimate import meta_model
from hf_moe_offload.planning.model_shapes import SHAPES, SOURCE_CACHE, SOURCE_FOLDER, SOURCE_TABLE, bundled_shape, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Total parameters as each release states it (model card or paper), in billions. The checkpoints' multi-token
# prediction layers (DeepSeek-V3's layer 61, GLM-4.5-Air's layer 46) are outside these totals and outside
# transformers' models. Published totals are rounded to the figures shown: agreement within 1%.
PUBLISHED_TOTAL_B = {
    "Qwen/Qwen3-30B-A3B": 30.5,
    "Qwen/Qwen3-235B-A22B": 235.0,
    "mistralai/Mixtral-8x7B-v0.1": 46.7,
    "mistralai/Mixtral-8x22B-v0.1": 141.0,
    "openai/gpt-oss-20b": 21.0,
    "openai/gpt-oss-120b": 117.0,
    "deepseek-ai/DeepSeek-V2-Lite": 15.7,
    "deepseek-ai/DeepSeek-V3": 671.0,
    "allenai/OLMoE-1B-7B-0924": 6.9,
    "zai-org/GLM-4.5-Air": 106.0,
}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, where huggingface_hub looks by default (HF_HUB_CACHE, read at its import)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def _cache_config(cache, repo_id: str, config: dict, commit: str = "0123456789abcdef0123456789abcdef01234567"):
    """Lay out `config` as huggingface_hub caches a model's config.json: models--{org}--{name}/refs/main names the
    snapshot that holds the file."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    return snapshot / "config.json"


def test_every_bundled_shape_has_its_release_published_parameter_total():
    assert set(PUBLISHED_TOTAL_B) == set(SHAPES)
    for name, shape in SHAPES.items():
        total = sum(t.numel() for t in meta_model(shape.config()).parameters()) / 1e9
        assert abs(total - PUBLISHED_TOTAL_B[name]) <= 0.01 * PUBLISHED_TOTAL_B[name], (name, total)
        assert shape.source == f"https://huggingface.co/{name}/blob/main/config.json"


@pytest.mark.parametrize("name", ["deepseek-ai/DeepSeek-V3", "openai/gpt-oss-120b", "mistralai/Mixtral-8x7B-v0.1"])
def test_a_bundled_shape_is_its_family_default_where_transformers_default_is_that_release(name):
    shapes = lambda config: {n: tuple(t.shape) for n, t in meta_model(config).named_parameters()}  # noqa: E731
    assert shapes(SHAPES[name].config()) == shapes(AutoConfig.for_model(SHAPES[name].model_type))


def test_a_bundled_name_is_read_from_the_table_when_the_cache_lacks_it(hub_cache, capsys):
    config, source = load_config("Qwen/Qwen3-30B-A3B")
    assert source.startswith(SOURCE_TABLE) and "Qwen/Qwen3-30B-A3B" in source
    assert (config.model_type, config.num_hidden_layers, config.num_experts, config.moe_intermediate_size,
            config.head_dim) == ("qwen3_moe", 48, 128, 768, 128)
    assert bundled_shape("qwen3-30b-a3b")[0] == "Qwen/Qwen3-30B-A3B"  # case aside, organization optional
    assert main(["estimate", "Qwen/Qwen3-30B-A3B", "--method", "lora-experts", "--expert-storage", "nf4",
                 "--gpu", "h100", "--host-adam-gps", "2", "--host-memory", "64", "--seq-len", "2048"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"config: {SOURCE_TABLE}") and "6144 experts in 48 layers" in out and "\nhost " in out


def test_a_name_in_the_local_cache_is_read_from_the_cache_before_the_table(hub_cache, capsys):
    # a config that differs from the table's row, so that the figures say which was read
    small = AutoConfig.for_model("qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=128,
                                 moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)
    path = _cache_config(hub_cache, "Qwen/Qwen3-30B-A3B", small.to_dict())
    config, source = load_config("Qwen/Qwen3-30B-A3B")
    assert source == f"{SOURCE_CACHE} ({path})"
    assert (config.num_hidden_layers, config.num_experts, config.hidden_size) == (2, 8, 64)
    # a name only the cache knows
    _cache_config(hub_cache, "acme/Tiny-MoE", small.to_dict())
    assert load_config("acme/Tiny-MoE")[1].startswith(SOURCE_CACHE)
    assert main(["estimate", "acme/Tiny-MoE", "--device", "cpu", "--host-memory", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"config: {SOURCE_CACHE}") and "16 experts in 2 layers" in out


def test_a_folder_or_config_json_is_read_before_any_name(tmp_path, hub_cache):
    AutoConfig.for_model("olmoe", vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_experts=4).save_pretrained(tmp_path / "m")
    for where in (tmp_path / "m", tmp_path / "m" / "config.json"):
        config, source = load_config(str(where))
        assert config.model_type == "olmoe" and source == f"{SOURCE_FOLDER} ({where})"
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json there"):
        load_config(str(tmp_path / "empty"))


def test_an_unknown_name_fails_with_the_way_out(hub_cache, capsys):
    with pytest.raises(UserError) as err:
        load_config("acme/Not-A-Model")
    message = str(err.value)
    assert "acme/Not-A-Model" in message and "config.json" in message and "hf download" in message
    assert all(name in message for name in SHAPES)
    assert main(["estimate", "acme/Not-A-Model"]) == 2
    assert "bundled names" in capsys.readouterr().err


@pytest.mark.slow
def test_the_hardware_page_is_what_the_code_generates():
    from hf_moe_offload.planning.hardware_table import render

    with open(os.path.join(ROOT, "docs", "hardware.md"), encoding="utf-8") as f:
        committed = f.read()
    assert render() == committed, "docs/hardware.md is stale: python -m hf_moe_offload.planning.hardware_table docs/hardware.md"
