"""The benchmarks' harnesses still drive the library. CI does not run the benchmarks (minutes each, and they rewrite
their JSON), and a changed signature once broke `benchmarks/cpu_optimizer.py` without a test noticing: each harness
runs here once at a tiny size, through the functions `main()` calls, and what it computes is checked where it has a
bound. No timing is asserted."""

from __future__ import annotations

import importlib
import math
import os
import sys
import tempfile

import pytest
import torch


BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def bench(name: str):
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)  # the scripts import each other (timing, offload) by their bare names
    return importlib.import_module(name)


def test_cpu_optimizer_throughput_harness():
    out = bench("cpu_optimizer").throughput(4, 4096, reps=1)
    variants = ("torch_fused", "expert_1w", "expert_2w", "expert_layer_2w", "expert_batched_2w")
    assert all(out[f"{name}_params_per_s"] > 0 for name in variants)
    assert all(out[f"ratio_{key}_vs_torch_fused"] > 0 for key in ("1w", "2w", "layer", "batched"))


def test_cpu_optimizer_copy_refresh_harness():
    """The Adam + bf16-copy comparison runs all three variants (the kernel built where a compiler is)."""
    out = bench("cpu_optimizer").with_copies(4, 4096, reps=1)
    assert all(out[f"{name}_params_per_s"] > 0 for name in ("torch_fused_then_copy", "one_pass", "two_pass"))
    assert out["ratio_one_pass_vs_torch"] > 0 and out["ratio_two_pass_vs_torch"] > 0


def test_cpu_optimizer_training_layout_harness():
    """The host Adam in the training layout (the GPU session's first step): all four variants run under the load, ours
    with the plan's budget for a device."""
    from hf_moe_offload.host_threads import DEVICE_THREADS, optimizer_threads

    out = bench("cpu_optimizer").training_layout(4, 4096, reps=1)
    variants = ("torch_fused_alone", "torch_fused_loaded", "ours_budget", "ours_full_teams")
    assert all(out[f"{name}_params_per_s"] > 0 for name in variants)
    assert out["budget"] == optimizer_threads(None, DEVICE_THREADS)


