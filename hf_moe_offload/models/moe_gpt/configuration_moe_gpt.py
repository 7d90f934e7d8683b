"""Configuration of MoE-GPT, a GPT-style decoder whose FFN layers are (every `moe_layer_frequency`-th) mixtures of
experts. It expresses the fairseq MoE language models exactly (pre-norm, biases everywhere, tied output, fairseq
gating) and the GPT-3-shaped MoE-S/M/L/XL models of ES-MoE (Appendix A.1, Table 4).

This file imports only `transformers`: it is copied next to saved models so that they load with
`trust_remote_code=True` where `hf_moe_offload` is not installed.
"""

from __future__ import annotations

from transformers import PretrainedConfig

# ES-MoE Appendix A.1, Table 4 (GPT-3 shapes; "d_head" there is the FFN width).
MOE_GPT_PRESETS: dict[str, dict[str, int]] = {
    "moe-s": dict(num_hidden_layers=12, hidden_size=768, intermediate_size=3072, num_attention_heads=12),
    "moe-m": dict(num_hidden_layers=24, hidden_size=1024, intermediate_size=4096, num_attention_heads=16),
    "moe-l": dict(num_hidden_layers=24, hidden_size=1536, intermediate_size=6144, num_attention_heads=16),
    "moe-xl": dict(num_hidden_layers=24, hidden_size=1536, intermediate_size=8192, num_attention_heads=24),
}

_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu")


