"""Expert offload on CPU: step time of the host and disk tiers vs resident, bytes moved per step against the minimum
for the cache (`minimum_bytes`), stall fraction, system CPU time and minor page faults per step, and the largest
expert count that trains within a fixed RSS budget with and without offload (ES-MoE Fig. 4 analogue).

    python benchmarks/offload.py                   # full table (~2 min on 2 cores)
    python benchmarks/offload.py --quick           # smaller sweep
    python benchmarks/offload.py --step-time-only  # the step-time table only (no JSON)
    python benchmarks/offload.py --checksums-only  # the disk tier's checksum cost only (no JSON)
    python benchmarks/offload.py --compute-path-only  # threads and staged chunks apart from I/O (own JSON)

Timings are ratios against the resident model measured in the same invocation: the tiers (and the disk tier forced to
recompute) run the same batches interleaved, round after round, and each reports its median round. Writes
benchmarks/offload.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import hf_moe_offload  # noqa: E402,F401
from hf_moe_offload import (  # noqa: E402
    ExpertAwareOptimizer,
    ExpertOptimizer,
    MoEGPTConfig,
    MoEGPTForCausalLM,
    OffloadConfig,
    enable_expert_offload,
)


def make_model(num_experts: int, hidden: int = 128, inter: int = 512, layers: int = 4,
               positions: int = 128) -> MoEGPTForCausalLM:
    torch.manual_seed(0)
    return MoEGPTForCausalLM(MoEGPTConfig(
        vocab_size=512, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=inter,
        num_experts=num_experts, moe_layer_frequency=2, max_position_embeddings=positions, hidden_dropout=0.0,
        attention_dropout=0.0))


def train_steps(model, opt, batches) -> tuple[float, float, int, float]:
    """-> (wall seconds, system CPU seconds, minor page faults, user CPU seconds) of the process over these steps."""
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for x in batches:
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return wall, r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt, r1.ru_utime - r0.ru_utime


def minimum_bytes(engine, cache_experts: int) -> tuple[float, float]:
    """The fewest bytes a disk tier with this cache must read and write per step. AdamW steps every expert
    each step (one without tokens has a zero gradient, as in the plain model: weight decay and moment decay), so of
    the K experts at most C = `cache_experts` stay in host memory and the other K - C have their Adam moments read
    and their weights and moments written once. Their weights are read twice if they had tokens (forward, and again
    for the reverse-order backward: a cache of C serves C of each sweep) and once if not (for the step). The cache is
    best spent on experts with tokens."""
    used = sum(1 for counts in engine.stats.tokens_per_expert.values() for n in counts if n)
    total, row = len(engine.store), engine.store.numel * 4
    uncached_used = max(0, used - cache_experts)
    uncached_idle = (total - used) - max(0, cache_experts - used)
    reads = uncached_used * 4 + uncached_idle * 3  # rows: weights x2 + moments; weights + moments
    return reads * row, max(0, total - cache_experts) * 3 * row


def ready_to_train(base, batches, mode: str, cache: int, **config):
    """(model, optimizer, engine or None): a copy of `base`, resident (`mode="resident"`) or offloaded with this
    cache, after one warm-up step (statistics reset)."""
    model = copy.deepcopy(base)
    engine = None
    if mode == "resident":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    else:
        engine = enable_expert_offload(model, OffloadConfig(
            mode=mode, offload_dir=tempfile.mkdtemp(prefix="bench-offload-"), host_cache_experts=cache,
            prefetch_depth=2, **config))
        opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
                                   ExpertOptimizer(engine, lr=1e-3))
    train_steps(model, opt, batches[:1])
    if engine is not None:
        engine.step_barrier()
        engine.stats.reset()
    return model, opt, engine


def interleaved(runs: dict, batches, rounds: int, before=lambda name: None) -> dict[str, list[tuple]]:
    """Each run of `runs` (name -> (model, optimizer, engine)) trains `batches`, run after run, `rounds` times
    (`before(name)` ahead of each): name -> per round (wall s per step, system CPU s, minor faults, user CPU s)."""
    out = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (model, opt, engine) in runs.items():
            before(name)
            wall, system, faults, user = train_steps(model, opt, batches)
            if engine is not None:
                engine.step_barrier()
            out[name].append((wall / len(batches), system, faults, user))
    return out


def cores_busy(rounds: list[tuple], steps: int) -> float:
    """The process's CPU time (user + system) over its wall time, over `interleaved` rounds of `steps` steps."""
    return sum(r[1] + r[3] for r in rounds) / sum(r[0] * steps for r in rounds)


