"""Step time under bf16 autocast vs fp32, per tier (resident, host, disk), on this machine.

    python benchmarks/mixed_precision.py            # E=32, 6 steps per run, 3 interleaved rounds
    python benchmarks/mixed_precision.py --quick

bf16 runs use CPU autocast and bf16 compute copies of the experts (`OffloadConfig(compute_dtype=torch.bfloat16)`,
what `--precision bf16` does); fp32 runs use neither. Every (tier, precision) pair is timed in the same process,
interleaved over rounds, and reported as the median step time and the ratio bf16 / fp32 of the same tier. Also
reported: float32 GEMMs in backward (0 expected under autocast) and the bytes each step moves. Writes
benchmarks/mixed_precision.json.
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

from offload import make_model  # noqa: E402

from hf_moe_offload import ExpertAwareOptimizer, ExpertOptimizer, OffloadConfig, enable_expert_offload  # noqa: E402
from hf_moe_offload.precision import GemmCounter  # noqa: E402


def build(base, tier: str, precision: str):
    model = copy.deepcopy(base)
    engine = None
    if tier == "resident":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    else:
        cfg = OffloadConfig(mode=tier, offload_dir=tempfile.mkdtemp(prefix="bench-amp-"), prefetch_depth=2,
                            host_cache_experts=16,
                            compute_dtype=torch.bfloat16 if precision == "bf16" else None)
        engine = enable_expert_offload(model, cfg)
        opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
                                   ExpertOptimizer(engine, lr=1e-3))
    return model, opt, engine


def timed_steps(model, opt, engine, precision: str, batches) -> tuple[float, int]:
    fp32_gemms = 0
    t0 = time.perf_counter()
    for x in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(x, labels=x).loss
        with GemmCounter() as gemms:
            loss.backward()
        fp32_gemms += gemms.by_dtype[torch.float32]
        opt.step()
        opt.zero_grad()
    if engine is not None:
        engine.step_barrier()
    return (time.perf_counter() - t0) / len(batches), fp32_gemms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--experts", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(2)
    steps, rounds = (3, 2) if args.quick else (6, 3)
    base = make_model(args.experts)
    batches = [torch.randint(0, 512, (8, 64)) for _ in range(steps)]
    runs = {}
    for tier in ("resident", "host", "disk"):
        for precision in ("fp32", "bf16"):
            model, opt, engine = build(base, tier, precision)
            timed_steps(model, opt, engine, precision, batches[:1])  # warm-up
            runs[(tier, precision)] = {"model": model, "opt": opt, "engine": engine, "times": [], "fp32_gemms": 0}
    for _ in range(rounds):  # interleaved: machine noise hits every configuration alike
        for (tier, precision), run in runs.items():
            if run["engine"] is not None:
                run["engine"].stats.reset()
            t, gemms = timed_steps(run["model"], run["opt"], run["engine"], precision, batches)
            run["times"].append(t)
            run["fp32_gemms"] = gemms
            if run["engine"] is not None:
                st = run["engine"].stats
                run["mb_per_step"] = (st.h2d_bytes + st.d2h_bytes + st.disk_read_bytes + st.disk_write_bytes) / 2**20 / steps
    rows = []
    for (tier, precision), run in runs.items():
        step_s = statistics.median(run["times"])
        fp32_s = statistics.median(runs[(tier, "fp32")]["times"])
        rows.append({"tier": tier, "precision": precision, "step_s": step_s, "ratio_vs_fp32": step_s / fp32_s,
                     "fp32_gemms_in_backward": run["fp32_gemms"], "moved_MB_per_step": run.get("mb_per_step", 0.0)})
    print(f"\nStep time, MoE-GPT 4 layers (2 MoE), E={args.experts}, d=128, ffn=512, batch 8x64, "
          f"{torch.get_num_threads()} threads, {platform.processor() or 'cpu'}")
    print(f"{'tier':>8} {'precision':>9} {'step s':>8} {'x fp32':>7} {'fp32 GEMMs bwd':>15} {'MB moved/step':>14}")
    for r in rows:
        print(f"{r['tier']:>8} {r['precision']:>9} {r['step_s']:>8.3f} {r['ratio_vs_fp32']:>7.2f} "
              f"{r['fp32_gemms_in_backward']:>15} {r['moved_MB_per_step']:>14.1f}")
    with open(os.path.join(HERE, "mixed_precision.json"), "w") as f:
        json.dump({"machine": platform.platform(), "threads": torch.get_num_threads(), "experts": args.experts,
                   "steps": steps, "rounds": rounds, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
