"""The command line of `hf-moe-offload estimate` (the estimate itself: estimate.py; `--measure`: measure.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from ..planning import estimate as estimate_module  # late-bound: `estimate.estimate` patched in tests is the one run
from ..errors import UserError
from ..planning.activations import LOSS_CHUNK_TOKENS
from ..planning.estimate import FLAG_FIELDS, METHODS, Estimate, Workload
from .flags import add_dataclass_arguments, dataclass_values
from ..offload.config import OffloadConfig
from ..offload.stores.quantized import QUANTIZED_STORAGES
from ..planning.time_model import GPUS, resolve_rates

GiB = 2**30

def add_cli(sub) -> None:
    p = sub.add_parser("estimate", help="memory per tier and bytes moved per step, from a model folder or config.json",
                       description=estimate_module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a model folder (its config.json is read; no weights needed), a config.json, or a "
                                 "Hub name (e.g. Qwen/Qwen3-30B-A3B), read offline from the local Hugging Face cache "
                                 "or the bundled table of public configs (docs/hardware.md)")
    p.add_argument("--method", default="full", choices=METHODS,
                   help="full: every weight trained; lora: adapters on attention, experts frozen; lora-experts: "
                        "adapters on every expert matrix too (docs/lora.md)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="the model's dtype")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="where the model computes")
    p.add_argument("--gpu-memory", type=float, help="GB of GPU memory available (default: --gpu's memory, else this "
                                                    "GPU's free memory)")
    p.add_argument("--host-memory", type=float, help="GB of host memory available (default: this machine's)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank (LoRA methods)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="transformers' activation checkpointing: each decoder layer keeps its input only and "
                        "recomputes the rest in the backward (less device memory, one more forward)")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="micro-batches per optimizer step (gradient accumulation): the host Adam steps once per window")
    p.add_argument("--loss-chunk-tokens", type=int, default=LOSS_CHUNK_TOKENS,
                   help="tokens per chunk of the LM loss, as `train` takes it (0: the stock loss, every token's logits)")
    offload = p.add_argument_group("expert offload (OffloadConfig's fields, as `train` takes them)")
    add_dataclass_arguments(offload, OffloadConfig, names=FLAG_FIELDS, notes={
        "expert_storage": "estimate: with --method lora or lora-experts",
        "pin_fraction": "the estimate counts trained experts' pins on the GPU and in the disk tier's host cache "
                        "(fewer records turn over between the sweeps)"})
    time = p.add_argument_group("time model (on a GPU; docs/estimate.md)")
    time.add_argument("--gpu", choices=sorted(GPUS), help="the GPU, for its rates and memory (default: h100's rates, "
                                                          "this GPU's free memory)")
    time.add_argument("--gpu-tflops", type=float, help="dense bf16 TFLOPS of the GPU (default: the --gpu table's)")
    time.add_argument("--gpu-efficiency", type=float, help="the fraction of it a training step reaches (default 0.4)")
    time.add_argument("--pcie-gbps", type=float, help="GB/s of pinned copies per direction (default: the table's)")
    time.add_argument("--host-adam-gps", type=float,
                      help="G parameters/s the host Adam steps (default: measured here by a 1 s probe)")
    time.add_argument("--disk-gbps", type=float, help="GB/s the disk tier reads and writes (default 3)")
    time.add_argument("--measure", action="store_true",
                      help="time the model's own layer shapes at this micro-batch on this machine (one decoder layer "
                           "of its class, resident and with its experts streamed, the LM head and loss, the device's "
                           "AdamW, the package's host Adam, pinned copies both ways) and predict the step from those "
                           "rates instead of peak x efficiency: on the GPU where torch sees one, else on the CPU "
                           "(a CPU step, not a GPU's); --method full, host and device tiers (docs/estimate.md)")
    p.add_argument("--gpu-sizes", help="comma-separated GPU memory sizes in GB (e.g. 12,24,48,80): print the largest "
                                       "batch that fits each, per method (full, full with the dense optimizer on the "
                                       "host, LoRA on every expert with its factors on the GPU or in the store) and "
                                       "tier; LoRA's experts stored as --expert-storage (auto: nf4)")
    p.add_argument("--json", help="also write the estimate to this file")
    p.set_defaults(func=run_cli)


def run_cli(args) -> int:
    from ..planning.model_shapes import load_config

    config, source = load_config(args.model)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    device = args.device
    if args.measure:
        if args.method != "full":
            raise UserError("--measure times full fine-tuning only (--method full)")
        # the prediction is for where the rates were measured: the CPU where torch sees no GPU
        device = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
    w = Workload(method=args.method, dtype=dtype, batch_size=args.batch_size, seq_len=args.seq_len,
                 lora_r=args.lora_r, device=device, gradient_checkpointing=args.gradient_checkpointing,
                 micro_batches=args.micro_batches, loss_chunk_tokens=args.loss_chunk_tokens,
                 **dataclass_values(OffloadConfig, args, names=FLAG_FIELDS))
    gb = 1e9
    gpu_memory = args.gpu_memory or (GPUS[args.gpu].memory_gb if args.gpu else None)
    rates = (resolve_rates(args.gpu, args.gpu_tflops, args.gpu_efficiency, args.pcie_gbps, args.host_adam_gps,
                           args.disk_gbps) if device == "cuda" and not args.measure else None)
    device_budget = int(gpu_memory * gb) if gpu_memory and device == "cuda" else None
    est = estimate_module.estimate(config, w, device_budget=device_budget, rates=rates,
                                   host_budget=int(args.host_memory * gb) if args.host_memory else None)
    print(f"config: {source}")
    print(render(est))
    out = est.as_dict()
    if args.measure:
        from ..planning.measure import measure, predict, render_measured

        if args.device == "cuda" and device == "cpu":
            print("\nno GPU here: --measure times this CPU, so its figures are a CPU step, not a GPU's")
        m = measure(config, dtype, w.batch_size, w.seq_len, pin_fraction=w.pin_fraction, device=torch.device(device),
                    host_budget=int(args.host_memory * gb / 4) if args.host_memory else None)
        steps = predict(est, m, config.num_hidden_layers)
        print(render_measured(est, m, steps))
        out["measured"] = dataclasses.asdict(m)
        out["measured_steps"] = {tier: dataclasses.asdict(st) for tier, st in steps.items()}
    if args.gpu_sizes:
        from ..planning.batch_fit import largest_batches
        from ..planning.batch_fit import render as render_fits

        try:
            sizes = [float(x) for x in args.gpu_sizes.split(",")]
        except ValueError:
            raise UserError(f"--gpu-sizes takes GB numbers separated by commas, e.g. 12,24,48,80; got "
                            f"{args.gpu_sizes!r}") from None
        if device != "cuda" or any(gb <= 0 for gb in sizes):
            raise UserError("--gpu-sizes needs --device cuda and sizes above 0 GB")
        storage = w.expert_storage if w.expert_storage in QUANTIZED_STORAGES else "nf4"
        fits = largest_batches(config, w, sizes, lora_storage=storage)
        print("\nlargest batch per GPU size (" + f"LoRA r={w.lora_r}, {storage} experts; "
              + "predicted):")
        print("\n".join(render_fits(fits, w.seq_len)))
        out["largest_batch"] = [dataclasses.asdict(f) for f in fits]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def render(est: Estimate) -> str:
    w = est.workload
    gib = lambda b: f"{b / GiB:,.2f} GiB"  # noqa: E731
    lines = [
        f"{est.model_type}: {est.expert_params / 1e9:.2f} B expert parameters ({est.num_experts} experts in "
        f"{est.moe_layers} layers, {est.params_per_expert / 1e6:.2f} M each), {est.non_expert_params / 1e9:.2f} B other"
        + (f", {est.lora_params / 1e6:.1f} M LoRA (r={w.lora_r})" if est.lora_params else ""),
        f"method {w.method}, experts stored as "
        + (f"{w.expert_storage}" if w.expert_storage in QUANTIZED_STORAGES else
           ("fp32 state (weights, grad, Adam)" if not w.frozen_experts else str(w.dtype).removeprefix("torch.")))
        + f" ({est.expert_record_bytes / 2**20:.2f} MiB per expert), model {str(w.dtype).removeprefix('torch.')}, "
        f"batch {w.batch_size} x {w.seq_len} tokens"
        + (f" x {w.micro_batches} micro-batches" if w.micro_batches > 1 else "")
        + (", activation checkpointing" if w.gradient_checkpointing else "") + f", computing on {w.device}",
        "",
        f"{'tier':<8}{'device':>14}{'host':>14}{'disk':>14}{'upload/step':>16}{'download/step':>16}"
        f"{'disk read/step':>16}{'disk write/step':>17}",
    ]
    for t in est.tiers.values():
        lines.append(f"{t.tier:<8}{gib(t.device_bytes):>14}{gib(t.host_bytes):>14}{gib(t.disk_bytes):>14}"
                     f"{gib(t.h2d_bytes_per_step):>16}{gib(t.d2h_bytes_per_step):>16}"
                     f"{gib(t.disk_read_bytes_per_step):>16}{gib(t.disk_write_bytes_per_step):>17}")
    host = est.tiers["host"]
    if host.activations:
        lines += ["", "host tier's GPU parts: " + ", ".join(f"{k} {host.parts[k] / 1e9:,.2f} GB"
                                                          for k in host.device_parts if k != "activations"),
                  "  activations " + f"{host.parts['activations'] / 1e9:,.2f} GB = " + " + ".join(
                      f"{k} {v / 1e9:,.2f}" for k, v in host.activations.items())]
    lines += ["", f"mode='auto' picks: {est.auto} ({est.auto_reason})"]
    if w.device == "cuda":
        lines.append(f"largest batch (x {w.seq_len} tokens) within {est.device_budget / 1e9:.0f} GB of GPU memory: "
                     + ", ".join(f"{t.tier} {t.largest_batch['without checkpointing']} without / "
                                 f"{t.largest_batch['with checkpointing']} with activation checkpointing"
                                 for t in est.tiers.values()))
    if est.flops is not None:
        fl = est.flops
        lines.append(f"FLOPs per micro-batch (offloaded tiers): {fl.total / 1e12:,.1f} T (forward {fl.forward / 1e12:,.1f}"
                     f", backward {fl.backward / 1e12:,.1f}, recompute {fl.recompute / 1e12:,.1f})")
    if est.rates is not None:
        r = est.rates
        lines += ["", f"time model: {r.gpu} at {r.gpu_tflops:g} TFLOPS x {r.efficiency:g}, PCIe {r.pcie_gbps:g} GB/s "
                      f"per direction, host Adam {r.host_adam_gps:.2f} G params/s ({r.host_adam_source}), disk "
                      f"{r.disk_gbps:g} GB/s; seconds per optimizer step (the largest floor binds):",
                  f"{'tier':<8}{'GPU':>9}{'link':>9}{'host Adam':>11}{'disk':>9}{'step':>9}{'tokens/s':>11}  binds"
                  f"{'':<12}link hidden at"]
        for t in est.tiers.values():
            s = t.time
            f = s.floors
            hidden = f"{s.link_hidden_at_tokens:,} tokens/micro-batch" if s.link_hidden_at_tokens else "-"
            lines.append(f"{t.tier:<8}{f['GPU compute']:>9.2f}{f['PCIe link']:>9.2f}{f['host Adam']:>11.2f}"
                         f"{f.get('disk', 0.0):>9.2f}{s.window_s:>9.2f}{s.tokens_per_s:>11,.0f}  {s.binding:<17}"
                         f"{hidden}")
        host = est.tiers["host"].time
        if host.adam_hidden_at_tokens:
            lines.append(f"the host Adam hides behind the GPU at {host.adam_hidden_at_tokens:,} tokens per optimizer "
                         "step (more micro-batches per step: --micro-batches)")
        lines.append("decoding (batch 1, offloaded experts uploaded as routed): " + "; ".join(
            f"device-cache hit {d.cache_hit:.0%}: {d.upload_bytes_per_token / 1e6:,.0f} MB/token, "
            f"~{d.tokens_per_s:,.1f} tokens/s" for d in est.decode))
    lines += [f"disk tier host cache: {est.host_cache_experts} experts; process overhead (~0.5 GiB) not included",
              "host figures are what the process holds: glibc's malloc keeps freed memory beyond them unless it "
              "returns it (the jobs' --malloc return; docs/jobs.md)"]
    return "\n".join(lines)



__all__ = ["add_cli", "render", "run_cli"]
