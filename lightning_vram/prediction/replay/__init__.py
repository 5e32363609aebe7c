"""Replaying one training step under fake tensors: the baseline, each change tried on it, the largest batch that fits.

:class:`~lightning_vram.prediction.predictor.Predictor` puts the pieces together, once per round of replays: the
baseline, a variant, a batch size, :func:`~lightning_vram.prediction.replay.simulation.simulate` (a run's sampled
step, checked against its counts, then each change) and the fit table
(:func:`~lightning_vram.prediction.replay.search.largest_batches_that_fit`); :func:`lightning_vram.predict` builds on
it.
"""
