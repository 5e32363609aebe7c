"""The history before a replayed steady step: the run's first step, synthesised from the steady one.

The allocator's cache at a sampled (steady) step was shaped by the run's first step, which started with no gradients
and no optimizer state: it created the gradients in backward and the optimizer state at the start of the optimizer's
step (torch's ``_init_group``: per parameter ``exp_avg``, ``exp_avg_sq``, in parameter order, before the update's
temporaries; SGD's momentum buffers at its first update). Those blocks were cut from segments that the forward pass's
activations had used, so a steady step finds its cache fragmented that way. A steady step run from a freshly packed
allocator (every tensor that exists before it allocated first, packed) does not: it under-predicts the reserved peak
near capacity. On the recorded traces (tests/data/gpu-traces), step 1's reserved peaks, forward / backward, MiB:

============================  ==================  ==================  ==================
trace                         measured            packed steady step  first step + steady
============================  ==================  ==================  ==================
GPT-2 124M fp32, batch 8      7,872 / 8,658       7,864 / 8,650       7,872 / 8,658
GPT-2 124M fp32, batch 150    122,820 / 137,544   109,654 / 124,378   122,822 / 137,546
ResNet-50 SGD, batch 64       6,704 / 6,704       5,712 / 6,864       6,672 / 6,674
============================  ==================  ==================  ==================

(H200.) GPT-2 at batch 91 on an 80 GB H100 was predicted to fit from the packed step and ran out of memory at its
second step.

:func:`with_first_step` puts that first step before the steady one: the tensors that exist before the step except the
gradients and the optimizer state, then the steady step's own allocations and frees on blocks of their own, without
the frees of the gradients it starts with (they do not exist yet), with the optimizer state allocated where the first
optimizer phase starts, the libraries' workspaces where they were first used; the gradients it leaves are the steady
step's starting gradients. Block identity is kept:
every malloc of the steady step is a new block in the history, whatever id it reuses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning_vram.records import AllocationEvent, AllocationSequence, Phase


def with_first_step(
    step: AllocationSequence, gradients: Mapping[int, int], optimizer_state: Sequence[int]
) -> AllocationSequence:
    """The run's first step, synthesised from ``step``, then ``step``: the sequence a steady step's cache comes from.

    ``step``: a steady step's sequence, the blocks that exist before it allocated before its first phase, a library's
    workspace (a negative block id) where the step first used it: the history allocates it there and keeps it, the
    steady step finds it allocated.
    ``gradients``: each gradient block the step starts with (its id), mapped to the block that holds that parameter's
    gradient when the step ends (the gradient the next step starts with). ``optimizer_state``: the optimizer state's
    blocks, in the order the optimizer creates them. Ids that are not blocks the step starts with are ignored. A step
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
    if first is None:
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
    state = [starting[block] for block in optimizer_state if block in starting]
    if Phase.OPTIMIZER in body:
        absent.update(event[1] for event in state if not isinstance(event, Phase))
    survivors = _survivors(body)
    carried = {after: block for block, after in gradients.items() if block in absent}
    fresh = 1 + max((abs(event[1]) for event in step if not isinstance(event, Phase)), default=0)
    history: list[AllocationEvent] = [event for event in before if isinstance(event, Phase) or event[1] not in absent]
    held = {block for block in starting if block not in absent}  # blocks the history holds, by their history id
    current: dict[int, int] = {}  # a block of the step allocated in the history: its history id
    optimizer_started = False
    for position, event in enumerate(body):
        if isinstance(event, Phase):
            history.append(event)
            if event is Phase.OPTIMIZER and not optimizer_started:
                optimizer_started = True
                history.extend(state)
                held.update(event[1] for event in state if not isinstance(event, Phase))
            continue
        kind, block, size, stream = event
        if kind == "malloc" and block < 0:  # a library's workspace, allocated at its first use and kept
            history.append(event)
            held.add(block)
        elif kind == "malloc":
            if position in survivors and block in carried:
                named = carried.pop(block)
            else:
                named, fresh = fresh, fresh + 1
            current[block] = named
            held.add(named)
            history.append(("malloc", named, size, stream))
        elif block in current:
            named = current.pop(block)
            held.discard(named)
            history.append(("free", named, 0, 0))
        elif block in held:  # a block the step starts with, freed by the step
            held.discard(block)
            history.append(("free", block, 0, 0))
    # Between the two steps: what the history keeps beyond the step's start is freed, what the step starts with and
    # the history lacks is allocated.
    history.extend(("free", block, 0, 0) for block in current.values() if block not in starting)
    history.extend(event for block, event in starting.items() if block not in held)
    steady = (event for event in body if isinstance(event, Phase) or event[0] == "free" or event[1] >= 0)
    return (*history, *steady)


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