def step_time_table(expert_counts, steps: int, batch: int, seq: int, rounds: int = 3) -> list[dict]:
    """Per expert count: the resident model, the host tier and the disk tier (cache: a quarter of the experts; with
    its defaults: forwards from the mapped files, each expert's forward graph kept; once reading the forwards'
    weights through the cache as on a GPU; once recomputing the graphs in backward) train the same batches,
    interleaved (`rounds` x `steps` steps each, tier after tier), after one warm-up step each. The step time is the
    median over rounds; the ratio is against the resident median of the same invocation. `cores_busy`: the process's
    CPU time (user + system) over its wall time."""
    rows = []
    for E in expert_counts:
        base = make_model(E)
        batches = [torch.randint(0, 512, (batch, seq)) for _ in range(steps)]
        cache = max(4, (E * 2) // 4)  # a quarter of the 2 MoE layers' experts
        runs = {"resident": ready_to_train(base, batches, "resident", cache),
                "host": ready_to_train(base, batches, "host", cache),
                "disk": ready_to_train(base, batches, "disk", cache),
                "disk-via-cache": ready_to_train(base, batches, "disk", cache, mmap_weights=False),
                "disk-recompute": ready_to_train(base, batches, "disk", cache, keep_activations=False)}
        rounds_of = interleaved(runs, batches, rounds)
        n = rounds * steps
        res_t = statistics.median(r[0] for r in rounds_of["resident"])
        for tier, (_, _, engine) in runs.items():
            t = statistics.median(r[0] for r in rounds_of[tier])
            row = {"experts_per_layer": E, "tier": tier, "step_s": t, "resident_step_s": res_t,
                   "ratio_vs_resident": t / res_t, "system_s_per_step": sum(r[1] for r in rounds_of[tier]) / n,
                   "minor_faults_per_step": sum(r[2] for r in rounds_of[tier]) / n,
                   "cores_busy": cores_busy(rounds_of[tier], steps)}
            if engine is not None:
                st = engine.stats
                read, written, mapped = st.disk_read_bytes / n, st.disk_write_bytes / n, st.disk_mapped_bytes / n
                row.update({
                    "disk_read_MB_per_step": read / 2**20,
                    "disk_mapped_MB_per_step": mapped / 2**20,
                    "disk_write_MB_per_step": written / 2**20,
                    "stall_fraction": st.stall_seconds / st.compute_seconds if st.compute_seconds else 0.0,
                    "cache_hit_rate": st.cache_hits / max(1, st.cache_hits + st.cache_misses),
                })
                if tier.startswith("disk"):
                    min_read, min_write = minimum_bytes(engine, cache)
                    # The minimum counts the forwards' weights, which a mapped forward takes from the page cache.
                    row.update({"read_vs_minimum": (read + mapped) / min_read if min_read else None,
                                "write_vs_minimum": written / min_write if min_write else None,
                                "min_read_MB_per_step": min_read / 2**20, "min_write_MB_per_step": min_write / 2**20})
                engine.store.close()
            rows.append(row)
    return rows


def checksum_table(expert_counts, steps: int, batch: int, seq: int, rounds: int = 3) -> list[dict]:
    """The disk tier's cost of checking every row it reads and writes: the same batches with the shipped checksum
    (XXH3-64), with zlib's CRC32 (the checksum before XXH3) and with none (a constant: nothing is checked),
    interleaved round after round in this invocation; median round, ratios against no checksum. Swapping the hash
    function is a benchmark-only patch of the store module."""
    import zlib

    from hf_moe_offload.offload.stores import expert_files as files_module
    from hf_moe_offload.offload.stores.store import tensor_bytes

    shipped = files_module._row_hash
    hashes = {"none": lambda buffer: 0, "crc32": lambda buffer: zlib.crc32(tensor_bytes(buffer)),
              "xxh3": shipped}

    def use(name: str) -> None:
        files_module._row_hash = hashes[name]

    rows = []
    try:
        for E in expert_counts:
            base = make_model(E)
            batches = [torch.randint(0, 512, (batch, seq)) for _ in range(steps)]
            runs = {}
            for name in hashes:
                use(name)  # the warm-up writes the files with this checksum
                runs[name] = ready_to_train(base, batches, "disk", max(4, (E * 2) // 4))
            walls = {name: statistics.median(r[0] for r in rs)
                     for name, rs in interleaved(runs, batches, rounds, before=use).items()}
            for name, (_, _, engine) in runs.items():
                rows.append({"experts_per_layer": E, "checksum": name, "step_s": walls[name],
                             "ratio_vs_none": walls[name] / walls["none"]})
                engine.store.close()
    finally:
        files_module._row_hash = shipped
    return rows


def compute_path_table(experts: int, steps: int, batch: int, seq: int, rounds: int = 4) -> list[dict]:
    """What the experts' compute path costs on the CPU, apart from the I/O: the host tier with its experts
    on every thread (`compute_threads=2`) and on one (the default on 2 cores), and the disk tier one expert at a time
    (`stage_experts=1`) and in staged chunks (the default with every expert cached; forced with a quarter cached,
    where the default is one at a time), each with every expert cached (no I/O) and with a quarter cached; all on the same batches, interleaved round after round; median round against resident."""
    base = make_model(experts)
    batches = [torch.randint(0, 512, (batch, seq)) for _ in range(steps)]
    quarter, everything = max(4, (experts * 2) // 4), experts * 2
    variants = {"resident": ("resident", quarter, {}),
                "host, 2 threads": ("host", quarter, {"compute_threads": 2}),
                "host": ("host", quarter, {}),
                "disk all cached, 1 at a time": ("disk", everything, {"stage_experts": 1}),
                "disk all cached, staged": ("disk", everything, {}),
                "disk 1/4 cached, 1 at a time": ("disk", quarter, {"stage_experts": 1}),
                "disk 1/4 cached, staged": ("disk", quarter, {"stage_experts": min(8, (quarter - 3) // 3)})}
    runs = {name: ready_to_train(base, batches, mode, cache, **config) for name, (mode, cache, config)
            in variants.items()}
    rounds_of = interleaved(runs, batches, rounds)
    res_t = statistics.median(r[0] for r in rounds_of["resident"])
    rows = []
    for name, (_, _, engine) in runs.items():
        t = statistics.median(r[0] for r in rounds_of[name])
        rows.append({"experts_per_layer": experts, "variant": name, "step_s": t, "ratio_vs_resident": t / res_t,
                     "stage_experts": engine.stage_experts if engine is not None else None,
                     "pins": engine.pin_limit if engine is not None else None,
                     "system_s_per_step": sum(r[1] for r in rounds_of[name]) / (rounds * steps),
                     "cores_busy": cores_busy(rounds_of[name], steps)})
        if engine is not None:
            engine.store.close()
    return rows


CAPACITY_CHILD = r"""
import json, sys, tempfile, psutil, torch
sys.path.insert(0, {here!r})
from offload import make_model
from hf_moe_offload import ExpertAwareOptimizer, ExpertOptimizer, OffloadConfig, enable_expert_offload
E, tier = int(sys.argv[1]), sys.argv[2]
torch.randn(8, 8) @ torch.randn(8, 8)
base = psutil.Process().memory_info().rss
if tier == "resident":
    model = make_model(E, hidden=64, inter=1024, layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
else:
    # Built layer by layer would be the production path (load_offloaded_pretrained); here the model is built
    # resident first, so the peak is measured from after the offload only: VmHWM is reset to the current RSS
    # (writing 5 to clear_refs, Linux >= 4.0), then training sets the peak, as for the resident model.
    model = make_model(E, hidden=64, inter=1024, layers=2)
    engine = enable_expert_offload(model, OffloadConfig(mode="disk", offload_dir=tempfile.mkdtemp(), host_cache_experts=16))
    import gc; gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), ExpertOptimizer(engine, lr=1e-3))
for _ in range(2):
    x = torch.randint(0, 512, (4, 64))
    model(x, labels=x).loss.backward(); opt.step(); opt.zero_grad()
# VmHWM (peak RSS of this image), not ru_maxrss, which keeps the forking parent's RSS across exec.
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({{"rss_now": psutil.Process().memory_info().rss - base,
                  "peak": peak - base}}))
"""


def capacity_table(budget_mb: int, resident_counts, offload_counts) -> list[dict]:
    """Peak RSS over the post-import baseline for growing expert counts; the largest count under the budget."""
    code = CAPACITY_CHILD.format(here=HERE)
    rows = []
    for tier, counts in (("resident", resident_counts), ("disk", offload_counts)):
        for E in counts:
            out = subprocess.run([sys.executable, "-c", code, str(E), tier], capture_output=True, text=True,
                                 env=dict(os.environ, OMP_NUM_THREADS="2"))
            if out.returncode:
                raise RuntimeError(out.stderr[-3000:])
            d = json.loads(out.stdout.strip().splitlines()[-1])
            held = d["peak"]  # peak RSS while training, both tiers (the disk tier's peak counts from after offloading)
            rows.append({"tier": tier, "experts_per_layer": E, "held_MB": held / 2**20, "peak_MB": d["peak"] / 2**20,
                         "expert_state_MB": E * 2 * (2 * 64 * 1024 + 1024 + 64) * 16 / 2**20,
                         "fits_budget": held / 2**20 <= budget_mb})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget-mb", type=int, default=400)
    ap.add_argument("--step-time-only", action="store_true", help="only the step-time table (no JSON written)")
    ap.add_argument("--checksums-only", action="store_true", help="only the checksum-cost table (no JSON written)")
    ap.add_argument("--capacity-only", action="store_true", help="only the RSS-capacity table (keeps the JSON's "
                    "step-time and checksum rows from the last full run)")
    ap.add_argument("--compute-path-only", action="store_true", help="only the compute-path table (writes "
                    "benchmarks/offload_compute_path.json)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.compute_path_only:
        rows = compute_path_table(32, steps=4, batch=8, seq=64)
        print(f"\nThe experts' compute path, MoE-GPT d=128, 32 experts x 2 MoE layers, batch 8x64 "
              f"(median of interleaved rounds)")
        print(f"{'variant':>30} {'step s':>7} {'x resident':>10} {'chunk':>5} {'pins':>4} {'sys s/step':>10} "
              f"{'cores busy':>10}")
        for r in rows:
            print(f"{r['variant']:>30} {r['step_s']:>7.3f} {r['ratio_vs_resident']:>10.2f} "
                  f"{r['stage_experts'] if r['stage_experts'] is not None else '-':>5} "
                  f"{r['pins'] if r['pins'] is not None else '-':>4} {r['system_s_per_step']:>10.3f} "
                  f"{r['cores_busy']:>10.2f}")
        with open(os.path.join(HERE, "offload_compute_path.json"), "w") as f:
            json.dump({"machine": platform.platform(), "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)
        return
    counts = [16, 32] if args.quick else [16, 32, 64]
    steps = 3 if args.quick else 5
    previous = {}
    if args.capacity_only:
        with open(os.path.join(HERE, "offload.json")) as f:
            previous = json.load(f)

    def fmt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    if not args.checksums_only:
        rows = previous.get("step_time") or step_time_table(counts, steps=steps, batch=8, seq=64,
                                                            rounds=2 if args.quick else 3)
        print(f"\nStep time, MoE-GPT 4 layers (2 MoE), d=128, ffn=512, batch 8x64, {platform.processor() or 'cpu'}")
        print(f"{'E':>4} {'tier':>14} {'step s':>7} {'x resident':>10} {'read MB/step':>12} {'mapped':>6} "
              f"{'x min':>5} {'write MB/step':>13} {'x min':>5} {'stall':>5} {'hit':>4} {'sys s/step':>10} "
              f"{'faults/step':>11} {'cores busy':>10}")
        for r in rows:
            print(f"{r['experts_per_layer']:>4} {r['tier']:>14} {r['step_s']:>7.3f} {r['ratio_vs_resident']:>10.2f} "
                  f"{fmt(r.get('disk_read_MB_per_step'), '.1f'):>12} {fmt(r.get('disk_mapped_MB_per_step'), '.1f'):>6} "
                  f"{fmt(r.get('read_vs_minimum'), '.2f'):>5} "
                  f"{fmt(r.get('disk_write_MB_per_step'), '.1f'):>13} {fmt(r.get('write_vs_minimum'), '.2f'):>5} "
                  f"{fmt(r.get('stall_fraction'), '.2f'):>5} {fmt(r.get('cache_hit_rate'), '.2f'):>4} "
                  f"{r['system_s_per_step']:>10.3f} {r['minor_faults_per_step']:>11.0f} "
                  f"{fmt(r.get('cores_busy'), '.2f'):>10}")
        if args.step_time_only:
            return
    sums = previous.get("checksums") or checksum_table(counts, steps=steps, batch=8, seq=64,
                                                       rounds=2 if args.quick else 3)
    print("\nThe disk tier's row checksums: step time with each, against none (same batches, interleaved)")
    print(f"{'E':>4} {'checksum':>8} {'step s':>7} {'x none':>6}")
    for r in sums:
        print(f"{r['experts_per_layer']:>4} {r['checksum']:>8} {r['step_s']:>7.3f} {r['ratio_vs_none']:>6.2f}")
    if args.checksums_only:
        return
    res_counts = [32, 64, 128] if args.quick else [32, 64, 128, 256]
    off_counts = [64, 256] if args.quick else [64, 256, 512]
    cap = capacity_table(args.budget_mb, res_counts, off_counts)
    print(f"\nRSS held while training (over the post-import baseline), budget {args.budget_mb} MiB; "
          "experts of d=64, ffn=1024, 2 MoE layers")
    print(f"{'tier':>8} {'E':>5} {'expert state MiB':>16} {'held MiB':>9} {'fits':>5}")
    for r in cap:
        print(f"{r['tier']:>8} {r['experts_per_layer']:>5} {r['expert_state_MB']:>16.0f} {r['held_MB']:>9.0f} "
              f"{str(r['fits_budget']):>5}")
    largest = {t: max([r["experts_per_layer"] for r in cap if r["tier"] == t and r["fits_budget"]], default=0)
               for t in ("resident", "disk")}
    print(f"largest expert count within {args.budget_mb} MiB: resident {largest['resident']}, "
          f"disk tier >= {largest['disk']} (largest tried)")
    out = {"machine": platform.platform(), "threads": torch.get_num_threads(), "step_time": rows, "checksums": sums,
           "capacity": cap,
           "largest_within_budget": largest, "budget_mb": args.budget_mb}
    with open(os.path.join(HERE, "offload.json"), "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
