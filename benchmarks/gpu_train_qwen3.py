"""Offloaded training of a Qwen3-MoE-shaped model on one GPU against the peer a user would pick, DeepSpeed
ZeRO-Offload, in one invocation. Run through `benchmarks/gpu_offload.py --family qwen3_moe` or directly:

    python benchmarks/gpu_train_qwen3.py                         # 16 layers x 64 experts, top-8, d=1024, ffn 512
    python benchmarks/gpu_train_qwen3.py --tokens 8192,16384     # more tokens per step
    python benchmarks/gpu_train_qwen3.py --gpu-memory-gb 16      # the resident model OOMs, the host tier trains
    python benchmarks/gpu_train_qwen3.py --gpu-memory-gb below-peers  # a cap where resident and ZeRO-2 do not fit
    python benchmarks/gpu_train_qwen3.py --quick --device cpu    # a smoke run of the harness (tests/test_benchmarks.py)

Variants, each on the same batches, interleaved round after round (median round; ratios against the resident median
of the same invocation), after one warm-up step:
- resident: the whole model on the GPU, `torch.optim.AdamW(fused=True)`, bf16 autocast (transformers' grouped_mm);
- host: experts offloaded to host memory (ES-MoE), bf16 compute copies uploaded through the slab, the expert-wise Adam
  on the host overlapped with backward (`ExpertAwareOptimizer(AdamW(fused=True), ExpertOptimizer)`);
- host-pin: the same with ES-MoE's pinning (`pin_fraction=0.25`, the default): each layer's most-loaded quarter
  keeps its whole state on the GPU and steps there (offload/pins/device_pins.py), within the device budget;
- host-fp32: the host variant with fp32 weights uploaded (autocast casts them on the GPU);
- ds-zero2: DeepSpeed ZeRO-2, `offload_optimizer: cpu` (CPU-Adam), bf16; ds-zero3: ZeRO-3 with `offload_param` too,
  the model partitioned to host memory before the engine is made (`deepspeed.zero.Init(module=...)`: otherwise the
  engine moves the whole model to the GPU first) (needs `deepspeed`, benchmark-only: `DS_BUILD_OPS=0 pip install
  deepspeed`; CPU-Adam compiles at first use).

`--gpu-memory-gb below-peers` caps the GPU memory (`torch.cuda.set_per_process_memory_fraction`) at 95% of ZeRO-2's
floor (bf16 weights and gradients of every parameter, 4 bytes each, before activations), where what our host tier
needs on the device (`hf-moe-offload estimate`'s figure) is below that: what a user with a smaller card meets, where
ZeRO-3 with parameter offload is the peer left (at the default shape: 6.5 GB at 2k tokens; at 16k tokens our
activations alone exceed ZeRO-2's floor and no cap separates them). A variant that runs out of memory there, at its
warm-up or in a timed round, is recorded as "OOM" and the others go on; the JSON is rewritten after every variant's
round, so a run stopped at its time limit keeps what each variant measured so far.

Per variant: step time, x resident, GPU busy fraction (kernel time from the torch profiler over the wall time of one
profiled step), H2D / D2H bytes per step and their share of the floor (each routed expert not pinned on the device
up for its forward and once more for its backward, its gradient down once, in bf16: `transfer_floors`), the pins'
moves, host Adam seconds per step (ours: the expert steps' busy time), peak GPU memory. The floors measured in the same run: the resident step, the host Adam over the expert parameters (torch's fused CPU
AdamW), the transfers at the measured H2D bandwidth. Beside each measured step, `hf-moe-offload estimate`'s predicted
one (its time model with the link and host Adam rates measured here) and, with `--measure`, `estimate --measure`'s
(every rate measured at this shape and batch: hf_moe_offload/planning/measure.py). Writes
benchmarks/gpu_train_qwen3[_<tokens>][_cap...].json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from hf_moe_offload import ExpertAwareOptimizer, ExpertOptimizer, OffloadConfig, enable_expert_offload  # noqa: E402

VARIANTS = ("resident", "host", "host-pin", "host-fp32", "ds-zero2", "ds-zero3")


def qwen3_config(layers: int, experts: int, hidden: int, ffn: int, top_k: int, vocab: int, positions: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * ffn, moe_intermediate_size=ffn,
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 256),
        head_dim=64 if hidden >= 64 else hidden, num_experts=experts, num_experts_per_tok=top_k,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=positions, use_cache=False,
        router_aux_loss_coef=0.001, output_router_logits=False)


def make_qwen3(layers: int, experts: int, hidden: int, ffn: int, top_k: int, vocab: int, positions: int):
    from transformers import AutoModelForCausalLM

    config = qwen3_config(layers, experts, hidden, ffn, top_k, vocab, positions)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).train()


class Variant:
    """One way of training the model: `step(x)` runs forward, backward and the optimizer step."""

    def __init__(self, name: str, base, device: torch.device, lr: float = 1e-4):
        self.name, self.device, self.engine, self.ds = name, device, None, None
        self.experts = None
        model = copy.deepcopy(base)
        if name.startswith("ds-"):
            self.ds = _deepspeed_engine(model, stage=int(name[-1]), lr=lr)
            return
        if name != "resident":
            # host: bf16 copies (the default under autocast on a GPU, set here for the CPU smoke run too); host-fp32:
            # fp32 weights uploaded, autocast casts them on the device.
            self.engine = enable_expert_offload(model, OffloadConfig(
                mode="host", pin_fraction=0.25 if name == "host-pin" else 0.0,
                compute_dtype=torch.float32 if name == "host-fp32" else torch.bfloat16))
        model.to(device)  # the non-expert weights only where the experts are offloaded
        fused = {"fused": True} if device.type == "cuda" else {}
        inner = torch.optim.AdamW(model.parameters(), lr=lr, **fused)
        if self.engine is not None:
            self.experts = ExpertOptimizer(self.engine, lr=lr)
            self.opt = ExpertAwareOptimizer(inner, self.experts)
        else:
            self.opt = inner
        self.model = model

    def step(self, x: torch.Tensor) -> float:
        if self.ds is not None:
            loss = self.ds(input_ids=x, labels=x).loss
            self.ds.backward(loss)
            self.ds.step()
        else:
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                loss = self.model(input_ids=x, labels=x).loss
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            if self.engine is not None:
                self.engine.step_barrier()  # (`synchronize` would also send the device pins home)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return float(loss.detach())


def _deepspeed_engine(model, stage: int, lr: float):
    import deepspeed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "zero_optimization": zero, "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if stage == 3:
        # partitioned in host memory here, in bf16 (the engine checks a partitioned model's dtype); without it the
        # engine moves the whole model to the GPU before partitioning it, which a capped GPU cannot hold
        deepspeed.zero.Init(module=model.to(torch.bfloat16), config_dict_or_path=config, remote_device="cpu",
                            pin_memory=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def gpu_busy_fraction(variant: Variant, x: torch.Tensor) -> float | None:
    """Kernel time over wall time of one profiled step (CUDA only)."""
    if variant.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        variant.step(x)
        wall = time.perf_counter() - t0
    kernels = sum(e.device_time for e in prof.events() if e.device_type.name == "CUDA") / 1e6
    return kernels / wall


def transfer_floors(engine) -> tuple[int, int]:
    """Bytes per step a host-tier training step cannot avoid moving (no checkpointing here): each routed expert that
    is not pinned on the device goes up once for the forward and once more for its backward (which needs the weights
    again), and its gradient comes down once, in the compute dtype (the last step's routing and pins)."""
    width = engine.store.numel * engine.store.compute_dtype.itemsize
    pinned = set(engine.device_pins.keys()) if engine.device_pins is not None else set()
    moved = sum(1 for l, layer in enumerate(engine.layers) for e, n in enumerate(layer.last_counts)
                if n and (l, e) not in pinned)
    return max(1, 2 * moved * width), max(1, moved * width)


def host_adam_floor(params: int, repeats: int = 3) -> tuple[float, float]:
    """(seconds, params/s) of torch's fused CPU AdamW over `params` parameters: the host Adam floor."""
    p = torch.zeros(params, requires_grad=True)
    p.grad = torch.randn(params) * 1e-3
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    opt.step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return t, params / t


def h2d_bandwidth(nbytes: int) -> float | None:
    """Measured pinned host -> device bytes/s (CUDA only)."""
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - t0)


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def failed_row(name: str, err: BaseException) -> dict:
    """A variant that did not run: "OOM" where the GPU (or its cap) ran out of memory, else why it could not start."""
    detail = type(err).__name__ + ": " + (str(err).splitlines() or [""])[0][:160]
    return {"variant": name, "error": "OOM" if is_oom(err) else detail, "detail": detail}


