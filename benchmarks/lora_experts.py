"""LoRA on every expert matrix (peft `target_parameters`): experts resident against experts streamed.

python benchmarks/lora_experts.py [--layers 4 --experts 32 --hidden 256 --expert-ffn 512 --steps 6 --rounds 2
                                   --dtype bf16]

A Qwen3-MoE of the given shape (random weights, in `--dtype`) is saved once; each variant then runs in its own process
(peak RSS is per process): `resident` (peft's own path: the parametrization forms W + BA for the whole layer in each
forward), `host` and `disk` (frozen experts offloaded to a weights-only store in the model's dtype, the disk tier
with a quarter of the experts cached; the low-rank term added in the streamed pass), and the quantized stores
`host-nf4`, `disk-int8`, `disk-nf4` (bitsandbytes' formats, dequantized per chunk). LoRA r=16 on
every expert matrix and on q/k/v/o, AdamW lr 1e-3, batch 4 x 128 tokens. Reported: peak RSS over the process's
baseline after imports, the store's bytes, the median step time (the first step left out) and its ratio to the
resident run's in the same round, the bytes read from the store per step. Variants alternate round by round; a ratio
is the median over rounds. Writes benchmarks/lora_experts.json.
`--device cuda`: the model computes on the GPU (the streamed variants' experts come up through the slab, quantized
ones dequantized there), and the table adds the peak GPU memory and the bytes uploaded per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("resident", "host", "disk", "host-nf4", "disk-int8", "disk-nf4")


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def run_variant(args) -> dict:
    """One variant in this process: -> its figures."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hf_moe_offload import OffloadConfig, expert_target_parameters, load_offloaded_pretrained

    torch.manual_seed(0)
    baseline = _rss("VmRSS:")
    cuda = args.device == "cuda"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    store_mib = 0.0
    if args.variant == "resident":
        model, engine = AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=dtype).to(args.device), None
        for p in model.parameters():
            p.requires_grad_(False)
    else:
        experts = args.layers * args.experts
        tier, _, storage = args.variant.partition("-")
        cfg = OffloadConfig(mode=tier, offload_dir=os.path.join(args.work, "experts"), train_experts=False,
                            host_cache_experts=max(8, experts // 4) if tier == "disk" else None,
                            pin_fraction=0.0, expert_storage=storage or "auto")
        model = load_offloaded_pretrained(args.ckpt, cfg, dtype=dtype, device=args.device)
        from hf_moe_offload import get_offload_engine

        engine = get_offload_engine(model)
        store_mib = len(engine.store) * engine.store.record_bytes() / 2**20
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=expert_target_parameters(model))
    model = get_peft_model(model, lora).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(1)
    times, losses = [], []
    read0 = engine.stats.disk_read_bytes if engine is not None else 0
    h2d0 = engine.stats.h2d_bytes if engine is not None else 0
    for _ in range(args.steps):
        x = torch.randint(0, model.config.vocab_size, (4, 128), generator=g).to(args.device)
        t0 = time.perf_counter()
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    read = (engine.stats.disk_read_bytes - read0) / args.steps if engine is not None else 0
    gpu = {"peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20,
           "h2d_mib_per_step": ((engine.stats.h2d_bytes - h2d0) / args.steps if engine is not None else 0) / 2**20
           } if cuda else {}
    return {**gpu, "variant": args.variant, "peak_rss_over_baseline_mib": (_rss("VmHWM:") - baseline) / 2**20,
            "store_mib": store_mib,
            "step_s": statistics.median(times[1:]), "disk_read_mib_per_step": read / 2**20, "losses": losses,
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def save_model(args) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=4096, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                               moe_intermediate_size=args.expert_ffn, num_hidden_layers=args.layers,
                               num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
                               num_experts=args.experts, num_experts_per_tok=4, max_position_embeddings=512)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    model.save_pretrained(args.ckpt)
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--expert-ffn", type=int, default=512)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="the model's dtype (default bf16)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "lora_experts.json"))
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant, in a child process
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    with tempfile.TemporaryDirectory() as work:
        args.ckpt = os.path.join(work, "ckpt")
        expert_bytes = save_model(args)
        rows: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            for variant in VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]:
                vwork = tempfile.mkdtemp(dir=work)
                cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant, "--ckpt", args.ckpt,
                       "--work", vwork, "--layers", str(args.layers), "--experts", str(args.experts),
                       "--steps", str(args.steps), "--device", args.device, "--dtype", args.dtype]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                     env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
                rows[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    summary = []
    for variant in VARIANTS:
        ratios = [row["step_s"] / base["step_s"] for row, base in zip(rows[variant], rows["resident"])]
        summary.append({"variant": variant, "peak_rss_over_baseline_mib": max(r["peak_rss_over_baseline_mib"]
                                                                               for r in rows[variant]),
                        "step_s": statistics.median(r["step_s"] for r in rows[variant]),
                        "x_resident": statistics.median(ratios),
                        "disk_read_mib_per_step": statistics.median(r["disk_read_mib_per_step"] for r in rows[variant]),
                        "store_mib": rows[variant][0]["store_mib"],
                        "trainable": rows[variant][0]["trainable"],
                        **{k: statistics.median(r[k] for r in rows[variant])
                           for k in ("peak_gpu_mib", "h2d_mib_per_step") if k in rows[variant][0]}})
    print(f"expert weights {expert_bytes / 2**20:.0f} MiB ({args.dtype}), {args.layers} layers x {args.experts} "
          f"experts, {args.rounds} rounds x {args.steps} steps")
    print(f"{'variant':<11}{'peak RSS MiB':>14}{'store MiB':>11}{'step s':>9}{'x resident':>12}{'disk MiB/step':>15}")
    for s in summary:
        gpu = f"  GPU peak {s['peak_gpu_mib']:.0f} MiB, up {s['h2d_mib_per_step']:.1f} MiB/step" if "peak_gpu_mib" in s else ""
        print(f"{s['variant']:<11}{s['peak_rss_over_baseline_mib']:>14.0f}{s['store_mib']:>11.0f}{s['step_s']:>9.2f}"
              f"{s['x_resident']:>12.2f}{s['disk_read_mib_per_step']:>15.1f}{gpu}")
    with open(args.out, "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("variant", "ckpt", "work")},
                   "expert_weight_mib": expert_bytes / 2**20, "summary": summary, "rounds": rows}, f, indent=2)


if __name__ == "__main__":
    main()
