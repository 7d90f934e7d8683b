"""Dynamic expert placement (ES-MoE §4.2) vs static expert parallelism: tokens per rank on skewed routings.

    python benchmarks/placement.py [--trials 40] [--tokens 8192] [--out benchmarks/placement.json]

For E experts on k ranks, each trial draws one MoE layer's routing of `tokens` tokens x top-2 from a Zipf-like
popularity (expert i of a random permutation gets weight 1 / (i + 1)^s; s = 0 is uniform up to sampling noise) and
reports the busiest rank's tokens over the mean (1.00 = perfectly balanced):

- static:    fixed contiguous blocks of experts per rank (fairseq / DeepSpeed expert parallelism);
- dynamic:   `plan_placement`, Graham's LPT on tokens (ES-MoE §4.2);
- +pins:     dynamic, with 25% of each rank's experts pinned from the previous batch (ES-MoE §4.3; consecutive
             batches of one trial share the popularity), pins kept on their rank;
- bound:     max(mean, largest expert) / mean -- no placement of whole experts can do better.

Also the planner's time per call. Prints a table and writes JSON next to this file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import time

from hf_moe_offload.distributed.placement import (
    PlacementCost,
    makespan_lower_bound,
    plan_placement,
    static_placement,
)


def routing(rng: random.Random, popularity: list[float], tokens: int) -> list[int]:
    """Tokens per expert for `tokens` tokens, each choosing two distinct experts by popularity (the second choice is
    redrawn while it equals the first)."""
    E = len(popularity)
    first = rng.choices(range(E), popularity, k=tokens)
    second = rng.choices(range(E), popularity, k=tokens * 3)
    counts = [0] * E
    j = 0
    for e in first:
        counts[e] += 1
        while second[j] == e:
            j += 1
            if j == len(second):
                second += rng.choices(range(E), popularity, k=tokens)
        counts[second[j]] += 1
        j += 1
    return counts


def ratio(tokens_per_rank: list[int]) -> float:
    mean = sum(tokens_per_rank) / len(tokens_per_rank)
    return max(tokens_per_rank) / mean


def pins_from(placement, tokens: list[int], world: int, fraction: float) -> dict[int, int]:
    pins = {}
    for r in range(world):
        ran = placement.experts_of(r)
        for e in sorted(ran, key=lambda e: (-tokens[e], e))[: math.ceil(fraction * len(ran))]:
            pins[e] = r
    return pins


def run(args) -> dict:
    rows = []
    for E in (16, 64):
        for world in (2, 4, 8):
            for s in (0.0, 0.8, 1.2):
                rng = random.Random(1000 * E + 10 * world + int(10 * s))
                static_r, dyn_r, pin_r, bound_r = [], [], [], []
                for _ in range(args.trials):
                    popularity = [1.0 / (i + 1) ** s for i in range(E)]
                    rng.shuffle(popularity)
                    previous = None
                    for batch in range(2):  # batch 0 sets the pins used by batch 1
                        tokens = routing(rng, popularity, args.tokens)
                        dynamic = plan_placement(tokens, world)
                        if batch == 0:
                            previous = (dynamic, tokens)
                            continue
                        pinned = plan_placement(tokens, world, PlacementCost(),
                                                pinned=pins_from(*previous, world, 0.25))
                        static_r.append(ratio(static_placement(tokens, world).tokens))
                        dyn_r.append(ratio(dynamic.tokens))
                        pin_r.append(ratio(pinned.tokens))
                        bound_r.append(makespan_lower_bound(tokens, world) / (sum(tokens) / world))
                rows.append({
                    "experts": E, "ranks": world, "zipf_s": s,
                    "static_max_over_mean": statistics.mean(static_r),
                    "static_worst": max(static_r),
                    "dynamic_max_over_mean": statistics.mean(dyn_r),
                    "dynamic_worst": max(dyn_r),
                    "dynamic_pinned_max_over_mean": statistics.mean(pin_r),
                    "bound_max_over_mean": statistics.mean(bound_r),
                })
    # Planner time per call (all ranks run it once per MoE layer and batch).
    timing = {}
    rng = random.Random(7)
    for E, world in ((64, 8), (256, 8), (512, 8)):
        popularity = [1.0 / (i + 1) for i in range(E)]
        tokens = routing(rng, popularity, 8192)
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            plan_placement(tokens, world, PlacementCost(upload_seconds=100.0))
        timing[f"E{E}_k{world}_us"] = (time.perf_counter() - t0) / n * 1e6
    return {"rows": rows, "plan_placement_time": timing, "trials": args.trials, "tokens": args.tokens,
            "top_k": 2, "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per MoE layer and batch (x top-2 assignments)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "placement.json"))
    args = p.parse_args()
    result = run(args)
    print(f"tokens per rank, max / mean (mean over {args.trials} trials; {args.tokens} tokens x top-2 per layer)")
    print(f"{'E':>4} {'k':>3} {'zipf s':>6} | {'static':>7} {'(worst)':>8} | {'dynamic':>7} {'(worst)':>8} | "
          f"{'+pins':>6} | {'bound':>6}")
    for r in result["rows"]:
        print(f"{r['experts']:>4} {r['ranks']:>3} {r['zipf_s']:>6.1f} | {r['static_max_over_mean']:>7.3f} "
              f"{r['static_worst']:>8.3f} | {r['dynamic_max_over_mean']:>7.3f} {r['dynamic_worst']:>8.3f} | "
              f"{r['dynamic_pinned_max_over_mean']:>6.3f} | {r['bound_max_over_mean']:>6.3f}")
    print("plan_placement time per call: " + ", ".join(f"{k} {v:.1f}" for k, v in result["plan_placement_time"].items()))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
