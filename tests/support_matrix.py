"""docs/support.md: which MoE family has which feature verified where, generated from the tests' own tables.

    python tests/support_matrix.py docs/support.md

Each evidence below names one test function; the families it covers are read from the test itself: its
`@pytest.mark.parametrize` list of families (the same list pytest runs), minus the families the generic tiny-config
shrink cannot build (tests/moe_families.py: those tests skip them); or, for a test written for one family, that
family, checked against the test's source. The simulated-device rows are the suites
tests/test_simulated_device.py re-runs under the simulated runtime (their `-k` expressions evaluated as pytest does).
The GPU rows are records of runs on a GPU machine (benchmarks/RESULTS.md): a test that passed there, or a figure
measured there, each with its machine, date and commit.

tests/test_support_matrix.py regenerates the page and compares it with the committed one. Nothing here trains a
model; building the tiny configs (one forward each) is the cost.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import transformers  # noqa: E402
from _pytest.mark.expression import Expression  # noqa: E402
from _pytest.mark.structures import ParameterSet  # noqa: E402

from moe_families import Unshrinkable, experts_families, tiny_config  # noqa: E402

REGENERATE = "python tests/support_matrix.py docs/support.md"
MOE_GPT = "moe_gpt"  # the package's own MoE-GPT (hf_moe_offload/models/moe_gpt)


def parametrized(module: str, test: str, argname: str) -> list:
    """The values `argname` takes in `module.test`'s `@pytest.mark.parametrize` marks (argnames may be joined:
    "tier,storage"; values may be `pytest.param`)."""
    func = getattr(importlib.import_module(module), test)
    for mark in getattr(func, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names = mark.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if argname not in names:
            continue
        values = [v.values if isinstance(v, ParameterSet) else v for v in mark.args[1]]
        if len(names) > 1:
            values = [v[names.index(argname)] for v in values]
        elif any(isinstance(v, ParameterSet) for v in mark.args[1]):
            values = [v[0] if isinstance(v, tuple) else v for v in values]
        return list(values)
    raise LookupError(f"tests/{module}.py::{test} has no parametrize over {argname!r}: update tests/support_matrix.py")


@dataclass(frozen=True)
class Evidence:
    """One test (or one GPU record) and the families it verifies a feature on."""

    where: str  # "CPU" | "sim" | "GPU test" | "GPU run"
    ref: str  # tests/test_x.py::test_name, or the benchmark and its machine, date and commit
    what: str  # what it compares, with its tolerance
    families: Callable[[], list[str]] = field(compare=False)


def from_parametrize(module: str, test: str, argname: str = "family",
                     require: dict[str, tuple] | None = None) -> Callable[[], list[str]]:
    """The families of `module.test`'s parametrize list; `require`: other parametrized arguments that must take these
    values (e.g. the host tier), checked so that the evidence does not outlive the test's table."""
    def families() -> list[str]:
        for name, wanted in (require or {}).items():
            values = parametrized(module, test, name)
            missing = [w for w in wanted if w not in values]
            if missing:
                raise LookupError(f"tests/{module}.py::{test} no longer runs {name}={missing}: update "
                                  "tests/support_matrix.py")
        return list(dict.fromkeys(parametrized(module, test, argname)))
    return families


def fixed(module: str, test: str, family: str, marker: str, helper: str | None = None) -> Callable[[], list[str]]:
    """A test written for one family: `marker` (how it builds that family's model) must be in its source, or in the
    source of the module's function `helper` that builds it."""
    def families() -> list[str]:
        mod = importlib.import_module(module)
        source = inspect.getsource(getattr(mod, test))
        if helper is not None:
            source = inspect.getsource(getattr(mod, helper))
        if marker not in source:
            raise LookupError(f"tests/{module}.py::{helper or test} no longer contains {marker!r}: check which family "
                              f"{test} tests and update tests/support_matrix.py")
        return [family]
    return families


