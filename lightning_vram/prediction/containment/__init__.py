"""The replay's containment: which objects the user's step can reach, and keeping it to its own copies of them.

The walk (``reach``, ``code_roots``, ``method_reach``, ``construction``, ``user_code``, ``plain_reads``,
``_torch_hooks``) reads the user's code without running it; ``containment``, ``isolation``, ``escapes``, ``deadline``
and ``checkpoint_frames`` act on what it found around each replay. See docs/replay-containment.md.
"""