def test_offload_step_time_harness_moves_at_least_the_minimum(tmp_path, monkeypatch):
    """Every tier trains; the disk tiers' bytes are at least `minimum_bytes` (a lower bound: if the accounting or the
    bound were wrong, a ratio below 1 would show it); the host tier moves nothing."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the harness's offload directories
    rows = bench("offload").step_time_table([4], steps=2, batch=2, seq=16, rounds=1)
    assert {r["tier"] for r in rows} == {"resident", "host", "disk", "disk-via-cache", "disk-recompute"}
    assert all(r["step_s"] > 0 for r in rows)
    for r in rows:
        if r["tier"].startswith("disk"):
            assert r["read_vs_minimum"] >= 1.0 and r["write_vs_minimum"] >= 1.0, r
        elif r["tier"] == "host":
            assert r["disk_read_MB_per_step"] == 0 and r["disk_write_MB_per_step"] == 0


def test_moe_layer_measure_harness():
    moe_layer = bench("moe_layer")
    variants = {"ours": moe_layer.ours(4), "ours_loop": moe_layer.ours_loop(4),
                "qwen3_grouped_mm": moe_layer.qwen3(4, "grouped_mm"), "qwen3_ours": moe_layer.qwen3(4, "ours")}
    out = moe_layer.measure(variants, 64, reps=1)
    assert out["ours"]["ratio_vs_ours"] == 1.0
    assert all(r["time_s"] > 0 and r["saved_bytes"] > 0 for r in out.values())


def test_mpmoe_memory_harness():
    """The saved-bytes count of one partitioned layer and a timed step, at a tiny shape (tests/test_pipelining.py
    checks the counts themselves against Eq. 5)."""
    mpmoe = bench("mpmoe_memory")
    from hf_moe_offload.pipelining import PartitionedExecutor

    experts, x, plan = mpmoe.experts_and_plan(16, 64, 4, 32)
    m = mpmoe.measure_saving(x, plan, experts, 2, "S1")
    assert m.saving_bytes > 0 and m.theory_bytes > 0
    assert mpmoe.step_time(experts, x, plan, PartitionedExecutor(2, "S1"), torch.randn(32, 16)) > 0


@pytest.mark.slow
def test_lm_head_memory_harness():
    """Both heads train on a small vocabulary in their own processes and end at the same loss (same seed, same
    tokens, same first steps: the chunked loss is the stock loss)."""
    run = bench("lm_head_memory").run
    stock, chunked = run("stock", 64, 512), run("chunked-16", 64, 512)
    assert stock["peak_mb"] > 0 and chunked["peak_mb"] > 0
    assert abs(stock["loss"] - chunked["loss"]) <= 1e-4 * abs(stock["loss"])


def test_gpu_train_qwen3_harness_on_the_simulated_device(tmp_path):
    """benchmarks/gpu_train_qwen3.py (issue 35's GPU benchmark against DeepSpeed) at a tiny size on the CPU, the
    offloaded variants on the simulated device: the slab path's bytes are counted (at least the routed experts'
    weights up and gradients down), every variant trains to a finite loss, and `estimate --measure`'s prediction
    stands beside the measured steps. The DeepSpeed rows need a GPU."""
    from hf_moe_offload.runtime import use_runtime
    from hf_moe_offload.runtime.simulated import SimulatedRuntime

    with use_runtime(SimulatedRuntime(seed=0, max_delay=0.0)):
        (result,) = bench("gpu_train_qwen3").main(["--quick", "--device", "cpu", "--measure",
                                                   "--out", str(tmp_path / "q.json")])
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"resident", "host", "host-pin", "host-fp32"}
    assert all(math.isfinite(r["last_loss"]) and r["step_s"] > 0 for r in rows.values())
    # `estimate --measure`'s prediction beside the measured step (host-fp32 has no estimate row)
    assert all(rows[name]["measure_predicted_step_s"] > 0 for name in ("resident", "host", "host-pin"))
    for name in ("host", "host-pin", "host-fp32"):
        assert rows[name]["h2d_GB"] > 0 and rows[name]["d2h_GB"] > 0
        # at most 1.3x what a step cannot avoid moving (the floor from the last step's routing and pins)
        assert rows[name]["h2d_over_floor"] <= 1.3 and rows[name]["d2h_over_floor"] <= 1.3, rows[name]
    assert os.path.exists(tmp_path / "q.json")


def test_gpu_train_qwen3_records_an_oom_and_writes_each_variant_as_it_ends(tmp_path, monkeypatch):
    """A variant that runs out of memory in a timed round (as under a GPU memory cap) is recorded as "OOM" and the
    others go on; the JSON on disk holds every variant's row as soon as its round ended (read here when the last
    variant starts its first timed step: the first variant's time and the OOM are there already)."""
    import json

    from hf_moe_offload.runtime import use_runtime
    from hf_moe_offload.runtime.simulated import SimulatedRuntime

    q = bench("gpu_train_qwen3")
    out = tmp_path / "q.json"
    real, calls, seen = q.Variant.step, {}, []

    def step(self, x):
        calls[self.name] = calls.get(self.name, 0) + 1
        if self.name == "host" and calls[self.name] > 1:  # past its warm-up
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if self.name == "host-pin" and calls[self.name] == 2:
            seen.append({r["variant"]: r for r in json.loads(out.read_text())[-1]["rows"]})
        return real(self, x)

    monkeypatch.setattr(q.Variant, "step", step)
    with use_runtime(SimulatedRuntime(seed=0, max_delay=0.0)):
        (result,) = q.main(["--quick", "--device", "cpu", "--variants", "resident,host,host-pin", "--out", str(out)])
    rows = {r["variant"]: r for r in result["rows"]}
    assert rows["host"]["error"] == "OOM" and "step_s" not in rows["host"]
    assert rows["resident"]["step_s"] > 0 and rows["host-pin"]["step_s"] > 0
    (early,) = seen
    assert early["resident"]["step_s"] > 0 and early["host"]["error"] == "OOM" and "host-pin" not in early
    final = json.loads(out.read_text())[-1]
    assert final["complete"] and {r["variant"] for r in final["rows"]} == {"resident", "host", "host-pin"}


def test_gpu_train_qwen3_cap_below_peers():
    """At the benchmark's default shape the cap sits between our host tier's device figure and ZeRO-2's floor, below
    the resident figure, at 2k tokens; at 16k tokens our activations exceed ZeRO-2's floor and no cap separates them."""
    q = bench("gpu_train_qwen3")
    config = q.qwen3_config(16, 64, 1024, 512, 8, 32000, 512)
    cap = q.cap_below_peers(config, 2048, 512)
    assert cap["ours_host_tier_GB"] < cap["cap_GB"] < cap["zero2_floor_GB"] < cap["resident_GB"]
    with pytest.raises(SystemExit, match="no cap separates"):
        q.cap_below_peers(config, 16384, 512)


