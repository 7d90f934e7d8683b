"""What a training step launches on an asynchronous device, expert by expert vs through the slab, counted on
the CPU with the simulated device: aten ops dispatched on the compute thread (each a kernel launch or a view on a
GPU), GEMMs among them, and copies enqueued on the side streams (uploads and gradient downloads). Timings on the
simulated device mean nothing; these counts are what the GPU profile (RESULTS.md, H200, 2026-11-25) measured per layer (470 mm, ~2,000
launches per MoE layer at 64 experts, top-8).

    python benchmarks/slab_dispatch.py            # Qwen3-MoE d=64, 2 layers, 8 / 32 / 128 experts, every expert routed
    python benchmarks/slab_dispatch.py --tiers host,disk   # also the disk tier (bytes up and down per step too)

Writes benchmarks/slab_dispatch.json.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from gpu_train_qwen3 import make_qwen3  # noqa: E402
from hf_moe_offload import OffloadConfig, enable_expert_offload  # noqa: E402
from hf_moe_offload.precision import GemmCounter  # noqa: E402
from hf_moe_offload.runtime import use_runtime  # noqa: E402
from hf_moe_offload.runtime.simulated import SimulatedRuntime  # noqa: E402

def round_robin_routing(model, experts: int) -> None:
    """Every router's choices replaced (a forward hook on its output) by token i -> experts i, i + 1, ... (mod E):
    every expert gets rows, whatever the random weights would choose."""
    def hook(module, inputs, output):
        logits, scores, index = output
        i = torch.arange(index.shape[0]).unsqueeze(1)
        return logits, scores, (i + torch.arange(index.shape[1])) % experts

    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(hook)


def count(experts: int, slab: bool, top_k: int = 2, rows_per_expert: int = 16, tier: str = "host") -> dict:
    with use_runtime(SimulatedRuntime(seed=0, max_delay=0.0)) as rt, tempfile.TemporaryDirectory() as folder:
        model = make_qwen3(2, experts, 64, 32, top_k, 256, 64)
        round_robin_routing(model, experts)
        # No room for the slab's two chunks: the per-expert loop through the stager's slots.
        budget = None if slab else 1
        # The disk tier caches every expert's record plus the slab's two chunks' room: the same chunks as the host
        # tier, its reads and writes on top.
        cache = {"host_cache_experts": 3 * experts + 8, "offload_dir": folder} if tier == "disk" else {}
        engine = enable_expert_offload(model, OffloadConfig(mode=tier, pin_fraction=0.0,
                                                            device_budget_bytes=budget, **cache))
        tokens = experts * rows_per_expert // top_k
        x = torch.randint(0, 256, (tokens // 16, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            model(x[:1, :4])  # binds the engine outside the count
        before = rt.copies
        engine.stats.reset()
        with GemmCounter() as mode:
            model(input_ids=x, labels=x).loss.backward()
        engine.step_barrier()
        assert (engine.slab is not None) == slab
        layers = len(engine.layers)
        st = engine.stats
        return {"experts": experts, "tier": tier, "path": "slab" if slab else "per-expert", "tokens": tokens,
                "h2d_bytes": st.h2d_bytes, "d2h_bytes": st.d2h_bytes,
                "ops_per_layer": sum(mode.ops.values()) / layers,
                "gemms_per_layer": mode.gemms / layers,
                "copies_per_layer": (rt.copies - before) / layers}


def main() -> list[dict]:
    tiers = sys.argv[sys.argv.index("--tiers") + 1].split(",") if "--tiers" in sys.argv else ["host"]
    rows = [count(e, slab, tier=tier) for tier in tiers for e in (8, 32, 128) for slab in (False, True)]
    print("\nQwen3-MoE d=64, expert FFN 32, 2 layers, top-2, 16 rows per expert; one training step (forward + "
          "backward) on the simulated device; per layer (the non-expert work of the layer included)")
    print(f"{'tier':>4} {'experts':>7} {'path':>10} {'tokens':>6} {'ops':>7} {'GEMMs':>6} {'copies':>6} "
          f"{'up bytes':>10} {'down bytes':>10}")
    for r in rows:
        print(f"{r['tier']:>4} {r['experts']:>7} {r['path']:>10} {r['tokens']:>6} {r['ops_per_layer']:>7.0f} "
              f"{r['gemms_per_layer']:>6.0f} {r['copies_per_layer']:>6.0f} {r['h2d_bytes']:>10} {r['d2h_bytes']:>10}")
    with open(os.path.join(HERE, "slab_dispatch.json"), "w") as fh:
        json.dump({"machine": platform.platform(), "torch": torch.__version__, "rows": rows}, fh, indent=2)
    return rows


if __name__ == "__main__":
    main()
