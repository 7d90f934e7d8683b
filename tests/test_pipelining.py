"""MPMoE micro-batch pipelining and memory reuse (hf_moe_offload.pipelining): equivalence with the unpartitioned
layer for every restore strategy and granularity (resident and host-offloaded experts), saved-bytes accounting vs
Eq. 5 on scaled Table 3 shapes, and the configurator (Algorithm 1, performance model, real measurements).

Tolerance: fp32, atol = rtol = 1e-5. Partitioning changes how rows are grouped into GEMMs (and the order of the
index_add_ accumulation), so results differ from the unpartitioned layer only by rounding (observed <= 1e-6).
"""

from __future__ import annotations

import copy
import gc
import logging
import math
import weakref
import zlib

import pytest
import torch

from hf_moe_offload import MoEGPTConfig, MoEGPTForCausalLM, OffloadConfig, enable_expert_offload
from hf_moe_offload.models.moe_gpt.moe_layer import MoEGPTExperts
from hf_moe_offload.models.moe_gpt.moe_ops import DispatchPlan
from hf_moe_offload.pipelining import (
    GranularitySearch,
    LocalComm,
    PartitionedExecutor,
    PerformanceModel,
    PipelineConfigurator,
    Speeds,
    disable_micro_batch_pipelining,
    enable_micro_batch_pipelining,
    split_plan,
)
from hf_moe_offload.pipelining.memory import measure_saving
from hf_moe_offload.families.moe_path import get_moe_path, moe_path, sorted_experts

TOL = dict(atol=1e-5, rtol=1e-5)
STRATEGIES = ["keep", "S1", "S2", "S3", "S4"]
GRANULARITIES = [1, 2, 3, 4, 8]


def tiny_model(seed: int = 0, **overrides) -> MoEGPTForCausalLM:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
               num_experts=6, num_experts_per_tok=2, moe_layer_frequency=1, hidden_dropout=0.0,
               attention_dropout=0.0, max_position_embeddings=64)
    cfg.update(overrides)
    model = MoEGPTForCausalLM(MoEGPTConfig(**cfg))
    with torch.no_grad():  # larger than the 0.02 init so that differences would show
        for m in model.modules():
            if isinstance(m, MoEGPTExperts):
                for p in m.parameters():
                    p.normal_(0.0, 0.2)
    return model


def resident(model, tmp_path):
    return None


def host_offload(model, tmp_path):
    return enable_expert_offload(model, OffloadConfig(mode="host", prefetch_depth=2, pin_fraction=0.0))


EXPERTS = {"resident": resident, "offload-host": host_offload}


def expert_grads(model, engine, reference=None) -> list[torch.Tensor]:
    """Per-expert gradients, flattened in the offload layout (from the store, or from `.grad` of resident experts)."""
    if engine is None:
        return [p.grad for m in model.modules() if isinstance(m, MoEGPTExperts) for p in m.parameters()]
    out = []
    for layer, module in zip(engine.layers, [m for m in reference.modules() if isinstance(m, MoEGPTExperts)]):
        for e in range(layer.layout.num_experts):
            out.append(engine.expert_grad((layer.layer, e)))
    return out


def reference_store_grads(reference, engine) -> list[torch.Tensor]:
    out = []
    for layer, module in zip(engine.layers, [m for m in reference.modules() if isinstance(m, MoEGPTExperts)]):
        lay = layer.layout
        for e in range(lay.num_experts):
            if module.fc1_weight.grad is None:
                out.append(None)
                continue
            out.append(lay.pack([getattr(module, t.name).grad[e] for t in lay.tensors], torch.empty(lay.numel)))
    return out


def assert_grads_close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None or g is None:
            assert (g is None or not g.abs().any()) and (w is None or not w.abs().any())
            continue
        torch.testing.assert_close(g, w, **TOL)


