"""Fabricated fairseq MoE LM checkpoints in the exact on-disk layout of the spec, and an independent reference
forward written from `shared/specs/fairseq-moe-checkpoints.md` §4 (pure torch; it does not use hf_moe_offload)."""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F


def make_fairseq_checkpoint(folder, *, E=4, W=2, layers=4, moe_freq=2, d=32, ffn=48, heads=4, V=60, max_pos=64,
                            learned_pos=False, top1=False, dtype=torch.float16, seed=0, eval_capacity=-1.0,
                            normalize_before_dropping=False):
    """Writes model-shared.pt and model-rank-{r}.pt (L = E/W experts per file); returns (shared_sd, experts, cfg)
    where experts[(i, g)] = {fc1.weight, fc1.bias, fc2.weight, fc2.bias} for global expert g of layer i."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.1):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    cfg = {
        "_name": "transformer_lm_gpt", "decoder_embed_dim": d, "decoder_ffn_embed_dim": ffn,
        "decoder_layers": layers, "decoder_attention_heads": heads, "decoder_normalize_before": True,
        "no_decoder_final_norm": False, "no_scale_embedding": False, "share_decoder_input_output_embed": True,
        "decoder_learned_pos": learned_pos, "layernorm_embedding": False, "activation_fn": "gelu",
        "dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.0, "moe_freq": moe_freq,
        "moe_expert_count": E, "moe_gating_use_fp32": True, "moe_second_expert_policy": "all",
        "moe_normalize_gate_prob_before_dropping": normalize_before_dropping, "moe_top1_expert": top1,
        "moe_eval_capacity_token_fraction": eval_capacity, "tokens_per_sample": max_pos,
        "max_target_positions": max_pos,
    }
    shared = {"decoder.version": torch.tensor([3.0]), "decoder.embed_tokens.weight": rnd(V, d, scale=0.5)}
    if learned_pos:
        shared["decoder.embed_positions.weight"] = rnd(max_pos + 2, d)
    else:
        shared["decoder.embed_positions._float_tensor"] = torch.tensor([1.0])
    experts = {}
    L = E // W
    for i in range(layers):
        p = f"decoder.layers.{i}."
        for proj in ("q", "k", "v", "out"):
            shared[p + f"self_attn.{proj}_proj.weight"] = rnd(d, d, scale=0.2)
            shared[p + f"self_attn.{proj}_proj.bias"] = rnd(d)
        for ln in ("self_attn_layer_norm", "final_layer_norm"):
            shared[p + f"{ln}.weight"] = (1 + rnd(d)).to(dtype)
            shared[p + f"{ln}.bias"] = rnd(d)
        if moe_freq and (i + 1) % moe_freq == 0:
            shared[p + "moe_layer.gate.wg.weight"] = rnd(E, d, scale=1.0)
            for gid in range(E):
                experts[(i, gid)] = {"fc1.weight": rnd(ffn, d, scale=0.2), "fc1.bias": rnd(ffn),
                                     "fc2.weight": rnd(d, ffn, scale=0.2), "fc2.bias": rnd(d)}
        else:
            shared[p + "fc1.weight"], shared[p + "fc1.bias"] = rnd(ffn, d, scale=0.2), rnd(ffn)
            shared[p + "fc2.weight"], shared[p + "fc2.bias"] = rnd(d, ffn, scale=0.2), rnd(d)
    shared["decoder.layer_norm.weight"] = (1 + rnd(d)).to(dtype)
    shared["decoder.layer_norm.bias"] = rnd(d)
    shared["decoder.output_projection.weight"] = shared["decoder.embed_tokens.weight"]

    def wrap(model):
        return {"args": None, "cfg": {"model": dict(cfg), "task": {"_name": "language_modeling"}}, "model": model,
                "criterion": None, "optimizer_history": [{"num_updates": 100}], "task_state": {},
                "extra_state": {"epoch": 1}, "last_optimizer_state": None}

    os.makedirs(folder, exist_ok=True)
    torch.save(wrap(shared), os.path.join(folder, "model-shared.pt"))
    for r in range(W):
        rank = {}
        for (i, gid), tensors in experts.items():
            if gid // L == r:
                for name, t in tensors.items():
                    rank[f"decoder.layers.{i}.moe_layer.experts.{gid - r * L}.{name}"] = t
        torch.save(wrap(rank), os.path.join(folder, f"model-rank-{r}.pt"))
    return shared, experts, cfg


def reference_logits(shared, experts, cfg, tokens, capacity: bool = False, training: bool = False):
    """fairseq MoE LM forward from the spec, fp32. tokens: (B, T) with pad id 1."""
    sd = {k: v.float() for k, v in shared.items()}
    ex = {k: {n: t.float() for n, t in v.items()} for k, v in experts.items()}
    d, heads = cfg["decoder_embed_dim"], cfg["decoder_attention_heads"]
    E = cfg["moe_expert_count"]
    B, T = tokens.shape
    nonpad = (tokens != 1).long()
    pos = torch.cumsum(nonpad, 1) * nonpad + 1  # spec §4: t-th non-pad token -> row t + 1 (pads -> 1)
    if cfg["decoder_learned_pos"]:
        P = sd["decoder.embed_positions.weight"][pos]
    else:
        half = d // 2
        freq = torch.exp(torch.arange(half, dtype=torch.float) * -(math.log(10000) / (half - 1)))
        ang = pos.float().unsqueeze(-1) * freq
        P = torch.cat([torch.sin(ang), torch.cos(ang)], -1) * (pos != 1).unsqueeze(-1)  # padding row is zero
    h = math.sqrt(d) * sd["decoder.embed_tokens.weight"][tokens] + P
    causal = torch.ones(T, T).tril().bool()
    keymask = causal[None] & nonpad[:, None, :].bool()
    for i in range(cfg["decoder_layers"]):
        p = f"decoder.layers.{i}."
        u = F.layer_norm(h, (d,), sd[p + "self_attn_layer_norm.weight"], sd[p + "self_attn_layer_norm.bias"], 1e-5)

        def proj(name, x):
            return x @ sd[p + f"self_attn.{name}_proj.weight"].T + sd[p + f"self_attn.{name}_proj.bias"]

        hd = d // heads
        q = proj("q", u) * hd ** -0.5
        k, v = proj("k", u), proj("v", u)
        q, k, v = (t.view(B, T, heads, hd).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)).masked_fill(~keymask[:, None], float("-inf"))
        att = torch.nan_to_num(scores.softmax(-1))
        h = h + proj("out", (att @ v).transpose(1, 2).reshape(B, T, d))
        u = F.layer_norm(h, (d,), sd[p + "final_layer_norm.weight"], sd[p + "final_layer_norm.bias"], 1e-5)
        if cfg["moe_freq"] and (i + 1) % cfg["moe_freq"] == 0:
            x = u.reshape(-1, d)
            S = x.shape[0]
            probs = (x @ sd[p + "moe_layer.gate.wg.weight"].T).softmax(-1)
            logits = x @ sd[p + "moe_layer.gate.wg.weight"].T
            i1 = probs.argmax(-1)
            top1 = cfg["moe_top1_expert"]
            i2 = logits.masked_fill(F.one_hot(i1, E).bool(), float("-inf")).argmax(-1)
            m1, m2 = F.one_hot(i1, E), F.one_hot(i2, E)
            if capacity:
                frac = cfg["moe_eval_capacity_token_fraction"]
                if not training and frac > 0:
                    C = math.ceil(frac * S)
                else:
                    C = math.ceil(S / E) * (1 if top1 else 2)
                loc1 = (torch.cumsum(m1, 0) - 1) * m1
                loc2 = (torch.cumsum(m2, 0) - 1 + m1.sum(0)) * m2
                k1 = loc1.sum(-1) < C
                k2 = loc2.sum(-1) < C
            else:
                k1 = k2 = torch.ones(S, dtype=torch.bool)
            p1, p2 = probs.gather(-1, i1[:, None])[:, 0], probs.gather(-1, i2[:, None])[:, 0]
            if not top1 and cfg["moe_normalize_gate_prob_before_dropping"]:  # fairseq top2gating: before the drops
                den = (p1 + p2).clamp(min=torch.finfo(torch.float).eps)
                p1, p2 = p1 / den, p2 / den
            g1, g2 = p1 * k1, p2 * k2
            if not top1 and not cfg["moe_normalize_gate_prob_before_dropping"]:
                den = (g1 + g2).clamp(min=torch.finfo(torch.float).eps)
                g1, g2 = g1 / den, g2 / den
            y = torch.zeros_like(x)
            for s in range(S):
                choices = [(i1[s], g1[s])] + ([] if top1 else [(i2[s], g2[s])])
                for e, w in choices:
                    if w == 0:
                        continue
                    t = ex[(i, int(e))]
                    y[s] += w * (F.gelu(x[s] @ t["fc1.weight"].T + t["fc1.bias"]) @ t["fc2.weight"].T + t["fc2.bias"])
            h = h + y.view(B, T, d)
        else:
            h = h + F.gelu(u @ sd[p + "fc1.weight"].T + sd[p + "fc1.bias"]) @ sd[p + "fc2.weight"].T + sd[p + "fc2.bias"]
    h = F.layer_norm(h, (d,), sd["decoder.layer_norm.weight"], sd["decoder.layer_norm.bias"], 1e-5)
    return h @ sd["decoder.embed_tokens.weight"].T
