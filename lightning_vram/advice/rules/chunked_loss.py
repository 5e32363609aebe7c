"""Chunked loss: the loss's own saved tensors (its log-probabilities over the classes or vocabulary) are large.

Read from the replayed baseline (``ReplayedStep.loss_activation_bytes``): it fires where the loss holds
:data:`CHUNKED_LOSS_MIN_SHARE` of the forward pass's activations and
:data:`~lightning_vram.advice.rules.base.MIN_SAVING_SHARE` of the peak, and the modelled saving is as large. No
replay applies the change, so the saving is modelled phase by phase from the replayed baseline's live peaks
(:func:`_chunked_loss_peak`): the log-probabilities it saves, and the tensors of the same size alive beside them that
the counted parts leave in ``other`` (the logits in forward; the gradients of the log-probabilities and of the
logits in backward), all held one chunk at a time instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_vram.advice.catalogue import FULL_PRECISIONS
from lightning_vram.advice.checkpointing import OUTSIDE, ROOT
from lightning_vram.advice.rules.base import MIN_SAVING_SHARE, Rule, no_changes, not_replayed, share_text
from lightning_vram.advice.savings import trusted
from lightning_vram.records import (
    Advice,
    AdviceId,
    Phase,
    PhasePeak,
    ReplayedStep,
    RunSummary,
    SavingBasis,
    Severity,
    Simulation,
    TrainingLoop,
    TrainingSetup,
)
from lightning_vram.units import format_bytes, format_percent

ID = AdviceId.CHUNKED_LOSS
CHUNKED_LOSS_MIN_SHARE = 0.25
"""The loss's own saved tensors must be a quarter of the forward pass's activations to be worth chunking."""
LOSS_CHUNKS = 8
"""Chunks the chunked-loss advice computes the loss in: one eighth of its log-probabilities kept at a time."""


def _chunked_loss_peak(baseline: ReplayedStep, peak: PhasePeak, loss_bytes: int, sixteen_bit: bool = False) -> int:
    """A replayed phase's live peak in bytes with the loss computed in :data:`LOSS_CHUNKS` chunks, each recomputed.

    The loss's vocabulary-sized tensors are as large as the log-probabilities it saves (``loss_bytes``); at a 16-bit
    precision (``sixteen_bit``) the head's logits are there in 16 bits too, half as large, before their float32 copy
    (a GPT-NeoX LM at bf16-mixed: 122.8 MiB modelled without them, 158.9 MiB realised). Forward
    keeps none of the log-probabilities and none of the logits (up to the phase's ``other``, where they are), but one
    chunk of each while it is computed. Backward starts with the loss: where the phase's peak is at its start (no
    gradient yet beyond those backward started with, :func:`_entering`), the log-probabilities
    and the gradients of them and of the logits (up to ``other``) are held one chunk at a time; and the rest of
    backward, once the loss's tensors are freed, runs as it does now
    (:func:`_after_the_loss`): the phase peaks at the higher of the two. A later backward peak is left as it is. The
    optimizer step holds none of them. The parts are read at the peak itself (:func:`_parts_at_peak`).
    """
    peak_bytes = baseline.reported_bytes(peak)
    gradients, other = _parts_at_peak(baseline, peak)
    logits = loss_bytes + (loss_bytes // 2 if sixteen_bit else 0)
    if peak.phase is Phase.FORWARD:
        held = loss_bytes + min(logits, other)
    elif peak.phase is Phase.BACKWARD and gradients is not None and gradients <= _entering(baseline):
        held = loss_bytes + min(loss_bytes + logits, other)
        return max(peak_bytes - held + held // LOSS_CHUNKS, _after_the_loss(baseline, loss_bytes, sixteen_bit))
    else:
        return peak_bytes
    return peak_bytes - held + held // LOSS_CHUNKS


def _parts_at_peak(baseline: ReplayedStep, peak: PhasePeak) -> tuple[int | None, int]:
    """The gradients and ``other`` bytes live at a replayed phase's peak (``None`` and 0 where nothing tells).

    From the baseline's timeline where it has the phase: its highest point, every part read at that instant. The
    phase's breakdown holds the counted parts where their sum peaked, which need not be the live peak's instant: an
    LSTM language model checkpointed peaked at the loss's backward with no gradient yet (the timeline: 0 bytes of
    gradients, 62.5 MiB of ``other``) while its breakdown held 7.8 MiB of gradients, counted later in backward, which
    read as a peak after the loss and left the chunked loss's 46.9 MiB unadvised.
    """
    timeline = baseline.timeline
    points = [point for point in timeline.points if point.phase is peak.phase] if timeline is not None else []
    if points:
        highest = max(points, key=lambda point: point.total)
        return highest.gradients, highest.other
    if peak.breakdown is None:
        return None, 0
    return peak.breakdown.gradients, peak.breakdown.other or 0


def _entering(baseline: ReplayedStep) -> int:
    """The gradient bytes alive as the replayed backward starts: 0, or under gradient accumulation the window's.

    From the baseline's timeline (its first backward point); 0 where it has none. A stepping micro-batch starts
    backward with the gradients its window's earlier micro-batches left, and adds to them in place: a trial's
    transformer LM at ``accumulate_grad_batches=2`` peaked at the loss's backward with 2.7 MiB of them alive, which
    read as a peak after the loss and left the chunked loss's 38.4 MiB unadvised ("0 B below the replayed peak").
    """
    timeline = baseline.timeline
    points = [point for point in timeline.points if point.phase is Phase.BACKWARD] if timeline is not None else []
    return points[0].gradients if points else 0


def _after_the_loss(baseline: ReplayedStep, loss_bytes: int, sixteen_bit: bool = False) -> int:
    """The replayed backward's highest live bytes once the loss's vocabulary-sized tensors are freed (0: unknown).

    From the baseline's timeline: the first backward point where the saved activations have fallen by the
    log-probabilities (``loss_bytes``) and ``other`` holds less than one vocabulary-sized tensor (the gradients of the
    log-probabilities and of the logits freed), and every point after it. Chunking the loss changes none of that part
    of the step. A trial's transformer LM: the start of backward modelled at 49.5 MB, the rest of backward peaking at
    56.8 MB, which the chunked run measured to the byte. At a 16-bit precision the gradient of the 16-bit logits
    (half a vocabulary-sized tensor) follows those of the float32 ones: the part after the loss starts once ``other``
    holds less than it, where any point does.
    """
    timeline = baseline.timeline
    points = [point for point in timeline.points if point.phase is Phase.BACKWARD] if timeline is not None else []
    if not points:
        return 0
    start = points[0].activations
    bounds = (loss_bytes // 2, loss_bytes) if sixteen_bit else (loss_bytes,)
    for bound in bounds:
        for index, point in enumerate(points):
            if point.activations <= start - loss_bytes and point.other < bound:
                return max(later.total for later in points[index:])
    return 0


@dataclass(frozen=True)
class _Weighed:
    """The replayed baseline's loss weighed for chunking.

    ``loss_bytes``: what the loss's own ops saved; ``share``: their share of the forward pass's activations;
    ``peak``: the replayed peak (``peak_bytes`` as the report measures it); ``chunked``: each phase's modelled peak in
    bytes with the loss computed in chunks.
    """

    loss_bytes: int
    share: float
    peak: PhasePeak
    peak_bytes: int
    chunked: dict[Phase, int]

    @property
    def saving(self) -> int:
        """The modelled saving in bytes: the replayed peak less the highest chunked phase."""
        return self.peak_bytes - max(self.chunked.values(), default=self.peak_bytes)

    @property
    def evidence(self) -> str:
        """The loss's saved bytes, as shares of the forward pass's activations and of the peak, in words."""
        return (
            f"the loss's own ops saved {format_bytes(self.loss_bytes)}, {format_percent(self.share)} of the forward"
            f" pass's activations and {share_text(self.loss_bytes, self.peak_bytes)} of the replayed"
            f" {self.peak.phase.value} peak ({format_bytes(self.peak_bytes)})"
        )


def _sixteen_bit(setup: TrainingSetup) -> bool:
    """Whether the run trains at a 16-bit precision (mixed or true), its head's logits in 16 bits."""
    return setup.precision not in FULL_PRECISIONS


