"""gpuwarden.clients: how gpuwarden reaches the API server and Prometheus with a user's credentials.

What the rest imports (only from here): :func:`load_credentials` (kubectl's way to find them: a
kubeconfig's context, its ``exec`` credential plugin, or the pod's ServiceAccount) and the
:class:`Credentials` it gives; :class:`PrometheusClient` for PromQL queries through a
:class:`PrometheusEndpoint` (token, basic auth, CA, headers); :func:`tls_context` and
:func:`failure`, which both use (a client's TLS, and a request's failure in a few words).
Each failure that is the user's to fix is a :class:`LoginError` or :class:`PrometheusError`, one
line for the user.
"""

from gpuwarden.clients.http import failure, tls_context
from gpuwarden.clients.kubeconfig import IN_CLUSTER, Credentials, LoginError
from gpuwarden.clients.kubeconfig import load as load_credentials
from gpuwarden.clients.prometheus import PrometheusClient, PrometheusEndpoint, PrometheusError

__all__ = [
    "IN_CLUSTER",
    "Credentials",
    "LoginError",
    "PrometheusClient",
    "PrometheusEndpoint",
    "PrometheusError",
    "failure",
    "load_credentials",
    "tls_context",
]