def cap_below_peers(config, tokens: int, seq: int) -> dict:
    """A GPU memory cap (GB) where neither the resident model nor ZeRO-2 fits and our host tier does: 95% of ZeRO-2's
    floor (bf16 weights and gradients of every parameter, before its activations and buckets, which need more), where
    that is above the host tier's device figure (`hf-moe-offload estimate`); the resident figure is above both."""
    from hf_moe_offload.planning.estimate import Workload, estimate

    w = Workload(method="full", dtype=torch.bfloat16, batch_size=max(1, tokens // seq), seq_len=seq, device="cuda",
                 pin_fraction=0.0)
    est = estimate(config, w, device_budget=1 << 40, host_budget=1 << 50)
    zero2 = 4 * (est.expert_params + est.non_expert_params)
    ours, resident = est.tiers["host"].device_bytes, est.tiers["device"].device_bytes
    cap = 0.95 * zero2
    if ours >= cap:
        raise SystemExit(f"no cap separates them at this shape: our host tier needs {ours / 1e9:.1f} GB on the GPU, "
                         f"ZeRO-2 at least {zero2 / 1e9:.1f} GB")
    return {"cap_GB": cap / 1e9, "ours_host_tier_GB": ours / 1e9, "zero2_floor_GB": zero2 / 1e9,
            "resident_GB": resident / 1e9}


def table(args, tokens: int, device: torch.device, progress=lambda result: None) -> dict:
    """The variants' rows at `tokens` per step. `progress(result)` gets the table as measured so far after each
    variant's warm-up and each variant's round (a failed variant's row says why: "OOM")."""
    seq = args.seq
    batch = max(1, tokens // seq)
    base = make_qwen3(args.layers, args.experts, args.hidden, args.ffn, args.top_k, args.vocab, seq)
    expert_params = sum(p.numel() for n, p in base.named_parameters() if ".experts." in n)
    cap = None
    if args.gpu_memory_gb == "below-peers":
        cap = cap_below_peers(base.config, batch * seq, seq)
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap["cap_GB"] * 1e9 / total), device)
        print(f"GPU memory cap {cap['cap_GB']:.2f} GB (ours {cap['ours_host_tier_GB']:.2f}, ZeRO-2 at least "
              f"{cap['zero2_floor_GB']:.2f}, resident {cap['resident_GB']:.2f})", flush=True)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab, (batch, seq), generator=gen).to(device) for _ in range(args.steps)]
    rows, runs = {}, {}
    times, adam, peaks, losses = {}, {}, {}, {}
    head = {"tokens_per_step": batch * seq, "batch": batch, "seq": seq, "expert_params": expert_params, "cap": cap}

    def snapshot(final_rows: dict | None = None) -> dict:
        out = final_rows or {name: rows.get(name) or (measured_row(name, runs[name]) if times.get(name) else None)
                             for name in args.variants}
        return {**head, "rows": [r for r in out.values() if r is not None]}

    def measured_row(name: str, variant: Variant) -> dict:
        t = statistics.median(times[name])
        base_t = statistics.median(times["resident"]) if times.get("resident") else None
        row = {"variant": name, "step_s": t, "x_resident": t / base_t if base_t else None,
               "tokens_per_s": batch * seq / t, "peak_gpu_GB": peaks[name] / 1e9 if peaks[name] else None,
               "last_loss": losses[name][-1], "rounds": len(times[name])}
        if variant.engine is not None:
            n = len(times[name]) * len(batches)
            st = variant.engine.stats
            up_floor, down_floor = transfer_floors(variant.engine)
            row.update({"h2d_GB": st.h2d_bytes / n / 1e9, "h2d_reupload_GB": st.h2d_reupload_bytes / n / 1e9,
                        "d2h_GB": st.d2h_bytes / n / 1e9, "h2d_over_floor": st.h2d_bytes / n / up_floor,
                        "d2h_over_floor": st.d2h_bytes / n / down_floor,
                        "pin_move_GB": st.pin_move_bytes / n / 1e9,
                        "host_adam_s": statistics.median(adam[name]) if adam[name] else None})
        return row

    def drop(name: str, err: BaseException) -> None:
        rows[name] = failed_row(name, err)
        runs.pop(name, None)
        print(f"{name}: {rows[name]['error']}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    weights_bf16 = expert_params * 2
    for name in args.variants:
        if name.startswith("ds-") and device.type != "cuda":
            continue
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            variant = Variant(name, base, device)
            variant.step(batches[0])  # warm-up (allocator, cuBLAS plans, CPU-Adam's build)
        except Exception as err:  # noqa: BLE001 - an OOM under a cap is a result, not a crash
            if not is_oom(err) and not isinstance(err, ImportError):
                raise
            variant = None
            drop(name, err)
        if variant is not None:
            if variant.engine is not None:
                variant.engine.stats.reset()
            runs[name] = variant
            times[name], adam[name], peaks[name], losses[name] = [], [], 0, []
        progress(snapshot())
    for _ in range(args.rounds):
        for name, variant in list(runs.items()):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                t0 = time.perf_counter()
                for x in batches:
                    losses[name].append(variant.step(x))
                    if variant.experts is not None:
                        adam[name].append(variant.experts.step_seconds)
                elapsed = (time.perf_counter() - t0) / len(batches)
            except Exception as err:  # noqa: BLE001 - as at the warm-up
                if not is_oom(err):
                    raise
                drop(name, err)
                del variant
                progress(snapshot())
                continue
            times[name].append(elapsed)
            print(f"{tokens} tokens, {name}: {times[name][-1]:.3f} s per step", flush=True)
            if device.type == "cuda":
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated())
            progress(snapshot())
    adam_s, adam_rate = host_adam_floor(expert_params if not args.quick else min(expert_params, 2**20))
    if args.quick:
        adam_s *= expert_params / min(expert_params, 2**20)
    bandwidth = h2d_bandwidth(min(weights_bf16, 2**30))
    transfer_floor = 2 * weights_bf16 / bandwidth if bandwidth else None
    base_t = statistics.median(times["resident"]) if times.get("resident") else None
    final = {}
    for name in args.variants:
        if name in rows:
            final[name] = rows[name]
        elif name in runs:
            row = measured_row(name, runs[name])
            try:
                row["gpu_busy"] = gpu_busy_fraction(runs[name], batches[0])
            except Exception as err:  # noqa: BLE001 - the profiled step's own memory
                if not is_oom(err):
                    raise
                row["gpu_busy"] = None
            final[name] = row
    floors = {"resident_step_s": base_t, "host_adam_s": adam_s, "host_adam_params_per_s": adam_rate,
              "transfer_s": transfer_floor, "h2d_GB_per_s": bandwidth / 1e9 if bandwidth else None}
    largest = max(v for k, v in floors.items() if k in ("resident_step_s", "host_adam_s", "transfer_s") and v)
    predicted = predicted_steps(base.config, batch, seq, device, adam_rate, bandwidth)
    measured = measured_steps(base.config, batch, seq, device, list(final)) if args.measure else {}
    for name, row in final.items():
        if "step_s" in row:
            row["x_largest_floor"] = row["step_s"] / largest
            if name in predicted:  # `hf-moe-offload estimate`'s time model with this run's link and host Adam rates
                row["predicted_step_s"] = predicted[name]
                row["measured_x_predicted"] = row["step_s"] / predicted[name]
            if name in measured:  # `hf-moe-offload estimate --measure`'s prediction, measured in this process
                row["measure_predicted_step_s"] = measured[name]
                row["step_x_measure_predicted"] = row["step_s"] / measured[name]
    return {**snapshot(final), "floors": floors}


