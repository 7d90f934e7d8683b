"""What a run needs before it starts, from a config alone: `estimate` (device, host and disk memory per tier, bytes
a step moves), its parts (`activations`, `estimate_stream`, `batch_fit`, `time_model`), `measure` (the rates measured
on this machine), `model_shapes` (configs of Hub releases, offline) and docs/hardware.md (`hardware_table`). The
estimate asks the engine's own rules (offload/plan.py, offload/planner.py, the slab's sizes) rather than restating
them, so a rule changed there changes the prediction.

May import: `errors`, `families`, `models`, `offload`, `optim.expert_optimizer`, `quiet`, `runtime`.
"""
