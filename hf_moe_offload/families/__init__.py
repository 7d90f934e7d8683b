"""What every MoE family of transformers shares with this package, reached through one entry: transformers' experts
implementation "hf_moe_offload" (`moe_path`), how a family's expert tensors pack into one flat row per expert
(`layouts`), its routers (`routing`) and the chunked causal-LM loss (`lm_loss`). No per-model hooks: a feature added
here reaches Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-style, GLM, OLMoE, Granite and MoE-GPT alike.

May import: `errors`, `models`, `trainer`.
"""
