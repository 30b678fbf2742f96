"""Generated stubs of the kubelet PodResources v1 gRPC API (see ``hack/gen-podresources.sh``).

Nothing here is written by hand except this file and ``podresources.proto``;
the client that uses them is :mod:`gpuwarden.agent.attribution.kubelet`.
"""
