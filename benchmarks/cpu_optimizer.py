"""Expert-wise CPU optimizer: (1) per-expert Adam throughput vs `torch.optim.AdamW(fused=True)` on the same tensors
(one expert per call, as in the eager mode of the per-expert loop; a layer's experts handed over at once, as in the
eager mode of the grouped host path; batched fused calls, as in the deferred mode's `step()`),
(1b) the same with bf16 compute copies refreshed by every step (a GPU's default under autocast): torch's fused AdamW
followed by the copy, against our steps writing the copy in the same pass (optim/fused_adam.py) and in a second pass,
(0) the host Adam in the training layout of a GPU step (the main thread busy in Python, a copy loop beside it) against
torch's fused AdamW alone on the same cores,
(2) step time of an offloaded MoE with expert steps overlapped with backward (eager, ES-MoE §4.1) vs the same
steps all after backward (deferred).

    python benchmarks/cpu_optimizer.py [--quick] [--layout-only] [--out FILE]

Writes benchmarks/cpu_optimizer.json. Ratios are measured in the same invocation, the variants interleaved.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from hf_moe_offload import ExpertAwareOptimizer, ExpertOptimizer, OffloadConfig, enable_expert_offload  # noqa: E402
from hf_moe_offload.offload import OffloadStats  # noqa: E402
from hf_moe_offload.offload.stores.store import HostExpertStore  # noqa: E402

sys.path.insert(0, HERE)
from offload import make_model  # noqa: E402
from timing import interleaved_rounds, median_ratio  # noqa: E402


class _Engine:
    """Just enough of an OffloadEngine to drive ExpertOptimizer over a bare store."""

    def __init__(self, store, numel):
        from hf_moe_offload.families.layouts import ExpertLayout, ExpertTensor
        from hf_moe_offload.offload.ledger import UpdateLedger
        from hf_moe_offload.offload.lora.lora_store import LoraStore
        from hf_moe_offload.offload.updates import ExpertUpdates

        self.store = store
        self.coordinator = None
        layout = ExpertLayout([ExpertTensor("w", (numel,), True)], len(store), None)
        self.layers = [type("L", (), {"layout": layout})()]
        self.ledger = UpdateLedger()  # the optimizer's hooks and pending updates, as the engine keeps them
        self.lora = LoraStore()  # no LoRA factors in this store
        self.updates = ExpertUpdates(self)  # what the optimizer sees of an engine (offload/updates.py)

    device_pins = None
    plan = None  # unbound: the optimizer's default workers and threads
    config = OffloadConfig()
    depth = 1

    def synchronize(self):
        self.ledger.wait_all()

    wait_in_flight = synchronize

    def wait_for_uploads(self):
        pass  # no device: nothing reads the host records

    def end_window(self):
        pass


def throughput(num_experts: int, numel: int, reps: int) -> dict:
    """Params/s of torch's fused AdamW and of our expert steps in their three modes, on the same tensors, interleaved
    round by round (`timing.interleaved_rounds`; a round steps every expert once per variant)."""
    torch.manual_seed(0)
    keys = [(0, e) for e in range(num_experts)]
    store = HostExpertStore(keys, numel, torch.float32, OffloadStats())
    for k in keys:
        r = store.acquire(k)
        r.param.normal_()
        r.grad.normal_()
        store.has_grad[k] = True
    noise = torch.randn(numel)  # a landed gradient
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in keys]
    for p in params:
        p.grad = torch.randn(numel)
    ref = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)

    def land_gradients():  # each step clears the gradient: land a new one (untimed) so every round does the same work
        for k in keys:
            store.acquire(k).add_grad(noise)
            store.has_grad[k] = True

    def handed(workers: int, together: bool):
        # Eager mode: each expert handed over alone, as the per-expert loop's backward does, or (`together`) a layer's
        # experts at once, as on the grouped host path and the disk tier's staged chunks, stepped several per fused
        # call on the workers.
        engine = _Engine(store, numel)
        opt = ExpertOptimizer(engine, lr=1e-3, weight_decay=0.01, workers=workers, boundary_fn=lambda: True)
        assert opt.eager

        def run():
            for group in [keys] if together else [[k] for k in keys]:
                assert len(opt._take_final([(k, store.acquire(k), None) for k in group])) == len(group)
            engine.synchronize()
            opt._stepped.clear()
        return opt, run

    def batched():
        # Deferred mode (global clipping or loss scaling, the Trainer's default): `step()` steps every ready expert,
        # several per fused multi-tensor call, split over the 2 workers.
        engine = _Engine(store, numel)
        opt = ExpertOptimizer(engine, lr=1e-3, weight_decay=0.01, workers=2, defer_steps=True,
                              boundary_fn=lambda: True)

        def run():
            opt.step()
            engine.synchronize()
        return opt, run

    variants = {"torch_fused": (None, ref.step), "expert_1w": handed(1, False), "expert_2w": handed(2, False),
                "expert_layer_2w": handed(2, True), "expert_batched_2w": batched()}
    times = interleaved_rounds({name: run for name, (_, run) in variants.items()}, reps, warmup=1,
                               setup=lambda name: land_gradients())
    for opt, _ in variants.values():
        if opt is not None:
            opt._pool.shutdown()
    work = num_experts * numel
    out = {"experts": num_experts, "params_per_expert": numel}
    for name, ts in times.items():
        out[f"{name}_params_per_s"] = work / statistics.median(ts)
    for name, key in (("expert_1w", "1w"), ("expert_2w", "2w"), ("expert_layer_2w", "layer"),
                      ("expert_batched_2w", "batched")):
        out[f"ratio_{key}_vs_torch_fused"] = median_ratio(times["torch_fused"], times[name])
    return out


def with_copies(num_experts: int, numel: int, reps: int) -> dict:
    """Params/s of an AdamW step that also refreshes a bf16 copy of each expert: torch's fused AdamW then
    `copy.copy_(param)` (two passes), and our batched deferred steps over a store with bf16 copies, through the
    one-pass kernel and with it disabled (two passes), interleaved round by round."""
    from hf_moe_offload.optim import fused_adam

    torch.manual_seed(0)
    keys = [(0, e) for e in range(num_experts)]
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in keys]
    copies = [torch.empty(numel, dtype=torch.bfloat16) for _ in keys]
    for p in params:
        p.grad = torch.randn(numel) * 1e-3
    ref = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)

    def torch_two_pass():
        ref.step()
        for p, c in zip(params, copies):
            c.copy_(p.detach())

    def ours(one_pass: bool):
        store = HostExpertStore(keys, numel, torch.bfloat16, OffloadStats())
        engine = _Engine(store, numel)
        opt = ExpertOptimizer(engine, lr=1e-3, weight_decay=0.01, workers=2, defer_steps=True,
                              boundary_fn=lambda: True)
        kernel = fused_adam.kernel()

        def land():
            for k in keys:
                store.acquire(k).add_grad(params[0].grad)
                store.has_grad[k] = True

        def run():
            saved, fused_adam._kernel = fused_adam._kernel, kernel if one_pass else False
            try:
                opt.step()
                engine.synchronize()
            finally:
                fused_adam._kernel = saved
        return opt, run, land

    variants = {"one_pass": ours(True), "two_pass": ours(False)}
    times = interleaved_rounds({"torch_fused_then_copy": torch_two_pass,
                                **{name: run for name, (_, run, _) in variants.items()}}, reps, warmup=1,
                               setup=lambda name: variants[name][2]() if name in variants else None)
    for opt, _, _ in variants.values():
        opt._pool.shutdown()
    out = {"experts": num_experts, "params_per_expert": numel, "kernel": fused_adam.kernel() is not None}
    for name, ts in times.items():
        out[f"{name}_params_per_s"] = num_experts * numel / statistics.median(ts)
    for name in variants:
        out[f"ratio_{name}_vs_torch"] = median_ratio(times["torch_fused_then_copy"], times[name])
    return out


class _Load:
    """What runs beside the host Adam in a training step on a GPU: the main thread in Python (launching the device's
    work; here a loop counting, half the time, and waiting the other half) and a copy loop (the uploads' staging;
    here 64 MiB copies back and forth)."""

    def __init__(self):
        self.stop = threading.Event()
        self.spins = 0
        self.threads = [threading.Thread(target=self._copy, daemon=True)]

    def _copy(self):
        a, b = torch.empty(16 * 2**20), torch.empty(16 * 2**20)
        while not self.stop.is_set():
            b.copy_(a)
            a.copy_(b)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def spin_until(self, future) -> None:
        """The main thread until `future` is done: 1 ms of Python, then 1 ms waiting (as on a device sync)."""
        while not future.done():
            until = time.perf_counter() + 1e-3
            while time.perf_counter() < until:
                self.spins += 1
            time.sleep(1e-3)

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()


def training_layout(num_experts: int, numel: int, reps: int) -> dict:
    """Params/s of the host Adam as it runs while a GPU trains: bf16 copies refreshed in the step, `step()` on the
    workers while the main thread runs Python and a copy loop runs beside it (`_Load`). Ours with the thread budget
    the plan gives a device (`OffloadConfig.optimizer_threads` unset: the cores less 2) and with each worker's team
    as large as the machine (how the workers ran before the budget), against torch's fused AdamW alone on the same
    cores with nothing beside it (the floor the issue measures against) and under the same load."""
    from concurrent.futures import ThreadPoolExecutor

    from hf_moe_offload.host_threads import DEVICE_THREADS, available_cores, optimizer_threads

    torch.manual_seed(0)
    keys = [(0, e) for e in range(num_experts)]
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in keys]
    for p in params:
        p.grad = torch.randn(numel) * 1e-3
    ref = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    side = ThreadPoolExecutor(1)  # torch's step off the main thread, as the workers are

    def torch_loaded():
        with _Load() as load:
            load.spin_until(side.submit(ref.step))

    cores = available_cores()
    budget = optimizer_threads(None, DEVICE_THREADS)

    def ours(threads: int):
        store = HostExpertStore(keys, numel, torch.bfloat16, OffloadStats())
        engine = _Engine(store, numel)
        engine.config = OffloadConfig(optimizer_threads=threads)
        opt = ExpertOptimizer(engine, lr=1e-3, weight_decay=0.01, workers=2, defer_steps=True,
                              boundary_fn=lambda: True)

        def land():
            for k in keys:
                store.acquire(k).add_grad(params[0].grad)
                store.has_grad[k] = True

        def run():
            with _Load() as load:
                load.spin_until(side.submit(lambda: (opt.step(), engine.synchronize())))
        return opt, run, land

    variants = {"ours_budget": ours(budget), "ours_full_teams": ours(2 * cores)}
    times = interleaved_rounds({"torch_fused_alone": ref.step, "torch_fused_loaded": torch_loaded,
                                **{name: run for name, (_, run, _) in variants.items()}}, reps, warmup=1,
                               setup=lambda name: variants[name][2]() if name in variants else None)
    for opt, _, _ in variants.values():
        opt._pool.shutdown()
    side.shutdown()
    out = {"experts": num_experts, "params_per_expert": numel, "cores": cores, "budget": budget}
    for name, ts in times.items():
        out[f"{name}_params_per_s"] = num_experts * numel / statistics.median(ts)
    for name in ("torch_fused_loaded", *variants):
        out[f"ratio_{name}_vs_torch_alone"] = median_ratio(times["torch_fused_alone"], times[name])
    return out


def overlap(num_experts: int, steps: int, tier: str) -> dict:
    base = make_model(num_experts, hidden=256, inter=1024, layers=4)
    batches = [torch.randint(0, 512, (8, 64)) for _ in range(steps)]
    times = {}
    for mode in ("overlapped", "after_backward"):
        model = copy.deepcopy(base)
        engine = enable_expert_offload(model, OffloadConfig(mode=tier, offload_dir=f"/tmp/bench-ovl-{mode}",
                                                            host_cache_experts=num_experts, prefetch_depth=2))
        # The same math, with every expert step deferred to after backward (no global-norm pass either way).
        experts = ExpertOptimizer(engine, lr=1e-3, defer_steps=mode == "after_backward")
        opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), experts)
        for i, x in enumerate(batches):
            if i == 1:
                t0 = time.perf_counter()
            model(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        engine.step_barrier()
        times[mode] = (time.perf_counter() - t0) / (steps - 1)
        experts.close()
    return {"tier": tier, "experts_per_layer": num_experts, "overlapped_step_s": times["overlapped"],
            "after_backward_step_s": times["after_backward"],
            "speedup": times["after_backward"] / times["overlapped"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layout-only", action="store_true", help="only the training layout (the GPU session's step)")
    ap.add_argument("--out", default=os.path.join(HERE, "cpu_optimizer.json"))
    args = ap.parse_args()
    sizes = [(64, 256 * 1024), (16, 2 * 1024 * 1024)]
    lay = [training_layout(e, n, 3 if args.quick else 8) for e, n in sizes]
    print("\nHost Adam in the training layout (M params/s; main thread busy, a copy loop beside it; bf16 copies)")
    print(f"{'experts':>7} {'params/expert':>13} {'torch alone':>11} {'torch loaded':>12} {'ours':>6} {'ratio':>6} "
          f"{'full teams':>10} {'ratio':>6}  (ratios vs torch alone; ours: {lay[0]['budget']} of "
          f"{lay[0]['cores']} cores)")
    for r in lay:
        print(f"{r['experts']:>7} {r['params_per_expert']:>13} {r['torch_fused_alone_params_per_s'] / 1e6:>11.0f} "
              f"{r['torch_fused_loaded_params_per_s'] / 1e6:>12.0f} {r['ours_budget_params_per_s'] / 1e6:>6.0f} "
              f"{r['ratio_ours_budget_vs_torch_alone']:>6.2f} {r['ours_full_teams_params_per_s'] / 1e6:>10.0f} "
              f"{r['ratio_ours_full_teams_vs_torch_alone']:>6.2f}")
    if args.layout_only:
        with open(args.out, "w") as f:
            json.dump({"machine": platform.platform(), "threads": torch.get_num_threads(), "layout": lay}, f,
                      indent=2)
        return
    torch.set_num_threads(2)
    tp = [throughput(64, 256 * 1024, 3 if args.quick else 10), throughput(16, 2 * 1024 * 1024, 3 if args.quick else 8)]
    print("\nPer-expert Adam throughput (M params/s)")
    print(f"{'experts':>7} {'params/expert':>13} {'torch fused':>11} {'ours 1 worker':>13} {'ours 2 workers':>14} "
          f"{'ratio(2w)':>9} {'layer, eager':>12} {'ratio':>6} {'batched 2w':>10} {'ratio':>6}")
    for r in tp:
        print(f"{r['experts']:>7} {r['params_per_expert']:>13} {r['torch_fused_params_per_s'] / 1e6:>11.0f} "
              f"{r['expert_1w_params_per_s'] / 1e6:>13.0f} {r['expert_2w_params_per_s'] / 1e6:>14.0f} "
              f"{r['ratio_2w_vs_torch_fused']:>9.2f} {r['expert_layer_2w_params_per_s'] / 1e6:>12.0f} "
              f"{r['ratio_layer_vs_torch_fused']:>6.2f} {r['expert_batched_2w_params_per_s'] / 1e6:>10.0f} "
              f"{r['ratio_batched_vs_torch_fused']:>6.2f}")
    cp = [with_copies(64, 256 * 1024, 3 if args.quick else 10),
          with_copies(16, 2 * 1024 * 1024, 3 if args.quick else 8)]
    print("\nAdam + bf16 copy refresh (M params/s): torch fused AdamW then copy_, ours in one pass, ours in two")
    print(f"{'experts':>7} {'params/expert':>13} {'torch+copy':>10} {'one pass':>8} {'ratio':>6} {'two pass':>8} "
          f"{'ratio':>6}")
    for r in cp:
        print(f"{r['experts']:>7} {r['params_per_expert']:>13} {r['torch_fused_then_copy_params_per_s'] / 1e6:>10.0f} "
              f"{r['one_pass_params_per_s'] / 1e6:>8.0f} {r['ratio_one_pass_vs_torch']:>6.2f} "
              f"{r['two_pass_params_per_s'] / 1e6:>8.0f} {r['ratio_two_pass_vs_torch']:>6.2f}")
    ov = [overlap(16, 4 if args.quick else 6, "host"), overlap(32, 4 if args.quick else 6, "host")]
    print("\nStep time: expert steps overlapped with backward vs all after backward (MoE-GPT d=256, ffn=1024)")
    print(f"{'tier':>5} {'E':>4} {'overlapped s':>12} {'after bwd s':>11} {'speedup':>8}")
    for r in ov:
        print(f"{r['tier']:>5} {r['experts_per_layer']:>4} {r['overlapped_step_s']:>12.3f} "
              f"{r['after_backward_step_s']:>11.3f} {r['speedup']:>8.2f}")
    with open(args.out, "w") as f:
        json.dump({"machine": platform.platform(), "threads": torch.get_num_threads(), "layout": lay,
                   "throughput": tp, "with_copies": cp, "overlap": ov}, f, indent=2)


if __name__ == "__main__":
    main()