# ----------------------------------------------------------------------------------------------------------------
# Equivalence
# ----------------------------------------------------------------------------------------------------------------
def test_split_plan_keeps_every_row_once_and_expert_order():
    torch.manual_seed(0)
    S, E, k = 13, 5, 2
    plan = DispatchPlan.build(torch.rand(S, k), torch.randint(0, E, (S, k)), E)
    for n in (1, 2, 3, 4, 8, 13):
        parts = split_plan(plan, S, n)
        assert len(parts) == n
        assert sorted(torch.cat([p.token_index for p in parts]).tolist()) == sorted(plan.token_index.tolist())
        assert [sum(c) for c in zip(*[p.counts for p in parts])] == plan.counts
        sizes = [len(set(p.token_index.tolist())) for p in parts]
        assert max(sizes) - min(sizes) <= 1  # nearly equal token partitions (n need not divide S)
        for p in parts:  # rows of one partition stay grouped by expert, in the original order within an expert
            expert = torch.repeat_interleave(torch.arange(E), torch.tensor(p.counts))
            assert torch.all(expert[1:] >= expert[:-1])


@pytest.mark.parametrize("factory", list(EXPERTS))
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("n", GRANULARITIES)
def test_layer_equals_unpartitioned(factory, strategy, n, tmp_path):
    reference = tiny_model()
    model = copy.deepcopy(reference)
    engine = EXPERTS[factory](model, tmp_path)
    block, ref_block = model.model.layers[0].moe, reference.model.layers[0].moe
    gen = torch.Generator().manual_seed(zlib.crc32(f"{factory}-{strategy}-{n}".encode()))
    x = torch.randn(3, 7, 32, generator=gen)  # 21 tokens: n = 2, 4, 8 do not divide it
    gy = torch.randn(3, 7, 32, generator=gen)
    xr, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_ref = ref_block(xr)[0]
    (out_ref * gy).sum().backward()
    moe_path(model).layers[0].set_pipelined(PartitionedExecutor(n, strategy))
    out = block(xp)[0]
    (out * gy).sum().backward()
    torch.testing.assert_close(out, out_ref, **TOL)
    torch.testing.assert_close(xp.grad, xr.grad, **TOL)
    torch.testing.assert_close(block.router.weight.grad, ref_block.router.weight.grad, **TOL)
    if engine is None:
        for p, q in zip(block.experts.parameters(), ref_block.experts.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL)
    else:
        got = [engine.expert_grad((0, e)) for e in range(6)]
        want = reference_store_grads(reference, engine)[:6]
        assert_grads_close(got, want)


@pytest.mark.parametrize("factory", list(EXPERTS))
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("n", GRANULARITIES)
def test_causal_lm_equals_unpartitioned(factory, strategy, n, tmp_path):
    causal_lm_equals_unpartitioned(factory, strategy, n, tmp_path)


def causal_lm_equals_unpartitioned(factory: str, strategy: str, n: int, tmp_path, device: str = "cpu") -> None:
    """Both models on `device` (tests/test_cuda.py runs this on a GPU)."""
    reference = tiny_model(seed=1)
    model = copy.deepcopy(reference)
    engine = EXPERTS[factory](model, tmp_path)
    reference.to(device)
    model.to(device)  # the non-expert weights where the experts are offloaded
    executor = enable_micro_batch_pipelining(model, n=n, strategy=strategy)
    gen = torch.Generator().manual_seed(zlib.crc32(f"lm-{factory}-{strategy}-{n}".encode()))
    ids = torch.randint(0, 101, (2, 9), generator=gen).to(device)  # 18 tokens
    ref_out = reference(ids, labels=ids)
    out = model(ids, labels=ids)
    assert executor.last_choice == (n, strategy)
    torch.testing.assert_close(out.logits, ref_out.logits, **TOL)
    torch.testing.assert_close(out.loss, ref_out.loss, **TOL)
    ref_out.loss.backward()
    out.loss.backward()
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, **TOL, msg=name)
    if engine is not None:
        assert_grads_close(expert_grads(model, engine, reference), reference_store_grads(reference, engine))
    disable_micro_batch_pipelining(model)
    path = get_moe_path(model)
    assert path is None or all(layer.pipelined is None for layer in path.layers)


