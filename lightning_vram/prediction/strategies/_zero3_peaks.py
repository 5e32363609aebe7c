"""ZeRO-3's forward and backward peaks beyond the counted parts: the parameters it gathers whole and holds.

DeepSpeed 0.19's ``PartitionedParameterCoordinator`` gathers each module's parameters whole before it runs and, after
it, releases only those not used again within ``stage3_max_reuse_distance`` elements of the step's trace (10^9 by
default, ``__params_to_release``): every parameter a module uses in forward is used again in its backward, so each
stays gathered from its forward to the end of its module's backward. At the forward's peak the rank thus holds every
parameter whole (those a module with submodules uses directly are saved by autograd: counted as activations), and
the flat buffer of one coalesced all-gather (``_all_gather_coalesced``: ``torch.empty`` of the gathered elements,
each parameter then ``torch.cat`` out of it, the buffer held until the last of its parameters is waited on); the
prefetch gathers parameters in trace order until ``stage3_prefetch_bucket_size`` elements are in flight, so the
buffer is taken as that many elements (the whole parameters where fewer), held until the last module holding
parameters of its own starts in forward: its fetch pops the last of them, and the forward's tail (that module's
ops, the loss) holds no buffer (:func:`forward_live`). In backward the reduce bucket appears at
the first gradient's hook, and the last module's parameters are released once its backward has run.

The CPU's live count (:mod:`lightning_vram.measure.live`) does not see three of the counted partitions, held by no
tensor it registers: the parameters' (``ds_tensor``), the gradients' (``grad_partitions_flat_buffer``) and the fp32
master copy (``fp32_partitioned_groups_flat``); the monitor reports a phase's peak as the larger of its live count
and its counted parts. On 2 gloo ranks an MLP (``Linear(128, 128)``, ReLU, dropout, ``Linear(128, 10)``, batch 64,
Adam) measured 414,396 bytes at backward's peak and 377,980 at forward's: 164,880 and 172,624 beyond the counted
parts less those partitions (the batch, 66,048 bytes of the first layer gathered, two 32,768-byte activation
gradients; forward: both layers gathered twice over, the parameters and the all-gather's buffer).
"""

from __future__ import annotations

from lightning_vram.measure.deepspeed_zero import full_numel
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.records import Phase, ReplayedStep, StepTimeline


def unseen_partitions(device_type: str, share: int, element: int, master_element: int) -> int:
    """Bytes of ZeRO-3's partitions the live count misses: the parameters', the gradients' and the fp32 master's.

    ``share``: the partition's elements; ``element``: bytes of a parameter element; ``master_element``: of the master
    copy's. None on CUDA, whose allocator counts them.
    """
    return (2 * share * element + share * master_element) if device_type == "cpu" else 0


def last_module_bytes(predictor: Predictor, replayed: ReplayedStep, element: int) -> int:
    """Bytes of the parameters (whole) of the last module the forward ran: released first in backward."""
    modules = [profile.name for profile in replayed.modules if not profile.name.startswith("(")]
    if not modules:
        return 0
    try:
        module = predictor.module.get_submodule(modules[-1])
    except AttributeError:
        return 0
    return sum(full_numel(parameter) for parameter in module.parameters() if parameter.requires_grad) * element


def forward_live(
    predictor: Predictor, replayed: ReplayedStep, resident: int, held: int, buffer: int, saved: int
) -> int:
    """The rank's forward live peak, in bytes.

    ``resident`` bytes, the replay's activations and temporaries, the ``held`` gathered parameters and the ``saved``
    gathered copies autograd keeps; and one all-gather's ``buffer`` until the last module holding parameters of its
    own starts (:func:`last_fetch_op`): its fetch waits on the last parameter of the last coalesced all-gather, and
    the handle holding the buffer goes with it (DeepSpeed 0.19: ``__inflight_param_registry.pop(param)`` per
    parameter, the ``AllGatherCoalescedHandle`` of a group referenced by each of its parameters until then). The
    forward's tail (the last module's own ops, the loss) holds no buffer: a transformer LM whose peak is at its loss
    was predicted +15.6% at DeepSpeed's default ``stage3_prefetch_bucket_size`` (5,796,140 B for 5,012,364) with the
    buffer held there. Without a timeline, the buffer at the replay's forward peak.
    """
    breakdown = replayed.phases[Phase.FORWARD].breakdown
    assert breakdown is not None
    whole = resident + held + saved
    timeline = replayed.timeline
    tail = None if timeline is None else last_fetch_op(predictor, timeline)
    if timeline is None or tail is None:
        return whole + breakdown.activations + (breakdown.other or 0) + buffer
    points = [point for point in timeline.points if point.phase is Phase.FORWARD]
    before = max((point.activations + point.other + buffer for point in points if point.op < tail), default=0)
    after = max((point.activations + point.other for point in points if point.op >= tail), default=0)
    return whole + max(before, after)


