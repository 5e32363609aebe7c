"""A simulator of PyTorch's CUDA caching allocator: what the device holds (reserved) around the tensors (allocated).

``settings`` reads the allocator's configuration as torch does (``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF``),
``model`` replays a sequence of allocations and frees through torch's own rules (block sizes, pools, best fit,
splitting, merging, expandable segments, release-and-retry at a capacity), ``snapshot`` reads a trace torch recorded
(``torch.cuda.memory._dump_snapshot()``) into such a sequence, with the reserved figures it recorded beside it.
Pure Python: nothing here imports torch. docs/allocator-model.md says which torch source each rule follows.
"""