def simulated(suite: str, candidates: Callable[[], list[str]],
              test_name: Callable[[str], str]) -> Callable[[], list[str]]:
    """The families of `candidates` whose test (named by `test_name(family)`) the simulated-device suite `suite`
    selects (tests/test_simulated_device.py's SUITES: files, node ids, `-k` expressions and `--deselect` prefixes,
    matched as pytest does)."""
    def families() -> list[str]:
        args = importlib.import_module("test_simulated_device").SUITES[suite]
        valued = ("-k", "--deselect")
        targets = [a for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or args[i - 1] not in valued)]
        keyword = args[args.index("-k") + 1] if "-k" in args else None
        deselected = tuple(args[i + 1] for i, a in enumerate(args) if a == "--deselect")
        out = []
        for family in candidates():
            node = test_name(family)  # "tests/test_x.py::test_name[id]"
            path, _, name = node.partition("::")
            # A target is a file, a test or one of its parametrizations: a test (or a parametrization) is selected
            # by its file, by itself, or, named without its id, by any of its parametrizations.
            if not any(t == path or node.startswith(t) or t.startswith(node + "[") for t in targets) or (
                    deselected and node.startswith(deselected)):
                continue
            if keyword is not None and not Expression.compile(keyword).evaluate(lambda s: s.lower() in name.lower()):
                continue
            out.append(family)
        return out
    return families


def recorded(*families: str) -> Callable[[], list[str]]:
    """The families of a GPU record (what ran then; the record is history and does not follow the tests)."""
    return lambda: list(families)


# --- the GPU records (benchmarks/RESULTS.md) ---
H200 = "H200 machine, 2026-11-25, b827c27"
GPU_TESTS = f"`pytest tests/test_cuda.py -n 8`, 50 passed ({H200})"

def _offload_tier(tier: str, family_text: str, moe_gpt_text: str, gpu_family_text: str, gpu_moe_gpt_text: str,
                  gpu_run: str, gpu_run_text: str) -> list[Evidence]:
    """One offload tier's evidence: the same tests, parametrized by `tier`, with the texts that differ."""
    return [
        Evidence("CPU", f"tests/test_families.py::test_family_offloaded_equals_stock[{tier}]", family_text,
                 from_parametrize("test_families", "test_family_offloaded_equals_stock", require={"tier": (tier,)})),
        Evidence("CPU", f"tests/test_offload.py::test_streamed_equals_resident_with_grad_accumulation[{tier}]",
                 moe_gpt_text,
                 fixed("test_offload", "test_streamed_equals_resident_with_grad_accumulation", MOE_GPT,
                       "small_model(")),
        Evidence("sim", "tests/test_simulated_device.py::test_suite_passes_on_the_simulated_device[families]",
                 "tests/test_families.py re-run on the simulated device",
                 simulated("families", lambda: experts_families(),
                           lambda f: f"tests/test_families.py::test_family_offloaded_equals_stock[{f}-{tier}]")),
        Evidence("sim", "tests/test_simulated_device.py::test_suite_passes_on_the_simulated_device[offload]",
                 "tests/test_offload.py re-run on the simulated device",
                 simulated("offload", lambda: [MOE_GPT],
                           lambda f: "tests/test_offload.py::test_streamed_equals_resident_with_grad_accumulation")),
        Evidence("GPU test", f"tests/test_cuda.py::test_cuda_family_offloaded_equals_stock[{tier}]",
                 f"{gpu_family_text}, {GPU_TESTS}",
                 recorded("qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3", "glm4_moe", "granitemoe")),
        Evidence("GPU test", f"tests/test_cuda.py::test_cuda_streamed_equals_resident[{tier}]",
                 f"{gpu_moe_gpt_text}, {GPU_TESTS}", recorded(MOE_GPT)),
        Evidence("GPU run", gpu_run, gpu_run_text, recorded(MOE_GPT)),
    ]


