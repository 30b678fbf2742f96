"""An API server model that keeps Events by name, for the tests of what posts them (the Event poster,
the scaler's Events through it)."""

from __future__ import annotations

from typing import Any

from gpuwarden.operator.kube.client import ApiError


class EventStore:
    """The API server's Events, by name; each request answered as ``answers`` says (then ``ok``).

    ``stored_then_504``: stored, then answered 504 (etcd stalled past the request's timeout);
    ``unreachable``: no answer (status 0); ``forbidden``: 403; ``ok``: 201, or 409 for a name
    already there (what the API server answers a second create of one name).
    """

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)
        self.events: dict[str, dict[str, Any]] = {}
        self.attempts = 0

    async def request(self, method: str, path: str, *, body: dict[str, Any]) -> dict[str, Any]:
        assert (method, path) == ("POST", f"/api/v1/namespaces/{body['metadata']['namespace']}/events")
        self.attempts += 1
        answer = self.answers.pop(0) if self.answers else "ok"
        if answer == "unreachable":
            raise ApiError(0, "POST: ClientConnectorError()")
        if answer == "forbidden":
            raise ApiError(403, "events is forbidden")
        name = body["metadata"]["name"]
        if name in self.events:
            raise ApiError(409, f'events "{name}" already exists')
        self.events[name] = body
        if answer == "stored_then_504":
            raise ApiError(504, "Timeout: request did not complete within requested timeout")
        return body

    def reasons(self) -> list[str]:
        return [e["reason"] for e in self.events.values()]
