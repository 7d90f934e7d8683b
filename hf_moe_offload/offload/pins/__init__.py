"""Pinned experts (ES-MoE §4.3): which experts stay resident, chosen by load (`pinning`), applied at each window's
close, and on a device their whole training state (`device_pins`).

May import: `offload.stores`, `offload.telemetry`, `runtime`.
"""
