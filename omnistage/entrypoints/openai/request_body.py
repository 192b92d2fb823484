"""Request bodies to JSON, with the limits Python's ``json`` module lacks.

``decode_json_body(raw)`` turns the bytes of a request into a JSON value or
raises a 400 ``APIError`` that says what is wrong, for everything the parser
would refuse or choke on:

- not UTF-8 (RFC 8259 requires it between systems), or not JSON at all;
- nested deeper than ``MAX_JSON_DEPTH`` levels: counted by a flat scan before
  parsing, because ``json.loads`` recurses once per level and a 200 KB body of
  brackets would otherwise end in ``RecursionError``;
- an integer literal longer than Python converts (``sys.get_int_max_str_digits``,
  4300 digits by default): reported with the path of the field that holds it;
- a string with a lone UTF-16 surrogate (``"\\ud800"``): valid JSON, but not
  text any tokenizer, template or response can carry; reported with its path.

The size limit is the reader's (``api_server.read_json_body``): it needs the
stream, this needs the whole body.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from omnistage.entrypoints.openai.errors import APIError, bad_request

# Deeper than any real request (chat content parts sit 5 levels down, tool
# schemas a dozen or so), far below where the recursive parser would fail.
MAX_JSON_DEPTH = 64

# A JSON string (escapes included), on UTF-8 bytes: '"' and '\\' never occur
# inside a multi-byte sequence, so the pattern cannot match across characters.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
# A \u escape of a surrogate (D800-DFFF); only escapes can put one into a decoded string.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def decode_json_body(raw: bytes) -> Any:
    """The body's JSON value, or a 400 naming the problem (and the field, where one is at fault)."""
    if not raw:
        raise bad_request("The request body is empty; expected a JSON object", code="invalid_json")
    raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark, which some clients send
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(
            f"The request body is not valid JSON: it is not UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})",
            code="invalid_json",
        ) from None
    # Fewer openers than the limit cannot nest deeper than it: skip the scan.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and (depth := json_depth(raw)) > MAX_JSON_DEPTH:
        raise _too_deep(depth)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # the scan bounds the depth; this only guards a lower interpreter limit
        raise _too_deep(json_depth(raw)) from None
    except ValueError:  # int("9" * 5000): past the interpreter's digit limit
        raise _oversized_int(text) from None
    if _SURROGATE_ESCAPE.search(text):
        _check_unicode(value)
    return value


def json_depth(text: str | bytes) -> int:
    """How deeply the arrays and objects of a JSON text nest, found without recursion.

    Exact for valid JSON; for invalid JSON at least the depth the parser would
    reach before failing (it stops at the first error)."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    # Vectorized (+1 per opener, -1 per closer, deepest running sum): a 16 MB body of brackets takes ~0.3 s.
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), np.int32(1), np.int32(-1))
    return max(int(np.cumsum(steps, dtype=np.int32).max()), 0)


def _too_deep(depth: int) -> APIError:
    return bad_request(
        f"The request body nests JSON {depth} levels deep; at most {MAX_JSON_DEPTH} levels are accepted",
        code="json_too_deep",
    )


class _OversizedInt:
    """Stands in for an integer literal too long to convert, so its field can be found."""

    def __init__(self, digits: str) -> None:
        self.digits = digits


def _oversized_int(text: str) -> APIError:
    def parse_int(s: str) -> Any:
        try:
            return int(s)
        except ValueError:
            return _OversizedInt(s)

    try:
        value = json.loads(text, parse_int=parse_int)
    except ValueError as exc:  # something else the parser refuses
        return bad_request(f"The request body is not valid JSON: {exc}", code="invalid_json")
    for path, item in _walk(value):
        if isinstance(item, _OversizedInt):
            n = len(item.digits.lstrip("-"))
            where = f"Invalid value for {path!r}: " if path else ""
            return bad_request(
                f"{where}an integer literal of {n} digits; no parameter takes numbers that large",
                param=path or None,
                code="invalid_value",
            )
    return bad_request("The request body is not valid JSON: an integer literal is too long", code="invalid_json")


def _check_unicode(value: Any) -> None:
    for path, item in _walk(value):
        if isinstance(item, str) and not _encodable(item):
            raise _invalid_unicode(path, item, "")
        if isinstance(item, dict):
            for key in item:
                if not _encodable(key):
                    raise _invalid_unicode(path, key, "a key of ")


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _invalid_unicode(path: str, s: str, what: str) -> APIError:
    index = next(i for i, ch in enumerate(s) if 0xD800 <= ord(ch) <= 0xDFFF)
    where = f"{what}{path!r}" if path else "the request body"
    return bad_request(
        f"Invalid Unicode in {where}: a lone surrogate U+{ord(s[index]):04X} at character {index}; "
        "strings must be valid Unicode text (surrogates only in \\uD8xx\\uDCxx pairs)",
        param=path or None,
        code="invalid_unicode",
    )


def _walk(value: Any) -> Any:
    """(path, value) for every value of a decoded JSON document, depth first, without recursion.
    Paths read like ``messages[0].content``."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        yield path, item
        if isinstance(item, dict):
            children = [(f"{path}.{k}" if path else str(k), v) for k, v in item.items()]
        elif isinstance(item, list):
            children = [(f"{path}[{i}]", v) for i, v in enumerate(item)]
        else:
            continue
        stack.extend(reversed(children))  # first child first: the error names the first bad field
