"""Offloaded generation on CPU: decode tokens/s and time to first token of our disk tier (inference mode: the decode
cache; pre-gating in a row of its own, since it is off by default on the CPU) against accelerate's `device_map` disk
offload of the same experts and against the resident model, all in one invocation; pre-gating hit rate, cache hit
rate and bytes read per token.

    python benchmarks/generate.py            # Qwen3-MoE, 4 layers, 16 experts/layer, d=256; cache 8 of 64 experts
    python benchmarks/generate.py --quick    # fewer tokens and rounds
    python benchmarks/generate.py --model-path outputs/moe-gpt-small --cache 4   # the main job's trained model
    python benchmarks/generate.py --analyze [--model-path ...]   # guess and cache policy on one routing trace

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
from hf_moe_offload.moe_path import experts_layers, find_experts_modules, get_moe_path  # noqa: E402
from hf_moe_offload.offload.api import _router, get_offload_engine  # noqa: E402
from hf_moe_offload.offload.inference import DecodeCache, PreGate  # noqa: E402
from hf_moe_offload.offload.telemetry import OffloadStats  # noqa: E402
from hf_moe_offload.offload.checkpoint import load_offloaded_pretrained  # noqa: E402


class Clock(BaseStreamer):
    """Timestamps of what `generate` emits: the prompt first, then each new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def make_checkpoint(path: str, layers: int, experts: int, hidden: int, inter: int) -> Qwen3MoeConfig:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=2048, hidden_size=hidden, intermediate_size=2 * inter, moe_intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, head_dim=hidden // 4,
        num_experts=experts, num_experts_per_tok=2, max_position_embeddings=512, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return config


