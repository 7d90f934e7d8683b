"""The streamed experts of one MoE layer: one chunked path on every runtime (ES-MoE §4.1).

A call's routed experts run in chunks of k: a chunk's weights are made usable where the experts compute (the engine's
`stream_chunks`: uploaded into a device slab, copied into a host staging block, or read in place) and its tokens run as
one grouped GEMM per matmul; the next chunk's weights come in meanwhile. k = 1 is ES-MoE's per-expert pipeline (each
expert by its own function: dropout inside the experts replays one RNG state per expert, a decode step's few tokens);
k = a layer's experts is the host tier's whole-layer GEMM or a device's layer-granular slab. Backward takes the chunks
in reverse, differentiates each chunk's forward (kept, or recomputed from the weights streamed again: T_M is not kept
on a device), and hands the chunk's expert gradients to the engine at once (one block down from a device).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

from ...models.moe_gpt.moe_ops import dropout_active, grouped_expert_counts
from ...precision import autocast_state, compute_dtype, restore_autocast
from ...rng import get_rng, rng_devices, set_rng
from ...families.layouts import ExpertLayout
from ..lora.expert_lora import ChunkLora, ExpertLora, active_expert_lora
from ..plan import Phase, Source
from ..stores.store import WEIGHTS, ExpertKey

Segment = tuple[int, int, int]  # (expert, first token, tokens) in the call's expert-sorted input
# An empty, non-persistent buffer the offload leaves on each experts module: `model.to(dtype)`, `.half()`, ... convert
# it with the module's other tensors, so the offloaded experts' dtype follows the model's
# (`OffloadedExpertsLayer.meta`).
DTYPE_BUFFER = "_offloaded_experts_dtype"


@dataclass(frozen=True)
class ChunkPlan:
    """How one call runs its experts: `chunks` of segments, each chunk computed at once, its weights from `source`
    (offload/streaming/chunk_sources.py): SLAB (a device block of k experts), LAYER (the host tier's (E, P) block: one chunk of
    every expert, those without tokens included), STAGED (streamed one by one and copied into the host staging block,
    k = `stage_experts`): one grouped GEMM per matmul over the chunk's (k, P) weights; EXPERT (streamed one by one,
    k = 1): the layout's expert function over the expert's (P,) weights. `lora`: the peft
    adapters on the experts' tensors this call applies (offload/lora/expert_lora.py)."""

    source: Source
    chunks: list[list[Segment]]
    lora: ExpertLora | None = None

    @property
    def grouped(self) -> bool:
        return self.source != Source.EXPERT


def segments(counts, ids, keep_empty: bool = False) -> list[Segment]:
    out, first = [], 0
    for e, n_tokens in zip(ids, counts):
        if n_tokens or keep_empty:
            out.append((e, first, n_tokens))
        first += n_tokens
    return out


def span(chunk: list[Segment]) -> tuple[int, int]:
    """The chunk's tokens [lo, hi) of the call's input (its segments are adjacent)."""
    return chunk[0][1], chunk[-1][1] + chunk[-1][2]


