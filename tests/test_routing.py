"""Router freezing and the load-balancing loss, for every MoE family (issue 13, part 4)."""

from __future__ import annotations

import argparse
import copy

import torch
from moe_families import VOCAB, Unshrinkable, experts_families, tiny_model

from hf_moe_offload import ExpertAwareOptimizer, ExpertOptimizer, OffloadConfig, enable_expert_offload
from hf_moe_offload.jobs import _ready_for_training
from hf_moe_offload.families.moe_path import find_experts_modules
from hf_moe_offload.families.routing import freeze_routers, keep_load_balancing_loss, router_modules


def test_every_family_has_one_router_per_moe_layer():
    found = 0
    for family in experts_families():
        try:
            model = tiny_model(family)
        except Unshrinkable:
            continue
        routers = router_modules(model)
        assert len(routers) == len(find_experts_modules(model)), family
        assert all(any(True for _ in r.parameters()) for _, r in routers), family
        found += 1
    assert found >= 35


def test_frozen_routers_stay_put_while_everything_else_trains(tmp_path):
    model = tiny_model("qwen3_moe")
    initial = copy.deepcopy(model.state_dict())
    engine = enable_expert_offload(model, OffloadConfig(mode="disk", offload_dir=str(tmp_path), host_cache_experts=3))
    frozen = freeze_routers(model)
    assert frozen == ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    opt = ExpertAwareOptimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
                               ExpertOptimizer(engine, lr=1e-2))
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, 10))
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    engine.synchronize()
    after = model.state_dict()
    for name, t in initial.items():  # experts (read back from the store) included
        assert torch.equal(after[name], t) == (name in frozen), name


def test_load_balancing_loss_counts_whenever_its_coefficient_is_set():
    model = tiny_model("qwen3_moe", router_aux_loss_coef=0.05)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    plain = model(ids, labels=ids)
    assert plain.aux_loss is None  # stock default: coefficient set, loss silently without it
    assert keep_load_balancing_loss(model)
    out = model(ids, labels=ids)
    assert out.aux_loss is not None and out.aux_loss > 0
    torch.testing.assert_close(out.loss, plain.loss + 0.05 * out.aux_loss, atol=1e-6, rtol=0)
    assert not keep_load_balancing_loss(model)  # already on: nothing to switch


def test_job_helper_applies_both():
    model = tiny_model("mixtral", router_aux_loss_coef=0.02)
    _ready_for_training(model, argparse.Namespace(freeze_router=True))
    assert model.config.output_router_logits
    assert all(not p.requires_grad for _, r in router_modules(model) for p in r.parameters())
    assert model.training


def test_expert_load_is_counted_for_any_family_from_the_experts_call(tmp_path):
    """ExpertLoadCallback counts tokens per expert from `top_k_index` of transformers' experts signature: a Mixtral
    (offloaded, so through the MoE path) and a gpt-oss (stock) model both get per-layer counts and dead experts."""
    import types

    from transformers import TrainerState

    from hf_moe_offload.jobs.run_stats import ExpertLoadCallback

    for family, offload in (("mixtral", True), ("gpt_oss", False)):
        model = tiny_model(family, num_experts=16)
        if offload:
            enable_expert_offload(model, OffloadConfig(mode="host"))
        callback = ExpertLoadCallback()
        args, state = types.SimpleNamespace(device="cpu"), TrainerState()
        callback.on_train_begin(args, state, None, model=model)
        ids = torch.randint(0, VOCAB, (1, 3))  # 3 tokens x top-2: at most 6 of 16 experts reached per layer
        model(ids)
        state.global_step = 1
        logs = {"loss": 1.0}
        callback.on_log(args, state, None, logs=logs)
        counts = callback.history[-1]["counts"]
        assert len(counts) == len(find_experts_modules(model)) and all(sum(r) == 3 * 2 for r in counts), family
        assert logs["expert_load/dead_experts"] == sum(r.count(0) for r in counts) >= 2 * 10, family
        callback.on_train_end(args, state, None)
