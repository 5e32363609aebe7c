"""Measuring: device probes, NVML, timing, tensor counting and attribution, and the run's aggregates."""
