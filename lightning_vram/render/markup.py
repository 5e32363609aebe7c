r"""Markdown that text from the user's model cannot break: escaping, code spans, and the subset advice is written in.

Module names, class names, device names and error messages come from the user's code. In Markdown a backtick ends a
code span, ``|`` ends a table cell, a line break ends a table row and ``<`` starts raw HTML, which a Markdown
renderer shows live. Every such string enters Markdown through :func:`escape_markdown` (plain text) or
:func:`code_span` (code), both of which keep it on one line.

On a console, :func:`printable` keeps such a string on its line and stops it from driving the terminal.

Advice titles and details are written in a small subset of Markdown (inline code, bold, fenced code blocks) and may
quote module names. :func:`advice_tokens` reads that subset, the same way for the Markdown and the HTML report, and
:func:`safe_markdown` writes it back with every piece escaped, so a quoted name that breaks its code span still
renders as text.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_SPECIAL = re.compile(r"[\\`*\[\]<>&|~$#]|(?<![^\W_])_|_(?![^\W_])")
"""Characters that can start Markdown (or GitHub math) inline; ``_`` only where it can start emphasis."""
_LINE_START = re.compile(r"^(\s*)([-+=]|\d+(?=[.)]))", re.MULTILINE)
"""A list item, setext underline or ordered-list number at the start of a line."""
_FENCED_BLOCK = re.compile(r"```(\w*)\n(.*?)\n?```", re.DOTALL)
_INLINE = re.compile(r"(?<!`)(?P<fence>`+)(?!`)(?P<code>.+?)(?<!`)(?P=fence)(?!`)|\*\*(?P<bold>[^*]+)\*\*", re.DOTALL)
_BACKTICK_RUN = re.compile(r"`+")


def one_line(text: str) -> str:
    r"""``text`` with its line breaks written as ``\n`` and ``\r``, so that it cannot end a line of Markdown.

    >>> print(one_line("a\nb"))
    a\nb
    """
    return text.replace("\r", "\\r").replace("\n", "\\n")


def printable(text: str) -> str:
    r"""``text`` with each character a terminal would act on (line breaks, escape sequences) written as an escape.

    For plain text on a console: a module name cannot start a new line, clear the screen or recolour it.

    >>> print(printable("a\nb\x1b[2J c"))
    a\nb\x1b[2J c
    """
    if text.isprintable():
        return text
    return "".join(character if character.isprintable() else repr(character)[1:-1] for character in text)


def escape_markdown(text: str, keep_lines: bool = False) -> str:
    r"""``text`` as literal Markdown text: every character that could start markup is backslash-escaped.

    On one line unless ``keep_lines`` (then a line's leading list or heading marker is escaped too).

    >>> print(escape_markdown("a|b <i>x</i> `c` snake_case _x_ $y$"))
    a\|b \<i\>x\</i\> \`c\` snake_case \_x\_ \$y\$
    """
    if not keep_lines:
        text = one_line(text)
    escaped = _SPECIAL.sub(lambda match: "\\" + match.group(0), text)
    if keep_lines:
        escaped = _LINE_START.sub(_escape_line_start, escaped)
    return escaped


def _escape_line_start(match: re.Match[str]) -> str:
    indent, marker = match.group(1), match.group(2)
    return f"{indent}{marker}\\" if marker[0].isdigit() else f"{indent}\\{marker}"


def code_span(text: str, in_table: bool = False) -> str:
    r"""``text`` as an inline code span that no character in it can end early, on one line.

    The fence is one backtick longer than the longest run of backticks inside. In a table cell (``in_table``),
    ``|`` is escaped as GitHub-flavoured tables need even inside code.

    >>> print(code_span("blocks.0"), code_span("a`b"), code_span("`x"), code_span("x|y", in_table=True))
    `blocks.0` ``a`b`` `` `x `` `x\|y`
    """
    text = one_line(text)
    if not text:
        return ""
    fence = "`" * (max((len(run) for run in _BACKTICK_RUN.findall(text)), default=0) + 1)
    pad = " " if text[0] in "` " or text[-1] in "` " else ""
    if in_table:
        text = text.replace("|", "\\|")
    return f"{fence}{pad}{text}{pad}{fence}"


def code_block(text: str, language: str = "") -> str:
    r"""A fenced code block holding ``text``; the fence is longer than any run of backticks inside.

    >>> print(code_block("x = 1", "python"))
    ```python
    x = 1
    ```
    """
    fence = "`" * max(3, max((len(run) for run in _BACKTICK_RUN.findall(text)), default=0) + 1)
    return f"{fence}{language}\n{text}\n{fence}"


class Token(NamedTuple):
    """A piece of advice Markdown: ``kind`` is ``text``, ``code``, ``bold`` or ``block`` (``language`` for blocks)."""

    kind: str
    text: str
    language: str = ""


def advice_tokens(markdown: str) -> list[Token]:
    r"""The pieces of advice Markdown: fenced code blocks, then inline code and bold in the text between them.

    >>> [tuple(token) for token in advice_tokens("Use `x` **now**:\n```python\nf(x)\n```")]
    [('text', 'Use ', ''), ('code', 'x', ''), ('text', ' ', ''), ('bold', 'now', ''), ('text', ':', ''), ('block', 'f(x)', 'python')]
    """  # noqa: E501 -- the doctest's output is one line
    tokens: list[Token] = []
    position = 0
    for block in _FENCED_BLOCK.finditer(markdown):
        tokens += _inline_tokens(markdown[position : block.start()].strip("\n"))
        tokens.append(Token("block", block.group(2), block.group(1)))
        position = block.end()
    tokens += _inline_tokens(markdown[position:].strip("\n"))
    return tokens


def _inline_tokens(text: str) -> list[Token]:
    tokens: list[Token] = []
    position = 0
    for match in _INLINE.finditer(text):
        if match.start() > position:
            tokens.append(Token("text", text[position : match.start()]))
        if match.group("bold") is not None:
            tokens.append(Token("bold", match.group("bold")))
        else:
            tokens.append(Token("code", match.group("code")))
        position = match.end()
    if position < len(text):
        tokens.append(Token("text", text[position:]))
    return tokens


def safe_markdown(markdown: str, keep_lines: bool = True) -> str:
    r"""Advice Markdown written back with every piece escaped: what the text quotes is never read as markup.

    ``keep_lines=False`` puts it on one line (a title that becomes a heading).

    >>> print(safe_markdown("Checkpoint `a`<img src=x>` to save 5 MiB"))
    Checkpoint `a`\<img src=x\>\` to save 5 MiB
    """
    parts = []
    for token in advice_tokens(markdown):
        if token.kind == "block":
            parts.append(f"\n{code_block(token.text, token.language)}\n")
        elif token.kind == "code":
            parts.append(code_span(token.text))
        elif token.kind == "bold":
            parts.append(f"**{escape_markdown(token.text)}**")
        else:
            parts.append(escape_markdown(token.text, keep_lines=keep_lines))
    text = "".join(parts).strip("\n")
    return text if keep_lines else one_line(text)