def _weighed(baseline: ReplayedStep, sixteen_bit: bool = False) -> _Weighed:
    """The replayed baseline's loss weighed for chunking (:func:`_chunked_loss_peak`, phase by phase)."""
    loss_bytes = baseline.loss_activation_bytes
    peak = baseline.reported_peak
    phases = baseline.phases.items()
    chunked = {phase: _chunked_loss_peak(baseline, peaked, loss_bytes, sixteen_bit) for phase, peaked in phases}
    return _Weighed(loss_bytes, baseline.loss_activation_share, peak, baseline.reported_bytes(peak), chunked)


def _enough(weighed: _Weighed) -> bool:
    """Whether the loss is large enough to chunk and chunking it saves enough of the peak."""
    threshold = MIN_SAVING_SHARE * weighed.peak_bytes
    return weighed.share >= CHUNKED_LOSS_MIN_SHARE and weighed.loss_bytes >= threshold and weighed.saving >= threshold


FABRIC_AUTOCAST = (
    "# Under Fabric, run these lines (the body, the head and the loss) in `with fabric.autocast():`: Fabric applies\n"
    "# {precision} to the wrapped model's own forward only, and a submodule called directly would run in float32\n"
)
"""The chunked loss's lines in a Fabric loop at a 16-bit precision: Fabric's precision covers its module's forward."""


