"""The estimate's activation model: what a training step holds on the compute device beside the weights, part by part.

Counted per token from the config, the way transformers' decoder layers, this package's MoE path and its chunked LM
loss (lm_loss.py) keep tensors, as the peak of one step:

- **kept**: what lives from its forward until its backward. Without activation checkpointing every decoder layer's
  saved activations; with it only each layer's input (what `torch.utils.checkpoint` keeps), the rest recomputed in
  the backward. The LM loss keeps the hidden states' gradient (formed chunk by chunk in the forward), the head's
  input copy with the labels shifted, and where the head is trained its fp32 weight gradient.
- **transient peak**: the larger of the LM loss's one chunk of fp32 logits with its softmax gradient in the
  compute dtype (the stock loss without chunking: every token's logits, their fp32 copy, log-softmax and gradient)
  and the backward of one layer: its recomputed activations (with checkpointing), the gradients flowing through it,
  and the gradient block of one chunk of streamed experts on its way to the host (trained experts).

One decoder layer's saved activations per token (`item`: the model dtype's bytes; the RMS norms compute in fp32):
two RMSNorms' fp32 inputs and normalized copies and outputs, 2 h (8 + item), and the per-head q/k norms where the
family has them, (q + kv) (8 + item); q, k, v and the rotary embedding's products, 3 (q + kv) item; the attention
output and o_proj's input, 2 q item (SDPA keeps no score matrix); the residual stream, 2 h item. An MoE layer adds
the router's fp32 logits and probabilities, 2 E 4, and the top-k copies of the token for the experts, their outputs
and the weighted outputs, 3 k h item; where the experts' graphs are kept (computing on the CPU from unquantized
weights, `OffloadConfig.keep_activations`) their gate/up and activation outputs, 3 k I item. A dense FFN the same
for its width.
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
        return cls(hidden=h, q=heads * head_dim, kv=(getattr(config, "num_key_value_heads", None) or heads) * head_dim,
                   qk_norm=any(name.endswith(("q_norm", "k_norm")) for name, _ in model.named_modules()),
                   inter=inter, dense_inter=getattr(config, "intermediate_size", None) or inter, top_k=k,
                   layers=config.num_hidden_layers, moe_layers=moe_layers,
                   layer_experts=num_experts // max(1, moe_layers), vocab=config.vocab_size)

    def layer_bytes(self, item: int, moe: bool, keeps_expert_graphs: bool) -> int:
        """One decoder layer's saved activations per token."""
        h, q, kv = self.hidden, self.q, self.kv
        attention = (2 * h * (8 + item) + (q + kv) * (8 + item if self.qk_norm else 0) + 3 * (q + kv) * item
                     + 2 * q * item + 2 * h * item)
        if moe:
            ffn = (2 * self.layer_experts * 4 + 3 * self.top_k * h * item
                   + (3 * self.top_k * self.inter * item if keeps_expert_graphs else 0))
        else:
            ffn = 3 * self.dense_inter * item
        return attention + ffn

    def all_layers_bytes(self, item: int, keeps_expert_graphs: bool) -> int:
        return (self.moe_layers * self.layer_bytes(item, True, keeps_expert_graphs)
                + (self.layers - self.moe_layers) * self.layer_bytes(item, False, keeps_expert_graphs))


def activation_parts(shape: ActivationShape, tokens: int, item: int, checkpointing: bool, keeps_expert_graphs: bool,
                     loss_chunk_tokens: int = LOSS_CHUNK_TOKENS, train_head: bool = False,
                     chunk_gradient_bytes: int = 0) -> dict[str, int]:
    """The step's activation peak on the compute device for `tokens` tokens, by part (their sum is the figure).
    `train_head`: the LM head's weight is trained (its fp32 gradient is formed in the loss's forward);
    `chunk_gradient_bytes`: one chunk of streamed experts' gradients on the device (trained experts)."""
    h, v = shape.hidden, shape.vocab
    layer = max(shape.layer_bytes(item, shape.moe_layers > 0, keeps_expert_graphs),
                shape.layer_bytes(item, False, keeps_expert_graphs) if shape.moe_layers < shape.layers else 0)
    parts: dict[str, int] = {}
    if checkpointing:
        parts["layer inputs kept for recompute"] = shape.layers * tokens * h * item
    else:
        parts["every layer's saved activations"] = tokens * shape.all_layers_bytes(item, keeps_expert_graphs)
    backward = (tokens * layer if checkpointing else 0) + BACKWARD_GRADIENTS * tokens * h * item + chunk_gradient_bytes
    if loss_chunk_tokens:
        chunk = min(loss_chunk_tokens, tokens)
        parts["LM loss: hidden gradient and shifted input"] = 2 * tokens * h * item
        if train_head:
            parts["LM loss: head gradient (fp32)"] = v * h * 4
        loss = chunk * v * (4 + item)
        loss_label = f"peak: LM loss, one chunk of {chunk:,} tokens' logits"
    else:  # the stock loss: the logits, their fp32 copy and log-softmax kept; the gradient formed in the backward
        parts["LM loss: full logits (fp32 copy, log-softmax)"] = tokens * v * (item + 2 * 4)
        loss = tokens * v * 4
        loss_label = "peak: LM loss, the logits' gradient"
    if loss >= backward:
        parts[loss_label] = loss
    else:
        parts["peak: one layer's backward" + (" (its recompute)" if checkpointing else "")
              + (" and a chunk's expert gradients" if chunk_gradient_bytes else "")] = backward
    return parts


__all__ = ["ActivationShape", "LOSS_CHUNK_TOKENS", "activation_parts"]
