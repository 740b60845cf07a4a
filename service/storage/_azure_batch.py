"""Entity-group transactions without thread pools.

azure-core prepares the sub-requests of a multipart (batch) request in a
``ThreadPoolExecutor`` it creates for each batch, again for the changeset inside it,
and once more to read the sub-responses: a dozen threads started and joined per
transaction, for a few header policies per sub-request. In the coordinator, where a
join writes a two-operation transaction and heartbeats are written in batches of 100,
starting those threads was the largest cost of a 1,024-node rendezvous on Azurite (a
third of the process's samples). :func:`install` makes azure-core do the same work in
order, in the calling thread: what each policy does to each sub-request and
sub-response is unchanged, only not in parallel.
"""

from __future__ import annotations

import importlib
from typing import Any

from azure.core.pipeline import Pipeline, PipelineContext, PipelineRequest, PipelineResponse

__all__ = ["install"]

# The modules that bound azure-core's ``_parts_helper`` by name (sync responses).
_PARTS_USERS = ("azure.core.rest._http_response_impl", "azure.core.pipeline.transport._base")


def _prepare_in_order(request: Any) -> None:
    info = request.multipart_mixed_info
    if not info:
        return
    requests, policies, options = info[0], info[1], info[3]
    for sub in requests:
        if sub.multipart_mixed_info:
            _prepare_in_order(sub)  # the changeset's own sub-requests
        pipeline_request = PipelineRequest(sub, PipelineContext(None, **options))
        for policy in policies:
            policy.on_request(pipeline_request)  # sync pipeline: plain calls


def _parts_in_order(response: Any) -> Any:
    if not response.content_type or not response.content_type.startswith("multipart/mixed"):
        raise ValueError("You can't get parts if the response is not multipart/mixed")
    responses = response._get_raw_parts()
    if response.request.multipart_mixed_info:
        policies = response.request.multipart_mixed_info[1]
        for part in responses:
            context = PipelineContext(None)
            pipeline_request = PipelineRequest(part.request, context)
            pipeline_response = PipelineResponse(part.request, part, context=context)
            for policy in policies:
                policy.on_response(pipeline_request, pipeline_response)
    return responses


def install() -> None:
    """Makes azure-core handle batch sub-requests and sub-responses in order
    (idempotent). Leaves any part whose shape differs from azure-core 1.x's untouched."""
    current = Pipeline.__dict__.get("_prepare_multipart_mixed_request")
    if isinstance(current, staticmethod) and current.__func__ is not _prepare_in_order:
        Pipeline._prepare_multipart_mixed_request = staticmethod(_prepare_in_order)  # type: ignore[method-assign]
    for name in _PARTS_USERS:
        module = importlib.import_module(name)
        helper = getattr(module, "_parts_helper", None)
        if helper is not None and helper.__name__ == "_parts_helper":
            module._parts_helper = _parts_in_order  # type: ignore[attr-defined]
