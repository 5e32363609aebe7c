"""Of each live peak of a gloo rank's sampled step, the bytes gloo's worker thread released late, for the ground-truth
runs that set one process's prediction against each rank's measured step.

A tensor a collective used, dropped by the rank's code while gloo's worker thread still holds the finished work,
stays allocated until that thread gets the GIL; allocated at a phase's peak, it raises the peak by its size now and
then (docs/measurement.md, "Why a gloo rank's live peak varies from run to run"). The step without that delay peaked
between the measured peak less those bytes and the measured peak: the range a prediction is held to
(``replay_records.peak_error``). The monitor reads these bytes only to set its own replay against the step (the
report's ``simulation.baseline.parts[].released_late_bytes``) and forgets them at the step's end when it replays
nothing, as these runs do; the report has no field for them. So they are read here as the session forgets them.
"""

from __future__ import annotations

from lightning_vram import VramSession


def released_late_of(session: VramSession) -> dict[str, int]:
    """A dictionary that gets, as ``session`` forgets its sampled step's late releases, each phase's bytes released
    late (phases with none left out): its sampler's ``forget_late_releases``, wrapped on this session only."""
    late: dict[str, int] = {}
    sampler = session._sampler
    forget = sampler.forget_late_releases

    def read_then_forget() -> None:
        late.update((phase.value, nbytes) for phase, nbytes in sampler.released_late().items())
        forget()

    sampler.forget_late_releases = read_then_forget  # type: ignore[method-assign]
    return late