# feature -> its evidence. The features' names are the page's columns.
FEATURES: dict[str, list[Evidence]] = {
    "offload, host tier": _offload_tier(
        "host", "full training, 3 AdamW steps vs the stock model: logits and gradients 1e-5, weights 1e-4 (fp32)",
        "MoE-GPT streamed vs resident with gradient accumulation, prefetch depths 1-3, pins (fp32)",
        "the CPU comparison above on the GPU", "MoE-GPT streamed vs resident on the GPU",
        f"benchmarks/gpu_offload.py ({H200})",
        "MoE-GPT d=1024, 537 M expert parameters, bf16 autocast: step time, peak GPU memory and bytes per step vs the "
        "resident model (benchmarks/RESULTS.md); this was before the slab"),
    "offload, disk tier": _offload_tier(
        "disk", "as the host tier's, with a host cache of 2 experts (experts evicted and read again every step)",
        "MoE-GPT on the disk tier vs resident, as the host tier's", "the CPU comparison on the GPU",
        "MoE-GPT on the disk tier vs resident on the GPU",
        f"benchmarks/gpu_offload.py and the main job `hf-moe-offload train` ({H200})",
        "MoE-GPT: the benchmark's disk tier (bound by the VM's disk) and the main job's 400 steps (d=128: the pipeline "
        "on a GPU, not a speed figure); benchmarks/RESULTS.md"),
    "LoRA on experts": [
        Evidence("CPU", "tests/test_lora_families.py::test_family_lora_on_streamed_experts_equals_resident_lora",
                 "peft's LoRA on the expert tensors (and attention), frozen experts streamed from the host and disk "
                 "tiers vs peft's resident LoRA: fp32 1e-5, bf16 autocast 5e-2, 2 AdamW steps",
                 from_parametrize("test_lora_families", "test_family_lora_on_streamed_experts_equals_resident_lora",
                                  require={"tier": ("host", "disk")})),
        Evidence("CPU", "tests/test_expert_lora.py::test_lora_on_streamed_experts_equals_lora_on_resident_experts",
                 "the same comparison, 3 AdamW steps, host and disk tiers, fp32 and bf16 autocast",
                 from_parametrize("test_expert_lora", "test_lora_on_streamed_experts_equals_lora_on_resident_experts",
                                  require={"tier": ("host", "disk")})),
        Evidence("sim", "tests/test_expert_lora.py::test_lora_on_the_simulated_device_equals_lora_on_resident_experts",
                 "training through the slab and evaluation through the device expert cache, simulated",
                 fixed("test_expert_lora", "test_lora_on_the_simulated_device_equals_lora_on_resident_experts",
                       "qwen3_moe", '_pair("qwen3_moe"')),
    ],
    "quantized experts (nf4, int8)": [
        Evidence("CPU", "tests/test_quantized_experts.py::"
                        "test_quantized_experts_compute_what_the_library_dequantized_experts_compute",
                 "nf4 and int8 stores on the host and disk tiers compute what bitsandbytes' dequantized experts "
                 "compute (a quantized model is another model by design: the comparison is with it, not with the "
                 "bf16 one)",
                 from_parametrize("test_quantized_experts",
                                  "test_quantized_experts_compute_what_the_library_dequantized_experts_compute",
                                  require={"tier": ("host", "disk"), "storage": ("nf4", "int8")})),
        Evidence("CPU", "tests/test_quantized_experts.py::"
                        "test_lora_on_quantized_experts_equals_lora_on_the_dequantized_resident_model",
                 "LoRA on nf4/int8 experts vs LoRA on the dequantized resident model",
                 from_parametrize("test_quantized_experts",
                                  "test_lora_on_quantized_experts_equals_lora_on_the_dequantized_resident_model")),
        Evidence("CPU", "tests/test_prequantized_checkpoints.py::test_lora_on_nf4_frozen_experts_from_a_release",
                 "LoRA on nf4 experts loaded from an MXFP4 / FP8 release",
                 from_parametrize("test_prequantized_checkpoints", "test_lora_on_nf4_frozen_experts_from_a_release")),
        Evidence("sim", "tests/test_quantized_experts.py::"
                        "test_quantized_experts_on_the_simulated_device_upload_their_bytes_and_dequantize_there",
                 "the quantized rows uploaded and dequantized on the (simulated) device",
                 fixed("test_quantized_experts",
                       "test_quantized_experts_on_the_simulated_device_upload_their_bytes_and_dequantize_there",
                       "qwen3_moe", '_pair("qwen3_moe"')),
    ],
    "MPMoE pipelining": [
        Evidence("CPU", "tests/test_pipelining.py::test_causal_lm_equals_unpartitioned",
                 "MoE-GPT in 1-8 token partitions, restore strategies keep/S1-S4, resident and host tier, vs the "
                 "unpartitioned model (1e-5)",
                 fixed("test_pipelining", "test_causal_lm_equals_unpartitioned", MOE_GPT, "-> MoEGPTForCausalLM",
                       helper="tiny_model")),
        Evidence("CPU", "tests/test_families.py::test_qwen3_moe_micro_batch_pipelining_equals_stock",
                 "Qwen3-MoE partitions, S1-S4, device and host tier, vs the stock model",
                 fixed("test_families", "test_qwen3_moe_micro_batch_pipelining_equals_stock", "qwen3_moe",
                       'tiny_model("qwen3_moe")')),
        Evidence("sim", "tests/test_simulated_device.py::test_suite_passes_on_the_simulated_device"
                        "[pipelining+optimizer]", "tests/test_pipelining.py re-run on the simulated device",
                 simulated("pipelining+optimizer", lambda: [MOE_GPT],
                           lambda f: "tests/test_pipelining.py::test_causal_lm_equals_unpartitioned")),
        Evidence("sim", "tests/test_simulated_device.py::test_suite_passes_on_the_simulated_device[families]",
                 "tests/test_families.py's Qwen3-MoE partitions re-run on the simulated device",
                 simulated("families", lambda: ["qwen3_moe"],
                           lambda f: f"tests/test_families.py::test_{f}_micro_batch_pipelining_equals_stock")),
        Evidence("GPU test", "tests/test_cuda.py::test_cuda_micro_batch_pipelining_equals_unpartitioned",
                 f"MoE-GPT partitions (keep, S1-S4) vs the unpartitioned model on the GPU, {GPU_TESTS}",
                 recorded(MOE_GPT)),
    ],
    "expert parallel": [
        Evidence("CPU", "tests/test_distributed.py::test_expert_parallel_equals_one_process_on_the_concatenated_batch",
                 "2 and 3 gloo processes (static, dynamic placement on the host and disk tiers, PPMoE) vs one "
                 "process on the concatenated batch: gradients 5e-7, weights 2e-5",
                 fixed("test_distributed", "test_expert_parallel_equals_one_process_on_the_concatenated_batch",
                       MOE_GPT, '"dist_equivalence.py"')),
        Evidence("CPU", "tests/test_distributed.py::test_expert_parallel_on_qwen3_moe",
                 "the same on 2 gloo processes", fixed("test_distributed", "test_expert_parallel_on_qwen3_moe",
                                                        "qwen3_moe", '"--family", "qwen3_moe"')),
        Evidence("sim", "tests/test_simulated_device.py::test_suite_passes_on_the_simulated_device[expert-parallel]",
                 "the MoE-GPT comparison re-run on the simulated device",
                 simulated("expert-parallel", lambda: [MOE_GPT],
                           lambda f: "tests/test_distributed.py::"
                                     "test_expert_parallel_equals_one_process_on_the_concatenated_batch")),
    ],
    "Hub checkpoints": [
        Evidence("CPU", "tests/test_hub_checkpoints.py::test_hub_layout_checkpoint_streams_into_the_disk_tier",
                 "a checkpoint in the Hub's per-expert layout (one file and sharded) streamed expert by expert into "
                 "the disk tier equals transformers' own load",
                 from_parametrize("test_hub_checkpoints", "test_hub_layout_checkpoint_streams_into_the_disk_tier")),
        Evidence("CPU", "tests/test_hub_checkpoints.py::"
                        "test_train_cli_on_a_hub_checkpoint_and_load_the_output_without_this_package",
                 "`hf-moe-offload train --model-path` on it, the output loaded by stock transformers",
                 from_parametrize("test_hub_checkpoints",
                                  "test_train_cli_on_a_hub_checkpoint_and_load_the_output_without_this_package")),
        Evidence("CPU", "tests/test_prequantized_checkpoints.py::"
                        "test_release_streams_into_the_store_as_transformers_dequantizes_it",
                 "MXFP4 (gpt-oss) and FP8 (DeepSeek-V3, Qwen3 -FP8) releases dequantized expert by expert as "
                 "transformers dequantizes them",
                 lambda: sorted(importlib.import_module("test_prequantized_checkpoints").RELEASES)),
        Evidence("CPU", "tests/test_offload.py::test_save_pretrained_from_disk_tier_streams_and_loads_anywhere",
                 "MoE-GPT's own checkpoints saved from and loaded into the disk tier",
                 fixed("test_offload", "test_save_pretrained_from_disk_tier_streams_and_loads_anywhere", MOE_GPT,
                       "small_model(")),
    ],
    "generate": [
        Evidence("CPU", "tests/test_inference.py::test_greedy_generation_equals_the_resident_model",
                 "greedy tokens from the host and disk tiers (mapped files, pre-gating) equal the resident model's "
                 "(fp32, exact)",
                 from_parametrize("test_inference", "test_greedy_generation_equals_the_resident_model")),
        Evidence("CPU", "tests/test_inference.py::"
                        "test_a_bf16_model_keeps_bf16_experts_only_and_generates_the_resident_tokens",
                 "a bf16 model's greedy tokens equal the resident bf16 model's",
                 from_parametrize("test_inference",
                                  "test_a_bf16_model_keeps_bf16_experts_only_and_generates_the_resident_tokens")),
        Evidence("sim", "tests/test_device_generation.py::test_decoding_on_the_device_gives_the_resident_greedy_tokens",
                 "decoding on the (simulated) device with the device expert cache off and on: the resident greedy "
                 "tokens",
                 from_parametrize("test_device_generation",
                                  "test_decoding_on_the_device_gives_the_resident_greedy_tokens",
                                  require={"tier": ("host", "disk")})),
    ],
}

