"""MoE-GPT: a GPT-style decoder with dropless, mask-free, sequential-expert MoE layers.

One MoE layer, from router to combine (ES-MoE §4.1 "Supporting larger batches"):

    router (fp32 softmax, top-k, aux/z losses)
      -> dispatch plan: stable argsort of the chosen expert ids, tokens per expert
      -> experts run one after another on their own contiguous slice of the sorted tokens
      -> weighted combine: each token gathers its k rows through the inverse permutation (no atomic index_add_)

There is no (tokens x experts x capacity) dispatch mask, no zero padding and, by default, no dropped token. Every
expert's weights are one contiguous block of leading-expert-dimension tensors (`fc1_weight[e]`, ...), the layout of
transformers' own MoE models, so that the offload engine can move, store and update experts one at a time.

The experts module is an `ExpertsInterface` module (`@use_experts_implementation`): it is called as
`experts(hidden_states, top_k_index, top_k_weights)` like every transformers MoE family, and `hf_moe_offload` reaches
it through that one entry (offload, MPMoE partitions, expert parallelism) by registering its own implementation.
The default implementation is "eager" (the plain path below; fairseq parity). One MoE layer (router, experts, the
block) is in `moe_layer.py`, the generic ops (dispatch plan, dropless executor, grouped linear, chunked loss) in
`moe_ops.py` beside it. This file imports only torch,
transformers and its sibling files: it is saved next to models as remote code, with them.

References: ES-MoE (Kim et al., ICML 2024) §4.1; fairseq `moe` branch (top1gate.py, top2gate.py, moe_layer.py);
Switch Transformer (aux loss); ST-MoE (router z-loss).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import ModelOutput, MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import PreTrainedModel

from .configuration_moe_gpt import MoEGPTConfig
from .moe_layer import MoEGPTExperts, MoEGPTRouter, MoEGPTSparseMoeBlock, load_balancing_loss
from .moe_ops import chunked_lm_loss


def sinusoidal_position_embedding(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """fairseq's `SinusoidalPositionalEmbedding` rows for `positions` (non-interleaved [sin | cos], fp32)."""
    half = dim // 2
    step = math.log(10000) / (half - 1)
    freq = torch.exp(torch.arange(half, dtype=torch.float, device=positions.device) * -step)
    angles = positions.float().unsqueeze(-1) * freq
    emb = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


class MoEGPTAttention(nn.Module):
    """Multi-head causal self-attention with biases (fairseq layout: q/k/v/out_proj), SDPA, KV cache."""

    def __init__(self, config: MoEGPTConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.dropout = config.attention_dropout
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self,
        hidden_states: torch.Tensor,  # (B, T, C)
        attention_mask: torch.Tensor | None,  # (B, 1, T, T_kv) bool, True = attend; None = plain causal
        past_key_values: Cache | None = None,
    ) -> torch.Tensor:
        B, T, C = hidden_states.shape

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)

        q, k, v = heads(self.q_proj(hidden_states)), heads(self.k_proj(hidden_states)), heads(self.v_proj(hidden_states))
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=attention_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=attention_mask is None and T > 1,
        )
        return self.out_proj(out.transpose(1, 2).reshape(B, T, C))


