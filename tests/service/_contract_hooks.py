"""schemathesis hooks for ``tests/service/test_contract.py`` (loaded through
``SCHEMATHESIS_HOOKS``).

A JSON Schema states each field on its own; the wire models also have rules across
fields (``max_nodes >= min_nodes``, ``rank < world_size``, a ``set`` with one value per
key, an envelope that names no '.' segment), written as their own validators, which
raise ``ValueError`` (pydantic's ``value_error``). A body the schema allows but such a
rule refuses is not data the document calls valid, so it is left out of the positive
cases, as are bodies with numbers JSON cannot carry exactly; every other refusal of a
schema-valid body (a type, a bound, a pattern) still fails the run.

A join or wait that the schema allows to hold is sent holding at most :data:`HOLD`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import schemathesis
from pydantic import TypeAdapter, ValidationError

from rallypoint.service._http import effective_routes
from rallypoint.service.app import create_app


def _bodies() -> dict[tuple[str, str], TypeAdapter[Any]]:
    """The body type of every operation, by (method, path template)."""
    found: dict[tuple[str, str], TypeAdapter[Any]] = {}
    for route in effective_routes(create_app()):
        field = getattr(route, "body_field", None)
        if field is None:
            continue
        adapter: TypeAdapter[Any] = TypeAdapter(field.field_info.annotation)
        for method in route.methods:
            found[method.upper(), route.path_format] = adapter
    return found


_BODIES = _bodies()

#: The longest a generated join or wait holds for its seal (its ``wait``, 30 s when left
#: out). A held request answers as a short one does, only later: with the test's seed,
#: three joins held 20 s of a 44 s run (until a last call sealed their rounds), which
#: was the test's wall time spent idle.
HOLD = 0.5


def refused_by_cross_field_rule(method: str, path: str, body: Any) -> bool:
    """Whether the body's only faults are ones its models' own validators found."""
    adapter = _BODIES.get((method.upper(), path))
    if adapter is None:
        return False
    try:
        adapter.validate_json(json.dumps(body))
    except ValidationError as exc:
        return all(error["type"] == "value_error" for error in exc.errors())
    except (TypeError, ValueError):  # not JSON at all: not this rule's business
        return False
    return False


def _numbers(value: Any) -> Iterator[int | float]:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        for item in value:
            yield from _numbers(item)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


def inexact_number(body: Any) -> bool:
    """Whether the body has a number no JSON reader takes exactly (RFC 8259, section 6):
    a float past 2**53, or an integer past int64. schemathesis compares bounds such as
    ``maximum: 2**63 - 1`` in floats, so it calls 2**63 valid; the API does not."""
    return any(
        abs(n) > 2**63 - 1 or (isinstance(n, float) and abs(n) >= 2**53) for n in _numbers(body)
    )


@schemathesis.hook
def filter_case(context: Any, case: Any) -> bool:
    meta = case.meta
    if (
        meta is None
        or not meta.generation.mode.is_positive
        or not isinstance(case.body, (dict, list))
    ):
        return True
    method, path = case.operation.method, case.operation.path
    return not (inexact_number(case.body) or refused_by_cross_field_rule(method, path, case.body))


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    """Lowers a valid ``wait`` of a join or wait (or a left-out one) to :data:`HOLD`;
    an invalid one (a string, -1, 61) is sent as generated."""
    if not case.operation.path.endswith(("/join", "/wait")) or not isinstance(case.body, dict):
        return
    wait = case.body.get("wait", 30.0)
    if isinstance(wait, (int, float)) and not isinstance(wait, bool) and HOLD < wait <= 60:
        case.body["wait"] = HOLD
