"""Offloaded generation: decode tokens/s and time to first token of our tiers (inference mode: the decode cache;
pre-gating in a row of its own, since it is off by default on the CPU) against accelerate's `device_map` offload of
the same experts and against the resident model, all in one invocation; pre-gating hit rate, cache hit rates and bytes
read and uploaded per token.

    python benchmarks/generate.py            # CPU: Qwen3-MoE, 4 layers, 16 experts/layer, d=256; cache 8 of 64 experts
    python benchmarks/generate.py --quick    # fewer tokens and rounds
    python benchmarks/generate.py --device cuda --layers 16 --experts 64 --hidden 1024 --inter 512 --top-k 8 \
        --dtype bf16 --batch 1,8 --cache 256   # a GPU: ours host / disk (a quarter of the experts in the
                                               # host cache) with a device cache of 0, 1/4, 1/2 of the experts,
                                               # accelerate's CPU and disk offload, the resident model
    python benchmarks/generate.py --model-path outputs/moe-gpt-small --cache 4   # the main job's trained model
    python benchmarks/generate.py --analyze [--model-path ...]   # guess and cache policy on one routing trace
    HF_MOE_OFFLOAD_RUNTIME=simulated python benchmarks/generate.py --device-variants --batch 1,8 --quick --cache 16
        # the device variants' bytes and hit rates on the simulated device (CI's stand-in for a GPU)

The model is random (seeded) and saved once as safetensors; every variant loads that checkpoint the way a user would
(`from_pretrained`, `from_pretrained(device_map=..., offload_folder=...)`, `load_offloaded_pretrained`), then
generates greedily from the same prompt. Variants run interleaved, round after round; each reports its median
round, and its ratios are the medians of the per-round ratios against the resident model (and accelerate) of the same
round, so that drift of this shared machine between rounds cancels. Writes benchmarks/generate.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import hf_moe_offload  # noqa: E402,F401
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

from hf_moe_offload import OffloadConfig  # noqa: E402
from hf_moe_offload.families.moe_path import experts_layers, find_experts_modules, get_moe_path  # noqa: E402
from hf_moe_offload.offload.api import _router, get_offload_engine  # noqa: E402
from hf_moe_offload.offload.inference.policies import DecodeCache, PreGate  # noqa: E402
from hf_moe_offload.offload.telemetry import OffloadStats  # noqa: E402
from hf_moe_offload.offload.checkpoint import load_offloaded_pretrained  # noqa: E402
from hf_moe_offload.runtime import aligned_nbytes  # noqa: E402


class Clock(BaseStreamer):
    """Timestamps of what `generate` emits: the prompt first, then each new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def make_checkpoint(path: str, layers: int, experts: int, hidden: int, inter: int, top_k: int = 2,
                    dtype: torch.dtype = torch.float32) -> Qwen3MoeConfig:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=2048, hidden_size=hidden, intermediate_size=2 * inter, moe_intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, head_dim=hidden // 4,
        num_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=512, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    return config


def accelerate_device_map(config, experts_on: str = "disk", rest_on: str = "cpu") -> dict[str, str]:
    """Every module with weights of its own on `rest_on`, the experts modules on `experts_on` ("disk", "cpu")."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    experts = {name for name, _ in find_experts_modules(model)}
    out = {}
    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            out[name] = experts_on if name in experts else rest_on
    return out


PARAGRAPH = ("The history of the city begins in the early middle ages, when a small settlement grew up around a river "
             "crossing. In the following centuries it became a centre of trade and learning, and by the nineteenth "
             "century it was one of the largest cities in the country, known for its universities and its railway.")


def make_prompt(model_path: str | None, vocab: int, n: int) -> torch.Tensor:
    """n tokens of an English paragraph with the model's tokenizer, else n seeded random ids."""
    if model_path is not None and os.path.exists(os.path.join(model_path, "tokenizer.json")):
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(model_path)(PARAGRAPH, return_tensors="pt").input_ids[:, :n]
        if ids.shape[1] == n:
            return ids
    return torch.randint(1, vocab, (1, n), generator=torch.Generator().manual_seed(1))


