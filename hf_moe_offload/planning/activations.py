"""The estimate's activation model: what a training step holds on the compute device beside the weights, part by part.

Counted per token from the config, the way transformers' decoder layers, this package's MoE path and its chunked LM
loss (families/lm_loss.py) keep tensors, as the peak of one step:

- **kept**: what lives from its forward until its backward. Without activation checkpointing every decoder layer's
  saved activations; with it only each layer's input (what `torch.utils.checkpoint` keeps), the rest recomputed in
  the backward.
- **the peak beside it**, the larger of two moments: the LM loss's forward (the hidden states' gradient, formed
  there chunk by chunk, the head's input copy with the labels shifted, one chunk's fp32 logits with its softmax
  gradient in the compute dtype, and where the head is trained its fp32 weight gradient; the stock loss without
  chunking: every token's logits, their fp32 copy, log-softmax and gradient), when the parameters' gradients do not
  exist yet; and one layer's backward: its recomputed activations (with checkpointing), the gradients flowing
  through it, and a chunk of streamed experts' gradients twice (the grouped GEMM's, per tensor, and the block they
  are concatenated into to go home).

One decoder layer's saved activations per token, as autograd saves them (`item`: the model dtype's bytes; the RMS
norms compute in fp32): each RMSNorm its fp32 input, the normalized copy cast back and its output (the next
projection's input), h (4 + 2 item), and the per-head q/k norms where the family has them (Qwen3, OLMoE, ...),
(q + kv) (4 + item); attention (SDPA) the rotated q and k, v and its output, 2 (q + kv) item, and fp32 log-sum-exps;
an MoE layer the router's fp32 probabilities, E 4, the routing's int64 indices, the top-k copies of the token the
experts take and their weighted outputs, 2 k h item; where the experts' graphs are kept (computing on the CPU from
unquantized weights, `OffloadConfig.keep_activations`) their gate/up and activation outputs, 3 k I item. A dense FFN
its gate, up, activation and product, 4 I item. (Counted against autograd's saved tensors of a tiny Qwen3-MoE on the
simulated device: tests/test_device_memory.py.)
"""

from __future__ import annotations

from dataclasses import dataclass

# The chunked LM loss's tokens per chunk: `train`'s --loss-chunk-tokens default (0: the stock loss, full logits).
LOSS_CHUNK_TOKENS = 1024
# Gradients alive in one layer's backward beside its saved activations, in hidden-state widths per token: the
# gradient arriving, the one leaving and the residual branch's.
BACKWARD_GRADIENTS = 3