def last_fetch_op(predictor: Predictor, timeline: StepTimeline) -> int | None:
    """The first op of the last module to start in forward that holds trainable parameters of its own.

    Its name resolved in the predictor's module; ``None`` where the timeline has no module entries or none holds any.
    """
    last = None
    for name, op in timeline.module_entries:
        try:
            module = predictor.module.get_submodule(name)
        except AttributeError:
            continue
        if any(parameter.requires_grad for parameter in module.parameters(recurse=False)):
            last = op
    return last


def backward_live(
    replayed: ReplayedStep, resident: int, bucket: int, held: int, last: int, saved: int, wide: tuple[int, ...] = ()
) -> tuple[int, int] | None:
    """The rank's backward live peak over the replay's timeline, and the gradient held whole at it.

    ``None`` without a timeline. Before the first gradient appears: ``resident`` bytes, every ``held`` parameter, the
    ``saved`` gathered copies autograd keeps, each point's activations and temporaries; from then on the reduce
    ``bucket`` too, the ``last`` module's parameters released once the gradients are more than its own. ``wide``: the
    bytes of each parameter's whole gradient larger than the bucket, which DeepSpeed 0.19 holds whole
    (:func:`wide_gradient`) from the point it appears to the next gradient's; where it appears, autograd's own
    gradient (the previous point's temporaries) is still alive beside it.
    """
    timeline = replayed.timeline
    if timeline is None:
        return None
    points = [point for point in timeline.points if point.phase is Phase.BACKWARD]
    if not points:
        return None
    first = next((index for index, point in enumerate(points) if point.gradients > 0), len(points))
    before = max((point.activations + point.other for point in points[:first]), default=None)
    peaks: list[tuple[int, int]] = []
    if before is not None:
        peaks.append((resident + held + saved + before, 0))
    holding, previous = 0, points[first - 1] if first > 0 else None
    for point in points[first:]:
        # the last module's parameters go after its backward, which makes its gradients (``last`` bytes) first
        base = resident + bucket + held + saved - (last if point.gradients > last else 0)
        grown = point.gradients - (previous.gradients if previous is not None else 0)
        if grown > 0:
            holding = wide_gradient(grown, wide)
            if holding and previous is not None:
                peaks.append((base + holding + previous.activations + previous.other, holding))
        peaks.append((base + holding + point.activations + point.other, holding))
        previous = point
    return max(peaks, key=lambda peak: peak[0])


def wide_gradient(grown: int, wide: tuple[int, ...]) -> int:
    """Bytes of the widest gradient in ``wide`` that fits the replay's gradients' growth ``grown``; 0 for none.

    DeepSpeed 0.19's stage 3 (``reduce_independent_p_g_buckets_and_remove_grads``) reduces its bucket before a
    gradient that would overflow it, then ``__add_grad_to_ipg_bucket`` copies the gradient into the bucket only where
    it fits (``bucket.elements + param.grad.numel() <= reduce_bucket_size``): a wider one stays whole in
    ``param.grad``, in the bucket's list, until the next gradient's hook overflows the bucket and reduces it (or the
    backward's epilogue). A ZeRO-3 rank of a model with a ``Linear(64, 2000)`` head (20,000-element buckets, 2 gloo
    ranks) held the head's 512,000-byte weight gradient so: backward predicted 2,436,940 B for 2,700,952 measured.
    """
    return max((size for size in wide if size <= grown), default=0)
