"""Prediction: one training step replayed under fake tensors, contained, and what the device must hold for it.

``replay/`` is the engine (the step, its changes, its counting, the searches built on it), ``containment/`` keeps
the replay away from everything outside its own copies (the walk of the user's code and what it reaches, the
isolation and restore around each replay). Between ``measure`` (which it counts with) and ``advice`` (which asks it).
"""