WHERE = {  # label -> what it means, in the page's legend
    "CPU": "tested on the CPU: the test runs in CI (`bash .ci/run`, 2 cores, no GPU) and compares with plain "
           "PyTorch / transformers / peft",
    "sim": "tested on the simulated device (hf_moe_offload/runtime/simulated.py): CUDA's stream ordering on the "
           "CPU, copies that land late, a missing wait raises; also in CI",
    "GPU test": "the test passed on a GPU (machine, date and commit named; the code has changed since)",
    "GPU run": "measured on a GPU (benchmarks/RESULTS.md; machine, date and commit named)",
}


def shrinkable() -> dict[str, str | None]:
    """family -> None where the generic shrink builds its tiny model, else the reason it cannot."""
    out = {}
    for family in experts_families():
        try:
            tiny_config(family)
            out[family] = None
        except Unshrinkable as err:
            out[family] = str(err)
    return out


def collect() -> tuple[list[tuple[str, str, Evidence]], dict[str, dict[str, list[str]]], dict[str, str | None]]:
    """((key, feature, evidence) numbered, family -> feature -> evidence keys, family -> why the shrink cannot build
    it or None)."""
    skipped = shrinkable()
    numbered, cells = [], {}
    for feature, evidence in FEATURES.items():
        for ev in evidence:
            key = str(len(numbered) + 1)
            numbered.append((key, feature, ev))
            for family in ev.families():
                if family != MOE_GPT and family not in skipped:
                    raise LookupError(f"{ev.ref} names {family!r}, which is not an MoE family of the installed "
                                      "transformers: update tests/support_matrix.py")
                if skipped.get(family):  # the test skips it (the generic shrink cannot build it)
                    continue
                cells.setdefault(family, {}).setdefault(feature, []).append(key)
    return numbered, cells, skipped


