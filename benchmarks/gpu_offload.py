"""Expert offload on a CUDA GPU: step time, peak GPU memory and bytes moved per step of the host and disk tiers vs the
resident model, under bf16 autocast (how users train on GPUs), in one invocation.

    python benchmarks/gpu_offload.py           # MoE-GPT d=1024, ffn=4096, 8 layers (4 MoE) x 16 experts (~3 min)
    python benchmarks/gpu_offload.py --quick   # d=512, ffn=2048
    python benchmarks/gpu_offload.py --batch 32 --tiers host,host-bf16   # 32k tokens per step
    python benchmarks/gpu_offload.py --tiers host,host-deferred          # expert steps overlapped vs after bwd
    python benchmarks/gpu_offload.py --family qwen3_moe --tokens 2048,8192,16384   # vs DeepSpeed: gpu_train_qwen3.py

Tiers: resident, host (fp32 weights uploaded; autocast casts them on the GPU), host-bf16 (`compute_dtype=bf16`: bf16
copies uploaded, half the bytes, the same bf16 GEMMs), disk. Each variant trains the same batches, interleaved round
after round (median round; ratios against the resident median of the same invocation), after one warm-up step. The
resident model steps with torch's fused AdamW on the GPU; the offloaded ones with ExpertAwareOptimizer: fused AdamW on
the GPU for the non-expert weights, the expert-wise Adam on the CPU (ES-MoE §4.1) for the experts, overlapped with
backward. `fwd+bwd` rows time forward and backward alone (no optimizer: the transfer pipeline of ES-MoE §4.1 by
itself). Peak GPU memory is `max_memory_allocated` over the timed steps, counted for that variant alone (the others
stay allocated). Writes benchmarks/gpu_offload.json. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from hf_moe_offload import ExpertAwareOptimizer, ExpertOptimizer, OffloadConfig, enable_expert_offload  # noqa: E402
from offload import make_model  # noqa: E402


def prepared(base, tier: str, cache: int, optimizer: bool, workers: int = 2):
    """(model, optimizer or None, engine or None) on the GPU. `tier`: resident, host, host-bf16 (bf16 compute
    copies: what the uploads carry), host-deferred (every expert step after backward instead of overlapped with it,
    ES-MoE §4.1), disk."""
    model, engine = copy.deepcopy(base), None
    if tier != "resident":
        engine = enable_expert_offload(model, OffloadConfig(
            mode=tier.split("-")[0], offload_dir=tempfile.mkdtemp(prefix="bench-gpu-"), host_cache_experts=cache,
            prefetch_depth=2, compute_dtype=torch.bfloat16 if tier.endswith("bf16") else None))
    model.cuda()  # the non-expert weights only where the experts are offloaded
    opt = None
    if optimizer:
        inner = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        opt = inner if engine is None else ExpertAwareOptimizer(
            inner, ExpertOptimizer(engine, lr=1e-4, defer_steps=tier.endswith("deferred"), workers=workers))
    return model, opt, engine


def step(model, opt, engine, x) -> None:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x, labels=x).loss
    loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)
        if engine is not None:
            engine.zero_grad()
    if engine is not None:
        engine.step_barrier()  # (`synchronize` would also send the device-pinned experts home every step)
    torch.cuda.synchronize()


def table(hidden: int, inter: int, experts: int, batch: int, seq: int, steps: int, rounds: int,
          tiers: list[str], workers: int = 2) -> list[dict]:
    base = make_model(experts, hidden=hidden, inter=inter, layers=8, positions=seq)
    n_experts = experts * 4
    cache = n_experts // 4
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 512, (batch, seq), generator=gen).cuda() for _ in range(steps)]
    variants = [(tier, with_opt) for with_opt in (True, False) for tier in ["resident"] + tiers
                if with_opt or not tier.endswith("deferred")]  # without an optimizer it is the host tier
    runs, held = {}, {}
    for tier, with_opt in variants:
        before = torch.cuda.memory_allocated()
        model, opt, engine = prepared(base, tier, cache, with_opt, workers)
        step(model, opt, engine, batches[0])  # warm-up (allocator, cuBLAS plans, the disk tier's first reads)
        held[tier, with_opt] = torch.cuda.memory_allocated() - before  # its weights, optimizer state, slots
        if engine is not None:
            engine.stats.reset()
        runs[tier, with_opt] = (model, opt, engine)
    times = {key: [] for key in runs}
    peaks = {key: 0 for key in runs}
    for _ in range(rounds):
        for key, (model, opt, engine) in runs.items():
            # Its own peak: what it holds, plus the most its steps allocate on top (the other variants' memory,
            # allocated all along, is left out).
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for x in batches:
                step(model, opt, engine, x)
            times[key].append((time.perf_counter() - t0) / steps)
            peaks[key] = max(peaks[key], held[key] + torch.cuda.max_memory_allocated() - before)
    rows = []
    tokens = batch * seq
    for (tier, with_opt), (model, opt, engine) in runs.items():
        t = statistics.median(times[tier, with_opt])
        base_t = statistics.median(times["resident", with_opt])
        row = {"tier": tier, "phase": "train step" if with_opt else "fwd+bwd", "step_s": t,
               "ratio_vs_resident": t / base_t, "tokens_per_s": tokens / t,
               "peak_gpu_MB": peaks[tier, with_opt] / 2**20}
        if engine is not None:
            st, n = engine.stats, rounds * steps
            row.update({"h2d_GB_per_step": st.h2d_bytes / n / 1e9, "d2h_GB_per_step": st.d2h_bytes / n / 1e9,
                        "disk_read_GB_per_step": st.disk_read_bytes / n / 1e9,
                        "disk_write_GB_per_step": st.disk_write_bytes / n / 1e9,
                        "stall_fraction": st.stall_seconds / st.compute_seconds if st.compute_seconds else 0.0})
            engine.store.close()
        rows.append(row)
    return rows


def main() -> None:
    if "--family" in sys.argv:
        family = sys.argv[sys.argv.index("--family") + 1]
        if family == "qwen3_moe":  # the Qwen3-MoE shape against DeepSpeed ZeRO-Offload
            from gpu_train_qwen3 import main as qwen3_main

            rest = sys.argv[1:]
            i = rest.index("--family")
            qwen3_main(rest[:i] + rest[i + 2 :])
            return
        if family != "moe_gpt":
            sys.exit(f"--family {family}: moe_gpt (this script's table) or qwen3_moe (gpu_train_qwen3.py)")
        sys.argv[sys.argv.index("--family") : sys.argv.index("--family") + 2] = []
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--experts", type=int, default=16, help="experts per MoE layer (4 MoE layers)")
    ap.add_argument("--batch", type=int, default=8, help="sequences of 1024 tokens per step")
    ap.add_argument("--tiers", default="host,host-bf16,disk", help="offloaded variants, against the resident model")
    ap.add_argument("--workers", type=int, default=2, help="ExpertOptimizer worker threads")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_offload.py needs a CUDA device")
    hidden, inter = (512, 2048) if args.quick else (1024, 4096)
    batch, seq, steps, rounds = args.batch, 1024, 3, 3
    rows = table(hidden, inter, args.experts, batch, seq, steps, rounds, args.tiers.split(","), args.workers)
    expert_params = args.experts * 4 * 2 * hidden * inter
    name = torch.cuda.get_device_name(0)
    print(f"\nMoE-GPT d={hidden}, ffn={inter}, 8 layers (4 MoE) x {args.experts} experts "
          f"({expert_params / 1e6:.0f} M expert parameters), batch {batch}x{seq}, bf16 autocast, {name}, "
          f"{os.cpu_count()} CPUs; disk/host cache {args.experts} experts")
    print(f"{'phase':>10} {'tier':>9} {'step s':>7} {'x resident':>10} {'tokens/s':>9} {'peak GPU MB':>11} "
          f"{'H2D GB':>7} {'D2H GB':>7} {'disk r GB':>9} {'disk w GB':>9} {'stall':>5}")
    for r in rows:
        def f(key, spec=".2f"):
            return format(r[key], spec) if key in r else "-"
        print(f"{r['phase']:>10} {r['tier']:>9} {r['step_s']:>7.3f} {r['ratio_vs_resident']:>10.2f} "
              f"{r['tokens_per_s']:>9.0f} {r['peak_gpu_MB']:>11.0f} {f('h2d_GB_per_step'):>7} "
              f"{f('d2h_GB_per_step'):>7} {f('disk_read_GB_per_step'):>9} {f('disk_write_GB_per_step'):>9} "
              f"{f('stall_fraction'):>5}")
    out = {"machine": platform.platform(), "gpu": name, "cpus": os.cpu_count(), "torch": torch.__version__,
           "hidden": hidden, "ffn": inter, "experts_per_layer": args.experts, "moe_layers": 4, "batch": batch,
           "seq": seq, "workers": args.workers, "rows": rows}
    name = ("gpu_offload.json" if (batch, args.tiers, args.workers) == (8, "host,host-bf16,disk", 2)
            else f"gpu_offload_b{batch}_{args.tiers.replace(',', '_')}_w{args.workers}.json")
    with open(os.path.join(HERE, name), "w") as fh:
        json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
