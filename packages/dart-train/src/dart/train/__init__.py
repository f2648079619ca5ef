"""dart.train: the DART trainer (step-wise GRPO + TIS / decoupled PPO on a Qwen2.5-VL policy, weight publishing).

Modules: :mod:`.config` (TrainerConfig), :mod:`.loss` and :mod:`.advantages` (the objective),
:mod:`.batching` (recorded samples -> model inputs), :mod:`.interface` (the TrainerBackend seam),
:mod:`.update` (the RL update over it), :mod:`.backend` (TorchBackend), :mod:`.fsdp` (FsdpBackend),
:mod:`.distributed` (rank 0 driving the other ranks), :mod:`.sft`
(warm start), :mod:`.publish` (WeightPublisher), :mod:`.checkpoint` (resume), :mod:`.service`
(TrainerService on the bus), :mod:`.errors`. Nothing heavy is imported here, so ``import dart.train``
stays cheap.
"""

__version__ = "0.1.0"