# The first variant of each list is the resident baseline.
CPU_VARIANTS = ["resident", "accelerate disk", "ours disk, mapped (default)", "ours disk, cache",
                "ours disk, cache + pre-gating"]
# On a device: ours with the device expert cache (offload/inference/device_cache.py) holding 0, 1/4, 1/2 of the experts.
DEVICE_VARIANTS = ["resident", "accelerate cpu", "accelerate disk"] + [
    f"ours {tier}, device cache {share}" for tier in ("host", "disk") for share in ("0", "1/4", "1/2")]


def load(variant: str, ckpt: str, work: str, config, cache: int, device: torch.device = torch.device("cpu"),
         dtype: torch.dtype | None = None, expert_bytes: int = 0, total_experts: int = 0):
    if variant == "resident":
        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(device)
    if variant.startswith("accelerate"):
        folder = tempfile.mkdtemp(dir=work)
        rest = (device.index or 0) if device.type == "cuda" else "cpu"
        return AutoModelForCausalLM.from_pretrained(
            ckpt, dtype=dtype, offload_folder=folder,
            device_map=accelerate_device_map(config, experts_on=variant.split()[1], rest_on=rest))
    if ", device cache " in variant:
        tier, share = variant.removeprefix("ours ").split(", device cache ")
        fraction = {"0": 0.0, "1/4": 0.25, "1/2": 0.5}[share]
        return load_offloaded_pretrained(ckpt, OffloadConfig(
            mode=tier, offload_dir=tempfile.mkdtemp(dir=work) if tier == "disk" else None,
            host_cache_experts=cache if tier == "disk" else None, train_experts=False, device=device,
            device_cache_bytes=int(fraction * total_experts) * expert_bytes), dtype=dtype)
    # Inference only: the store holds the weights (no gradient, no Adam moments), so the cache's bytes are
    # `cache` experts' weights, what accelerate would need to hold `cache` experts.
    # "mapped" (the default on the CPU): uncached experts computed from their memory-mapped files; "cache": every
    # expert read into the cache, as on a GPU, where the uploads come from the cache's page-locked slots.
    pregate, mmap = {"ours disk, mapped (default)": (None, None), "ours disk, cache": (None, False),
                     "ours disk, cache + pre-gating": (True, False)}[variant]
    return load_offloaded_pretrained(ckpt, OffloadConfig(mode="disk", offload_dir=tempfile.mkdtemp(dir=work),
                                                         host_cache_experts=cache, pregate=pregate,
                                                         mmap_weights=mmap, train_experts=False), dtype=dtype)


def expert_sizes(model, dtype: torch.dtype) -> tuple[int, int]:
    """(experts in all layers, one expert's bytes in a device-cache slot): what the device-cache variants size by."""
    layers = experts_layers(model)
    return sum(layout.num_experts for _, _, layout in layers), aligned_nbytes(layers[0][2].numel, dtype)


def run_once(model, prompt: torch.Tensor, new_tokens: int) -> dict:
    """One greedy generation; decode tokens/s counts every sequence of the batch."""
    engine = get_offload_engine(model)
    if engine is not None:
        engine.stats.reset()
    clock = Clock()
    prompt = prompt.to(model.device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             streamer=clock, pad_token_id=0, use_cache=True)
    new = clock.times[1:]
    row = {"ttft_s": new[0] - t0, "decode_tok_s": (len(new) - 1) * prompt.shape[0] / (new[-1] - new[0]),
           "tokens": out[:, prompt.shape[1]:].tolist()}
    if engine is not None:
        logs = engine.stats.as_log_dict(prefix="")
        row.update(read_MB_per_token=logs["disk_read_MB"] / len(new),
                   mapped_MB_per_token=logs.get("disk_mapped_MB", 0.0) / len(new),
                   uploaded_MB_per_token=logs["h2d_MB"] / len(new),
                   cache_hit_rate=engine.stats.cache_hit_rate,
                   device_cache_hit_rate=engine.stats.device_cache_hit_rate,
                   pregate_hit_rate=logs.get("pregate_hit_rate"))
    return row


