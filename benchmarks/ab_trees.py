"""One training step's time of two checkouts of this package, A/B in one invocation (a refactor's "within noise").

Each round runs, for every tier, one subprocess per checkout (alternating which goes first), each importing the
package from its own tree and timing `--steps` training steps of the same model on the same batches after a warm-up
step; the table gives each tier's median per-step time per checkout and the median over rounds of the ratio B / A
(same round, so drift of a shared machine between rounds cancels).

    git worktree add /tmp/before <commit>
    python benchmarks/ab_trees.py /tmp/before . --rounds 5     # A: the commit, B: this tree
    python benchmarks/ab_trees.py /tmp/before . --tiers host --dtype bf16   # the host Adam's one-pass kernel

Writes benchmarks/ab_trees.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import statistics, sys, tempfile, time, torch
sys.path.insert(0, sys.argv[1])
import hf_moe_offload
from hf_moe_offload import (ExpertAwareOptimizer, ExpertOptimizer, MoEGPTConfig, MoEGPTForCausalLM, OffloadConfig,
                            enable_expert_offload)
assert hf_moe_offload.__file__.startswith(sys.argv[1]), hf_moe_offload.__file__
tier, steps, dtype = sys.argv[2], int(sys.argv[3]), sys.argv[4]
# bf16: the store keeps bf16 compute copies that every host step refreshes (the GPU's layout), under CPU autocast
half = {"compute_dtype": torch.bfloat16} if dtype == "bf16" else {}
torch.manual_seed(0)
torch.set_num_threads(2)
config = MoEGPTConfig(vocab_size=512, max_position_embeddings=128, hidden_size=128, num_hidden_layers=4,
                      num_attention_heads=4, intermediate_size=512, num_experts=16, num_experts_per_tok=2,
                      moe_layer_frequency=2, hidden_dropout=0.0, attention_dropout=0.0)
model = MoEGPTForCausalLM(config)
with tempfile.TemporaryDirectory() as folder:
    kw = {"offload_dir": folder, "host_cache_experts": 12} if tier == "disk" else {}
    engine = enable_expert_offload(model, OffloadConfig(mode=tier, **kw, **half))
    opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), ExpertOptimizer(engine, lr=1e-3))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 512, (8, 128), generator=g) for _ in range(steps + 1)]
    times = []
    for x in batches:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(half)):
            loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        engine.step_barrier()
        times.append(time.perf_counter() - t0)
    engine.synchronize()
print(statistics.median(times[1:]))
"""


def run(tree: str, tier: str, steps: int, dtype: str = "fp32") -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(tree), tier, str(steps), dtype],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.path.abspath(tree)})
    if out.returncode:
        raise RuntimeError(f"{tree} ({tier}) failed:\n{out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("a", help="checkout A (the baseline)")
    ap.add_argument("b", help="checkout B")
    ap.add_argument("--tiers", default="host,disk")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: bf16 compute copies refreshed by every host step, under CPU autocast")
    ap.add_argument("--out", default=os.path.join(HERE, "ab_trees.json"))
    args = ap.parse_args()
    tiers = args.tiers.split(",")
    times = {(t, side): [] for t in tiers for side in "ab"}
    for r in range(args.rounds):
        for tier in tiers:
            order = "ab" if r % 2 == 0 else "ba"
            for side in order:
                times[(tier, side)].append(run(getattr(args, side), tier, args.steps, args.dtype))
            print(f"round {r} {tier}: A {times[(tier, 'a')][-1]:.3f} s, B {times[(tier, 'b')][-1]:.3f} s", flush=True)
    rows = []
    for tier in tiers:
        a, b = times[(tier, "a")], times[(tier, "b")]
        rows.append({"tier": tier, "a_step_s": statistics.median(a), "b_step_s": statistics.median(b),
                     "b_over_a": statistics.median(y / x for x, y in zip(a, b)),
                     "b_over_a_range": [min(y / x for x, y in zip(a, b)), max(y / x for x, y in zip(a, b))]})
    print(f"\nA: {args.a}  B: {args.b}; {args.rounds} rounds, median of {args.steps} steps each, MoE-GPT 4 layers "
          f"(2 MoE x 16 experts, d=128), batch 8 x 128, {args.dtype}, 2 threads, {platform.processor() or 'cpu'}")
    print(f"{'tier':>5} {'A step s':>9} {'B step s':>9} {'B / A':>6} {'range':>13}")
    for row in rows:
        lo, hi = row["b_over_a_range"]
        print(f"{row['tier']:>5} {row['a_step_s']:>9.3f} {row['b_step_s']:>9.3f} {row['b_over_a']:>6.3f} "
              f"{lo:>6.3f}-{hi:<6.3f}")
    result = {"a": args.a, "b": args.b, "rounds": args.rounds, "steps": args.steps, "dtype": args.dtype,
              "machine": platform.platform(),
              "rows": rows}
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    main()