def measured_steps(config, batch: int, seq: int, device: torch.device, variants: list[str]) -> dict[str, float]:
    """The step `hf-moe-offload estimate --measure` predicts (rates measured on `device` at this shape and batch) for
    those of `variants` it models: the resident model, ours with pins (one measuring) and without (another). Its
    resident model computes in bf16 (the estimate's model dtype), where the resident variant keeps fp32 weights
    under autocast."""
    from hf_moe_offload.planning.estimate import Workload, estimate
    from hf_moe_offload.planning.measure import measure, predict

    out = {}
    for names, pins in ((("resident", "host-pin"), 0.25), (("host",), 0.0)):
        names = [name for name in names if name in variants]
        if not names:
            continue
        w = Workload(method="full", dtype=torch.bfloat16, batch_size=batch, seq_len=seq, device=device.type,
                     pin_fraction=pins)
        est = estimate(config, w, host_budget=1 << 50)
        m = measure(config, torch.bfloat16, batch, seq, pin_fraction=pins, device=device, repeats=3, warmup=1)
        print(f"estimate --measure (pins {pins}): measured in {m.seconds:.0f} s", flush=True)
        steps = predict(est, m, config.num_hidden_layers)
        for name in names:
            out[name] = steps["device" if name == "resident" else "host"].window_s
    return out