@pytest.mark.parametrize("strategy", ["S3", "S4"])
def test_recomputation_replays_dropout_masks(strategy):
    """With expert dropout, recomputing T_M (S3/S4) must reuse the forward's RNG state: same grads as "keep"."""
    model = tiny_model(activation_dropout=0.5)
    model.train()
    ids = torch.randint(0, 101, (2, 9))
    grads = {}
    for s in ("keep", strategy):
        m = copy.deepcopy(model)
        enable_micro_batch_pipelining(m, n=3, strategy=s)
        torch.manual_seed(123)
        m(ids, labels=ids).loss.backward()
        grads[s] = [p.grad for p in m.parameters()]
    for a, b in zip(grads["keep"], grads[strategy]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_no_grad_forward_saves_nothing_and_matches():
    model = tiny_model()
    ids = torch.randint(0, 101, (2, 9))
    with torch.no_grad():
        ref = model(ids).logits
        ex = enable_micro_batch_pipelining(model, n=4, strategy="S1")
        out = model(ids).logits
    assert ex.last_choice == (4, "keep")  # nothing saved for backward: nothing to offload
    torch.testing.assert_close(out, ref, **TOL)


# ----------------------------------------------------------------------------------------------------------------
# Memory: saved bytes vs Eq. 5 (Table 3 FFN shapes scaled down by 8, ReLU as the paper's in-place activation)
# ----------------------------------------------------------------------------------------------------------------
TABLE3 = {"GPT-S": (768, 3072), "BERT-L": (1024, 4096), "GPT-XL": (2048, 8192)}
SCALE = 8


@pytest.mark.parametrize("name", list(TABLE3))
def test_saved_bytes_reach_95_percent_of_eq5(name):
    M, H = (d // SCALE for d in TABLE3[name])
    E, k, S = 16, 2, 128
    cfg = MoEGPTConfig(hidden_size=M, intermediate_size=H, num_experts=E, num_experts_per_tok=k,
                       activation_function="relu", num_attention_heads=4)
    torch.manual_seed(0)
    module = MoEGPTExperts(cfg)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.02)
    experts = sorted_experts(module)
    x = torch.randn(S, M, requires_grad=True)
    # index_add_'s combine, as the partitions' own: the gathering combine of the unpartitioned layer saves no copy of
    # T_DO for backward (index_add_ keeps its source), so it would start from a (B, M) smaller baseline.
    plan = DispatchPlan.build(torch.rand(S, k, requires_grad=True), torch.randint(0, E, (S, k)), E, gathers=False)
    B, elem = S * k, 4
    # "keep" with n=1 through the executor saves exactly what the plain layer saves (the counting is consistent).
    base = measure_saving(x, plan, experts, 1, "keep")
    assert base.reuse_bytes == base.keep_bytes
    assert base.keep_bytes >= B * (2 * M + H) * elem  # T_DI + T_M + T_DO at least
    for n in (2, 4, 8):
        for strategy in ("S1", "S2", "S3", "S4"):
            m = measure_saving(x, plan, experts, n, strategy)
            assert m.theory_bytes == B * (2 * M * (n - 2) / n + H * (n - 1) / n) * elem
            assert m.fraction_of_bound >= 0.95, (name, n, strategy, m)
            assert m.fraction_of_bound <= 1.01, (name, n, strategy, m)


# ----------------------------------------------------------------------------------------------------------------
# Configurator: Algorithm 1 on synthetic costs
# ----------------------------------------------------------------------------------------------------------------
def parabola_cost(B: int, n: int) -> float:
    """Best n grows with B (n* = B / 1000), cost parabola-like in n (the two hypotheses of §4.1)."""
    return (n - B / 1000) ** 2


def test_algorithm1_cache_early_stop_and_range_updates():
    search = GranularitySearch(parabola_cost, n_min=1, n_max=8)
    assert search.G == {1: (0, 1), 8: (math.inf, math.inf)}
    # New B below every known range except n=1's: search from n_floor=1 upward, stop at the turning point.
    assert search(500) == 1
    assert search.profiled == [(500, 1), (500, 2)]  # early stop: cost rose at n=2
    assert search.G[1] == (0, 500)  # n == n_floor: its range is extended (line 22)
    # Cache hit (lines 3-5): no profiling.
    assert search(500) == 1 and search.cache_hits == 1 and len(search.profiled) == 2
    # Inside a known range (line 6): no profiling.
    assert search(300) == 1 and len(search.profiled) == 2
    # Between n=1's range and n=8's sentinel: scan 1..8, stop after the minimum at n=4.
    assert search(4000) == 4
    assert [n for b, n in search.profiled if b == 4000] == [1, 2, 3, 4, 5]
    assert search.G[4] == (4000, 4000)  # a new n strictly between the bounds gets a point range (line 20)
    # Just above n=4's range: the search starts at n_floor=4 (monotone hypothesis) and extends its range.
    assert search(4200) == 4
    assert [n for b, n in search.profiled if b == 4200] == [4, 5]
    assert search.G[4] == (4000, 4200)
    assert search(4100) == 4 and not [1 for b, _ in search.profiled if b == 4100]  # inside the updated range
    # Large B: costs fall all the way to n_ceil=8, whose sentinel range becomes (B, inf).
    assert search(9000) == 8
    assert [n for b, n in search.profiled if b == 9000] == [4, 5, 6, 7, 8]
    assert search.G[8] == (9000, math.inf)
    assert search(20000) == 8 and not [1 for b, _ in search.profiled if b == 20000]
    # Between n=1 and n=4's ranges: only n in [1, 4] are profiled.
    assert search(2000) == 2
    assert [n for b, n in search.profiled if b == 2000] == [1, 2, 3]
    assert search.G[2] == (2000, 2000)
    # Ranges stay monotone in n.
    ranges = [search.G[n] for n in sorted(search.G)]
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))


