"""LoRA on every expert of a model of Qwen3-30B-A3B's shape, its experts in 4 bits on the disk tier.

python benchmarks/real_shape_lora.py [--storage nf4 --lora-r 8 --seq-len 128 --steps 3 --cache-experts 256
                                      --offload-dir /tmp/real-shape-experts] [--layers 48]

Qwen3-30B-A3B's shape (48 layers x 128 experts of hidden 2048 / expert FFN 768, 29 B expert parameters; 32 query and
4 key/value heads, vocabulary 151936), random weights, bf16. The model is built on the meta device; the experts are
made one at a time (random bf16, scaled as an initialisation would) and quantized into the disk tier's files as they
are written (the fill path `load_offloaded_pretrained` takes), the rest is materialised in bf16. peft's LoRA on every
expert matrix and on q/k/v/o; AdamW lr 1e-4; `--steps` training steps of 1 x `--seq-len` random tokens on this
machine's CPU. Before anything is built, `hf_moe_offload.planning.estimate` prints what the tiers need for this workload; the
run then reports its peak RSS over the baseline after imports (to be within the estimate's host figure), the step
time, and the bytes read from the store per step against the estimate's. Writes benchmarks/real_shape_lora.json.
On a GPU (`--device cuda`) the same, with the peak GPU memory and the bytes uploaded per step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import time

import torch

from hf_moe_offload.host_allocator import POLICIES, set_policy


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _live_after_trim(baseline: int) -> int:
    """RSS over `baseline` once glibc has handed its free heap memory back (`malloc_trim(0)`): what the step keeps
    live, apart from what the allocator retains (the difference grows step by step on this machine)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    return _rss("VmRSS:") - baseline