def _fabric_lines(setup: TrainingSetup) -> str:
    """The comment a Fabric loop at a 16-bit precision needs beside the chunked loss's lines (else nothing).

    ``_FabricModule`` runs its module's ``forward`` under the precision; the chunked loss calls the model's body and
    head directly, outside it: a trial's transformer LM (Fabric, bf16-mixed) saved 30.0 MiB of the 38.4 MiB advised
    that way (its layers in float32), and 40.1 MiB inside ``fabric.autocast()``.
    """
    if setup.loop is not TrainingLoop.FABRIC or setup.precision in FULL_PRECISIONS:
        return ""
    return FABRIC_AUTOCAST.format(precision=f'precision="{setup.precision}"')


LOSS_READERS = ("nll_loss_forward", "nll_loss2d_forward")
"""The ops of a cross-entropy (``F.cross_entropy``, ``F.nll_loss``), as a replay's counted work names them."""


def _cross_entropies(baseline: ReplayedStep) -> int | None:
    """How many cross-entropies the replayed forward ran (recomputations aside); ``None``: its ops were not counted."""
    if baseline.work is None:
        return None
    forward = baseline.work.in_phase(Phase.FORWARD).groups
    return sum(group.count for group in forward if group.op in LOSS_READERS and not group.recomputed)


