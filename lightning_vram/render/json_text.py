"""JSON text for people and programs alike: indented, its long lists one line each.

``json.dumps(indent=2)`` runs Python's own encoder (the C encoder does not indent): 3.2 s for a report holding its
most recent peaks at their most (:data:`~lightning_vram.config.MAX_RECENT_STEPS`, 10**6 steps) on the 2-core machine
the project is built on, against 0.6 s without indentation, and 4 lines a peak. A list of :data:`LONG_LIST` items or
more is encoded by the C encoder, on one line; the rest is indented as ``json.dumps(data, indent=2)`` indents it, and
``json.loads`` reads back the same data either way.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

LONG_LIST = 1000
"""The number of items from which a list is written on one line."""


def indented_json(data: Any) -> str:
    """``json.dumps(data, indent=2)``, with each list of :data:`LONG_LIST` items or more on one line.

    >>> print(indented_json({"steps": [0, 1], "name": "run"}))
    {
      "steps": [
        0,
        1
      ],
      "name": "run"
    }
    >>> indented_json({"steps": list(range(1000))}).splitlines()[1][:23]
    '  "steps": [0, 1, 2, 3,'
    """
    token = uuid.uuid4().hex  # no string of the data's can be the placeholder of a long list
    long_lists: list[str] = []

    def placed(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: placed(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            if len(value) < LONG_LIST:
                return [placed(item) for item in value]
            long_lists.append(json.dumps(value))
            return f"{token}-{len(long_lists) - 1}"
        return value

    text = json.dumps(placed(data), indent=2)
    for index, encoded in enumerate(long_lists):
        text = text.replace(f'"{token}-{index}"', encoded, 1)
    return text
