"""Advising: rules over the run's measurements, the largest batch that fits, and the out-of-memory diagnosis."""