class MoEGPTMLP(nn.Module):
    """Dense FFN `fc2(act(fc1 x))` of the non-MoE layers."""

    def __init__(self, config: MoEGPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = ACT2FN[config.activation_function]
        self.activation_dropout = nn.Dropout(config.activation_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_dropout(self.act(self.fc1(x))))


# transformers >= 5.24 names the output's KV cache `cache` (`past_key_values` still works, with a deprecation warning
# on every generate); earlier versions `past_key_values`.
_CACHE_FIELD = "cache" if "cache" in MoeModelOutputWithPast.__dataclass_fields__ else "past_key_values"


@dataclass
class MoEGPTModelOutput(MoeModelOutputWithPast):
    """`MoeModelOutputWithPast` plus the router losses summed over MoE layers (unscaled)."""

    aux_loss: torch.FloatTensor | None = None
    z_loss: torch.FloatTensor | None = None


class MoEGPTDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: h += Attn(LN(h)); h += FFN_or_MoE(LN(h)) (fairseq `normalize_before`)."""

    def __init__(self, config: MoEGPTConfig, layer_idx: int):
        super().__init__()
        self.is_moe = config.is_moe_layer(layer_idx)
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = MoEGPTAttention(config, layer_idx)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if self.is_moe:
            self.moe = MoEGPTSparseMoeBlock(config)
        else:
            self.mlp = MoEGPTMLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, **kwargs):
        h = hidden_states + self.dropout(self.self_attn(self.self_attn_layer_norm(hidden_states), attention_mask, past_key_values))
        u = self.final_layer_norm(h)
        if self.is_moe:
            ffn, logits, aux_loss, z_loss = self.moe(u)
            return h + self.dropout(ffn), logits, aux_loss, z_loss
        return h + self.dropout(self.mlp(u)), None, None, None


class MoEGPTPreTrainedModel(PreTrainedModel):
    config_class = MoEGPTConfig
    config: MoEGPTConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MoEGPTDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    # Loss is a per-rank mean (Trainer must not rescale it by the number of processes under DDP).
    accepts_loss_kwargs = False
    # transformers' own kernels read `gate_up_proj` / `up_proj`, which fairseq-named experts do not have.
    _unsupported_experts_implementations = ("grouped_mm", "batched_mm", "deepgemm", "sonicmoe")

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        if requested_experts in self._unsupported_experts_implementations:
            raise ValueError(f"MoE-GPT experts support experts_implementation='eager' (the default) or one registered "
                             f"by hf_moe_offload, not {requested_experts!r}")
        return super().get_correct_experts_implementation(requested_experts or "eager")

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, MoEGPTExperts):
            init.normal_(module.fc1_weight, mean=0.0, std=std)
            init.normal_(module.fc2_weight, mean=0.0, std=std)
            init.zeros_(module.fc1_bias)
            init.zeros_(module.fc2_bias)
        elif isinstance(module, MoEGPTRouter):
            init.normal_(module.weight, mean=0.0, std=std)


def _attention_mask_4d(
    attention_mask: torch.Tensor | None, q_len: int, past_len: int, device: torch.device
) -> torch.Tensor | None:
    """Boolean (B, 1, q, kv) mask: causal AND not a pad key; None when plain causal SDPA suffices."""
    if attention_mask is None or (past_len == 0 and bool(attention_mask.all())):
        if past_len == 0:
            return None
        attention_mask = torch.ones(1, past_len + q_len, dtype=torch.bool, device=device)
    kv_len = attention_mask.shape[-1]
    q_pos = torch.arange(past_len, past_len + q_len, device=device)
    causal = torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]  # (q, kv)
    mask = causal[None] & attention_mask[:, None, :].bool()  # (B, q, kv)
    # A pad query with no real key before it (left padding) would see nothing: let it see itself so SDPA returns no
    # NaN. Other pad queries keep fairseq's key-padding semantics (they attend to the real keys before them).
    rows = torch.arange(q_len, device=device)
    empty = ~mask.any(-1)  # (B, q)
    mask[:, rows, q_pos] |= empty
    return mask[:, None]


class MoEGPTModel(MoEGPTPreTrainedModel):
    def __init__(self, config: MoEGPTConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.embed_scale = math.sqrt(config.hidden_size) if config.scale_embedding else 1.0
        if config.position_embedding_type == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings + config.position_offset, config.hidden_size)
        self.layernorm_embedding = (
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.layernorm_embedding else None
        )
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.layers = nn.ModuleList([MoEGPTDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.final_layer_norm else None
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def _positions(self, position_ids, attention_mask, past_len, q_len, device):
        pad = None
        if position_ids is None:
            if attention_mask is not None:
                # Count non-pad tokens only, so left padding does not shift positions (fairseq, GPT-2 generate).
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -q_len:]
                pad = attention_mask[:, -q_len:, None] == 0
            else:
                position_ids = torch.arange(past_len, past_len + q_len, device=device)[None]
        positions = position_ids + self.config.position_offset
        if self.config.position_embedding_type == "learned":
            pos = self.embed_positions(positions)
        else:
            pos = sinusoidal_position_embedding(positions, self.config.hidden_size)
        # Pads get no position (fairseq's zero padding row): their hidden states matter only where they are routed,
        # i.e. with fairseq's capacity semantics, where pads take capacity slots.
        return pos if pad is None else pos.masked_fill(pad, 0.0)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_router_logits: bool | None = None,
        return_dict: bool | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> MoEGPTModelOutput:
        # transformers >= 5.24 names the KV cache `cache` (generate passes it so); earlier versions `past_key_values`.
        past_key_values = past_key_values if past_key_values is not None else cache
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds")
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if self.gradient_checkpointing and self.training:
            use_cache = False
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if not use_cache:
            past_key_values = None
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        B, T, _ = inputs_embeds.shape
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        if past_len + T > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {past_len + T} exceeds max_position_embeddings={self.config.max_position_embeddings}"
            )

        pos = self._positions(position_ids, attention_mask, past_len, T, inputs_embeds.device)
        hidden = inputs_embeds * self.embed_scale + pos.to(inputs_embeds.dtype)
        if self.layernorm_embedding is not None:
            hidden = self.layernorm_embedding(hidden)
        hidden = self.dropout(hidden)
        mask = _attention_mask_4d(attention_mask, T, past_len, hidden.device)

        all_hidden = [] if output_hidden_states else None
        router_logits, aux_losses, z_losses = [], [], []
        for layer in self.layers:
            if all_hidden is not None:
                all_hidden.append(hidden)
            hidden, logits, aux, z = layer(hidden, attention_mask=mask, past_key_values=past_key_values)
            if logits is not None:
                router_logits.append(logits)
                aux_losses.append(aux)
                z_losses.append(z)
        if self.layer_norm is not None:
            hidden = self.layer_norm(hidden)
        if all_hidden is not None:
            all_hidden.append(hidden)

        return MoEGPTModelOutput(
            last_hidden_state=hidden,
            **{_CACHE_FIELD: past_key_values},
            hidden_states=tuple(all_hidden) if all_hidden is not None else None,
            router_logits=tuple(router_logits) if output_router_logits else None,
            aux_loss=torch.stack(aux_losses).sum() if aux_losses else hidden.new_zeros(()),
            z_loss=torch.stack(z_losses).sum() if z_losses else hidden.new_zeros(()),
        )


def _router_penalty(config: MoEGPTConfig, base: MoEGPTModelOutput) -> torch.Tensor:
    return config.router_aux_loss_coef * base.aux_loss + config.router_z_loss_coef * base.z_loss


class MoEGPTForCausalLM(MoEGPTPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MoEGPTConfig):
        super().__init__(config)
        self.model = MoEGPTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_router_logits: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        cache: Cache | None = None,
        **kwargs,
    ) -> MoeCausalLMOutputWithPast:
        past_key_values = past_key_values if past_key_values is not None else cache  # see MoEGPTModel.forward
        base = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            output_router_logits=output_router_logits,
        )
        hidden = base.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        chunk = getattr(self.config, "loss_chunk_tokens", 0)
        if labels is not None and chunk and self.training and type(self.lm_head) is nn.Linear:
            # No (tokens, vocab) logits in training: the loss and its gradient are taken chunk by chunk.
            loss = chunked_lm_loss(hidden[:, :-1].reshape(-1, hidden.shape[-1]), self.lm_head.weight,
                                   labels[:, 1:].reshape(-1).to(hidden.device), chunk)
            return self._output(loss + _router_penalty(self.config, base), None, base, return_dict)
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            # Mean over predicted tokens of this process; DDP averages processes (see accepts_loss_kwargs).
            shift_logits = logits[:, :-1].float().reshape(-1, logits.shape[-1])
            shift_labels = labels[:, 1:].reshape(-1).to(logits.device)
            loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100) + _router_penalty(self.config, base)
        return self._output(loss, logits, base, return_dict)

    @staticmethod
    def _output(loss, logits, base: MoEGPTModelOutput, return_dict: bool | None):
        out = MoeCausalLMOutputWithPast(
            loss=loss,
            aux_loss=base.aux_loss,
            logits=logits,
            **{_CACHE_FIELD: getattr(base, _CACHE_FIELD)},
            hidden_states=base.hidden_states,
            router_logits=base.router_logits,
        )
        return out if return_dict is not False else out.to_tuple()


@dataclass
class MoESequenceClassifierOutputWithPast(ModelOutput):
    loss: torch.FloatTensor | None = None
    aux_loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    past_key_values: Cache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    router_logits: tuple[torch.FloatTensor, ...] | None = None


class MoEGPTForSequenceClassification(MoEGPTPreTrainedModel):
    """Classifies from the last non-pad token (GPT-2 style), e.g. SST-2/MNLI/BoolQ (ES-MoE Table 2)."""

    def __init__(self, config: MoEGPTConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = MoEGPTModel(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        output_hidden_states: bool | None = None,
        output_router_logits: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> MoESequenceClassifierOutputWithPast:
        base = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=False,
            output_hidden_states=output_hidden_states,
            output_router_logits=output_router_logits,
        )
        hidden = base.last_hidden_state  # (B, T, C)
        B, T = hidden.shape[:2]
        if attention_mask is not None:
            # Last attended position; works for right and left padding.
            last = (torch.arange(T, device=hidden.device) * attention_mask.to(hidden.device).long()).argmax(-1)
        elif input_ids is not None and self.config.pad_token_id is not None:
            not_pad = (input_ids != self.config.pad_token_id).long()
            last = (torch.arange(T, device=hidden.device) * not_pad).argmax(-1)
        else:
            last = torch.full((B,), T - 1, device=hidden.device)
        logits = self.score(hidden[torch.arange(B, device=hidden.device), last])  # (B, num_labels)

        loss = None
        if labels is not None:
            labels = labels.to(logits.device)
            if self.config.problem_type is None:
                if self.num_labels == 1:
                    self.config.problem_type = "regression"
                elif labels.dtype in (torch.long, torch.int):
                    self.config.problem_type = "single_label_classification"
                else:
                    self.config.problem_type = "multi_label_classification"
            if self.config.problem_type == "regression":
                loss = F.mse_loss(logits.squeeze(-1).float(), labels.float())
            elif self.config.problem_type == "single_label_classification":
                loss = F.cross_entropy(logits.float(), labels.view(-1))
            else:
                loss = F.binary_cross_entropy_with_logits(logits.float(), labels.float())
            loss = loss + _router_penalty(self.config, base)
        out = MoESequenceClassifierOutputWithPast(
            loss=loss,
            aux_loss=base.aux_loss,
            logits=logits,
            hidden_states=base.hidden_states,
            router_logits=base.router_logits,
        )
        return out if return_dict is not False else out.to_tuple()


__all__ = [
    "MoEGPTPreTrainedModel",
    "MoEGPTModel",
    "MoEGPTForCausalLM",
    "MoEGPTForSequenceClassification",
    "MoEGPTModelOutput",
    "sinusoidal_position_embedding",
]
