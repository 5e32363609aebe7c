"""What a device can do at most: its peak FLOP/s per dtype class, its memory bandwidth and its cost per op.

:data:`GPU_PEAKS` holds NVIDIA's published dense figures for the cards of
:data:`~lightning_vram.prediction.devices.COMMON_GPUS`, each with the datasheet it comes from. Sparsity figures
(NVIDIA's "with sparsity", twice the dense rate) are not used: a training step's matrices are dense. Tensor-core
rates for fp16 and bf16 are those with fp32 accumulation (what torch's matrix products use). The CPU's figures are
never assumed: :func:`~lightning_vram.prediction.timing.host.measure_host_peaks` measures them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

TERA = 1e12
"""FLOP/s in a TFLOP/s."""
GB = 1e9
"""Bytes a second in a GB/s (decimal, as datasheets give bandwidth)."""
GPU_OP_OVERHEAD_SECONDS = 5e-6
"""Seconds each op adds on a GPU: eager PyTorch's host dispatch and kernel launch, an assumption (not measured here;
a few microseconds an op is the usual figure). Hidden in practice where the GPU runs longer than the host takes to
launch its kernels, so it overstates a large model's step a little and matters for a small one."""
GPU_ACHIEVED = 0.5
"""Share of a GPU's published peaks assumed achieved by a training step's ops, FLOP/s and bandwidth alike: an
assumption (well-tuned large-model training reports 40-60% of peak FLOP/s; memory-bound kernels reach more of their
bandwidth, small matrices less of their FLOP/s). Inside a training run the measured step time replaces it
(calibration)."""


@dataclass(frozen=True)
class DevicePeaks:
    """One device's peak rates: FLOP/s per dtype class, memory bandwidth in bytes/s, seconds an op adds.

    ``fp32_flops`` is the plain fp32 rate, ``tf32_flops`` the fp32 matrix products' where TF32 is allowed
    (``torch.backends.cuda.matmul.allow_tf32``), ``bf16_flops`` and ``fp16_flops`` the half types' (tensor cores
    with fp32 accumulation on a GPU). ``achieved`` is the share of these peaks assumed reached (1.0 for figures
    measured on the ops themselves). ``source`` says where the figures come from; ``memory_row`` names the
    :data:`~lightning_vram.prediction.devices.COMMON_GPUS` row of the card's memory (``None``: not a GPU of it).
    """

    name: str
    fp32_flops: float
    tf32_flops: float
    bf16_flops: float
    fp16_flops: float
    bandwidth: float
    op_overhead_seconds: float
    source: str
    achieved: float = GPU_ACHIEVED
    memory_row: str | None = None
    bf16_tensor_cores: bool = True
    """Whether the card computes bf16 on tensor cores (``False``: Turing's T4 runs bf16 at its fp32 rate, where a
    plan gives 16-mixed instead)."""
    op_achieved: Mapping[str, float] = field(default_factory=dict)
    """Measured shares of the roofline reached by some kinds of op, by op name (a variant priced as its plain form,
    :data:`OP_FAMILIES`); the other ops take :attr:`achieved`. Empty for the published GPUs."""

    def achieved_for(self, op: str) -> float | None:
        """The measured share of the roofline op ``op`` reaches (``None``: none measured for its kind).

        >>> DevicePeaks("cpu", 1, 1, 1, 1, 1, 0, "", op_achieved={"_softmax": 0.25}).achieved_for("_safe_softmax")
        0.25
        """
        return self.op_achieved.get(OP_FAMILIES.get(op, op))

    def flops_per_second(self, dtype: str, tf32: bool = False) -> float:
        """The peak FLOP/s for ops in ``dtype`` (a class of :data:`~lightning_vram.records.work.DTYPE_CLASSES`).

        fp64 and ops without a floating-point input are priced at the fp32 rate (no fp64 figure is kept: a
        training step rarely runs in it, and a GPU's fp64 rate is lower, so such a step is predicted too fast).

        >>> GPU_PEAKS["A100 80GB SXM"].flops_per_second("fp32", tf32=True) / TERA
        156.0
        """
        if dtype == "bf16":
            return self.bf16_flops
        if dtype == "fp16":
            return self.fp16_flops
        return self.tf32_flops if tf32 else self.fp32_flops


def _gpu(
    name: str,
    fp32: float,
    tf32: float,
    half: float,
    bandwidth_gb: float,
    source: str,
    memory_row: str,
    bf16: float | None = None,
) -> DevicePeaks:
    """A GPU's row: rates in TFLOP/s, bandwidth in GB/s.

    ``half`` is the fp16 rate, and the bf16 one unless ``bf16`` gives the rate of a card without bf16 tensor cores.
    """
    return DevicePeaks(
        name,
        fp32 * TERA,
        tf32 * TERA,
        (half if bf16 is None else bf16) * TERA,
        half * TERA,
        bandwidth_gb * GB,
        GPU_OP_OVERHEAD_SECONDS,
        source,
        memory_row=memory_row,
        bf16_tensor_cores=bf16 is None,
    )


OP_FAMILIES: dict[str, str] = {
    "_native_batch_norm_legit_functional": "native_batch_norm",
    "_safe_softmax": "_softmax",
}
"""Ops priced as another op's kind: a variant as its plain form."""

_ROW_12 = "RTX 3060 (12 GB)"
_ROW_16 = "T4 (16 GB)"
_ROW_24 = "RTX 3090 / 4090, A10, L4 (24 GB)"
_ROW_40 = "A100 40GB"
_ROW_80 = "A100 80GB / H100 80GB"
_ROW_141 = "H200 (141 GB)"

