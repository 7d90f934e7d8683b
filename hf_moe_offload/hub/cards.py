"""Model cards: describe a trained MoE and fill the card template (the upload: hub/upload.py).

- `describe_model(model)`: architecture, total and per-token active parameters, experts (works while experts are
  offloaded: their sizes come from the offload layouts, not from `parameters()`).
- `render_model_card(record)` / `write_model_card(folder, record)`: fill `model_cards/TEMPLATE.md` from a run record
  (the dict a job writes to `metrics.json`). Every `{{placeholder}}` must be filled; a missing one is an error.
"""

from __future__ import annotations

import logging
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

from torch import nn

logger = logging.getLogger(__name__)

CARD_FILE = "README.md"
RECORD_FILE = "metrics.json"
REMOTE_CODE_FILES = ("configuration_moe_gpt.py", "modeling_moe_gpt.py", "moe_layer.py", "moe_ops.py")
_PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")


# --- describing a model ---
def _unwrap(model: nn.Module) -> nn.Module:
    model = getattr(model, "module", model)  # DDP
    if hasattr(model, "get_base_model"):  # peft
        model = model.get_base_model()
    return model


def describe_model(model: nn.Module) -> dict[str, Any]:
    """Architecture and parameter counts of an MoE model, offloaded or not.

    `active_params` counts what one token runs through: every non-expert parameter plus `top_k` experts in each MoE
    layer (embeddings included, as usual for total counts; the tied output projection is counted once).
    """
    from ..families.moe_path import experts_layers, unwrapped_name

    model = _unwrap(model)
    cfg = model.config
    per_layer = []
    names = []
    expert_param_ids = set()
    for name, module, layout in experts_layers(model):
        per_layer.append((layout.num_experts, layout.numel))
        names.append(unwrapped_name(name))
        expert_param_ids |= {id(p) for p in module.parameters(recurse=False)}
    non_expert = sum(p.numel() for p in model.parameters() if id(p) not in expert_param_ids)
    expert_total = sum(e * n for e, n in per_layer)
    top_k = getattr(cfg, "num_experts_per_tok", None) or 1
    active = non_expert + sum(top_k * n for _e, n in per_layer)
    return {
        "model_type": cfg.model_type,
        "class": type(model).__name__,
        "num_hidden_layers": getattr(cfg, "num_hidden_layers", None),
        "hidden_size": getattr(cfg, "hidden_size", None),
        "num_attention_heads": getattr(cfg, "num_attention_heads", None),
        "intermediate_size": getattr(cfg, "intermediate_size", None),
        "vocab_size": getattr(cfg, "vocab_size", None),
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
        "moe_layers": len(per_layer),
        "moe_layer_indices": moe_layer_indices(names),
        "moe_layer_names": names,
        "num_experts": per_layer[0][0] if per_layer else 0,
        "num_experts_per_tok": top_k,
        "params_per_expert": per_layer[0][1] if per_layer else 0,
        "expert_params": expert_total,
        "non_expert_params": non_expert,
        "total_params": non_expert + expert_total,
        "active_params": active,
        "num_labels": getattr(cfg, "num_labels", None) if "SequenceClassification" in type(model).__name__ else None,
    }


_LAYER_NUMBER = re.compile(r"\.(\d+)(?:\.|$)")


def moe_layer_indices(names: list[str]) -> list[int]:
    """The decoder-layer index of each experts module, from its name (`model.layers.3.mlp.experts` -> 3: the first
    number in the name, the position in the model's layer list); [] when a name holds no number or two experts
    modules share one (an encoder and a decoder stack), where the names themselves say more."""
    found = [_LAYER_NUMBER.search(n) for n in names]
    if not all(found):
        return []
    indices = [int(m.group(1)) for m in found]
    return indices if len(set(indices)) == len(indices) else []


# --- rendering ---
def _fmt_count(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit} ({n:,})"
    return f"{n:,}"


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def load_card_template(path: str | os.PathLike | None = None) -> str:
    """The card template: `path`, else `model_cards/TEMPLATE.md` of the source tree or of the installed package."""
    if path is not None:
        return Path(path).read_text(encoding="utf-8")
    repo_copy = Path(__file__).resolve().parents[2] / "model_cards" / "TEMPLATE.md"
    if repo_copy.exists():
        return repo_copy.read_text(encoding="utf-8")
    try:  # wheels ship it as package data (setup.py maps model_cards/ to hf_moe_offload.model_cards)
        return (resources.files("hf_moe_offload.model_cards") / "TEMPLATE.md").read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError) as err:
        raise FileNotFoundError(
            "the model card template model_cards/TEMPLATE.md is missing from this installation; reinstall "
            "hf-moe-offload or pass template=<path>"
        ) from err


