"""OpenAI-style errors: one exception type that every layer of the server raises.

Whatever goes wrong with a request -- bad JSON, an unknown model, a broken
image, a prompt longer than the context -- becomes an ``APIError`` carrying the
HTTP status and the four fields of OpenAI's error body, so clients written
against OpenAI parse our errors without special cases.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code

    def to_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, status_code=400, param=param, code=code)


# Names pydantic puts into ``loc`` for union members ("str", "list[str]",
# "function-after[...]"); they are not fields, and a client wants the field path.
_UNION_MEMBER_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_union_member(part: str) -> bool:
    return part in _UNION_MEMBER_NAMES or "[" in part or part.startswith("function-")


def format_loc(loc: tuple[int | str, ...], prefix: str = "") -> str:
    """Render a pydantic ``loc`` as ``messages[0].content`` (the client's view of the field)."""
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _is_union_member(part):
            continue
        else:
            out += f".{part}" if out else part
    return out


def from_validation_error(exc: ValidationError, prefix: str = "") -> APIError:
    """Turn the first pydantic error into a 400 naming the field and the problem.

    A value that fits no member of a union (``stop``: a string or a list of
    strings) gets one error per member; of the first field's, the deepest is
    the one that names the culprit (``stop[1]``, not ``stop``)."""
    errors = exc.errors(include_url=False)
    field_errors = [e for e in errors if tuple(e.get("loc", ()))[:1] == tuple(errors[0].get("loc", ()))[:1]]
    err = max(field_errors, key=lambda e: len(format_loc(tuple(e.get("loc", ())))))  # the first of the deepest
    param = format_loc(tuple(err.get("loc", ())), prefix) or None
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        msg = f"Unrecognized request argument supplied: {param}"
    elif kind == "missing":
        msg = f"Missing required parameter: {param!r}"
    else:
        detail = err.get("msg", "invalid value")
        # Validators raising ValueError get "Value error, " glued in front; the
        # client does not care which mechanism found the problem.
        detail = detail.removeprefix("Value error, ")
        got = err.get("input")
        got_txt = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
        msg = f"Invalid value for {param!r}: {detail}{got_txt}" if param else f"{detail}{got_txt}"
    codes = {"extra_forbidden": "unrecognized_argument", "missing": "missing_required_parameter"}
    return APIError(msg, status_code=400, param=param, code=codes.get(kind, "invalid_value"))