GPU_PEAKS: dict[str, DevicePeaks] = {
    peaks.name: peaks
    for peaks in (
        _gpu(
            "RTX 3060",
            12.7,
            12.7,
            25.4,
            360,
            "NVIDIA GeForce RTX 3060 specifications (3,584 CUDA cores at 1.78 GHz boost, 360 GB/s) with the GA10x"
            " tensor-core rates of the NVIDIA Ampere GA102 GPU Architecture whitepaper (dense, fp32 accumulation)",
            _ROW_12,
        ),
        _gpu(
            "T4",
            8.1,
            8.1,
            65,
            320,
            "NVIDIA T4 Tensor Core GPU datasheet (FP32 8.1 TFLOPS, mixed FP16/FP32 65 TFLOPS, 320 GB/s); Turing has"
            " no TF32 or bf16 tensor cores: those run at the fp32 rate",
            _ROW_16,
            bf16=8.1,
        ),
        _gpu(
            "RTX 3090",
            35.6,
            35.6,
            71,
            936,
            "NVIDIA Ampere GA102 GPU Architecture whitepaper, GeForce RTX 3090 (dense, fp32 accumulation; 936 GB/s)",
            _ROW_24,
        ),
        _gpu(
            "RTX 4090",
            82.6,
            82.6,
            165.2,
            1008,
            "NVIDIA Ada Lovelace GPU Architecture whitepaper, GeForce RTX 4090 (dense, fp32 accumulation; 1,008 GB/s)",
            _ROW_24,
        ),
        _gpu(
            "A10",
            31.2,
            62.5,
            125,
            600,
            "NVIDIA A10 Tensor Core GPU datasheet (dense: TF32 62.5, BF16/FP16 125 TFLOPS; 600 GB/s)",
            _ROW_24,
        ),
        _gpu(
            "L4",
            30.3,
            60,
            121,
            300,
            "NVIDIA L4 Tensor Core GPU datasheet (dense, half the sparsity figures: TF32 60, BF16/FP16 121 TFLOPS;"
            " 300 GB/s)",
            _ROW_24,
        ),
        _gpu(
            "A100 40GB SXM",
            19.5,
            156,
            312,
            1555,
            "NVIDIA A100 Tensor Core GPU datasheet (dense: TF32 156, BF16/FP16 312 TFLOPS; 40GB HBM2 1,555 GB/s)",
            _ROW_40,
        ),
        _gpu(
            "A100 80GB SXM",
            19.5,
            156,
            312,
            2039,
            "NVIDIA A100 Tensor Core GPU datasheet (dense: TF32 156, BF16/FP16 312 TFLOPS; 80GB HBM2e 2,039 GB/s)",
            _ROW_80,
        ),
        _gpu(
            "H100 SXM",
            67,
            494.5,
            989.5,
            3350,
            "NVIDIA H100 Tensor Core GPU datasheet, SXM (dense, half the sparsity figures: TF32 494.5, BF16/FP16"
            " 989.5 TFLOPS; 3.35 TB/s)",
            _ROW_80,
        ),
        _gpu(
            "H100 PCIe",
            51,
            378,
            756,
            2000,
            "NVIDIA H100 Tensor Core GPU datasheet, PCIe (dense, half the sparsity figures: TF32 378, BF16/FP16"
            " 756 TFLOPS; 2 TB/s)",
            _ROW_80,
        ),
        _gpu(
            "H200 SXM",
            67,
            494.5,
            989.5,
            4800,
            "NVIDIA H200 Tensor Core GPU datasheet, SXM (dense, half the sparsity figures: TF32 494.5, BF16/FP16"
            " 989.5 TFLOPS; 4.8 TB/s)",
            _ROW_141,
        ),
    )
}
"""Published dense peaks of the GPUs of :data:`~lightning_vram.prediction.devices.COMMON_GPUS`, by card name."""


_NAME_WORDS: dict[str, tuple[str, ...]] = {
    "RTX 3060": ("3060",),
    "T4": ("T4",),
    "RTX 3090": ("3090",),
    "RTX 4090": ("4090",),
    "A10": ("A10",),
    "L4": ("L4",),
    "A100 40GB SXM": ("A100", "40GB"),
    "A100 80GB SXM": ("A100", "80GB"),
    "H100 SXM": ("H100",),
    "H100 PCIe": ("H100", "PCIE"),
    "H200 SXM": ("H200",),
}
"""The words of a CUDA device's name that pick each row of :data:`GPU_PEAKS`."""


def gpu_peaks(name: str) -> DevicePeaks | None:
    """The table's row for a CUDA device named ``name`` (``torch.cuda.get_device_name``), ``None`` if none matches.

    The row whose words are all in the name wins, the one with most words where several are (an H100 is taken
    for the SXM card unless its name says PCIe).

    >>> gpu_peaks("NVIDIA H100 80GB HBM3").name
    'H100 SXM'
    >>> gpu_peaks("NVIDIA A100-SXM4-40GB").name
    'A100 40GB SXM'
    >>> gpu_peaks("Tesla T4").name
    'T4'
    >>> gpu_peaks("NVIDIA GeForce GTX 1080") is None
    True
    """
    spoken = set(name.upper().replace("-", " ").replace("_", " ").split())
    matches = [row for row, words in _NAME_WORDS.items() if spoken.issuperset(words)]
    if not matches:
        return None
    return GPU_PEAKS[max(matches, key=lambda row: len(_NAME_WORDS[row]))]
