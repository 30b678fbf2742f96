"""The operator's own way to the Kubernetes API: the client, Events, TokenReview.

What the rest of the operator imports (only from here): the API client (:class:`KubeApi`, its
:class:`ApiError` and :data:`JsonObject`) and its login (:func:`connection_info`, Kopf's too), the
Event poster every Event goes through (:class:`EventPoster`, the :class:`EventSink` it provides,
:func:`object_ref`), and the agents' and
replicas' token check (:class:`TokenAuthenticator` with its :class:`Verdict`, :class:`Review`,
:class:`ReviewLimited` and the :class:`ReviewCollector` of its metrics).
"""

from gpuwarden.operator.kube.client import ApiError, JsonObject, KubeApi, connection_info
from gpuwarden.operator.kube.events import EventPoster, EventSink, object_ref
from gpuwarden.operator.kube.tokenreview import (
    Review,
    ReviewCollector,
    ReviewLimited,
    TokenAuthenticator,
    Verdict,
)

__all__ = [
    "ApiError",
    "EventPoster",
    "EventSink",
    "JsonObject",
    "KubeApi",
    "Review",
    "ReviewCollector",
    "ReviewLimited",
    "TokenAuthenticator",
    "Verdict",
    "connection_info",
    "object_ref",
]
