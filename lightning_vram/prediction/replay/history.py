"""The history before a replayed steady step: the run's first step, synthesised from the steady one.

The allocator's cache at a sampled (steady) step was shaped by the run's first step, which started with no gradients
and no optimizer state: it created the gradients in backward and the optimizer state at the start of the optimizer's
step (torch's ``_init_group``: per parameter ``exp_avg``, ``exp_avg_sq``, in parameter order, before the update's
temporaries; SGD's momentum buffers at its first update). Those blocks were cut from segments that the forward pass's
activations had used, so a steady step finds its cache fragmented that way. A steady step run from a freshly packed
allocator (every tensor that exists before it allocated first, packed) does not: it under-predicts the reserved peak
near capacity. On the recorded traces (tests/data/gpu-traces, cut by block identity), step 1's reserved peaks,
forward / backward, MiB:

============================  ==================  ==================  ===================
trace                         measured            packed steady step  first step + steady
============================  ==================  ==================  ===================
GPT-2 124M fp32, batch 8      7,872 / 8,658       7,864 / 8,650       7,872 / 8,658
GPT-2 124M fp32, batch 150    122,820 / 137,544   109,652 / 124,376   122,820 / 137,544
Llama (8 layers), batch 4     5,808 / 6,308       5,866 / 6,366       5,808 / 6,308
ResNet-50 SGD, batch 64       6,704 / 6,704       5,714 / 6,866       6,706 / 6,706
============================  ==================  ==================  ===================

(H200; the H100's, at the device's capacity, within 1%.) GPT-2 at batch 91 on an 80 GB H100 was predicted to fit from
the packed step and ran out of memory in its second step's backward; after the first step the model runs out there too,
at the same request, and fits with expandable segments, as the run with them did. The forward pass of a later step
starts with the whole reserve of the step before (the cache is never given back): with one more step before it, step 2
is reproduced where it was recorded (forward / backward, MiB: GPT-2 at batch 8 8,658 / 8,658, packed 7,864 / 8,650;
Llama 6,310 / 6,310, packed 5,866 / 6,366; ResNet-50 6,704 / 6,706 measured, 6,706 / 6,706 simulated, packed 5,714 /
6,866).

:func:`with_first_step` puts that first step before the steady one: the tensors that exist before the step except the
gradients and the optimizer state, then the steady step's own allocations and frees on blocks of their own, without
the frees of the gradients it starts with (they do not exist yet), with the optimizer state allocated where the first
optimizer phase starts, the libraries' workspaces where they were first used; the gradients it leaves are the steady
step's starting gradients. Block identity is kept: every malloc of the steady step is a new block in the history,
whatever id it reuses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning_vram.records import AllocationEvent, AllocationSequence, Phase


def with_first_step(
    step: AllocationSequence, gradients: Mapping[int, int], optimizer_state: Sequence[int], steps: int = 1
) -> AllocationSequence:
    """The run's first step, synthesised from ``step``, then ``step``: the sequence a steady step's cache comes from.

    ``steps``: the steps before ``step``: the first, then ``steps - 1`` as ``step`` runs (on blocks of their own),
    so that ``step`` is the run's step ``steps`` (counted from 0); 0: ``step`` is the run's first, as it is.

    ``step``: a steady step's sequence, the blocks that exist before it allocated before its first phase, a library's
    workspace (a negative block id) where the step first used it: the history allocates it there and keeps it, the
    steady step finds it allocated.
    ``gradients``: each gradient block the step starts with (its id), mapped to the block that holds that parameter's
    gradient when the step ends (the gradient the next step starts with). ``optimizer_state``: the optimizer state's
    blocks, in the order the optimizer creates them (a block named twice made once; a gradient block the state holds
    made in backward, as a gradient). Ids that are not blocks the step starts with are ignored. A step
    with no phase comes back as it is. A step with no optimizer phase keeps the state allocated before it.

    Phases are marked in the history too, so a phase's reserved peak read over the whole sequence (the highest of the
    history's and the step's) is the steady step's wherever the allocator releases nothing, and a capacity the history
    cannot be served in fails in the history's phase, as a real run fails in its first step.

    >>> step = (
    ...     ("malloc", 1, 100, 0),  # a parameter
    ...     ("malloc", 2, 100, 0),  # its gradient
    ...     ("malloc", 3, 200, 0),  # optimizer state
    ...     Phase.FORWARD, ("malloc", 4, 50, 0), ("free", 2, 0, 0),
    ...     Phase.BACKWARD, ("malloc", 5, 100, 0), ("free", 4, 0, 0),
    ...     Phase.OPTIMIZER, ("malloc", 4, 10, 0), ("free", 4, 0, 0),
    ... )
    >>> for event in with_first_step(step, {2: 5}, [3])[:11]:
    ...     print(event)
    ('malloc', 1, 100, 0)
    Phase.FORWARD
    ('malloc', 6, 50, 0)
    Phase.BACKWARD
    ('malloc', 2, 100, 0)
    ('free', 6, 0, 0)
    Phase.OPTIMIZER
    ('malloc', 3, 200, 0)
    ('malloc', 7, 10, 0)
    ('free', 7, 0, 0)
    Phase.FORWARD
    """
    first = next((index for index, event in enumerate(step) if isinstance(event, Phase)), None)
    if first is None or steps == 0:
        return step
    before, body = step[:first], step[first:]
    starting: dict[int, AllocationEvent] = {}
    for event in before:
        if not isinstance(event, Phase):
            if event[0] == "malloc":
                starting[event[1]] = event
            else:
                starting.pop(event[1], None)
    absent = {block for block in gradients if block in starting}
    # Once each (views of one flat buffer share a block), and not a gradient the state holds (made in backward).
    state = [
        starting[block] for block in dict.fromkeys(optimizer_state) if block in starting and block not in gradients
    ]
    if Phase.OPTIMIZER not in body:
        state = []
    absent.update(event[1] for event in state if not isinstance(event, Phase))
    history = _Steps(body, {after: block for block, after in gradients.items() if block in starting}, step)
    history.events.extend(event for event in before if isinstance(event, Phase) or event[1] not in absent)
    history.held.update(block for block in starting if block not in absent)
    history.run(state)
    history.hand_over(starting)
    for _ in range(steps - 1):
        history.run([])
        history.hand_over(starting)
    steady = (event for event in body if isinstance(event, Phase) or event[0] == "free" or event[1] >= 0)
    return (*history.events, *steady)


class _Steps:
    """The history's events, as :func:`with_first_step` runs the steady step's body on blocks of their own."""

    def __init__(self, body: AllocationSequence, carried: Mapping[int, int], step: AllocationSequence) -> None:
        self.body = body
        self.carried = carried  # a gradient the step ends with: the block the next step knows it as
        self.survivors = _survivors(body)
        self.fresh = 1 + max((abs(event[1]) for event in step if not isinstance(event, Phase)), default=0)
        self.events: list[AllocationEvent] = []
        self.held: set[int] = set()  # the blocks the history holds, by their history ids
        self.current: dict[int, int] = {}  # a block of the body allocated in the history: its history id

    def run(self, state: Sequence[AllocationEvent]) -> None:
        """One step: the body on blocks of its own, ``state`` allocated where its first optimizer phase starts.

        A free of a block the history does not hold (a gradient the first step does not start with) is left out.
        """
        for position, event in enumerate(self.body):
            if isinstance(event, Phase):
                self.events.append(event)
                if event is Phase.OPTIMIZER and state:
                    self.events.extend(state)
                    self.held.update(event[1] for event in state if not isinstance(event, Phase))
                    state = []
                continue
            kind, block, size, stream = event
            if kind == "malloc" and block < 0:  # a library's workspace, allocated at its first use and kept
                if block not in self.held:
                    self.events.append(event)
                    self.held.add(block)
            elif kind == "malloc":
                named = self.carried.get(block) if position in self.survivors else None
                if named is None or named in self.held:
                    named, self.fresh = self.fresh, self.fresh + 1
                self.current[block] = named
                self.held.add(named)
                self.events.append(("malloc", named, size, stream))
            elif block in self.current:
                named = self.current.pop(block)
                self.held.discard(named)
                self.events.append(("free", named, 0, 0))
            elif block in self.held:  # a block the step starts with, freed by the step
                self.held.discard(block)
                self.events.append(("free", block, 0, 0))

    def hand_over(self, starting: Mapping[int, AllocationEvent]) -> None:
        """Between two steps: what the history holds beyond the step's start is freed, what it lacks allocated."""
        for named in self.current.values():
            if named not in starting:
                self.events.append(("free", named, 0, 0))
                self.held.discard(named)
        self.current = {}
        for block, event in starting.items():
            if block not in self.held:
                self.events.append(event)
                self.held.add(block)


def _survivors(body: AllocationSequence) -> set[int]:
    """The positions in ``body`` of the mallocs whose blocks are still allocated at its end."""
    live: dict[int, int] = {}
    for position, event in enumerate(body):
        if not isinstance(event, Phase):
            if event[0] == "malloc":
                live[event[1]] = position
            else:
                live.pop(event[1], None)
    return set(live.values())