class OffloadedExpertsLayer:
    """The streamed experts of one MoE layer, `experts(x_sorted, counts, expert_ids)` on the model's MoE path; their
    weights live in the store under keys (layer, e)."""

    def __init__(self, engine, layer: int, module: nn.Module, layout: ExpertLayout):
        self.engine = engine
        self.layer = layer
        self.module = module
        self.layout = layout
        self.last_counts: list[int] = [0] * layout.num_experts
        # Streamed calls of this layer whose backward has not run yet (changed only by the methods below). A layer
        # may be called several times per micro-step (MPMoE partitions): an expert's gradient is final only in the
        # backward of the last call.
        self._outstanding = 0
        # Makes autograd call our backward even when no input requires grad (e.g. frozen layers below).
        self._anchor = torch.zeros(0, requires_grad=True)
        # Trainable parameters of the module that every expert's computation uses (e.g. a post-expert norm): ordinary
        # parameters, whose gradients the recompute in backward accumulates.
        expert_names = set(layout.names())
        self.shared_parameters = [p for n, p in module.named_parameters() if n not in expert_names]
        self._meta: dict[str, tuple[torch.Size, torch.dtype]] = {}  # expert tensor -> (shape, dtype) when offloaded
        self.handles: list = []  # the module's state-dict hooks (offload/api.py)
        self._recompute_forced = 0  # > 0 inside `recomputing()`
        self._view_cache: dict[tuple, list[torch.Tensor]] = {}  # see `_tensors`
        self._lora: ExpertLora | None = None  # peft's adapters on the expert tensors, as of the last `on_route`

    @property
    def meta(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Each expert tensor's (shape, dtype) as the module shows it now: its floating tensors in the dtype the model
        was last moved to (`DTYPE_BUFFER`), the others as they were."""
        marker = self.module._buffers.get(DTYPE_BUFFER)
        if marker is None:
            return self._meta
        return {n: (shape, marker.dtype if dtype.is_floating_point else dtype)
                for n, (shape, dtype) in self._meta.items()}

    @meta.setter
    def meta(self, value: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
        self._meta = value

    def __getstate__(self) -> dict:
        # A copy (`copy.deepcopy` of the model, offload/copies.py) starts with no call in flight, no adapters taken
        # and no views of the original store's buffers.
        return {**self.__dict__, "_view_cache": {}, "_lora": None, "_outstanding": 0, "_recompute_forced": 0}

    @contextmanager
    def recomputing(self):
        """Calls inside recompute T_M in backward whatever the engine's `keep_activations` (MPMoE partitions: their
        restore strategies handle what the layer saves and assume the expert inputs are all of it)."""
        self._recompute_forced += 1
        try:
            yield
        finally:
            self._recompute_forced -= 1

    def keeps_activations(self, x: torch.Tensor) -> bool:
        """Whether this call keeps its experts' forward graphs (`OffloadEngine.keep_activations`). Not inside
        `recomputing()`; not on the disk tier where the forward casts the weights (autocast to another dtype than the
        streamed copy's), nor with quantized experts on either tier (each is dequantized into a tensor of its own):
        the graphs would hold a full-width copy of every expert's weights, which the disk tier and quantized storage
        are there to avoid."""
        if not self.engine.keep_activations or self._recompute_forced or self.engine.store.quantization is not None:
            return False
        return self.engine.store.tier == "host" or compute_dtype(x) == self.engine.store.compute_dtype

    def keys(self, expert_ids: list[int]) -> list[ExpertKey]:
        return [(self.layer, e) for e in expert_ids]

    def on_route(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, counts: list[int],
                 outer: nn.Module | None = None) -> None:
        """Called by the MoE path with the layer's router input, choices and tokens per expert, before anything is
        dispatched or read, and with what sits at the experts module's place in the model (`outer`: peft's LoRA
        wrappers, if any): takes the active adapters for this forward's calls, picks the engine's mode for this
        call (inference or training) and, in inference, counts the routed experts' use (before a read of this call
        could evict one of them), scores this layer's pre-gating guess and starts the reads of the next layer's
        guessed experts (offload/inference/policies.py)."""
        engine = self.engine
        engine.bind(hidden_states.device)  # before the plan's first reads, which depend on the runtime
        self._lora = None
        if outer is not None:  # the factors in the store (offload/lora/lora_store.py) or on the module
            self._lora = (engine.lora.active(self.layer, outer, self.module) if engine.plan.lora_in_store
                          else active_expert_lora(outer, self.module))
        decoding = engine.decoding
        evaluating = not self.module.training
        if not decoding.enter_call(self.layer, decoding.inference_for(self.module), evaluating=evaluating):
            return
        for e, n in enumerate(counts):
            if n:
                decoding.decode_cache.touch((self.layer, e))
        if decoding.pregate is None:
            return
        decoding.pregate.observe(self.layer, top_k_index, self.num_experts)
        nxt = self.layer + 1
        if nxt < len(engine.layers):
            ids = decoding.pregate.guess(nxt, hidden_states, top_k_index.shape[-1])
            keys = [k for k in ((nxt, e) for e in ids) if k in engine.store]
            if keys and decoding.pregate.acting:
                engine.sources.prefetch(keys[: decoding.decode_cache.budget], WEIGHTS, engine.map_files)
                decoding.upload_ahead(keys)

    def prefetch(self, counts: list[int]) -> None:
        """Called with the dispatch plan before the token permutation, so the first reads overlap it."""
        engine = self.engine
        engine.sources.read_ahead(self.keys([e for e, n in enumerate(counts) if n]), WEIGHTS, engine.map_files)

    @property
    def training(self) -> bool:
        return self.module.training

    @property
    def num_experts(self) -> int:
        return self.layout.num_experts

    def expert_parameters(self) -> list[nn.Parameter]:
        return []  # the experts live in the store

    def __call__(self, x_sorted: torch.Tensor, counts: list[int], expert_ids: list[int] | None = None) -> torch.Tensor:
        ids = list(range(len(counts))) if expert_ids is None else list(expert_ids)
        self.engine.bind(x_sorted.device)
        total = [0] * self.layout.num_experts
        for e, n in zip(ids, counts):
            total[e] += n
        self.last_counts = total
        self.engine.stats.tokens_per_expert[str(self.layer)] = total
        plan = self.plan(x_sorted, counts, ids)
        if self._lora is not None:
            plan = replace(plan, lora=self._lora)
        if torch.is_grad_enabled():
            self._outstanding += 1
            shared = [p for p in self.shared_parameters if p.requires_grad]
            shared += self._lora.tensors() if self._lora is not None else []
            with self.engine.training_threads():
                return _StreamedExperts.apply(x_sorted, self._anchor, self, plan, *shared)
        with torch.no_grad():
            return self.run_forward(x_sorted, plan, rng_states=None)

    # --- the plan: which chunks, from where ---
    def plan(self, x: torch.Tensor, counts: list[int], ids: list[int]) -> ChunkPlan:
        """Chunks of k experts where one grouped GEMM per matmul computes them as the resident experts would
        (`grouped_counts`): a device's slab (k by its budget), the host tier's whole layer, the disk tier's staging
        block on the CPU (k = `stage_experts`); else one expert per chunk."""
        full = self.grouped_counts(x, counts, ids)
        if full is None:
            return ChunkPlan(Source.EXPERT, [[s] for s in segments(counts, ids)])
        engine = self.engine
        source = engine.plan.grouped_source
        if source == Source.LAYER:
            return ChunkPlan(Source.LAYER, [segments(full, range(len(full)), keep_empty=True)])
        k = engine.slab.experts if source == Source.SLAB else engine.stage_experts
        routed = segments(full, range(len(full)))
        return ChunkPlan(source, [routed[i : i + k] for i in range(0, len(routed), k)])

    def grouped_counts(self, x: torch.Tensor, counts: list[int], ids: list[int]) -> list[int] | None:
        """Tokens per expert, all E in expert order, when this call's chunks each run as one grouped GEMM per matmul
        under the resident experts' rule (`grouped_expert_counts`); None: expert by expert. A device: training calls
        through the slab. The CPU: over the store's (E, P) weights where it keeps a layer's so (the host tier), else in
        a training call over the engine's staging block (the disk tier, `stage_experts` > 1)."""
        engine = self.engine
        training = torch.is_grad_enabled() and not engine.decoding.inference
        source = engine.plan.grouped_source
        if source == Source.LAYER:
            weights = engine.store.grouped_weights(self.layer)
            if weights is None or weights.shape[0] != self.num_experts:
                return None
        elif source is None or not training:
            return None
        else:
            weights = engine.slab.blocks[0] if source == Source.SLAB else engine.sources.staging_block()
        if weights.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            return None
        views = self.layout.grouped_views(weights)
        return grouped_expert_counts(x, self.layout.matrices(views), counts, ids, self.module, self.num_experts)

    # --- one chunk's compute ---
    def _tensors(self, weights: torch.Tensor, x: torch.Tensor, grouped: bool) -> list[torch.Tensor]:
        """The chunk's expert tensors (layout order): (k, ...) views of its (k, P) weights, or one expert's views of
        its (P,) weights. Under autocast a streamed copy is used in its own dtype (autocast casts per op; a bf16 copy is
        never upcast back to fp32); without it the weights take the activations' dtype. Views of fixed buffers (blocks,
        host records, the disk tier's cache records) are made once per buffer: decoding calls each expert for one
        token, and making the views cost as much as its GEMMs."""
        autocast = torch.is_autocast_enabled(x.device.type)
        if not autocast and weights.dtype != x.dtype:
            weights = weights.to(x.dtype)
            return self.layout.grouped_views(weights) if grouped else self.layout.views(weights)
        if not grouped and not self.engine.plan.reuse_views:
            # a slot or a device copy (cheap on the host), or a quantized expert dequantized for this use only (a
            # new tensor each time: cached views would keep every one alive)
            return self.layout.views(weights)
        key = (weights.data_ptr(), tuple(weights.shape), grouped)
        views = self._view_cache.get(key)
        if views is None:
            views = self._view_cache[key] = (self.layout.grouped_views(weights) if grouped
                                             else self.layout.views(weights))
        return views

    def _chunk_lora(self, plan: ChunkPlan, chunk: list[Segment], leaves: bool, x: torch.Tensor) -> ChunkLora | None:
        if plan.lora is None:
            return None
        return plan.lora.chunk([e for e, _, _ in chunk], plan.grouped, self.num_experts, leaves, x)

    def _compute(self, xs: torch.Tensor, chunk: list[Segment], tensors: list[torch.Tensor], grouped: bool,
                 lora: ChunkLora | None) -> torch.Tensor:
        adapt = None
        if lora is not None:

            def adapt(linear):
                return lora.linear(linear, self.layout.names(), tensors)
        if grouped:
            return self.layout.grouped_forward(xs, [n_tokens for _, _, n_tokens in chunk], tensors, adapt)
        return self.layout.forward(xs, tensors, adapt)

    def _forward_chunk(self, xs: torch.Tensor, chunk: list[Segment], weights: torch.Tensor, plan: ChunkPlan,
                       graphs: list | None) -> torch.Tensor:
        """One chunk's forward; with `graphs`, its graph is kept for backward (`keep_activations`): the middle
        activation (T_M) saved as a resident model saves it, the weights not (`_kept_graph`)."""
        grouped = plan.grouped
        if graphs is None:
            lora = self._chunk_lora(plan, chunk, leaves=False, x=xs)
            return self._compute(xs, chunk, self._tensors(weights, xs, grouped), grouped, lora)
        leaves = [t.detach().requires_grad_(True) for t in self._tensors(weights, xs, grouped)]
        lora = self._chunk_lora(plan, chunk, leaves=True, x=xs)
        graphs.append((*_kept_graph(lambda inputs: self._compute(inputs, chunk, leaves, grouped, lora), xs, leaves,
                                    weights), lora))
        return graphs[-1][2].detach()

    def _differentiate(self, ys, xs, leaves: list, gy, params: tuple, g_params: list, lora: ChunkLora | None,
                       factors: list, g_lora: list) -> tuple:
        """One autograd pass over a chunk's forward graph -> (the input gradient, the expert tensors' gradients in
        layout order, none when the experts are frozen); the shared `params`' gradients are added into `g_params`,
        the chunk's LoRA factor blocks' into the gradients `g_lora` of the layer's `factors` (ChunkLora.accumulate)."""
        train = self.engine.train_experts
        extra = [*params, *(lora.tensors() if lora is not None else [])]
        grads = torch.autograd.grad(ys, [xs, *(leaves if train else []), *extra], gy.to(ys.dtype),
                                    allow_unused=bool(extra))
        tail = grads[len(grads) - len(extra):]
        for j, g in enumerate(tail[: len(params)]):
            if g is not None:
                g_params[j] = g if g_params[j] is None else g_params[j] + g
        if lora is not None:
            lora.accumulate(tail[len(params):], factors, g_lora)
        return grads[0], grads[1 : 1 + len(leaves)] if train else ()

    # --- the path: forward and backward ---
    def run_forward(self, x: torch.Tensor, plan: ChunkPlan, rng_states: list | None,
                    graphs: list | None = None) -> torch.Tensor:
        """`rng_states`: a list to record each chunk's RNG state in (for the recompute; None: no backward follows).
        `graphs`: a list to keep each chunk's forward graph in, (input leaf, weight leaves, output, holder, its
        ChunkLora), instead."""
        engine = self.engine
        chunks = plan.chunks
        y = None  # in the experts' output dtype (autocast: bf16), like the resident experts' torch.cat
        phase = Phase.INFERENCE if rng_states is None else Phase.FORWARD
        decoding = engine.decoding
        if (phase == Phase.INFERENCE and decoding.cost_model is not None and decoding.inference and not plan.grouped
                and plan.lora is None):
            on_host = [c[0] for c in chunks if decoding.compute_on_host((self.layer, c[0][0]), c[0][2], x)]
            if on_host:
                y = self._run_on_host(x, on_host)
                chunks = [c for c in chunks if c[0] not in on_host]
        save_rng = rng_states is not None and graphs is None and not plan.grouped and dropout_active(self.module)
        with contextlib.closing(engine.sources.stream_chunks(self.layer, plan.source, chunks, phase)) as stream:
            for chunk, weights, _ in stream:
                lo, hi = span(chunk)
                if save_rng:
                    rng_states.append(get_rng(x.device))
                out = self._forward_chunk(x[lo:hi], chunk, weights, plan, graphs)
                if y is None:
                    y = x.new_empty((x.shape[0], out.shape[-1]), dtype=out.dtype)
                y[lo:hi] = out
        return y if y is not None else x[:0].clone()

    def run_backward(self, x, gy, plan: ChunkPlan, rng_states: list, shared: tuple = (),
                     graphs: list | None = None) -> tuple:
        """-> (input gradient, gradients of the `shared` parameters); the experts' gradients go to the engine, a
        chunk's at once. The chunks in reverse, each differentiated from its kept graph (`graphs`) or its forward
        recomputed from the weights streamed again (under the chunk's RNG state where the forward recorded one)."""
        engine = self.engine
        gx = torch.zeros_like(x)
        factors = plan.lora.tensors() if plan.lora is not None else []  # the last of `shared`
        params = shared[: len(shared) - len(factors)]
        g_params, g_lora = [None] * len(params), [None] * len(factors)
        order = list(reversed(range(len(plan.chunks))))
        stream = engine.sources.stream_chunks(self.layer, plan.source, [plan.chunks[c] for c in order],
                                              Phase.BACKWARD)
        with contextlib.closing(stream):
            for c, (chunk, weights, records) in zip(order, stream):
                try:
                    lo, hi = span(chunk)
                    if graphs:
                        xs, leaves, ys, holder, lora = graphs[c]
                        holder[0] = weights  # the kept graph's saved weights are these (see _kept_graph)
                        graphs[c] = None  # freed once used, as autograd frees a resident model's saved tensors
                    else:
                        leaves = [t.detach().requires_grad_(True) for t in self._tensors(weights, x, plan.grouped)]
                        lora = self._chunk_lora(plan, chunk, leaves=True, x=x)
                        xs = x[lo:hi].detach().requires_grad_(True)
                        with torch.enable_grad(), torch.random.fork_rng(devices=rng_devices(x.device),
                                                                        enabled=bool(rng_states)):
                            if rng_states:
                                set_rng(x.device, rng_states[c])
                            ys = self._compute(xs, chunk, leaves, plan.grouped, lora)
                    gx[lo:hi], expert_grads = self._differentiate(ys, xs, leaves, gy[lo:hi], params, g_params, lora,
                                                                  factors, g_lora)
                except BaseException:
                    for (e, _, _), record in zip(chunk, records):
                        engine.gradients.release_record((self.layer, e), record)
                    raise
                if not plan.grouped:
                    expert_grads = tuple(g.unsqueeze(0) for g in expert_grads)
                engine.gradients.chunk_arrived(self.layer, chunk, records, expert_grads)
        engine.layer_backward_done(self.layer)
        return gx, [*g_params, *g_lora]

    @property
    def in_last_backward(self) -> bool:
        """Whether the backward running now is that of the micro-step's last call of this layer (its experts'
        gradients are final once it hands them over)."""
        return self._outstanding <= 1

    def backward_done(self) -> bool:
        """A call's backward is done -> whether it was the last outstanding one (the layer's gradients are final)."""
        self._outstanding = max(0, self._outstanding - 1)
        return self._outstanding == 0

    def forget_calls(self) -> None:
        """The window closed: calls whose backward never ran (a forward under grad only evaluated) are forgotten."""
        self._outstanding = 0

    def forget_buffers(self) -> None:
        """The store was replaced: drop the views made of its buffers."""
        self._view_cache.clear()

    def _run_on_host(self, x: torch.Tensor, on_host: list[Segment]) -> torch.Tensor:
        """Inference on an asynchronous device: run these experts on the host, from the store's host weights,
        instead of uploading them (Fiddler; `DecodePath.compute_on_host` chose them). -> the output buffer with
        their tokens' outputs filled, in the dtype the device experts produce."""
        engine = self.engine
        engine.runtime.record().synchronize()  # the host reads the inputs the compute stream produced
        out_dtype = compute_dtype(x)
        y = None
        for e, first, n_tokens in on_host:
            key = (self.layer, e)
            engine.ledger.wait_for_update(key)
            record = engine.store.acquire(key, WEIGHTS)
            try:
                xs = x[first : first + n_tokens].to("cpu")
                out = self.layout.forward(xs, self._tensors(record.compute_param(), xs, grouped=False))
            finally:
                engine.store.release(key)
            if y is None:
                y = x.new_empty((x.shape[0], out.shape[-1]), dtype=out_dtype)
            y[first : first + n_tokens] = out.to(x.device, out_dtype)
            engine.stats.host_computed_experts += 1
        return y