def _live_tensor_bytes() -> int:
    """Bytes of every CPU tensor storage Python still references (each storage once)."""
    import gc

    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def qwen3_30b_a3b_config(layers: int = 48):
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, max_position_embeddings=40960, tie_word_embeddings=False, dtype="bfloat16")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--storage", default="nf4", choices=("nf4", "int8", "bf16"))
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--cache-experts", type=int, default=256)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--offload-dir", default="/tmp/real-shape-experts")
    p.add_argument("--malloc", default="return", choices=POLICIES,
                   help="glibc malloc's policy (hf_moe_offload.host_allocator): return (the default here: the RSS is "
                        "what the process holds, the estimate's premise), retain, glibc (its dynamic defaults)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "real_shape_lora.json"))
    args = p.parse_args()
    malloc_set = set_policy(args.malloc)

    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from peft import LoraConfig, get_peft_model
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from hf_moe_offload import OffloadConfig, enable_expert_offload, expert_target_parameters
    from hf_moe_offload.planning.estimate import Workload, estimate
    from hf_moe_offload.cli.estimate import render

    config = qwen3_30b_a3b_config(args.layers)
    workload = Workload(method="lora-experts", expert_storage=args.storage, dtype=torch.bfloat16, batch_size=1,
                        seq_len=args.seq_len, lora_r=args.lora_r, host_cache_experts=args.cache_experts,
                        device=args.device)
    est = estimate(config, workload)
    print(render(est), flush=True)
    disk_est = est.tiers["disk"]
    baseline = _rss("VmRSS:")  # after every import (the estimate's too), as the estimate leaves the process out

    def stage(what: str) -> None:
        print(f"  {what}: RSS over baseline {(_rss('VmRSS:') - baseline) / 2**30:.2f} GiB (anonymous "
              f"{_rss('RssAnon:') / 2**30:.2f}, file-backed {_rss('RssFile:') / 2**30:.2f} GiB in all)", flush=True)

    shutil.rmtree(args.offload_dir, ignore_errors=True)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    engine = enable_expert_offload(model, OffloadConfig(
        mode="disk", offload_dir=args.offload_dir, train_experts=False, expert_storage=args.storage,
        host_cache_experts=args.cache_experts, pin_fraction=0.0, device=args.device), _initialize=False)
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    scale = 0.02
    for key in tqdm(engine.store.keys(), desc="experts (random, quantized as written)", unit="expert",
                    mininterval=10):
        engine.store.write_param(key, torch.randn(engine.store.numel, generator=g, dtype=torch.bfloat16) * scale)
    engine.store.flush()
    fill_s = time.perf_counter() - t0
    stage(f"experts filled in {fill_s:.0f} s")
    for name, param in list(model.named_parameters()):
        if param.device.type == "meta":
            # drawn in bf16 (an fp32 draw of lm_head alone is 1.2 GB), scaled in place
            value = (torch.ones(param.shape, dtype=torch.bfloat16) if "norm" in name
                     else torch.randn(param.shape, generator=g, dtype=torch.bfloat16).mul_(scale))
            set_module_tensor_to_device(model, name, args.device, value=value)
            del value
    model.to(args.device)
    for t in model.parameters():
        t.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                             target_parameters=expert_target_parameters(model))).train()
    trainable = sum(t.numel() for t in model.parameters() if t.requires_grad)
    stage(f"the rest made, {trainable / 1e6:.1f} M LoRA parameters")
    opt = torch.optim.AdamW([t for t in model.parameters() if t.requires_grad], lr=1e-4)
    times, losses, reads, trimmed, faults, system = [], [], [], [], [], []
    cuda = args.device == "cuda"
    for step in range(args.steps):
        x = torch.randint(0, config.vocab_size, (1, args.seq_len), generator=g).to(args.device)
        read0 = engine.stats.disk_read_bytes
        usage0 = resource.getrusage(resource.RUSAGE_SELF)
        t = time.perf_counter()
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=x, labels=x).loss
        stage("forward")
        loss.backward()
        stage("backward")
        opt.step()
        opt.zero_grad()
        engine.step_barrier()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        faults.append(usage.ru_minflt - usage0.ru_minflt)
        system.append(usage.ru_stime - usage0.ru_stime)
        trimmed.append(_live_after_trim(baseline))
        losses.append(loss.item())
        reads.append(engine.stats.disk_read_bytes - read0)
        print(f"step {step}: {times[-1]:.1f} s ({system[-1]:.1f} s system, {faults[-1] / 1e6:.2f} M minor faults), "
              f"loss {losses[-1]:.3f}, read {reads[-1] / 2**30:.2f} GiB, "
              f"peak RSS over baseline {(_rss('VmHWM:') - baseline) / 2**30:.2f} GiB, after malloc_trim "
              f"{trimmed[-1] / 2**30:.2f} GiB", flush=True)
    peak = _rss("VmHWM:") - baseline
    used = sum(1 for counts in engine.stats.tokens_per_expert.values() for n in counts if n)  # the last forward's
    live = _live_tensor_bytes()
    store_files = sum(os.path.getsize(os.path.join(args.offload_dir, f)) for f in os.listdir(args.offload_dir)
                      if f.endswith(".bin"))
    out = {
        "args": vars(args), "malloc_policy_set": malloc_set, "experts": est.num_experts,
        "expert_params": est.expert_params, "lora_trainable": trainable, "fill_s": fill_s, "step_s": times,
        "step_system_s": system, "step_minor_faults": faults, "losses": losses,
        "disk_read_bytes_per_step": reads, "peak_rss_over_baseline_bytes": peak, "rss_after_trim_bytes": trimmed, "experts_routed_last_step": used,
        "live_tensor_bytes_after_last_step": live,
        "store_file_bytes": store_files,
        "estimate": {"host_bytes": disk_est.host_bytes, "device_bytes": disk_est.device_bytes,
                     "disk_bytes": disk_est.disk_bytes, "disk_read_bytes_per_step": disk_est.disk_read_bytes_per_step,
                     "parts": disk_est.parts},
        **({"peak_gpu_bytes": torch.cuda.max_memory_allocated(),
            "h2d_bytes": engine.stats.h2d_bytes} if cuda else {}),
    }
    within = peak <= disk_est.host_bytes + (disk_est.device_bytes if not cuda else 0)
    print(f"\nexperts filled in {fill_s:.0f} s; store files {store_files / 2**30:.2f} GiB (estimate "
          f"{disk_est.disk_bytes / 2**30:.2f}); median step {statistics.median(times):.1f} s; reads/step "
          f"{statistics.median(reads) / 2**30:.2f} GiB (estimate {disk_est.disk_read_bytes_per_step / 2**30:.2f}, for every "
          f"expert routed; the last step routed {used} of {est.num_experts}); "
          f"peak RSS over baseline {peak / 2**30:.2f} GiB, estimate {disk_est.host_bytes / 2**30:.2f} GiB: "
          f"{'within' if within else 'ABOVE'}; after the last step: {trimmed[-1] / 2**30:.2f} GiB once malloc_trim "
          f"returned the allocator's free memory, of which live tensors {live / 2**30:.2f} GiB")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    shutil.rmtree(args.offload_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
