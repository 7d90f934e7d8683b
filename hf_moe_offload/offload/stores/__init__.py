"""The expert store and its files (ES-MoE §4.1's host and disk tiers): the flat per-expert records and the host tier
(`store`), the disk tier's bounded cache state machine (`disk_store`) with its I/O beside the cache (`disk_overlap`)
and its eviction order (`eviction`), the expert files with checksums and locks (`expert_files`), frozen experts
stored quantized (`quantized`) or as released (`prequantized`), safetensors read one tensor at a time
(`safetensors_io`) and the transformers checkpoint layout (`hub_layout`). A store knows nothing of the engine that
streams it.

May import: `errors`, `offload.telemetry`, `runtime`.
"""