def predicted_steps(config, batch: int, seq: int, device: torch.device, adam_rate: float,
                    bandwidth: float | None) -> dict[str, float]:
    """The step `hf_moe_offload.planning.estimate` predicts for the resident model and for ours with and without pins, on the
    GPU's row of its table (compute rate) with the link and host Adam rates this run measured."""
    from hf_moe_offload.planning.estimate import Workload, estimate
    from hf_moe_offload.planning.time_model import gpu_key, resolve_rates

    key = gpu_key(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if key is None:
        return {}
    rates = resolve_rates(key, host_adam_gps=adam_rate / 1e9, pcie_gbps=bandwidth / 1e9 if bandwidth else None)
    free = torch.cuda.mem_get_info(device)[0]
    out = {}
    for name, tier, pins in (("resident", "device", 0.25), ("host", "host", 0.0), ("host-pin", "host", 0.25)):
        w = Workload(method="full", dtype=torch.bfloat16, batch_size=batch, seq_len=seq, device="cuda",
                     pin_fraction=pins)
        out[name] = estimate(config, w, device_budget=free, host_budget=1 << 50, rates=rates).tiers[tier].time.window_s
    return out


def print_table(result: dict, title: str) -> None:
    print(f"\n{title}, {result['tokens_per_step']} tokens per step, {result['expert_params'] / 1e9:.2f} B expert "
          f"parameters")
    print("floors: " + ", ".join(f"{k} {v:.3g}" for k, v in result["floors"].items() if v is not None))
    cols = [("variant", ">10", None), ("step_s", ">7", ".3f"), ("x_resident", ">10", ".2f"),
            ("x_largest_floor", ">15", ".2f"), ("gpu_busy", ">8", ".2f"), ("peak_gpu_GB", ">11", ".1f"),
            ("h2d_GB", ">7", ".2f"), ("h2d_over_floor", ">14", ".2f"), ("d2h_GB", ">7", ".2f"),
            ("host_adam_s", ">11", ".3f"), ("predicted_step_s", ">16", ".3f"),
            ("measure_predicted_step_s", ">24", ".3f")]
    print(" ".join(format(c, f) for c, f, _ in cols))
    for row in result["rows"]:
        if "error" in row:
            print(f"{row['variant']:>10} {row['error']}")
            continue
        print(" ".join(format(row[c] if spec is None else (format(row[c], spec) if row.get(c) is not None else "-"),
                              f) for c, f, spec in cols))


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048", help="tokens per step, comma-separated (e.g. 2048,8192,16384)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=512, help="expert FFN width (moe_intermediate_size)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--gpu-memory-gb", default=None,
                    help="cap this process's GPU memory (torch.cuda.set_per_process_memory_fraction): GB, or "
                         "below-peers (where the resident model and ZeRO-2 do not fit and ours does: cap_below_peers)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="a tiny model (a smoke run of the harness)")
    ap.add_argument("--measure", action="store_true",
                    help="also record `hf-moe-offload estimate --measure`'s predicted step beside each measured one")
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/gpu_train_qwen3[_<tokens>].json)")
    args = ap.parse_args(argv)
    args.variants = args.variants.split(",")
    if args.gpu_memory_gb not in (None, "below-peers"):
        args.gpu_memory_gb = float(args.gpu_memory_gb)
    if args.quick:
        args.layers, args.experts, args.hidden, args.ffn, args.top_k, args.vocab = 2, 8, 64, 32, 2, 256
        args.seq, args.steps, args.rounds = 32, 2, 2
    device = torch.device(args.device)
    if isinstance(args.gpu_memory_gb, float) and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_gb * 1e9 / total), device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    results = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        result = table(args, tokens if not args.quick else 64, device,
                       progress=lambda partial: write(results + [{**partial, "complete": False}], args))
        title = (f"Qwen3-MoE {args.layers} layers x {args.experts} experts, top-{args.top_k}, d={args.hidden}, "
                 f"ffn {args.ffn}, bf16 autocast, {name}, {os.cpu_count()} CPUs"
                 + (f", GPU memory capped at {result['cap']['cap_GB'] if result['cap'] else args.gpu_memory_gb:.3g} GB"
                    if args.gpu_memory_gb else ""))
        print_table(result, title)
        result.update({"machine": platform.platform(), "device": name, "cpus": os.cpu_count(),
                       "torch": torch.__version__, "gpu_memory_gb": args.gpu_memory_gb, "title": title,
                       "complete": True})
        results.append(result)
        write(results, args)  # after each size, so that a run stopped at its time limit keeps what it measured
    return results


def write(results: list[dict], args) -> None:
    out = args.out or os.path.join(HERE, "gpu_train_qwen3" + ("" if args.tokens == "2048" else f"_{args.tokens.replace(',', '_')}")
                                   + (f"_cap{args.gpu_memory_gb:g}" if isinstance(args.gpu_memory_gb, float) else
                                      "_cap-below-peers" if args.gpu_memory_gb else "") + ".json")
    with open(out, "w") as fh:
        json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
