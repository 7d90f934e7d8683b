"""peft's LoRA on streamed experts: the low-rank term inside the streamed pass (`expert_lora`), the factors kept with
the experts in host memory (`lora_store`, `OffloadConfig.lora_in_store`) and what frozen offloaded experts leave on
their modules for peft to target (`stand_ins`).

May import: `families`, `precision`.
"""
