"""Streaming a chunk of experts and its gradients (ES-MoE §4.1's pipelined per-expert processing): one MoE layer's
call and its autograd function (`streamed`), each call's chunks brought where they compute and read ahead
(`chunk_sources`), the device slab's double-buffered blocks (`slab`), per-expert stagers and the gradient ring
(`transfers`) and gradients home to the store (`gradients`). The engine (offload/engine.py) composes these parts and
hands each the shared resources it uses.

May import: `families`, `models`, `offload.inference.device_cache`, `offload.lora`, `offload.plan`, `offload.stores`,
`offload.telemetry`, `precision`, `rng`, `runtime`.
"""
