"""Offloaded inference, when no backward follows: an inference call's path (`decoding`), the device expert cache
(`device_cache`), and the policies (`policies`): the decode cache's scores, pre-gating and the host-compute cost model.

May import: `offload.stores`, `offload.telemetry`, `runtime`.
"""
