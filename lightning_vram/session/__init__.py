"""The Lightning-free measuring core: :class:`VramSession` and the parts it wires, each with one job.

- :mod:`~lightning_vram.session.recorder`: the hot path (allocator readings at the phase boundaries, the step timer)
  and the allocator history;
- :mod:`~lightning_vram.session.sampling`: sampled steps counted tensor by tensor;
- :mod:`~lightning_vram.session.advisor`: the preflight check, the replay of a sampled step, the advice, the OOM
  diagnosis;
- :mod:`~lightning_vram.session.assembly`: the run's summary, what was not measured, the ranks' exchange, scalars;
- :mod:`~lightning_vram.session.sinks`: report files, TensorBoard, the console and stderr;
- :mod:`~lightning_vram.session.checkpoint_state`: the aggregates a checkpoint carries;
- :mod:`~lightning_vram.session.context`: the run's facts, fixed when it starts (the set-up read once);
- :mod:`~lightning_vram.session.core`: :class:`VramSession`, the wiring.
"""

from lightning_vram.session.core import VramSession

__all__ = ["VramSession"]
