"""A YAML subset parser for our own manifests (PyYAML is not a dependency of the project).

Supported, and all deploy/ uses: `---` separated documents; full-line `#` comments; block
mappings (`key: value`, `key:` + nested block); block sequences (`- scalar`, `- key: value` +
more keys of that mapping indented under it); literal block scalars (`key: |`, clip chomping);
scalars: "double-quoted" (JSON escapes), 'single-quoted', true/false, null/~, integers, floats,
plain strings; flow `[...]`/`{...}` only when the text is valid JSON. Anything else (anchors,
tags, folded scalars, inline comments after a value) raises ValueError rather than guessing.
"""

from __future__ import annotations

import json
import re
from typing import Any

_INT = re.compile(r"^[-+]?[0-9]+$")
_FLOAT = re.compile(r"^[-+]?([0-9]+\.[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$")
_KEY = re.compile(r'^("(?:[^"\\]|\\.)*"|[^\s:#"\'\-][^:]*?|-[^\s:][^:]*?):(?:\s+(.*))?$')


def _scalar(text: str, lineno: int) -> Any:
    t = text.strip()
    if t in ("", "null", "~"):
        return None
    if t.startswith('"'):
        return json.loads(t)
    if t.startswith("'"):
        if len(t) < 2 or not t.endswith("'"):
            raise ValueError(f"line {lineno}: unterminated single-quoted string")
        return t[1:-1].replace("''", "'")
    if t[0] in "[{":
        return json.loads(t)
    if t[0] in "&*!|>%@`" or " #" in t:
        raise ValueError(f"line {lineno}: unsupported YAML: {t!r}")
    if t in ("true", "false"):
        return t == "true"
    if _INT.match(t):
        return int(t)
    if _FLOAT.match(t):
        return float(t)
    return t


def _key_value(content: str) -> tuple[str, str] | None:
    m = _KEY.match(content)
    if m is None:
        return None
    key = json.loads(m.group(1)) if m.group(1).startswith('"') else m.group(1).strip()
    return key, (m.group(2) or "").strip()


def _is_item(content: str) -> bool:
    return content == "-" or content.startswith("- ")


class _Doc:
    def __init__(self, raw: list[tuple[int, str]]) -> None:
        self.raw = raw  # (lineno, line) of one document
        self.pos = 0
        self.pending: tuple[int, int, str] | None = None  # a "- key: v" line re-read as "key: v"

    def peek(self) -> tuple[int, int, str] | None:
        """The next meaningful line as (lineno, indent, content), skipping blanks and comments."""
        if self.pending is not None:
            return self.pending
        while self.pos < len(self.raw):
            n, line = self.raw[self.pos]
            if "\t" in line[: len(line) - len(line.lstrip())]:
                raise ValueError(f"line {n}: tab in indentation")
            s = line.strip()
            if s and not s.startswith("#"):
                return n, len(line) - len(line.lstrip(" ")), s
            self.pos += 1
        return None

    def take(self) -> None:
        if self.pending is not None:
            self.pending = None
        else:
            self.pos += 1

    def block(self, indent: int) -> Any:
        nxt = self.peek()
        assert nxt is not None
        return self.seq(indent) if _is_item(nxt[2]) else self.mapping(indent)

    def seq(self, indent: int) -> list[Any]:
        out: list[Any] = []
        while (nxt := self.peek()) is not None and nxt[1] >= indent:
            n, ind, content = nxt
            if ind != indent or not _is_item(content):
                raise ValueError(f"line {n}: expected a sequence item at indent {indent}")
            rest = content[1:].strip()
            self.take()
            if not rest:
                child = self.peek()
                if child is None or child[1] <= indent:
                    out.append(None)
                else:
                    out.append(self.block(child[1]))
            elif _key_value(rest) is not None:
                self.pending = (n, indent + 2, rest)
                out.append(self.mapping(indent + 2))
            else:
                out.append(_scalar(rest, n))
        return out

    def mapping(self, indent: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        while (nxt := self.peek()) is not None and nxt[1] >= indent:
            n, ind, content = nxt
            kv = _key_value(content)
            if ind != indent or kv is None:
                raise ValueError(f"line {n}: expected 'key: value' at indent {indent}, got {content!r}")
            key, value = kv
            if key in out:
                raise ValueError(f"line {n}: duplicate key {key!r}")
            self.take()
            if value == "|":
                out[key] = self.literal(indent, n)
                continue
            if value:
                out[key] = _scalar(value, n)
                continue
            child = self.peek()
            if child is not None and (child[1] > indent or (child[1] == indent and _is_item(child[2]))):
                out[key] = self.block(child[1])
            else:
                out[key] = None
        return out

    def literal(self, parent: int, n: int) -> str:
        """A `|` block: the following lines indented deeper than `parent` (blank lines kept)."""
        assert self.pending is None
        body: list[str] = []
        block_indent: int | None = None
        while self.pos < len(self.raw):
            _ln, line = self.raw[self.pos]
            if line.strip():
                ind = len(line) - len(line.lstrip(" "))
                if ind <= parent:
                    break
                if block_indent is None:
                    block_indent = ind
                if ind < block_indent:
                    raise ValueError(f"line {_ln}: literal block line less indented than its first")
                body.append(line[block_indent:])
            else:
                body.append("")
            self.pos += 1
        if block_indent is None:
            raise ValueError(f"line {n}: empty literal block")
        while body and body[-1] == "":
            body.pop()
        return "\n".join(body) + "\n"


def load_all(text: str) -> list[Any]:
    """Every non-empty document of `text`."""
    docs: list[list[tuple[int, str]]] = [[]]
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.rstrip() == "---":
            docs.append([])
        else:
            docs[-1].append((lineno, line))
    out = []
    for raw in docs:
        doc = _Doc(raw)
        first = doc.peek()
        if first is None:
            continue
        out.append(doc.block(first[1]))
        left = doc.peek()
        if left is not None:
            raise ValueError(f"line {left[0]}: unexpected content {left[2]!r}")
    return out
