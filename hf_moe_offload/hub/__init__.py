"""The Hub and the serving engines: model cards (`cards`), uploads (`upload`), LoRA adapters re-laid out per expert
for vLLM and SGLang (`adapter_export`, `adapter_serving`) and the checker of their loading rules (`adapter_check`).

May import: `errors`, `families`, `offload.stores`, `quiet`.
"""
