"""Models this package registers with the Auto classes: MoE-GPT (`moe_gpt`).

May import: nothing of the package.
"""