def _table(rows: list[tuple[str, str]]) -> str:
    return "\n".join(["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])


def _usage(record: dict, where: str) -> tuple[str, str]:
    task = record.get("task", "causal-lm")
    auto = "AutoModelForSequenceClassification" if task == "sequence-classification" else "AutoModelForCausalLM"
    cache = record.get("offload", {}).get("host_cache_experts") or 8
    with_pkg = [
        "import hf_moe_offload  # registers the moe_gpt model type with transformers' Auto classes",
        f"from transformers import {auto}, AutoTokenizer",
        "",
        f'model = {auto}.from_pretrained("{where}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{where}")',
    ]
    if task == "causal-lm":
        with_pkg += [
            'inputs = tokenizer("The history of", return_tensors="pt")',
            "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=20)[0]))",
        ]
    local = where
    stream = []
    if record.get("hub_model_id"):
        stream.append(f'local = huggingface_hub.snapshot_download("{where}")')
        local = "local"
        stream.insert(0, "import huggingface_hub")
    q = (lambda s: s) if local == "local" else (lambda s: f'"{s}"')
    with_pkg += [
        "",
        "# Experts bigger than memory: stream them from disk while training or fine-tuning",
        "from hf_moe_offload import OffloadConfig, load_offloaded_pretrained",
        *stream,
        f"model = load_offloaded_pretrained({q(local)}, OffloadConfig(mode=\"disk\", offload_dir=\"expert_store\", "
        f"host_cache_experts={cache}), model_class={auto})",
    ]
    if task == "causal-lm":
        with_pkg += [
            "",
            "# Generation with the experts on disk (weights only, a decode cache; tokens streamed) from the shell:",
            f"#   hf-moe-offload generate --model-path {local if local != 'local' else 'LOCAL_DIR'} --prompt \"The "
            f"history of\" --host-cache-experts {cache}",
        ]
    without = [
        f"from transformers import {auto}, AutoTokenizer",
        "",
        f'model = {auto}.from_pretrained("{where}", trust_remote_code=True)',
        f'tokenizer = AutoTokenizer.from_pretrained("{where}")',
    ]
    return "\n".join(with_pkg), "\n".join(without)


def _card_front_matter(record: dict) -> tuple[list[str], list[str]]:
    """The card's tags and its extra front-matter lines (dataset, base model)."""
    m = record.get("model", {})
    train = record.get("training", {})
    data = record.get("data", {})
    tags = ["mixture-of-experts", "moe", "hf-moe-offload", m.get("model_type", "moe_gpt")]
    if train.get("method") == "lora":
        tags.append("lora")
    extra = []
    if data.get("hub_name"):
        extra.append(f"datasets:\n- {data['hub_name']}")
    base = record.get("base_model")
    if base and not os.path.exists(base) and re.fullmatch(r"[\w.-]+/[\w.-]+", base):  # a Hub id, not a local path
        extra.append(f"base_model: {base}")
    return tags, extra


def _card_summary(record: dict) -> str:
    """The one-paragraph summary under the card's title (and the record's note, if any)."""
    m = record.get("model", {})
    task = record.get("task", "causal-lm")
    data = record.get("data", {})
    summary = (
        f"A Mixture-of-Experts {'language model' if task == 'causal-lm' else 'sequence classifier'} "
        f"({m.get('class', '')}) with {m.get('num_experts')} experts in each of {m.get('moe_layers')} MoE layers "
        f"({_fmt_count(m.get('total_params')).split(' (')[0]} parameters, "
        f"{_fmt_count(m.get('active_params')).split(' (')[0]} active per token), "
        f"trained on {data.get('description', 'n/a')}."
    )
    if record.get("note"):
        summary += f"\n\n{record['note']}"
    return summary


# --- what the run trained and froze, where the experts lived ---
EXPERT_WISE = "expert-wise CPU optimizer"


def run_experts(record: dict) -> dict[str, Any]:
    """How the run treated its experts: `record["training"]["experts"]` (`jobs.experts_summary`); for a record written
    without it, what the jobs do: trained with `--method full` (by the expert-wise CPU optimizer when offloaded, by the
    Trainer's optimizer when resident), frozen with `--method lora`."""
    train = record.get("training") or {}
    if train.get("experts"):
        return train["experts"]
    off = record.get("offload") or {}
    tier = off.get("mode") or "device"
    trained = train.get("method", "full") == "full"
    stored = off.get("expert_state_rows")
    storage = train.get("expert_storage") if train.get("expert_storage", "auto") != "auto" else None
    return {"trained": trained,
            "stepped_by": (EXPERT_WISE if tier in ("host", "disk") else "Trainer's optimizer") if trained else None,
            "storage": storage or (stored.split()[0] if stored else "n/a"), "stored": stored, "tier": tier}


def _tier_phrase(record: dict) -> str:
    """Where the experts lived: the offload tier, in words."""
    off = record.get("offload") or {}
    tier = off.get("mode") or "device"
    chosen = " (chosen by `--offload auto`)" if off.get("requested_mode") == "auto" else ""
    if tier == "disk":
        return (f"experts on the disk tier{chosen}, files behind a host cache of {off.get('host_cache_experts')} "
                "experts, streamed to the compute device expert by expert (ES-MoE §4.1)")
    if tier == "host":
        return (f"experts in host memory (host tier{chosen}), streamed to the compute device expert by expert "
                "(ES-MoE §4.1)")
    return f"experts resident on the compute device{chosen} (not offloaded)"


def _experts_phrase(experts: dict) -> str:
    """What happened to the experts' weights: who stepped them, or how they were kept frozen."""
    if not experts.get("trained"):
        return f"frozen, stored as {experts.get('storage')}, never stepped"
    if experts.get("stepped_by") == EXPERT_WISE:
        return f"trained, stepped by the {EXPERT_WISE} on the host (ES-MoE §4.1)"
    return "trained, stepped with the other parameters by the Trainer's AdamW"


def _checkpointing_phrase(record: dict) -> str:
    on = record.get("gradient_checkpointing")
    if on is None:
        return "not recorded"
    return ("on: transformers' activation checkpointing (non-reentrant), each decoder layer recomputed in the backward"
            if on else "off")


def _card_method_values(record: dict) -> dict[str, str]:
    """Card fields for what the run did: the technique line under the title, and the training table's method,
    trained, frozen, experts, activation-checkpointing and tier rows."""
    train = record.get("training") or {}
    method = train.get("method", "full")
    experts = run_experts(record)
    routers = " but the routers" if train.get("routers_frozen") else ""
    if method == "lora":
        name = "LoRA"
        method_text = f"LoRA ({train.get('lora') or 'adapters'})"
        head = record.get("task") == "sequence-classification"  # peft trains the new `score` head in full
        trained = "the LoRA adapters" + (" and the classification head" if head else " only") + " (method row)"
        frozen = (f"every {'other ' if head else ''}weight of the base model, the experts included (stored as "
                  f"{experts.get('storage')}: no gradient, no optimizer state)")
    else:
        name = "full fine-tuning" if record.get("base_model") else "training from scratch"
        method_text = (f"{name}, experts included" if record.get("base_model") else f"{name}, all parameters")
        if experts.get("stepped_by") == EXPERT_WISE:
            trained = f"every parameter{routers}: the experts by the {EXPERT_WISE}, the rest by the Trainer's AdamW"
        else:
            trained = f"every parameter{routers}, the experts included, by the Trainer's AdamW"
        frozen = "the routers (`--freeze-router`)" if train.get("routers_frozen") else "nothing"
    if method not in ("full", "lora"):
        name = method_text = str(method)
    on = record.get("gradient_checkpointing")
    checkpointing = "not recorded" if on is None else "on" if on else "off"
    trainer = f"`{train['trainer']}` (a `transformers.Trainer`)" if train.get("trainer") else "`transformers.Trainer`"
    return {
        "technique_line": f"{name}; {_tier_phrase(record)}; experts {_experts_phrase(experts)}; activation "
                          f"checkpointing {checkpointing}; {trainer}.",
        "method": method_text + (f"; {train['lm_loss']}" if train.get("lm_loss") else ""),
        "trained": trained,
        "frozen": frozen,
        "experts_treatment": _experts_phrase(experts),
        "checkpointing": _checkpointing_phrase(record),
        "tier": _tier_phrase(record),
    }


def _card_offload(record: dict) -> str:
    """The offload section: the tier's table (with the run's telemetry) or a line, then the processes if several."""
    off = record.get("offload") or {}
    tele = record.get("telemetry") or {}
    if off.get("mode") in ("host", "disk"):
        rows = [("tier", f"`{off['mode']}`" + (" (chosen by `mode=\"auto\"`)" if off.get("requested_mode") == "auto" else "")),
                (f"expert state ({off.get('expert_state_rows', 'fp32 weights, gradients, Adam moments')})",
                 f"{_fmt(off.get('expert_state_MB'))} MB in {off.get('experts_total')} expert records")]
        if off["mode"] == "disk":
            rows.append(("host cache", f"{off.get('host_cache_experts')} experts ({_fmt(off.get('host_cache_MB'))} MB, "
                                       f"{_fmt(off.get('host_cache_fraction'))} of the experts)"))
        rows += [("prefetch depth / pinned fraction", f"{off.get('prefetch_depth')} / {off.get('pin_fraction')}"),
                 ("experts", _experts_phrase(run_experts(record)))]
        if tele:
            rows += [
                ("disk read / mapped / written", f"{_fmt(tele.get('disk_read_MB'))} MB / "
                                                 f"{_fmt(tele.get('disk_mapped_MB'))} MB / "
                                                 f"{_fmt(tele.get('disk_write_MB'))} MB"),
                ("host→device / device→host", f"{_fmt(tele.get('h2d_MB'))} MB / {_fmt(tele.get('d2h_MB'))} MB"),
                ("cache hit rate", _fmt(tele.get("cache_hit_rate"))),
                ("stall time (compute waiting for an expert)", f"{_fmt(tele.get('stall_s'))} s of "
                                                               f"{_fmt(tele.get('streamed_compute_s'))} s streamed"),
            ]
        offload = _table(rows)
    elif off.get("mode") == "device":
        offload = ("Not offloaded: experts stayed resident on the device (`device` tier; dropless sequential expert "
                   "execution).")
    else:
        offload = "Not used."
    par = record.get("parallel") or {}
    if par.get("world_size", 1) > 1:
        offload += (f"\n\n{par['world_size']} processes ({par.get('backend', 'n/a')}); experts: "
                    f"{par.get('expert_parallel') or 'replicated (data parallel)'}.")
    return offload


_CARD_METRICS = (
    ("train_loss_first", "train loss, first logged"), ("train_loss_last", "train loss, last logged"),
    ("train_loss", "train loss, run average"), ("eval_loss", "eval loss"),
    ("eval_perplexity", "eval perplexity"),
    ("unigram_perplexity", "baseline: add-one unigram perplexity, same held-out tokens"),
    ("initial_accuracy", "eval accuracy before training"), ("eval_accuracy", "eval accuracy"),
    ("eval_accuracy_ci95", "eval accuracy, 95% Wilson interval"),
    ("majority_accuracy", "baseline: majority-class accuracy"), ("versus_baseline", "verdict"),
    ("tokens_per_second", "training tokens / s"), ("train_runtime_s", "training time (s)"),
)


def _card_metrics(metrics: dict) -> str:
    """The metrics table, in `_CARD_METRICS`' order, of the metrics the run recorded."""
    rows = []
    for key, label in _CARD_METRICS:
        value = metrics.get(key)
        if value is not None:
            shown = " – ".join(_fmt(v) for v in value) if isinstance(value, (list, tuple)) else _fmt(value)
            rows.append((label, shown))
    return _table(rows) if rows else "No metrics recorded."


def _card_expert_load(record: dict, top_k: int) -> str:
    """The per-layer expert-load table (routed tokens, max/mean over the run and the last interval, idle experts)."""
    load = record.get("expert_load") or {}
    if not load.get("layers"):
        return "No expert load was recorded."
    lines = [f"| layer | routed tokens (× top-{top_k}) | max / mean (run) | max / mean (last interval) | "
             "idle experts (run) |",
             "|---|---|---|---|---|"]
    for layer in load["layers"]:
        r, li = layer["run"], layer["last_interval"]
        lines.append(f"| `{layer['name']}` | {r['tokens']:,} | {r['max_over_mean']:.2f} | "
                     f"{li['max_over_mean']:.2f} | {r['idle_experts']} |")
    return "\n".join(lines)


def _moe_layers_row(m: dict) -> str:
    """`2 (layers 1, 3)`; the experts modules' names where their layer indices are not known."""
    indices, names = m.get("moe_layer_indices") or [], m.get("moe_layer_names") or []
    if indices:
        return f"{m.get('moe_layers')} (layers {', '.join(str(i) for i in indices)})"
    if names:
        return f"{m.get('moe_layers')} ({', '.join(f'`{n}`' for n in names)})"
    return str(m.get("moe_layers"))


def _card_model_values(m: dict) -> dict[str, str]:
    """Card fields for the model (`{{architecture}}` and the rest in model_cards/): architecture, shape, MoE layers,
    experts, parameter counts, vocabulary/context."""
    top_k = m.get("num_experts_per_tok", 1)
    return {
        "architecture": f"`{m.get('model_type')}` ({m.get('class')})"
                        + (", pre-norm GPT decoder with MoE FFN layers" if m.get("model_type") == "moe_gpt" else ""),
        "shape": f"{m.get('num_hidden_layers')} / {m.get('hidden_size')} / {m.get('num_attention_heads')} / "
                 f"{m.get('intermediate_size')}",
        "moe_layers": _moe_layers_row(m),
        "experts": f"{m.get('num_experts')}, top-{top_k} routing, dropless "
                   f"({_fmt_count(m.get('params_per_expert'))} parameters each)",
        "total_params": _fmt_count(m.get("total_params")),
        "active_params": _fmt_count(m.get("active_params")),
        "expert_params": _fmt_count(m.get("expert_params")),
        "vocab_context": f"{m.get('vocab_size')} / {m.get('max_position_embeddings')} tokens",
    }


def _card_training_values(record: dict) -> dict[str, str]:
    """Card fields for the training run: data, tokenizer, schedule, optimizer, hardware, runtime, command (the method
    rows: `_card_method_values`)."""
    train = record.get("training", {})
    data = record.get("data", {})
    metrics = record.get("metrics", {})
    par = record.get("parallel") or {}
    hw = record.get("hardware", {})
    return {
        "data": data.get("description", "n/a") + (f"; {data['train_size']}" if data.get("train_size") else "")
                + (f"; eval: {data['eval_size']}" if data.get("eval_size") else ""),
        "tokenizer": data.get("tokenizer", "n/a"),
        "schedule": f"{train.get('steps')} × {train.get('batch_size')} × {train.get('grad_accum')} × "
                    f"{par.get('world_size', 1)}" + (f" (sequences of {data['block_size']} tokens)"
                                                     if data.get("block_size") else ""),
        "optim": f"{train.get('lr')} (AdamW, {train.get('scheduler', 'cosine')}) / {train.get('precision')} / "
                 f"{train.get('seed')}",
        "hardware": hw.get("description", "n/a"),
        "runtime": f"{_fmt(metrics.get('total_runtime_s'))} s in total, {_fmt(metrics.get('train_runtime_s'))} s "
                   "training",
        "command": record.get("command", "n/a"),
    }


def card_values(record: dict) -> dict[str, str]:
    """Every `{{field}}` of the card template, formatted from a run record: 1. front matter and summary, 2. the model,
    3. the training, 4. offload and pipelining, 5. metrics and expert load, 6. usage and limitations."""
    m = record.get("model", {})
    task = record.get("task", "causal-lm")
    plots = record.get("plots", {})
    where = record.get("hub_model_id") or record.get("output_dir") or "path/to/model"
    name = record.get("hub_model_id") or os.path.basename(os.path.normpath(record.get("output_dir", "moe-gpt"))) or "moe-gpt"
    tags, extra = _card_front_matter(record)
    pipe = record.get("pipelining")
    with_pkg, without = _usage(record, where)
    return {
        "pipeline_tag": "text-classification" if task == "sequence-classification" else "text-generation",
        "license": record.get("license", "apache-2.0"),
        "tags": "\n".join(f"- {t}" for t in tags),
        "front_matter_extra": "".join(f"{e}\n" for e in extra),
        "model_name": name,
        "summary": _card_summary(record),
        **_card_model_values(m),
        **_card_training_values(record),
        **_card_method_values(record),
        "offload": _card_offload(record),
        "pipelining": ("Not used in this run." if not pipe
                       else _table([(k.replace("_", " "), f"`{v}`") for k, v in pipe.items()])),
        "metrics": _card_metrics(record.get("metrics", {})),
        "curves": f"![Training curves]({plots['training_curves']})" if plots.get("training_curves") else "",
        "expert_load_plot": plots.get("expert_load", "expert_load.png"),
        "expert_load": _card_expert_load(record, m.get("num_experts_per_tok", 1)),
        "usage_with_package": with_pkg,
        "usage_without_package": without,
        "limitations": record.get("limitations") or "See the training data and metrics above.",
    }


def render_model_card(record: dict, template: str | None = None) -> str:
    """Fill the card template from a run record. Raises `ValueError` naming any placeholder it cannot fill."""
    text = template if template is not None else load_card_template()
    values = card_values(record)
    missing = sorted({m.group(1) for m in _PLACEHOLDER.finditer(text)} - set(values))
    if missing:
        raise ValueError(f"the model card template has placeholders no run fills: {missing}")
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def write_model_card(folder: str, record: dict, template: str | None = None) -> str:
    """Write `README.md` (the model card) into `folder`; returns its path."""
    path = os.path.join(folder, CARD_FILE)
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_model_card(record, template))
    return path


__all__ = [
    "describe_model",
    "moe_layer_indices",
    "run_experts",
    "card_values",
    "render_model_card",
    "write_model_card",
    "load_card_template",
]