def own_head(
    summary: RunSummary, setup: TrainingSetup, loss_bytes: int, cross_entropies: int | None = 1
) -> tuple[str, int] | None:
    """The module whose output the loss read as logits, by name, with its calls; ``None`` where no module shows it.

    The one module of the sampled step (not the trained module itself, called once) whose output is as large as the
    log-probabilities the loss saved (at a 16-bit precision, or half as large: 16-bit logits): the head, whose input
    the printed ``chunked_cross_entropy`` takes (a trial's LSTM language model, ``self.out``, was shown
    transformers' lines alone). A head called once a position in a loop (a GRU decoder's, with teacher forcing) makes
    the logits in as many calls, their outputs together as large: its profile sums them, and its calls are returned
    for the lines that say so (a trial's seq2seq, ``self.out`` called 15 times, was shown transformers' lines alone).
    Several such modules, or none (logits from a function of the weights, a tied embedding's ``h @ emb.weight.T``),
    name none; nor is a head inside a ``transformers`` model named (its loss is computed inside the model, whose own
    lines follow).

    A head called more than once is named only where its calls' outputs can be the logits of one cross-entropy
    stacked: the replayed forward ran one (``cross_entropies``, its ``nll_loss`` ops; ``None``: not counted, none
    named), not one a call (a loss summed in the loop, or the model run on two halves of the batch and their losses
    added, where the printed mean over the stacked positions is another loss); and at a mixed precision, where each
    call makes 16-bit logits, its outputs total half the log-probabilities (a multi-sample dropout's two 16-bit
    outputs averaged total as much as the float32 log-probabilities, and stacking them is another loss).
    """
    sizes = {loss_bytes, loss_bytes // 2} if _sixteen_bit(setup) else {loss_bytes}
    looped = {loss_bytes // 2} if "mixed" in setup.precision else {loss_bytes}
    heads = [
        (profile.name, profile.calls)
        for profile in summary.modules
        if profile.calls >= 1
        and profile.output_bytes in (sizes if profile.calls == 1 else looped)
        and (profile.calls == 1 or cross_entropies == 1)
        and profile.name not in (ROOT, OUTSIDE)
    ]
    libraries = [switch.model for switch in setup.checkpointing_switches]
    if len(heads) != 1 or any(not model or heads[0][0].startswith(f"{model}.") for model in libraries):
        return None
    return heads[0]


def _head_lines(head: tuple[str, int] | None, setup: TrainingSetup) -> str:
    """The lines naming the run's own head (:func:`own_head`) in the printed code (nothing where none is named)."""
    if head is None:
        return ""
    # imported here: `lightning-vram show` and `diff` read LOSS_CHUNKS from this module without torch
    from lightning_vram.advice.checkpoint_code import CodeContext, code_path

    name, calls = head
    path = code_path(name, "", CodeContext(setup.loop).model)
    if calls > 1:
        return (
            f"# In your step the logits are the outputs of `{path}`, called {calls:,} times (a loop over the\n"
            f"# positions): together they are as large as the loss's log-probabilities. Keep the input you give it\n"
            f"# at each call instead, stacked along the positions as you stack the logits (hidden =\n"
            f"# torch.stack(inputs, 1)), and where the loop reads a call's logits (an argmax feeding the next\n"
            f"# input) compute them under torch.no_grad(); pass hidden, it as head, targets as the loss reads them:\n"
            f"# loss = chunked_cross_entropy(hidden.flatten(0, 1), {path}, targets.flatten())\n"
        )
    return (
        f"# In your step the logits are the output of `{path}` (its output is as large as the loss's\n"
        f"# log-probabilities): pass the input you give it as hidden and it as head, targets as the loss reads them:\n"
        f"# loss = chunked_cross_entropy(hidden.flatten(0, 1), {path}, targets.flatten())\n"
    )


def chunked_loss(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> Advice | None:
    """The loss's own saved tensors are a large share of the replayed step's activations and of its peak."""
    baseline = trusted(simulation)
    if baseline is None:
        return None
    weighed = _weighed(baseline, _sixteen_bit(setup))
    if not _enough(weighed):
        return None
    saving = weighed.saving
    return Advice(
        id=ID,
        severity=Severity.INFO,
        title=(
            f"Compute the loss in chunks to lower the peak by about {format_bytes(saving)} (the loss then agrees to"
            " float32 rounding, not bit for bit)"
        ),
        detail=(
            "Cross-entropy keeps the log-probabilities of every position over every class (the vocabulary of a"
            " language model) for backward, in float32. Computed chunk by chunk over the positions, each chunk"
            " recomputed in backward, it keeps one chunk's at a time; a fused linear cross-entropy kernel"
            " (Liger-Kernel's LigerFusedLinearCrossEntropyLoss) does the same without materialising the logits."
            " The loss is summed chunk by chunk, in another order than cross-entropy's mean: the loss and its"
            " gradients agree to float32 rounding (about 1e-6 relative), not bit for bit, and an optimizer that"
            " normalises gradients (Adam) can turn that rounding into whole steps where the true gradient is zero"
            " (attention's key bias). It is the cross-entropy of the head's logits: pass your loss's own options"
            " (class weights, ignore_index, label smoothing, a sum) and what your step does to the logits first, or"
            " it computes another loss.\n"
            "```python\n"
            "import torch\n"
            "import torch.nn.functional as F\n"
            "from torch.utils.checkpoint import checkpoint\n\n"
            f"def chunked_cross_entropy(hidden, head, targets, chunks={LOSS_CHUNKS}, logits_fn=None, **options):\n"
            "    # hidden: (positions, width), the input of the output layer `head`; targets: (positions,)\n"
            "    # logits_fn: what your step does to the logits before the loss (a temperature, soft-capping)\n"
            "    # options: your F.cross_entropy's own, as you pass them (weight=, ignore_index=, label_smoothing=,\n"
            '    # reduction="sum"); a term of your own on the logits (a z-loss) goes in chunk_loss, summed\n'
            '    reduction = options.pop("reduction", "mean")\n'
            '    if reduction not in ("mean", "sum"):\n'
            '        raise ValueError(f"reduction={reduction!r} keeps every position\'s loss: nothing to chunk")\n'
            "    def chunk_loss(h, t):\n"
            "        logits = head(h).float()\n"
            "        if logits_fn is not None:\n"
            "            logits = logits_fn(logits)\n"
            '        return F.cross_entropy(logits, t, reduction="sum", **options)\n'
            "    total = sum(checkpoint(chunk_loss, h, t, use_reentrant=False)\n"
            "                for h, t in zip(hidden.chunk(chunks), targets.chunk(chunks)))\n"
            '    if reduction == "sum":\n'
            "        return total\n"
            "    # the mean cross-entropy takes: over the targets counted, each by its class weight\n"
            '    counted = targets != options.get("ignore_index", -100)\n'
            '    weight = options.get("weight")\n'
            "    if weight is None:\n"
            "        return total / counted.sum()\n"
            "    return total / (weight[torch.where(counted, targets, 0)] * counted).sum()\n\n"
            f"{_head_lines(own_head(summary, setup, weighed.loss_bytes, _cross_entropies(baseline)), setup)}"
            "# A transformers model computes its loss inside model(..., labels=...): call its body and its head\n"
            "# instead (labels: -100 where no loss is taken; labels = ids where you pass the inputs). A model that\n"
            "# changes its logits before the loss needs it as logits_fn (Gemma 2: cap =\n"
            "# model.config.final_logit_softcapping, logits_fn=lambda logits: cap * torch.tanh(logits / cap)).\n"
            "# A causal LM (body: Llama's model.model, GPT-2's model.transformer; head: model.lm_head)\n"
            "# shifts the targets by one, as labels= shifts them:\n"
            "# hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state\n"
            "# loss = chunked_cross_entropy(hidden[:, :-1].flatten(0, 1), model.lm_head, labels[:, 1:].flatten())\n"
            "# A masked LM (body: BERT's model.bert; head: model.cls, its transform and decoder) shifts nothing:\n"
            "# hidden = model.bert(input_ids=ids, attention_mask=mask).last_hidden_state\n"
            "# loss = chunked_cross_entropy(hidden.flatten(0, 1), model.cls, labels.flatten())\n"
            "# An encoder-decoder (T5, BART; head: model.lm_head) feeds its decoder the labels shifted right, as\n"
            "# labels= does, and shifts no target. T5 scales the decoder's output by model.model_dim**-0.5 before its\n"
            "# head (where model.config.scale_decoder_outputs; tie_word_embeddings before transformers 5): without\n"
            "# that factor it computes another loss. BART scales nothing and adds a bias to the logits instead:\n"
            "# logits_fn=lambda logits: logits + model.final_logits_bias\n"
            "# encoded = model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state\n"
            "# decoded = model.get_decoder()(input_ids=model.prepare_decoder_input_ids_from_labels(labels=labels),\n"
            "#     encoder_hidden_states=encoded, encoder_attention_mask=mask).last_hidden_state\n"
            "# decoded = decoded * model.model_dim**-0.5  # T5's scaling, as above\n"
            "# loss = chunked_cross_entropy(decoded.flatten(0, 1), model.lm_head, labels.flatten())\n"
            "# A speech encoder-decoder (Whisper; head: model.proj_out) reads its input_features (features), and\n"
            "# its module's own function shifts the labels right (no prepare_decoder_input_ids_from_labels):\n"
            "# from transformers.models.whisper.modeling_whisper import shift_tokens_right\n"
            "# encoded = model.get_encoder()(input_features=features).last_hidden_state\n"
            "# decoded = model.get_decoder()(input_ids=shift_tokens_right(labels, model.config.pad_token_id,\n"
            "#     model.config.decoder_start_token_id), encoder_hidden_states=encoded).last_hidden_state\n"
            "# loss = chunked_cross_entropy(decoded.flatten(0, 1), model.proj_out, labels.flatten())\n"
            f"{_fabric_lines(setup)}"
            "```"
        ),
        evidence=(
            f"replayed on this run's step: {weighed.evidence}; saving modelled (not replayed): none of them kept in"
            f" forward, one chunk of {LOSS_CHUNKS} recomputed at a time in backward, and so for the tensors of their"
            " size beside them at the peak (the logits, the gradients of both), which is why the saving can exceed"
            " what the loss saved"
        ),
        estimated_saving_bytes=saving,
        saving_basis=SavingBasis.MODELLED,
    )


def why_not(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> str | None:
    """Why chunking the loss is not advised: its share, or the modelled saving, under the rule's threshold.

    Without a trusted replay the loss's saved tensors are not known: not weighed, and why.
    """
    baseline = trusted(simulation)
    if baseline is None:
        return not_replayed(simulation)
    weighed = _weighed(baseline, _sixteen_bit(setup))
    if weighed.share < CHUNKED_LOSS_MIN_SHARE:
        return (
            f"{weighed.evidence}: under the {format_percent(CHUNKED_LOSS_MIN_SHARE)} of the activations the rule needs"
        )
    if weighed.loss_bytes < MIN_SAVING_SHARE * weighed.peak_bytes:
        return f"{weighed.evidence}: under the {format_percent(MIN_SAVING_SHARE)} of the peak the rule needs"
    highest = max(weighed.chunked, key=lambda phase: weighed.chunked[phase])
    return (
        f"{weighed.evidence}; modelled in {LOSS_CHUNKS} chunks, the step would peak at"
        f" {format_bytes(weighed.chunked[highest])} in {highest.value}, {format_bytes(max(weighed.saving, 0))}"
        f" ({share_text(max(weighed.saving, 0), weighed.peak_bytes)}) below the replayed peak: under the"
        f" {format_percent(MIN_SAVING_SHARE)} of the peak the rule needs"
    )


RULE = Rule(ID, chunked_loss, no_changes, why_not)
