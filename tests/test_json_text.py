"""The report's JSON text: what ``json.dumps(indent=2)`` writes, with long lists on one line each, read back alike."""

from __future__ import annotations

import json
import math

from lightning_vram.render.json_text import LONG_LIST, indented_json


def test_data_without_long_lists_is_written_as_json_dumps_indents_it() -> None:
    data = {"a": [1, 2.5, None, True], "b": {"c": "é \u2028 \x00", "d": [], "e": {}}, "f": [[{"g": -1}]], 3: "key"}
    assert indented_json(data) == json.dumps(data, indent=2)


def test_long_lists_anywhere_are_one_line_each_and_read_back_the_same() -> None:
    points = [{"step": step, "peak_bytes": 2**47 + step} for step in range(LONG_LIST)]
    data = {
        "summary": {"recent_peaks": points, "short": [1, 2]},
        "series": [list(range(LONG_LIST + 5)), (0.5,) * LONG_LIST],
        "text": "a string that looks like nothing special",
        "nan": math.inf,
    }
    text = indented_json(data)
    assert json.loads(text) == json.loads(json.dumps(data))
    lines = text.splitlines()
    assert len(lines) < 30  # 3 long lists on a line each, the rest indented
    assert any(line.startswith('    "recent_peaks": [{"step": 0, ') for line in lines)
    assert '    "short": [\n      1,\n      2\n    ]' in text


def test_a_string_of_the_data_like_a_placeholder_stays_as_it_was() -> None:
    data = {"long": list(range(LONG_LIST)), "name": "0", "other": "-0"}
    assert json.loads(indented_json(data)) == data