class MoEGPTConfig(PretrainedConfig):
    r"""
    Configuration for [`MoEGPTModel`]. Standard GPT arguments (`vocab_size`, `hidden_size`, `num_hidden_layers`,
    `num_attention_heads`, `max_position_embeddings`, dropouts, `layer_norm_eps`) mean what they mean elsewhere in
    transformers. The non-standard ones:

    Args:
        intermediate_size (`int`): width of the dense FFN and of every expert FFN.
        num_experts (`int`): experts per MoE layer.
        num_experts_per_tok (`int`): 1 (Switch/top-1) or 2 (GShard/top-2).
        moe_layer_frequency (`int`): layer `i` (0-based) is an MoE layer iff `(i + 1) % moe_layer_frequency == 0`
            (fairseq's `moe_freq`); 0 makes every layer dense.
        router_aux_loss_coef (`float`): weight of the load-balancing loss `E * sum_e f_e * P_e` (fairseq/Switch form,
            `f_e` from the top-1 choice), summed over MoE layers and added to the LM loss.
        router_z_loss_coef (`float`): weight of the router z-loss `mean(logsumexp(logits)^2)` (ST-MoE).
        normalize_top2_weights (`bool`): top-2 combine weights are `p_i / (p_1 + p_2)` (fairseq) instead of raw `p_i`.
            Top-1 always uses the raw probability, as fairseq does.
        normalize_top2_before_dropping (`bool`): with `drop_tokens`, normalize the top-2 weights before capacity
            drops them (fairseq `moe_normalize_gate_prob_before_dropping`: a kept choice keeps `p_i / (p_1 + p_2)`)
            instead of after (default: a token whose second choice was dropped gets weight 1 on its first).
        second_expert_policy (`str`): only `"all"` (deterministic second choice, fairseq's released models).
        drop_tokens (`bool`): `False` (default) is dropless: every token reaches its experts. `True` applies
            fairseq's capacity semantics (capacity `2*ceil(S/E)` for top-2, `ceil(S/E)` for top-1; top-1 choices
            outrank top-2, earlier tokens win) for bit-parity with fairseq evaluation.
        eval_capacity_token_fraction (`float`): with `drop_tokens`, capacity `ceil(fraction * S)` in eval if > 0.
        position_embedding_type (`str`): `"learned"` or `"sinusoidal"` (fairseq's non-interleaved sin|cos table).
        position_offset (`int`): row of the position table used by the first token (fairseq: `padding_idx + 1 = 2`).
            Positions count non-pad tokens only, so left padding does not shift them.
        scale_embedding (`bool`): multiply token embeddings by `sqrt(hidden_size)` (fairseq default).
        layernorm_embedding (`bool`): LayerNorm after the embeddings.
        final_layer_norm (`bool`): LayerNorm before the output projection.
        activation_function (`str`): `"gelu"` is the exact erf GELU.
        activation_dropout (`float`): dropout after the FFN activation.
        loss_chunk_tokens (`int`): with labels, in training, compute the LM loss `loss_chunk_tokens` tokens at a
            time so that no `(tokens, vocab_size)` logits tensor exists (its gradient is taken in the same pass); the
            output's `logits` is then `None`. 0 (default) keeps the plain head, which returns logits.

    Example:

    ```python
    >>> from hf_moe_offload import MoEGPTConfig, MoEGPTForCausalLM
    >>> config = MoEGPTConfig.from_preset("moe-s", num_experts=16)
    >>> tiny = MoEGPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                     intermediate_size=64, num_experts=4)
    >>> model = MoEGPTForCausalLM(tiny)
    ```
    """

    model_type = "moe_gpt"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {"num_local_experts": "num_experts"}

    def __init__(
        self,
        vocab_size: int = 50257,
        max_position_embeddings: int = 1024,
        hidden_size: int = 768,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 12,
        intermediate_size: int = 3072,
        num_experts: int = 8,
        num_experts_per_tok: int = 2,
        moe_layer_frequency: int = 2,
        activation_function: str = "gelu",
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        activation_dropout: float = 0.0,
        layer_norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        router_aux_loss_coef: float = 0.01,
        router_z_loss_coef: float = 0.0,
        normalize_top2_weights: bool = True,
        normalize_top2_before_dropping: bool = False,
        second_expert_policy: str = "all",
        drop_tokens: bool = False,
        eval_capacity_token_fraction: float = -1.0,
        position_embedding_type: str = "learned",
        position_offset: int = 0,
        scale_embedding: bool = False,
        layernorm_embedding: bool = False,
        final_layer_norm: bool = True,
        loss_chunk_tokens: int = 0,
        use_cache: bool = True,
        tie_word_embeddings: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.max_position_embeddings = max_position_embeddings
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_layer_frequency = moe_layer_frequency
        self.activation_function = activation_function
        self.hidden_dropout = hidden_dropout
        self.attention_dropout = attention_dropout
        self.activation_dropout = activation_dropout
        self.layer_norm_eps = layer_norm_eps
        self.initializer_range = initializer_range
        self.router_aux_loss_coef = router_aux_loss_coef
        self.router_z_loss_coef = router_z_loss_coef
        self.normalize_top2_weights = normalize_top2_weights
        self.normalize_top2_before_dropping = normalize_top2_before_dropping
        self.second_expert_policy = second_expert_policy
        self.drop_tokens = drop_tokens
        self.eval_capacity_token_fraction = eval_capacity_token_fraction
        self.position_embedding_type = position_embedding_type
        self.position_offset = position_offset
        self.scale_embedding = scale_embedding
        self.layernorm_embedding = layernorm_embedding
        self.final_layer_norm = final_layer_norm
        self.loss_chunk_tokens = loss_chunk_tokens
        self.use_cache = use_cache
        # The experts' plain path (fairseq parity) unless another implementation is asked for (modeling file).
        kwargs.setdefault("experts_implementation", "eager")
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.validate()

    def validate(self) -> None:
        """Raise `ValueError` naming the first invalid field."""

        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MoEGPTConfig.{name} must be a positive integer, got {value!r}")

        for name in ("vocab_size", "max_position_embeddings", "hidden_size", "num_hidden_layers",
                     "num_attention_heads", "intermediate_size", "num_experts"):
            positive(name)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"MoEGPTConfig.hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.num_experts_per_tok not in (1, 2):
            raise ValueError(f"MoEGPTConfig.num_experts_per_tok must be 1 or 2, got {self.num_experts_per_tok!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"MoEGPTConfig.num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})"
            )
        if not isinstance(self.moe_layer_frequency, int) or self.moe_layer_frequency < 0:
            raise ValueError(
                f"MoEGPTConfig.moe_layer_frequency must be an integer >= 0, got {self.moe_layer_frequency!r}"
            )
        if self.activation_function not in _ACTIVATIONS:
            raise ValueError(
                f"MoEGPTConfig.activation_function must be one of {_ACTIVATIONS}, got {self.activation_function!r}"
            )
        for name in ("hidden_dropout", "attention_dropout", "activation_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"MoEGPTConfig.{name} must be in [0, 1), got {value!r}")
        for name in ("router_aux_loss_coef", "router_z_loss_coef", "layer_norm_eps"):
            if getattr(self, name) < 0:
                raise ValueError(f"MoEGPTConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.second_expert_policy != "all":
            raise ValueError(
                f"MoEGPTConfig.second_expert_policy must be 'all' (the deterministic policy of the released fairseq "
                f"models), got {self.second_expert_policy!r}"
            )
        if self.position_embedding_type not in ("learned", "sinusoidal"):
            raise ValueError(
                "MoEGPTConfig.position_embedding_type must be 'learned' or 'sinusoidal', "
                f"got {self.position_embedding_type!r}"
            )
        if not isinstance(self.position_offset, int) or self.position_offset < 0:
            raise ValueError(f"MoEGPTConfig.position_offset must be an integer >= 0, got {self.position_offset!r}")
        chunk = getattr(self, "loss_chunk_tokens", 0)
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
            raise ValueError(f"MoEGPTConfig.loss_chunk_tokens must be an integer >= 0, got {chunk!r}")

    @property
    def moe_layer_indices(self) -> list[int]:
        """0-based indices of the MoE layers (fairseq `moe_freq` rule)."""
        f = self.moe_layer_frequency
        return [i for i in range(self.num_hidden_layers) if f and (i + 1) % f == 0]

    def is_moe_layer(self, layer_idx: int) -> bool:
        f = self.moe_layer_frequency
        return bool(f) and (layer_idx + 1) % f == 0

    @classmethod
    def from_preset(cls, name: str, num_experts: int = 8, **kwargs) -> "MoEGPTConfig":
        """A named size from ES-MoE Table 4 (`moe-s`, `moe-m`, `moe-l`, `moe-xl`) with `num_experts` experts."""
        key = name.lower().replace("_", "-")
        if key not in MOE_GPT_PRESETS:
            raise ValueError(f"unknown MoE-GPT preset {name!r}; choose one of {sorted(MOE_GPT_PRESETS)}")
        return cls(**{**MOE_GPT_PRESETS[key], "num_experts": num_experts, **kwargs})


__all__ = ["MoEGPTConfig", "MOE_GPT_PRESETS"]
