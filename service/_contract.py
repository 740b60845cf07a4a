"""The OpenAPI document as a contract: every status each route answers, the error codes
it may carry, who may call it, and its limits.

Routes declare the errors their own code raises: ``responses=errors(UnknownJob, ...)``.
Dependencies declare theirs with :func:`raises` (the token check, the id checks, the
storage behind the app's state), so every route that uses one inherits them. And
:func:`install` has ``app.openapi()`` add what a route's shape implies:

- a body: 400 ``malformed_json`` and 413 ``body_too_large`` (which names the route's
  limit in bytes);
- a body or parameters: 422 ``invalid_request``, with ``detail``;
- path parameters: 404 ``not_found`` (a value with '/' leaves the route);
- the ``X-Rallypoint-Credential`` header: 403 ``invalid_credential``, and the node
  credential's security scheme, required together with the token;
- a dependency that raises ``Unauthorized``: the token's two schemes (bearer or
  ``X-Rallypoint-Token``) and 401, when the coordinator has a token;
- a ``default`` response (the envelope, which answers with other operations' replies):
  error statuses with any code.

Each error status is documented with the ``ErrorBody`` schema, its ``code`` narrowed to
the codes the route may send with it. ``tests/service/test_contract.py`` runs schemathesis
against a served coordinator, so a route that answers what its document does not say
fails the suite.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.dependencies.models import Dependant

from rallypoint.client import codes
from rallypoint.client.models import ErrorBody

from ._http import body_limit, effective_routes
from .errors import Forbidden, RallypointServiceError, Unauthorized

__all__ = ["errors", "install", "raises"]

F = TypeVar("F", bound=Callable[..., Any])
Errors = type[RallypointServiceError]

_RAISES = "__rallypoint_raises__"
# Carries a declaration's codes from errors() to install(), which removes it.
_CODES = "x-rallypoint-codes"
_REF = "#/components/schemas/"
_TOKEN_SCHEMES = ("bearerToken", "tokenHeader")
_CREDENTIAL_SCHEME = "nodeCredential"
SECURITY_SCHEMES: dict[str, dict[str, Any]] = {
    "bearerToken": {
        "type": "http",
        "scheme": "bearer",
        "description": "The admin token, or a token scoped to a job (trainer or reader).",
    },
    "tokenHeader": {
        "type": "apiKey",
        "in": "header",
        "name": "X-Rallypoint-Token",
        "description": "The same token, bare, where a gateway (an AzureML endpoint) "
        "takes Authorization for its own key; it wins over Authorization.",
    },
    _CREDENTIAL_SCHEME: {
        "type": "apiKey",
        "in": "header",
        "name": "X-Rallypoint-Credential",
        "description": "The node's credential from its join (at most 128 characters): "
        "a request that acts for a node carries it besides the token.",
    },
}
# A route that takes this header (rallypoint.client.CREDENTIAL_HEADER) acts for a node.
_CREDENTIAL_HEADER = SECURITY_SCHEMES[_CREDENTIAL_SCHEME]["name"].lower()
_VALIDATION_ISSUE = {
    "title": "ValidationIssue",
    "type": "object",
    "required": ["loc", "msg"],
    "properties": {
        "loc": {"type": "array", "items": {"type": "string"}, "title": "Loc"},
        "msg": {"type": "string", "title": "Msg"},
    },
}


def raises(*errors: Errors) -> Callable[[F], F]:
    """Declares the errors a dependency raises, for every route that uses it.

    Args:
        errors: Service error classes; each is documented under its ``status``.
    """

    def mark(call: F) -> F:
        setattr(call, _RAISES, (*getattr(call, _RAISES, ()), *errors))
        return call

    return mark


def errors(*errors: Errors) -> dict[int | str, dict[str, Any]]:
    """A route's ``responses=`` for the errors its own code raises: each status with
    the ``ErrorBody`` schema and the codes it may carry.

    Args:
        errors: Service error classes (``UnknownJob``, ``StaleGeneration``, ...).
    """
    by_status: dict[int, set[str]] = {}
    for error in errors:
        by_status.setdefault(error.status, set()).add(error.code)
    return {
        status: {"model": ErrorBody, "description": _describe(sorted(found)), _CODES: sorted(found)}
        for status, found in by_status.items()
    }


def install(app: FastAPI) -> None:
    """Makes ``app.openapi()`` the complete contract (see the module docstring); the
    coordinator's token setting decides whether routes declare the token's security."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _complete(app, generate())
        return app.openapi_schema  # type: ignore[return-value]  # set by generate()

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override


def _describe(found: Iterable[str] | None) -> str:
    if found is None:
        return "An error: see `code`"
    return "; ".join(f"`{code}`: {codes.CODES[code].partition(': ')[2]}" for code in found)