def constant_speeds(comp: float, comm: float, mem: float, alpha: dict | None = None) -> Speeds:
    points = {k: [(1.0, v), (1e15, v)] for k, v in (("comp", comp), ("comm", comm), ("mem", mem))}
    return Speeds(points=points, alpha=alpha or {})


def test_model_picks_s4_when_communication_bound():
    """Cheap compute, slow exchanges, and host copies that slow the exchanges down (PCIe vs network contention,
    §5.5.3 at N = 32, 64): extra copies cost more than extra re-dispatch, so S4."""
    contention = {("comm", "mem"): 0.3, ("comm", "all"): 0.3, ("mem", "comm"): 0.5, ("mem", "all"): 0.5}
    speeds = constant_speeds(comp=1e15, comm=1e9, mem=2e9, alpha=contention)
    cfg = PipelineConfigurator(768, 3072, speeds=speeds)
    n, s = cfg.choose_for(8192)
    assert s == "S4" and 1 <= n <= 8


def test_model_picks_s1_or_s2_when_compute_bound():
    """Slow compute, fast exchanges and copies: recomputation (S3, S4) is the expensive restore."""
    speeds = constant_speeds(comp=1e9, comm=1e12, mem=1e12)
    cfg = PipelineConfigurator(768, 3072, speeds=speeds)
    n, s = cfg.choose_for(8192)
    assert s in ("S1", "S2")


def test_model_granularity_grows_with_batch_when_latency_matters():
    """Piecewise speeds with a latency floor (Fig. 9): small batches want few partitions, large ones more."""
    lat = 1e-4  # seconds per op below 1e6 units
    pts = lambda peak: [(1e6, 1e6 / lat), (1e9, peak), (1e15, peak)]  # noqa: E731
    speeds = Speeds(points={"comp": pts(1e12), "comm": pts(1e9), "mem": pts(1e9)})
    model = PerformanceModel(speeds, 768, 3072)
    best = lambda B: min(range(1, 9), key=lambda n: model.time(B, n, "S4"))  # noqa: E731
    assert best(64) <= best(4096) <= best(65536)
    assert best(64) == 1 and best(65536) > 1