def test_slab_dispatch_harness():
    """benchmarks/slab_dispatch.py at 8 experts: both paths count, and the slab dispatches less."""
    per_expert, slab = (bench("slab_dispatch").count(8, s) for s in (False, True))
    assert per_expert["path"] == "per-expert" and slab["path"] == "slab"
    assert 0 < slab["ops_per_layer"] < per_expert["ops_per_layer"]
    assert 0 < slab["copies_per_layer"] < per_expert["copies_per_layer"]


@pytest.mark.slow
def test_generate_device_harness_on_the_simulated_device(tmp_path):
    """`benchmarks/generate.py --device cuda`'s variants (issue 37), here on the simulated device: each loads and
    decodes, the device-cache rows report their hit rates and bytes uploaded, and every variant gives the resident
    model's tokens (fp32)."""
    from hf_moe_offload.runtime import use_runtime
    from hf_moe_offload.runtime.simulated import SimulatedRuntime

    gen = bench("generate")
    ckpt = str(tmp_path / "ckpt")
    config = gen.make_checkpoint(ckpt, layers=2, experts=8, hidden=32, inter=32, top_k=2)
    experts, expert_bytes = gen.expert_sizes(gen.load("resident", ckpt, str(tmp_path), config, 4), torch.float32)
    assert experts == 16
    prompt = torch.randint(1, config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    with use_runtime(SimulatedRuntime(seed=0, max_delay=0.0)):
        runs = {}
        for v in gen.DEVICE_VARIANTS:
            model = gen.load(v, ckpt, str(tmp_path), config, 4, torch.device("cpu"), torch.float32, expert_bytes,
                             experts).eval()
            runs[v] = [gen.run_once(model, prompt, 4)]
    rows = {r["variant"]: r for r in gen.summarize(runs, gen.DEVICE_VARIANTS, "accelerate cpu")}
    assert all(r["same_tokens_as_resident"] and r["decode_tok_s"] > 0 for r in rows.values())
    assert rows["ours host, device cache 0"]["device_cache_hit_rate"] is None
    assert rows["ours host, device cache 1/2"]["device_cache_hit_rate"] > 0
    assert rows["ours disk, device cache 1/4"]["uploaded_MB_per_token"] > 0


def test_lora_experts_harness(tmp_path):
    """benchmarks/lora_experts.py (issue 38) at a tiny size, each variant in this process through `run_variant`:
    the same trainable adapters everywhere, the losses of the first step equal where the experts are stored at full
    width (the same model, adapters and batch: LoRA streamed equals LoRA resident), the quantized stores smaller, and
    only the disk tier reads from disk."""
    import argparse

    lora = bench("lora_experts")
    args = argparse.Namespace(layers=2, experts=16, hidden=64, expert_ffn=64, steps=2, device="cpu", dtype="fp32",
                              ckpt=str(tmp_path / "ckpt"))
    assert lora.save_model(args) == 2 * 16 * 3 * 64 * 64 * 4  # fp32 bytes of the experts' gate/up and down
    rows = {}
    for variant in lora.VARIANTS:
        rows[variant] = lora.run_variant(argparse.Namespace(**vars(args), variant=variant,
                                                           work=str(tmp_path / variant)))
    assert len({r["trainable"] for r in rows.values()}) == 1
    first = [rows[v]["losses"][0] for v in ("resident", "host", "disk")]
    assert max(first) - min(first) < 1e-4, first
    assert rows["disk"]["disk_read_mib_per_step"] > 0 and rows["host"]["disk_read_mib_per_step"] == 0
    assert rows["disk-nf4"]["store_mib"] < rows["disk-int8"]["store_mib"] < rows["disk"]["store_mib"] / 2
    assert all(r["disk_read_mib_per_step"] > 0 for v, r in rows.items() if v.startswith("disk"))


def test_the_gpu_session_fits_its_device_window():
    """benchmarks/gpu_session.sh runs on a lent GPU for at most 8 minutes of device time, installs included: its
    steps' limits add up to at most 420 s (the host Adam first), each step names its limit, and the script parses."""
    import re
    import subprocess

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu_session.sh")
    text = open(script).read()
    limits = [int(m.group(2)) for m in re.finditer(r"^\s*step (\S+) (\d+) ", text, re.M)]
    assert len(limits) >= 4 and sum(limits) <= 420, limits
    assert text.index("step host_adam") < text.index("step train_qwen3")  # the host Adam is measured first
    assert subprocess.run(["bash", "-n", script]).returncode == 0