def _walk(dependant: Dependant) -> Iterator[Dependant]:
    yield dependant
    for sub in dependant.dependencies:
        yield from _walk(sub)


def _complete(app: FastAPI, schema: dict[str, Any]) -> None:
    token = getattr(app.state, "settings", None) is None or app.state.settings.token is not None
    components = schema.setdefault("components", {})
    models = components.setdefault("schemas", {})
    body = models.setdefault(
        "ErrorBody", ErrorBody.model_json_schema(ref_template=_REF + "{model}")
    )
    # The one list, in the document (the client's model keeps a plain string: a newer
    # coordinator's code must not fail an older client's parsing).
    body["properties"]["code"]["enum"] = sorted(codes.CODES)
    models["ValidationIssue"] = _VALIDATION_ISSUE
    schemes = components.setdefault("securitySchemes", {})
    for route in effective_routes(app):
        if getattr(route, "dependant", None) is None or not getattr(
            route, "include_in_schema", False
        ):
            continue
        for method in route.methods or ():
            operation = schema["paths"].get(route.path_format, {}).get(method.lower())
            if operation is not None:
                _operation(route, operation, token, schemes)
    # FastAPI's own 422 body, which no reply of the coordinator has.
    models.pop("HTTPValidationError", None)
    models.pop("ValidationError", None)


def _operation(route: Any, operation: dict[str, Any], token: bool, schemes: dict[str, Any]) -> None:
    found: dict[int, set[str] | None] = {}

    def add(status: int, more: Iterable[str] | None) -> None:
        if more is None or found.get(status, set()) is None:
            found[status] = None
        else:
            found[status] = {*(found.get(status) or ()), *more}

    for status, declared in (route.responses or {}).items():
        if str(status).isdigit() and int(status) >= 400:
            add(int(status), declared.get(_CODES))
    params: list[Any] = []
    for dependant in _walk(route.dependant):
        for error in getattr(dependant.call, _RAISES, ()):
            add(error.status, [error.code])
        params += dependant.path_params + dependant.query_params
        params += dependant.header_params + dependant.cookie_params
    path_params = [p for d in _walk(route.dependant) for p in d.path_params]
    credential = any(p.alias.lower() == _CREDENTIAL_HEADER for p in params)
    if route.body_field is not None:
        add(400, [codes.MALFORMED_JSON])
        add(413, [codes.BODY_TOO_LARGE])
    if route.body_field is not None or params:
        add(422, [codes.INVALID_REQUEST])
    if path_params:
        add(404, [codes.NOT_FOUND])
    if credential:
        add(403, [codes.INVALID_CREDENTIAL])
    secured = any(
        status == Unauthorized.status and (c is None or Unauthorized.code in c)
        for status, c in found.items()
    )
    if not token:  # every caller is the operator: nothing refuses a token
        for error in (Unauthorized, Forbidden):
            kept = found.get(error.status)
            if kept is not None:
                kept.discard(error.code)
                if not kept:
                    del found[error.status]

    responses: dict[str, Any] = operation.setdefault("responses", {})
    if "default" in responses:  # it passes other operations' replies on (the envelope)
        found = dict.fromkeys(found)
    for status in [s for s in responses if s.isdigit() and int(s) >= 400]:
        del responses[status]
    for status, found_codes in sorted(found.items()):
        responses[str(status)] = _response(status, found_codes)
    if found.get(413) is not None:  # the envelope's operations meet their own limits
        responses["413"]["description"] += f": {body_limit(route.path_format)} bytes here"

    requirement: dict[str, list[str]] = {_CREDENTIAL_SCHEME: []} if credential else {}
    alternatives = [{s: [], **requirement} for s in _TOKEN_SCHEMES] if secured and token else []
    if credential and not alternatives:
        alternatives = [requirement]
    if alternatives:
        operation["security"] = alternatives
        for alternative in alternatives:
            for name in alternative:
                schemes[name] = SECURITY_SCHEMES[name]
    if credential:  # declared once, as the security scheme
        operation["parameters"] = [
            p
            for p in operation.get("parameters", [])
            if not (p.get("in") == "header" and p["name"].lower() == _CREDENTIAL_HEADER)
        ]
        if not operation["parameters"]:
            del operation["parameters"]


def _response(status: int, found: set[str] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"$ref": _REF + "ErrorBody"}
    if found is not None:
        narrowed: dict[str, Any] = {"code": {"type": "string", "enum": sorted(found)}}
        if found == {codes.INVALID_REQUEST} and status == 422:
            narrowed["detail"] = {"type": "array", "items": {"$ref": _REF + "ValidationIssue"}}
        body = {"allOf": [body, {"type": "object", "properties": narrowed}]}
        if "detail" in narrowed:
            body["allOf"][1]["required"] = ["detail"]
    return {
        "description": _describe(None if found is None else sorted(found)),
        "content": {"application/json": {"schema": body}},
    }