@dataclass(frozen=True)
class ActivationShape:
    """The widths the activation model reads from a config."""

    hidden: int
    heads: int
    q: int
    kv: int
    qk_norm: bool
    inter: int  # an expert's intermediate width
    dense_inter: int
    top_k: int
    layers: int
    moe_layers: int
    layer_experts: int
    vocab: int

    @classmethod
    def of(cls, config, model, moe_layers: int, num_experts: int) -> ActivationShape:
        h = config.hidden_size
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or h // heads
        inter = getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", None) or 4 * h
        k = (getattr(config, "num_experts_per_tok", None) or getattr(config, "num_experts_per_token", None)
             or getattr(config, "moe_top_k", None) or getattr(config, "top_k", None) or 2)
        return cls(hidden=h, heads=heads, q=heads * head_dim, kv=(getattr(config, "num_key_value_heads", None) or heads) * head_dim,
                   qk_norm=any(name.endswith(("q_norm", "k_norm")) for name, _ in model.named_modules()),
                   inter=inter, dense_inter=getattr(config, "intermediate_size", None) or inter, top_k=k,
                   layers=config.num_hidden_layers, moe_layers=moe_layers,
                   layer_experts=num_experts // max(1, moe_layers), vocab=config.vocab_size)

    def layer_bytes(self, item: int, moe: bool, keeps_expert_graphs: bool) -> int:
        """One decoder layer's saved activations per token."""
        h, q, kv, k = self.hidden, self.q, self.kv, self.top_k
        attention = (2 * self.norm_bytes(item) + (q + kv) * (4 + item if self.qk_norm else 0) + 2 * (q + kv) * item
                     + self.heads * 4)
        if moe:
            ffn = (self.layer_experts * 4 + 4 * k * 8 + 2 * k * h * item + k * item
                   + (3 * k * self.inter * item if keeps_expert_graphs else 0))
        else:
            ffn = 4 * self.dense_inter * item
        return attention + ffn

    def norm_bytes(self, item: int) -> int:
        """An RMSNorm's saved tensors per token: its fp32 input, the normalized copy and the output."""
        return self.hidden * (4 + 2 * item)

    def all_layers_bytes(self, item: int, keeps_expert_graphs: bool) -> int:
        return (self.moe_layers * self.layer_bytes(item, True, keeps_expert_graphs)
                + (self.layers - self.moe_layers) * self.layer_bytes(item, False, keeps_expert_graphs))


@dataclass(frozen=True)
class Adapters:
    """peft's LoRA adapters as the activations see them: (in, out) of each adapted dense matrix of one decoder layer
    and of each adapted matrix of one expert, and the rank."""

    dense: tuple[tuple[int, int], ...] = ()
    expert: tuple[tuple[int, int], ...] = ()
    r: int = 0

    def dense_bytes(self, item: int) -> int:
        """Per token and layer: peft casts each adapted matrix's input to its fp32 factors (where the model is
        narrower) and keeps the first factor's fp32 output for the second."""
        return sum((i * 4 if item < 4 else 0) + self.r * 4 for i, _ in self.dense)

    def expert_bytes(self, item: int) -> int:
        """Per routed token: each adapted expert matrix's first-factor output and the adapted sum (compute dtype)."""
        return sum((self.r + o) * item for _, o in self.expert)


def activation_parts(shape: ActivationShape, tokens: int, item: int, checkpointing: bool, keeps_expert_graphs: bool,
                     loss_chunk_tokens: int = LOSS_CHUNK_TOKENS, train_head: bool = False,
                     chunk_gradient_bytes: int = 0, gradient_bytes: int = 0, chunk_share: float = 0.0,
                     adapters: Adapters = Adapters(), late_gradient_bytes: int = 0) -> dict[str, int]:
    """The step's activation peak on the compute device for `tokens` tokens, by part (their sum is the figure).
    `train_head`: the LM head's weight is trained (its fp32 gradient is formed in the loss's forward);
    `chunk_gradient_bytes`: one chunk of streamed experts' gradients on the device (trained experts);
    `gradient_bytes`: the trained parameters' gradients that the caller counts all step (they exist in the backward
    only: the loss's forward has their room); `chunk_share`: the share of a layer's experts one streamed chunk holds
    (its backward recomputes their forward: 0 where the graphs are kept); `late_gradient_bytes`: the part of
    `gradient_bytes` formed after the last layer's backward (the input embedding's, untied)."""
    h, v = shape.hidden, shape.vocab
    moe = shape.moe_layers > 0
    layer = max(shape.layer_bytes(item, moe, keeps_expert_graphs),
                shape.layer_bytes(item, False, keeps_expert_graphs) if shape.moe_layers < shape.layers else 0)
    layer += adapters.dense_bytes(item) + (shape.top_k * adapters.expert_bytes(item) if keeps_expert_graphs else 0)
    # a streamed chunk's recomputed forward in its backward: gate/up and activation outputs with the adapters' terms,
    # and the routed tokens' gradient
    rows = tokens * shape.top_k * chunk_share if moe else 0
    recompute = int(rows * (3 * shape.inter * item + h * item + adapters.expert_bytes(item)))
    parts: dict[str, int] = {}
    if checkpointing:
        parts["layer inputs kept for recompute"] = shape.layers * tokens * h * item
    else:
        parts["every layer's saved activations"] = tokens * (shape.all_layers_bytes(item, keeps_expert_graphs)
                                                             + shape.layers * (layer - shape.layer_bytes(
                                                                 item, moe, keeps_expert_graphs)))
    parts["final norm"] = tokens * shape.norm_bytes(item)
    # One layer's backward: its recompute, the gradients through it, and the chunk's expert gradients twice (the
    # grouped GEMM's per tensor and their concatenation into the block sent home)
    backward = (tokens * layer if checkpointing else 0) + BACKWARD_GRADIENTS * tokens * h * item
    # the chunk's recompute is freed as autograd forms its gradients; the per-tensor gradients then meet their copy
    backward += max(recompute, chunk_gradient_bytes) + chunk_gradient_bytes
    backward -= late_gradient_bytes
    if loss_chunk_tokens:
        chunk = min(loss_chunk_tokens, tokens)
        # the hidden states' gradient and the label-shifted copy of the head's input, one chunk's fp32 logits and its
        # softmax gradient in the compute dtype, and the head's fp32 weight gradient where it is trained
        loss = 2 * tokens * h * item + chunk * v * (4 + item) + (v * h * 4 if train_head else 0)
        loss_label = f"peak: LM loss forward, one chunk of {chunk:,} tokens' logits"
    else:  # the stock loss: the logits, their fp32 copy and log-softmax, and their gradient
        loss = tokens * v * (item + 3 * 4)
        loss_label = "peak: LM loss on every token's logits"
    loss -= gradient_bytes
    if loss >= backward:  # (either can be below 0 where the gradients outweigh them: the gradients' room is enough)
        parts[loss_label + (" (beyond the gradients, not formed yet)" if gradient_bytes else "")] = max(0, loss)
    else:
        parts["peak: one layer's backward" + (" (its recompute)" if checkpointing else "")
              + (" and a chunk's expert gradients" if chunk_gradient_bytes else "")
              + (", less the input embedding's gradient (formed after it)" if late_gradient_bytes else "")] = max(
                  0, backward)
    return parts


__all__ = ["ActivationShape", "Adapters", "LOSS_CHUNK_TOKENS", "activation_parts"]
