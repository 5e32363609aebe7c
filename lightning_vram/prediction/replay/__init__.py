"""Replaying one training step under fake tensors: the baseline, each change tried on it, the largest batch that fits.

Entry points: :func:`~lightning_vram.prediction.replay.simulation.simulate` (a run's sampled step, checked against its
counts, then each change), :func:`~lightning_vram.prediction.replay.step.replay_step` (one replay) and
:func:`~lightning_vram.prediction.replay.search.largest_batch_that_fits`; :func:`lightning_vram.predict` builds on them.
"""
