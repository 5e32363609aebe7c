"""The Lightning-free measuring core: :class:`VramSession` and the parts it wires, each with one job.

A session's calls mirror the phase boundaries of a training step::

    session = VramSession(log_dir="runs/plain")
    session.start(model, optimizers=[optimizer])
    for batch in loader:
        session.batch_start(batch)
        loss = loss_fn(model(batch))
        session.before_backward()
        loss.backward()
        session.before_optimizer_step()
        optimizer.step(); optimizer.zero_grad()
        scalars = session.batch_end()          # the vram/... scalars at the end of each log interval, else {}
    report = session.finish()                  # writes vram_report.json/.md/.html into log_dir

A step method called before :meth:`~VramSession.start` raises a RuntimeError saying so (it would measure nothing).

The parts, each guarded through the run's one :class:`~lightning_vram._guard.Guard`:

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