def _cell(keys: list[str], numbered: dict[str, Evidence]) -> str:
    if not keys:
        return "not tested"
    parts = []
    for where in WHERE:
        mine = [k for k in keys if numbered[k].where == where]
        if mine:
            parts.append(f"{where} {', '.join(mine)}")
    return "; ".join(parts)


def render() -> str:
    from hf_moe_offload.cli.reference import cell, join_markdown

    numbered, cells, skipped = collect()
    by_key = {key: ev for key, _, ev in numbered}
    built = [f for f, why in skipped.items() if why is None]
    lora_outside = importlib.import_module("test_lora_families").OUTSIDE_THE_TABLE
    outside_test = "tests/test_lora_families.py::test_outside_the_table_lora_on_streamed_experts_equals_resident_lora"
    features = list(FEATURES)
    lines = [
        "# Support matrix: which family has which feature, verified where", "",
        "Each cell says where a feature was verified for a family, by number: the evidence list below names the test "
        "(or the GPU run) and what it compares. Generated from the tests' own tables by", "",
        f"    {REGENERATE}", "",
        f"with transformers {transformers.__version__} (its MoE families are the rows: every model type whose "
        "modeling file has transformers' experts interface, tests/moe_families.py); tests/test_support_matrix.py "
        "regenerates it and fails where it differs. Do not edit it by hand.", "",
        "Where:", "",
    ]
    lines += [f"- **{where}**: {what}" for where, what in WHERE.items()]
    lines += ["- **not tested**: no test covers the pair. Every cell without \"GPU\" is **not measured on a GPU**; "
              "nothing has run on more than one GPU.", "",
              f"{len(built)} of {len(skipped)} transformers MoE families are built tiny by the tests' generic shrink "
              "and run through the tables; the others are [below](#families-the-tests-cannot-build-tiny), with the "
              "reason. MoE-GPT (`moe_gpt`) is this package's own model.", "",
              "## The matrix", "",
              "| family | " + " | ".join(features) + " |", "|---|" + "---|" * len(features)]
    for family in [MOE_GPT] + built:
        row = cells.get(family, {})
        lines.append(f"| `{family}` | " + " | ".join(_cell(row.get(f, []), by_key) for f in features) + " |")
    lines += ["", "## The evidence", ""]
    for feature in features:
        lines += [f"**{feature}**", ""]
        lines += [f"{key}. {ev.where}: {ev.ref}: {ev.what}" for key, of, ev in numbered if of == feature]
        lines.append("")
    lines += ["## Families the tests cannot build tiny", "",
              "Every feature of these is **not tested** as a whole model: the generic shrink of their default config "
              f"fails for the reason given. LoRA on streamed experts is tested on some of their text models "
              f"({outside_test}: host and disk tiers, fp32 and bf16 autocast, against peft's resident LoRA).", "",
              "| family | why the shrink cannot build it | LoRA on experts through |", "|---|---|---|"]
    text_models = {t: what for t, (*_, what) in lora_outside.items()}
    for family, why in skipped.items():
        if why is None:
            continue
        via = [t for t in text_models if t in (family, f"{family}_text")]
        lines.append(f"| `{family}` | {cell(why)} | {', '.join(f'`{t}` (CPU)' for t in via) or 'not tested'} |")
    extra = [t for t in text_models if t not in skipped and t.removesuffix("_text") not in skipped]
    if extra:
        lines += ["", "Model types outside transformers' table of MoE families (their modeling file is another "
                  "model's) with LoRA on streamed experts tested the same way: "
                  + ", ".join(f"`{t}` ({text_models[t]})" for t in extra) + "."]
    lines += ["", "## What this page does not say", "",
              "- Speed: the GPU figures are benchmarks/RESULTS.md's; on the CPU the tests check equality, not time.",
              "- Families outside transformers (fairseq MoE checkpoints: docs/fairseq.md) and custom layouts "
              "(docs/extending.md).",
              "- A \"GPU test\" cell is a run of the code of its commit; the code has changed since, and the tests "
              "added to tests/test_cuda.py after it (the slab, LoRA on streamed experts, quantized experts, "
              "decoding with the device expert cache) have not run on a GPU."]
    return join_markdown(lines)


def main(argv: list[str] | None = None) -> int:
    from hf_moe_offload.cli.reference import write_text_atomic

    parser = argparse.ArgumentParser(prog="python tests/support_matrix.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="the file to write, e.g. docs/support.md (default: print the page)")
    args = parser.parse_args(argv)
    text = render()
    if args.out is None:
        sys.stdout.write(text)
    else:
        write_text_atomic(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