def _kept_graph(forward: Callable, xs: torch.Tensor, leaves: list[torch.Tensor], w: torch.Tensor) -> tuple:
    """Run `forward(xs)` over weight `leaves` that are views of `w` with the graph kept for backward, but not `w`:
    saved tensors that are views of `w` are packed as their place in it and unpacked from `holder[0]`, which the
    backward sets to the same weights at the same places (`w` itself, or the buffer they were streamed or staged
    into again: nothing updates an expert between its forward and its backward in a micro-step, since its step
    waits for the backward of the layer's last call). So the disk tier's cache may evict the record and fill its
    buffer with another expert meanwhile, and the host tier's records need no autograd version check (a gradient
    landed by another call of the layer, MPMoE partitions, bumps the counter of the record's buffer). -> (input leaf, leaves, output, holder)."""
    holder: list[torch.Tensor | None] = [None]
    base, origin = w.untyped_storage().data_ptr(), w.storage_offset()

    def pack(t: torch.Tensor):
        if t.untyped_storage().data_ptr() == base:
            return (t.storage_offset() - origin, t.shape, t.stride())
        return t

    def unpack(saved):
        if isinstance(saved, tuple):
            now = holder[0]
            return now.as_strided(saved[1], saved[2], now.storage_offset() + saved[0])
        return saved

    xs = xs.detach().requires_grad_(True)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        ys = forward(xs)
    return xs, leaves, ys, holder


