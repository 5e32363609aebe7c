"""Advice rules, one module per rule; :mod:`~lightning_vram.advice.rules.registry` lists them in order.

Each rule is a :class:`~lightning_vram.advice.rules.base.Rule`: a stable id, the changes it wants replayed on the
run's step, and a pure function (run summary, training set-up, replay of the step) -> advice or ``None``, which
reads each declared change's saving through :func:`~lightning_vram.advice.savings.resolve_saving`.
"""