def test_auto_with_real_measurements_is_valid_and_logged(caplog):
    model = tiny_model()
    with caplog.at_level(logging.INFO, logger="hf_moe_offload.pipelining"):
        ex = enable_micro_batch_pipelining(model)  # n="auto", strategy="auto", performance model
        ids = torch.randint(0, 101, (2, 16))
        ref = copy.deepcopy(model)
        disable_micro_batch_pipelining(ref)
        out = model(ids, labels=ids)
        out.loss.backward()
    n, s = ex.last_choice
    assert 1 <= n <= 8 and s in ("S1", "S2", "S3", "S4")
    assert any("MPMoE configurator" in r.message and f"n={n}, strategy={s}" in r.message for r in caplog.records)
    sp = ex.configurator.speeds
    assert all(v > 0 for pts in sp.points.values() for _, v in pts)
    assert all(0 < a <= 1 for a in sp.alpha.values()) and len(sp.alpha) == 9
    torch.testing.assert_close(out.loss, ref(ids, labels=ids).loss, **TOL)
    # The same B hits the cache: no new log line, same choice.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_moe_offload.pipelining"):
        model(ids, labels=ids)
    assert ex.last_choice == (n, s) and not any("MPMoE configurator" in r.message for r in caplog.records)


def test_profile_method_runs_algorithm1_on_real_timings():
    model = tiny_model()
    ex = enable_micro_batch_pipelining(model, method="profile", strategy="S4", n_max=3)
    ids = torch.randint(0, 101, (2, 8))
    model(ids, labels=ids).loss.backward()
    n, s = ex.last_choice
    assert s == "S4" and 1 <= n <= 3
    search = ex.configurator.searches["S4"]
    assert search.profiled and all(b == 32 for b, _ in search.profiled)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_invalid_arguments_say_what_to_do():
    model = tiny_model()
    with pytest.raises(ValueError, match="strategy must be one of"):
        enable_micro_batch_pipelining(model, n=2, strategy="S5")
    with pytest.raises(ValueError, match="n must be"):
        enable_micro_batch_pipelining(model, n=0, strategy="S1")
    assert "n=2, strategy=S4" in repr(enable_micro_batch_pipelining(model, n=2, strategy="S4"))


@pytest.mark.parametrize("strategy", ["S1", "S4"])
def test_composes_with_activation_checkpointing(strategy):
    """The decoder layer's checkpoint installs its own saved-tensor hooks; ours nest inside and still match."""
    reference = tiny_model()
    model = copy.deepcopy(reference)
    model.gradient_checkpointing_enable()  # transformers 5: alias of activation checkpointing
    model.train()
    reference.train()
    enable_micro_batch_pipelining(model, n=3, strategy=strategy)
    ids = torch.randint(0, 101, (2, 9))
    model(ids, labels=ids).loss.backward()
    reference(ids, labels=ids).loss.backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


def test_auto_with_offloaded_experts(tmp_path):
    reference = tiny_model()
    model = copy.deepcopy(reference)
    engine = host_offload(model, tmp_path)
    with pytest.raises(ValueError, match="resident experts"):
        enable_micro_batch_pipelining(model, method="profile")
    ex = enable_micro_batch_pipelining(model, speeds=constant_speeds(1e9, 1e12, 1e12))  # model method, fixed speeds
    ids = torch.randint(0, 101, (2, 9))
    out, ref = model(ids, labels=ids), reference(ids, labels=ids)
    torch.testing.assert_close(out.loss, ref.loss, **TOL)
    out.loss.backward()
    ref.loss.backward()
    assert ex.last_choice[1] in ("S1", "S2")
    assert_grads_close(expert_grads(model, engine, reference), reference_store_grads(reference, engine))


class RecordingComm(LocalComm):
    """LocalComm that remembers weak references to every T_DI it produced."""

    def __init__(self):
        self.refs = []

    def dispatch(self, x, plan):
        d = super().dispatch(x, plan)
        self.refs.append(weakref.ref(d.x))
        return d


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_partition_buffers_are_released_before_backward(strategy):
    """Memory reuse for real: with S1-S4 no partition's T_DI (nor T_M) survives its partition in forward, so the
    next partition reuses the memory; with "keep" all of them stay alive until backward."""
    model = tiny_model()
    block = model.model.layers[0].moe
    comm = RecordingComm()
    moe_path(model).layers[0].set_pipelined(PartitionedExecutor(4, strategy, comm=comm))
    x = torch.randn(2, 9, 32, requires_grad=True)
    out = block(x)[0]
    gc.collect()
    alive = [r() is not None for r in comm.refs]
    assert len(alive) == 4
    assert all(alive) if strategy == "keep" else not any(alive)
    out.sum().backward()  # and backward still restores them
    assert x.grad is not None and torch.isfinite(x.grad).all()