class _StreamedExperts(torch.autograd.Function):
    """Saves the expert inputs (T_DI). By default weights are re-streamed and T_M recomputed in backward, under the
    autocast state of the forward (backward itself runs outside the user's autocast block). With the engine's
    `keep_activations` each chunk's forward graph is kept instead (T_M saved, as a resident model does), and
    backward differentiates it without a second forward."""

    @staticmethod
    def forward(ctx, x_sorted, anchor, layer: OffloadedExpertsLayer, plan: ChunkPlan, *shared):
        ctx.layer, ctx.plan, ctx.shared = layer, plan, shared
        ctx.rng_states = []
        ctx.graphs = [] if layer.keeps_activations(x_sorted) else None
        ctx.autocast = autocast_state(x_sorted.device.type)
        ctx.save_for_backward(x_sorted)
        return layer.run_forward(x_sorted, plan, ctx.rng_states, ctx.graphs)

    @staticmethod
    def backward(ctx, gy):
        (x_sorted,) = ctx.saved_tensors
        with restore_autocast(x_sorted.device.type, ctx.autocast), ctx.layer.engine.training_threads():
            gx, g_shared = ctx.layer.run_backward(x_sorted, gy.contiguous(), ctx.plan, ctx.rng_states, ctx.shared,
                                                  ctx.graphs)
        ctx.graphs = None
        return gx, None, None, None, *g_shared


__all__ = ["DTYPE_BUFFER", "ChunkPlan", "OffloadedExpertsLayer"]