# --- --analyze: the guess and the cache policy, replayed on one decode's routing trace ---
def record_trace(ckpt: str, prompt: torch.Tensor, new_tokens: int) -> tuple[list, PreGate]:
    """Decode on the host tier and record every MoE layer call: (layer, router input, top-k choices)."""
    model = load_offloaded_pretrained(ckpt, OffloadConfig(mode="host", train_experts=False)).eval()
    engine = get_offload_engine(model)
    calls = []
    for layer in engine.layers:  # instrumentation: wrap each layer's routing callback
        original = layer.on_route

        def on_route(hidden, top_k_index, counts, layer=layer, original=original):
            calls.append((layer.layer, hidden.detach().clone(), top_k_index.detach().clone()))
            original(hidden, top_k_index, counts)

        layer.on_route = on_route
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                       use_cache=True)
    routers = [_router(model, route) for route in get_moe_path(model).layers]
    return calls, PreGate(routers, OffloadStats())


def guess_hit_rates(calls: list, pregate: PreGate, num_experts: int) -> dict[str, float]:
    """Fraction of the routed experts of decoded tokens (layers after the first) that each guess of k experts held:
    the router alone, the previous token's experts, co-activation counts alone, and PreGate (the three summed, each
    weighted by its recent hit rate)."""
    hits, total = Counter(), 0
    num_layers = max(layer for layer, _, _ in calls) + 1
    names = {"router": "router alone", "previous token": "previous token", "co-activation": "co-activation alone"}
    for i, (layer, hidden, idx) in enumerate(calls):
        pregate.observe(layer, idx, num_experts)
        decoding = i >= num_layers and hidden.reshape(-1, hidden.shape[-1]).shape[0] == 1
        nxt = layer + 1
        if nxt < num_layers and decoding and i + 1 < len(calls):
            actual = {e for e in calls[i + 1][2].reshape(-1).tolist() if 0 <= e < num_experts}
            guess = set(pregate.guess(nxt, hidden, idx.shape[-1]))
            own = pregate.source_guesses[nxt]  # each source's own top-k guess, made (and scored) by the guess above
            guesses = {label: own.get(source, set()) for source, label in names.items()}
            guesses["PreGate (sources weighted by hits)"] = guess
            for name, g in guesses.items():
                hits[name] += len(actual & g)
            total += len(actual)
    return {name: n / total for name, n in hits.items()}


def cache_hit_rates(calls: list, capacity: int) -> dict[str, float]:
    """Replays the expert requests of the trace (token 0: the prompt) through a cache of `capacity` experts:
    `DecodeCache` (as the disk tier uses it), LRU, and Belady's MIN (the optimum, knowing the future); hit rate over
    the decoded tokens."""
    num_layers = max(layer for layer, _, _ in calls) + 1
    requests, token = [], -1
    for layer, _, idx in calls:
        token += layer == 0
        requests += [(token, (layer, e)) for e in sorted(set(idx.reshape(-1).tolist()))]
    next_use, seen = [0] * len(requests), {}
    for i in reversed(range(len(requests))):
        next_use[i] = seen.get(requests[i][1], len(requests))
        seen[requests[i][1]] = i

    def replay(victim, used=lambda key: None, new_token=lambda tok: None) -> float:
        cache, hits, misses = {}, 0, 0  # key -> (its last use, its next use)
        for i, (tok, key) in enumerate(requests):
            new_token(tok)
            if key in cache:
                hits += tok > 0
            else:
                misses += tok > 0
                if len(cache) >= capacity:
                    del cache[victim(cache, key)]
            cache[key] = (i, next_use[i])
            used(key)
        return hits / (hits + misses)

    decode = DecodeCache(num_layers, capacity)

    def decode_victim(cache, key):
        held = Counter(k[0] for k in cache)
        held[key[0]] += 1
        return decode.victim(list(cache), held, key, speculative=False)

    def new_token(tok):
        while decode.tick < tok:
            decode.next_token()

    return {"DecodeCache (ours)": replay(decode_victim, decode.touch, new_token),
            "LRU": replay(lambda cache, key: min(cache, key=lambda k: cache[k][0])),
            "Belady's MIN (optimum)": replay(lambda cache, key: max(cache, key=lambda k: cache[k][1]))}


