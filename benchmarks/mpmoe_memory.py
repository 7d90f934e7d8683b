"""MPMoE memory reuse on CPU: saved-for-backward bytes vs the Eq. 5-6 bound, and step time per (n, S).

    python benchmarks/mpmoe_memory.py [--quick]

1. For the MoE FFN shapes of MPMoE Table 3 (GPT-S 768/3072, BERT-L 1024/4096, GPT-XL 2048/8192; full size, 4 experts,
   top-2, 512 tokens -> B = 1024 dispatched rows, ReLU as the paper's in-place activation, fp32) and n = 2, 4, 8 with
   S1-S4: the bytes the layer holds for backward without reuse vs with reuse (device-resident saved tensors plus the
   shared partition buffers, two for T_DI and T_DO, one for T_M; see hf_moe_offload/pipelining/memory.py), the
   measured saving against Eq. 5, and Eq. 6's saving ratio phi (theory and measured).
2. Forward+backward time of one GPT-S-shaped MoE layer (8 experts, top-2, 512 tokens) for n = 1, 2, 4, 8 and each
   strategy, as ratios against n = 1 "keep" in the same invocation; and the configurator's automatic choice
   (performance model on this machine's micro-benchmarks) against the best measured configuration.

Writes benchmarks/mpmoe_memory.json; appends a section to benchmarks/RESULTS.md unless --no-results.
On CPU, host offload copies within the same RAM (no memory is actually freed by S1-S3 here) and there is no
communication: the timings show the overhead of partitioning and of each restore path, not MPMoE's GPU speedups.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from hf_moe_offload.models.moe_gpt import MoEGPTConfig, MoEGPTExperts  # noqa: E402
from hf_moe_offload.models.moe_gpt.moe_ops import DispatchPlan  # noqa: E402
from hf_moe_offload.families.moe_path import sorted_experts  # noqa: E402
from hf_moe_offload.pipelining import PartitionedExecutor, PipelineConfigurator  # noqa: E402
from hf_moe_offload.pipelining.memory import eq6_saving_ratio, measure_saving  # noqa: E402

TABLE3 = {"GPT-S": (768, 3072), "BERT-L": (1024, 4096), "GPT-XL": (2048, 8192)}
STRATEGIES = ["S1", "S2", "S3", "S4"]


def experts_and_plan(M: int, H: int, E: int, S: int, k: int = 2, act: str = "relu"):
    cfg = MoEGPTConfig(hidden_size=M, intermediate_size=H, num_experts=E, num_experts_per_tok=k,
                       activation_function=act, num_attention_heads=4)
    module = MoEGPTExperts(cfg)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02)
    experts = sorted_experts(module)  # the sorted signature the executors and `measure_saving` call
    x = torch.randn(S, M, requires_grad=True)
    ids = torch.stack([torch.randperm(S) % E, (torch.randperm(S) + 1) % E], -1)[:, :k]  # balanced load
    plan = DispatchPlan.build(torch.rand(S, k), ids, E, gathers=False)  # the partitions' index_add_ combine
    plan.weights.requires_grad_(True)  # a leaf: the router's gradient path, reusable across steps
    return experts, x, plan


def memory_table(quick: bool) -> list[dict]:
    rows = []
    E, S = 4, 512
    for name, (M, H) in TABLE3.items():
        if quick and name == "GPT-XL":
            continue
        torch.manual_seed(0)
        experts, x, plan = experts_and_plan(M, H, E, S)
        B = plan.token_index.numel()
        for n in (2, 4, 8):
            for s in STRATEGIES:
                m = measure_saving(x, plan, experts, n, s)
                theory_elems = m.theory_bytes / 4
                rows.append({
                    "model": name, "M": M, "H": H, "B": B, "n": n, "strategy": s,
                    "keep_MB": m.keep_bytes / 2**20, "reuse_MB": m.reuse_bytes / 2**20,
                    "saving_MB": m.saving_bytes / 2**20, "eq5_MB": m.theory_bytes / 2**20,
                    "fraction_of_bound": m.fraction_of_bound,
                    "phi_theory": eq6_saving_ratio(B, M, H, E, n, theory_elems),
                    "phi_measured": eq6_saving_ratio(B, M, H, E, n, m.saving_bytes / 4),
                })
        del experts
    return rows


def step_time(experts, x, plan, ex: PartitionedExecutor, gy: torch.Tensor) -> float:
    experts.module.zero_grad(set_to_none=True)
    x.grad = None
    t0 = time.perf_counter()
    out = ex(x, plan, experts)
    (out * gy).sum().backward()
    return time.perf_counter() - t0


def time_table(quick: bool) -> tuple[list[dict], dict]:
    torch.manual_seed(0)
    M, H = TABLE3["GPT-S"]
    experts, x, plan = experts_and_plan(M, H, 8, 512, act="gelu")
    gy = torch.randn_like(x)
    rounds = 3 if quick else 5
    configs = [(n, s) for n in (1, 2, 4, 8) for s in ["keep"] + STRATEGIES]
    executors = {c: PartitionedExecutor(*c) for c in configs}
    best = {c: float("inf") for c in configs}
    for r in range(rounds + 1):  # interleaved rounds (machine noise hits every config alike); round 0 warms up
        for c in configs:
            t = step_time(experts, x, plan, executors[c], gy)
            if r:
                best[c] = min(best[c], t)
    base = best[(1, "keep")]
    rows = [{"n": n, "strategy": s, "time_s": best[(n, s)], "vs_n1_keep": best[(n, s)] / base} for n, s in configs]
    t0 = time.perf_counter()
    cfg = PipelineConfigurator(M, H)
    choice = cfg.choose_for(plan.token_index.numel(), torch.float32, torch.device("cpu"))
    choose_s = time.perf_counter() - t0
    reuse_rows = [r for r in rows if r["strategy"] != "keep"]
    best_row = min(reuse_rows, key=lambda r: r["time_s"])
    if choice in best:
        chosen = best[choice]
    else:
        ex = PartitionedExecutor(*choice)
        chosen = min(step_time(experts, x, plan, ex, gy) for _ in range(rounds))
    auto = {"choice": {"n": choice[0], "strategy": choice[1]}, "configurator_s": choose_s,
            "best_measured": {"n": best_row["n"], "strategy": best_row["strategy"],
                              "vs_n1_keep": best_row["vs_n1_keep"]},
            "chosen_vs_n1_keep": chosen / base,
            "model_estimates_ms": {s: {n: cfg.model.time(plan.token_index.numel(), n, s) * 1e3 for n in (1, 2, 4, 8)}
                                   for s in STRATEGIES},
            "alpha": {f"{y}|{x_}": a for (y, x_), a in cfg.speeds.alpha.items()}}
    return rows, auto


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(2)
    t_start = time.perf_counter()
    mem = memory_table(args.quick)
    times, auto = time_table(args.quick)
    wall = time.perf_counter() - t_start

    lines = ["| model (M/H) | n | S | keep MB | reuse MB | saving MB | Eq. 5 MB | % of bound | phi theory "
             "| phi measured |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in mem:
        lines.append(f"| {r['model']} ({r['M']}/{r['H']}) | {r['n']} | {r['strategy']} | {r['keep_MB']:.1f} | "
                     f"{r['reuse_MB']:.1f} | {r['saving_MB']:.1f} | {r['eq5_MB']:.1f} | "
                     f"{100 * r['fraction_of_bound']:.2f} | {r['phi_theory']:.3f} | {r['phi_measured']:.3f} |")
    tlines = ["| n | keep | S1 | S2 | S3 | S4 |", "|---|---|---|---|---|---|"]
    for n in (1, 2, 4, 8):
        cells = [f"{next(r for r in times if r['n'] == n and r['strategy'] == s)['vs_n1_keep']:.2f}"
                 for s in ["keep"] + STRATEGIES]
        tlines.append(f"| {n} | " + " | ".join(cells) + " |")
    base_s = next(r for r in times if r["n"] == 1 and r["strategy"] == "keep")["time_s"]
    print("\nSaved-for-backward bytes vs Eq. 5 (B = 1024 rows, 4 experts, fp32)")
    print("\n".join(lines))
    print(f"\nGPT-S layer fwd+bwd time vs n=1 keep ({base_s * 1e3:.0f} ms), 8 experts, 512 tokens top-2")
    print("\n".join(tlines))
    print(f"\nauto: {auto['choice']} ({auto['chosen_vs_n1_keep']:.2f}x of n=1 keep; configurator "
          f"{auto['configurator_s']:.2f} s); best measured with reuse: {auto['best_measured']}")
    with open(os.path.join(HERE, "mpmoe_memory.json"), "w") as f:
        json.dump({"machine": platform.platform(), "threads": torch.get_num_threads(), "memory": mem,
                   "step_time": {"base_s": base_s, "rows": times}, "auto": auto, "wall_s": wall}, f, indent=2)
    if args.no_results:
        return
    fractions = [r["fraction_of_bound"] for r in mem]
    section = [
        "", "## MPMoE memory reuse: saved bytes vs Eq. 5-6, step time per (n, S) (CPU)", "",
        f"Command: `python benchmarks/mpmoe_memory.py{' --quick' if args.quick else ''}` "
        f"(machine: 2-core AMD EPYC CPU, no GPU; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{wall:.0f} s).", "",
        "Saved-for-backward bytes of one MoE layer at the FFN shapes of MPMoE Table 3 (4 experts, top-2, 512 tokens "
        "-> B = 1024 rows, ReLU, fp32). keep = what autograd holds without reuse (T_DI, T_M, T_DO, combine weights, "
        "row index; parameters excluded; each storage once); reuse = what stays on the device for backward plus the "
        "shared partition buffers (2 x T_DI, 1 x T_M, 2 x T_DO of the largest partition, §3.3). "
        "phi = Eq. 6 with M_ms of one expert + gate (Eq. 1).", "",
        *lines, "",
        f"- Measured saving is {100 * min(fractions):.2f}-{100 * max(fractions):.2f}% of the Eq. 5 bound "
        "(goal >= 95%, MPMoE reports ~95%); identical for S1-S4, which differ in how they restore, not in what they "
        "free. The gap is the combine weights, which our T_DO buffers also carry.", "",
        f"Forward+backward time of a GPT-S-shaped layer (8 experts, 512 tokens, top-2, GELU), ratio vs n=1 keep "
        f"({base_s * 1e3:.0f} ms) in the same invocation:", "",
        *tlines, "",
        f"- Auto (performance model on this machine's micro-benchmarks): n={auto['choice']['n']}, "
        f"{auto['choice']['strategy']} -> {auto['chosen_vs_n1_keep']:.2f}x of n=1 keep; best measured with reuse: "
        f"n={auto['best_measured']['n']}, {auto['best_measured']['strategy']} "
        f"({auto['best_measured']['vs_n1_keep']:.2f}x). Configurator (micro-benchmarks + search): "
        f"{auto['configurator_s']:.2f} s, once per shape.",
        "- On CPU host offload copies within the same RAM and there is no all-to-all to hide, so these are the "
        "overheads of partitioning and of each restore path (recomputation costs 2 extra GEMMs in backward: S3/S4), "
        "not MPMoE's GPU speedups. No GPU was available to this session: CUDA peak memory and step times not measured.",
        "",
    ]
    with open(os.path.join(HERE, "RESULTS.md"), "a") as f:
        f.write("\n".join(section))


if __name__ == "__main__":
    main()
