"""containerd's filter syntax, as the snapshots API's List sends it.

    selectors := selector ("," selector)*
    selector  := fieldpath [operator value]
    fieldpath := field ("." field)*
    field     := quoted | [A-Za-z0-9_]+
    operator  := "==" | "!=" | "~="
    value     := quoted | [^\\s,]+
    quoted    := "..." with Go escapes, or /.../ or |...| (for regular expressions)

A filter matches when all its selectors match; a list of filters matches when any does (an empty
list matches everything). Snapshot fields: kind, name, parent, labels.KEY (KEY may be quoted to
hold dots: labels."containerd.io/snapshot.ref"). Semantics follow containerd: `==` needs the field
present, `!=` compares the (possibly empty) value, a bare fieldpath tests presence.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from snapshotter.errors import InvalidArgument

# (fieldpath) -> (value, present)
FieldLookup = Callable[[Sequence[str]], tuple[str, bool]]

_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "\\": "\\"}


@dataclass(frozen=True)
class Selector:
    fieldpath: tuple[str, ...]
    operator: str  # "", "==", "!=", "~="
    value: str = ""

    def matches(self, lookup: FieldLookup) -> bool:
        value, present = lookup(self.fieldpath)
        if self.operator == "":
            return present
        if self.operator == "==":
            return present and value == self.value
        if self.operator == "!=":
            return value != self.value
        return re.search(self.value, value) is not None


@dataclass(frozen=True)
class Filter:
    selectors: tuple[Selector, ...]

    def matches(self, lookup: FieldLookup) -> bool:
        return all(s.matches(lookup) for s in self.selectors)


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def fail(self, what: str) -> InvalidArgument:
        return InvalidArgument(f"filter {self.text!r}: {what} at position {self.pos}")

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def skip_space(self) -> None:
        while self.peek().isspace() and self.peek():
            self.pos += 1

    def quoted(self) -> str:
        quote = self.peek()
        self.pos += 1
        out: list[str] = []
        while True:
            ch = self.peek()
            if not ch:
                raise self.fail("unterminated quoted string")
            self.pos += 1
            if ch == quote:
                return "".join(out)
            if ch != "\\":
                out.append(ch)
                continue
            esc = self.peek()
            self.pos += 1
            if esc == quote:
                out.append(quote)
            elif esc in _ESCAPES:
                out.append(_ESCAPES[esc])
            elif esc in ("x", "u", "U"):
                width = {"x": 2, "u": 4, "U": 8}[esc]
                digits = self.text[self.pos:self.pos + width]
                if len(digits) != width or not all(c in "0123456789abcdefABCDEF" for c in digits):
                    raise self.fail(f"bad \\{esc} escape")
                out.append(chr(int(digits, 16)))
                self.pos += width
            elif quote in "/|" and esc:
                out.append("\\" + esc)  # regex escapes pass through untouched
            else:
                raise self.fail(f"bad escape \\{esc}")

    def field(self) -> str:
        if self.peek() in ('"', "/", "|"):
            return self.quoted()
        start = self.pos
        while self.peek() and (self.peek().isascii() and (self.peek().isalnum() or self.peek() == "_")):
            self.pos += 1
        if start == self.pos:
            raise self.fail("expected a field name")
        return self.text[start:self.pos]

    def value(self) -> str:
        if self.peek() in ('"', "/", "|"):
            return self.quoted()
        start = self.pos
        while self.peek() and self.peek() != "," and not self.peek().isspace():
            self.pos += 1
        if start == self.pos:
            raise self.fail("expected a value")
        return self.text[start:self.pos]

    def selector(self) -> Selector:
        self.skip_space()
        path = [self.field()]
        while self.peek() == ".":
            self.pos += 1
            path.append(self.field())
        self.skip_space()
        op = self.text[self.pos:self.pos + 2]
        if op in ("==", "!=", "~="):
            self.pos += 2
            self.skip_space()
            value = self.value()
            if op == "~=":
                try:
                    re.compile(value)
                except re.error as exc:
                    raise self.fail(f"bad regular expression {value!r}: {exc}") from None
            self.skip_space()
            return Selector(tuple(path), op, value)
        if self.peek() not in ("", ","):
            raise self.fail(f"unexpected {self.peek()!r}")
        return Selector(tuple(path), "")

    def parse(self) -> Filter:
        selectors = [self.selector()]
        while self.peek() == ",":
            self.pos += 1
            selectors.append(self.selector())
        if self.pos != len(self.text):
            raise self.fail("trailing input")
        return Filter(tuple(selectors))


def parse_filter(text: str) -> Filter:
    """Parse one filter string; "" matches everything. Raises InvalidArgument naming the filter."""
    if text == "":
        return Filter(())
    return _Parser(text).parse()


def parse_filters(texts: Sequence[str]) -> list[Filter]:
    return [parse_filter(t) for t in texts]


def match_any(filters: Sequence[Filter], lookup: FieldLookup) -> bool:
    """True if any filter matches (or there are none)."""
    return not filters or any(f.matches(lookup) for f in filters)