def analyze(args) -> None:
    with tempfile.TemporaryDirectory() as work:
        ckpt = args.model_path or os.path.join(work, "ckpt")
        config = AutoConfig.from_pretrained(ckpt) if args.model_path else make_checkpoint(
            ckpt, args.layers, args.experts, args.hidden, args.inter)
        prompt = make_prompt(args.model_path, config.vocab_size, args.prompt_tokens)
        calls, pregate = record_trace(ckpt, prompt, 64)
    num_experts = max(int(idx.max()) for _, _, idx in calls) + 1
    guesses = guess_hit_rates(calls, pregate, num_experts)
    caches = cache_hit_rates(calls, args.cache)
    print(f"\nGuess hit rate (fraction of routed experts the guess held), 64 decoded tokens:")
    for name, v in guesses.items():
        print(f"  {name:>34} {v:.2f}")
    print(f"Cache hit rate over the decoded tokens, cache {args.cache} experts:")
    for name, v in caches.items():
        print(f"  {name:>34} {v:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model-path", default=None, help="a saved model to benchmark instead of the random Qwen3-MoE "
                    "(e.g. the main job's outputs/moe-gpt-small: trained routers)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--cache", type=int, default=8, help="our disk tier's host cache, in experts")
    ap.add_argument("--top-k", type=int, default=2, help="experts per token (the random model)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", default="1", help="sequences per generate call; a comma-separated list runs each")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: the non-expert weights and the compute")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--device-variants", action="store_true", help="the --device cuda variants on the CPU: with "
                    "HF_MOE_OFFLOAD_RUNTIME=simulated, on the simulated device (its timings mean nothing; its bytes "
                    "uploaded and cache hit rates do); writes generate-simulated.json")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--rounds", type=int, default=7, help="rounds of every variant (not with --quick)")
    ap.add_argument("--variants", default=None, help="';'-separated subset of the variants (the resident model and "
                    "the ratios' base always run), e.g. 'ours host, device cache 0;ours disk, device cache 0'")
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/generate[-cuda|-simulated].json)")
    ap.add_argument("--analyze", action="store_true", help="instead of timing: the pre-gating guess and the decode "
                    "cache policy replayed on one decode's routing trace, against simpler guesses and LRU / Belady")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.analyze:
        return analyze(args)
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    new_tokens, rounds = (min(24, args.new_tokens), 2) if args.quick else (args.new_tokens, args.rounds)
    on_device = device.type == "cuda" or args.device_variants
    variants = DEVICE_VARIANTS if on_device else CPU_VARIANTS
    base = "accelerate cpu" if on_device else "accelerate disk"
    if args.variants:
        chosen = [v.strip() for v in args.variants.split(";") if v.strip()]
        unknown = [v for v in chosen if v not in variants]
        if unknown:
            ap.error(f"--variants: unknown {unknown}; these run here: {variants}")
        variants = [v for v in variants if v in {"resident", base, *chosen}]
    batches = [int(b) for b in args.batch.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as work:
        if args.model_path:
            ckpt = args.model_path
            config = AutoConfig.from_pretrained(ckpt)
        else:
            ckpt = os.path.join(work, "ckpt")
            config = make_checkpoint(ckpt, args.layers, args.experts, args.hidden, args.inter, args.top_k, dtype)
        models = {"resident": load("resident", ckpt, work, config, args.cache, device, dtype).eval()}
        total_experts, expert_bytes = expert_sizes(models["resident"], dtype)
        models.update({v: load(v, ckpt, work, config, args.cache, device, dtype, expert_bytes, total_experts).eval()
                       for v in variants[1:]})
        for batch in batches:
            prompt = torch.cat([make_prompt(args.model_path, config.vocab_size, args.prompt_tokens)] +
                               [torch.randint(1, config.vocab_size, (1, args.prompt_tokens),
                                              generator=torch.Generator().manual_seed(i)) for i in range(2, batch + 1)])
            for v in variants:  # warm-up: thread pools, first reads, allocator, the device cache's first fill
                t0 = time.perf_counter()
                run_once(models[v], prompt, 4)
                print(f"batch {batch} warm-up {v}: {time.perf_counter() - t0:.1f} s", flush=True)
            runs: dict[str, list[dict]] = {v: [] for v in variants}
            for round_ in range(rounds):
                for v in variants:
                    runs[v].append(run_once(models[v], prompt, new_tokens))
                    print(f"batch {batch} round {round_} {v}: {runs[v][-1]['decode_tok_s']:.2f} tok/s", flush=True)
            results.append((batch, summarize(runs, variants, base)))
    what = (args.model_path if args.model_path else f"random Qwen3-MoE {args.layers} layers x {args.experts} experts "
            f"(top-{args.top_k}), d={args.hidden}, expert ffn {args.inter}, {args.dtype}")
    print(f"\nGreedy decoding on {device}, {what}; our host cache {args.cache} of {total_experts} experts; prompt "
          f"{args.prompt_tokens}, {new_tokens} new tokens, median of {rounds} rounds; {platform.processor() or 'cpu'}")

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    for batch, rows in results:
        print(f"batch {batch}")
        print(f"{'variant':>29} {'tok/s':>7} {'x resident':>10} {'x ' + base:>16} {'TTFT s':>7} {'x res':>5} "
              f"{'MB read/tok':>11} {'MB mapped/tok':>13} {'MB up/tok':>9} {'cache hit':>9} {'dev cache':>9} "
              f"{'pregate hit':>11} {'same':>5}")
        for r in rows:
            print(f"{r['variant']:>29} {r['decode_tok_s']:>7.1f} {r['x_resident']:>10.2f} {r['x_base']:>16.2f} "
                  f"{r['ttft_s']:>7.3f} {r['ttft_x_resident']:>5.2f} {fmt(r['read_MB_per_token'], '.2f'):>11} "
                  f"{fmt(r['mapped_MB_per_token'], '.2f'):>13} {fmt(r['uploaded_MB_per_token'], '.2f'):>9} "
                  f"{fmt(r['cache_hit_rate'], '.2f'):>9} {fmt(r['device_cache_hit_rate'], '.2f'):>9} "
                  f"{fmt(r['pregate_hit_rate'], '.2f'):>11} {str(r['same_tokens_as_resident']):>5}")
    name = "generate.json" if not args.model_path else f"generate-{os.path.basename(os.path.normpath(args.model_path))}.json"
    if device.type == "cuda":
        name = name.replace(".json", "-cuda.json")
    elif args.device_variants:
        name = name.replace(".json", "-simulated.json")
    with open(args.out or os.path.join(HERE, name), "w") as f:
        json.dump({"args": vars(args), "total_experts": total_experts, "new_tokens": new_tokens, "rounds": rounds,
                   "machine": platform.platform(), "device": str(device),
                   "batches": {str(batch): rows for batch, rows in results}}, f, indent=1)


def summarize(runs: dict[str, list[dict]], variants: list[str], base: str) -> list[dict]:
    """Per variant: medians over rounds, and ratios as medians of the per-round ratios (same round)."""
    reference = runs["resident"][0]["tokens"]

    def paired(v: str, against: str, key: str) -> float:
        return statistics.median(r[key] / b[key] for r, b in zip(runs[v], runs[against]))

    rows = []
    for v in variants:
        rs = runs[v]
        row = {"variant": v, "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
               "x_resident": paired(v, "resident", "decode_tok_s"), "x_base": paired(v, base, "decode_tok_s"),
               "ttft_s": statistics.median(r["ttft_s"] for r in rs), "ttft_x_resident": paired(v, "resident", "ttft_s"),
               "same_tokens_as_resident": all(r["tokens"] == reference for r in rs)}
        for k in ("read_MB_per_token", "mapped_MB_per_token", "uploaded_MB_per_token", "cache_hit_rate",
                  "device_cache_hit_rate", "pregate_hit_rate"):
            values = [r[k] for r in rs if r.get(k) is not None]
            row[k] = statistics.median(values) if values else None
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