def accelerate_device_map(config) -> dict[str, str]:
    """Every module with weights of its own on the CPU, the experts modules on disk."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    experts = {name for name, _ in find_experts_modules(model)}
    out = {}
    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            out[name] = "disk" if name in experts else "cpu"
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


def load(variant: str, ckpt: str, work: str, config, cache: int):
    if variant == "resident":
        return AutoModelForCausalLM.from_pretrained(ckpt)
    if variant == "accelerate disk":
        folder = tempfile.mkdtemp(dir=work)
        return AutoModelForCausalLM.from_pretrained(ckpt, device_map=accelerate_device_map(config),
                                                    offload_folder=folder)
    # Inference only: the store holds the weights (no gradient, no Adam moments), so the cache's bytes are
    # `cache` experts' weights, what accelerate would need to hold `cache` experts.
    # "mapped" (the default on the CPU): uncached experts computed from their memory-mapped files; "cache": every
    # expert read into the cache, as on a GPU, where the uploads come from the cache's page-locked slots.
    pregate, mmap = {"ours disk, mapped (default)": (None, None), "ours disk, cache": (None, False),
                     "ours disk, cache + pre-gating": (True, False)}[variant]
    return load_offloaded_pretrained(ckpt, OffloadConfig(mode="disk", offload_dir=tempfile.mkdtemp(dir=work),
                                                         host_cache_experts=cache, pregate=pregate,
                                                         mmap_weights=mmap, train_experts=False))


def run_once(model, prompt: torch.Tensor, new_tokens: int) -> dict:
    engine = get_offload_engine(model)
    if engine is not None:
        engine.stats.reset()
    clock = Clock()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             streamer=clock, pad_token_id=0, use_cache=True)
    new = clock.times[1:]
    row = {"ttft_s": new[0] - t0, "decode_tok_s": (len(new) - 1) / (new[-1] - new[0]),
           "tokens": out[0, prompt.shape[1]:].tolist()}
    if engine is not None:
        logs = engine.stats.as_log_dict(prefix="")
        row.update(read_MB_per_token=logs["disk_read_MB"] / len(new),
                   mapped_MB_per_token=logs.get("disk_mapped_MB", 0.0) / len(new),
                   cache_hit_rate=engine.stats.cache_hit_rate,
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
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--rounds", type=int, default=7, help="rounds of every variant (not with --quick)")
    ap.add_argument("--analyze", action="store_true", help="instead of timing: the pre-gating guess and the decode "
                    "cache policy replayed on one decode's routing trace, against simpler guesses and LRU / Belady")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.analyze:
        return analyze(args)
    new_tokens, rounds = (24, 2) if args.quick else (64, args.rounds)
    variants = ["resident", "accelerate disk", "ours disk, mapped (default)", "ours disk, cache",
                "ours disk, cache + pre-gating"]
    with tempfile.TemporaryDirectory() as work:
        if args.model_path:
            ckpt = args.model_path
            config = AutoConfig.from_pretrained(ckpt)
        else:
            ckpt = os.path.join(work, "ckpt")
            config = make_checkpoint(ckpt, args.layers, args.experts, args.hidden, args.inter)
        models = {v: load(v, ckpt, work, config, args.cache).eval() for v in variants}
        prompt = make_prompt(args.model_path, config.vocab_size, args.prompt_tokens)
        total_experts = sum(layout.num_experts for _, _, layout in experts_layers(models["resident"]))
        for v in variants:  # warm-up: thread pools, first reads, allocator
            run_once(models[v], prompt, 4)
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for _ in range(rounds):
            for v in variants:
                runs[v].append(run_once(models[v], prompt, new_tokens))
    rows = []
    reference = runs["resident"][0]["tokens"]

    def paired(v: str, base: str, key: str) -> float:  # the median over rounds of v's figure / base's, same round
        return statistics.median(r[key] / b[key] for r, b in zip(runs[v], runs[base]))

    for v in variants:
        rs = runs[v]
        row = {"variant": v, "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
               "x_resident": paired(v, "resident", "decode_tok_s"),
               "x_accelerate": paired(v, "accelerate disk", "decode_tok_s"),
               "ttft_s": statistics.median(r["ttft_s"] for r in rs), "ttft_x_resident": paired(v, "resident", "ttft_s"),
               "same_tokens_as_resident": all(r["tokens"] == reference for r in rs)}
        for k in ("read_MB_per_token", "mapped_MB_per_token", "cache_hit_rate", "pregate_hit_rate"):
            values = [r[k] for r in rs if r.get(k) is not None]
            row[k] = statistics.median(values) if values else None
        rows.append(row)
    what = (args.model_path if args.model_path else f"random Qwen3-MoE {args.layers} layers x {args.experts} experts "
            f"(top-2), d={args.hidden}, expert ffn {args.inter}")
    print(f"\nGreedy decoding, {what}; our cache {args.cache} of {total_experts} experts; prompt "
          f"{args.prompt_tokens}, {new_tokens} new tokens, median of {rounds} rounds; {platform.processor() or 'cpu'}")
    print(f"{'variant':>29} {'tok/s':>7} {'x resident':>10} {'x accel':>7} {'TTFT s':>7} {'x res':>5} "
          f"{'MB read/tok':>11} {'MB mapped/tok':>13} {'cache hit':>9} {'pregate hit':>11} {'same':>5}")

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    for r in rows:
        print(f"{r['variant']:>29} {r['decode_tok_s']:>7.1f} {r['x_resident']:>10.2f} {r['x_accelerate']:>7.2f} "
              f"{r['ttft_s']:>7.3f} {r['ttft_x_resident']:>5.2f} {fmt(r['read_MB_per_token'], '.2f'):>11} "
              f"{fmt(r['mapped_MB_per_token'], '.2f'):>13} "
              f"{fmt(r['cache_hit_rate'], '.2f'):>9} {fmt(r['pregate_hit_rate'], '.2f'):>11} "
              f"{str(r['same_tokens_as_resident']):>5}")
    name = "generate.json" if not args.model_path else f"generate-{os.path.basename(os.path.normpath(args.model_path))}.json"
    with open(os.path.join(HERE, name), "w") as f:
        json.dump({"args": vars(args), "total_experts": total_experts, "new_tokens": new_tokens, "rounds": rounds,
                   "machine": platform.platform(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
