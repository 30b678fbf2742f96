"""Which pod owns which GPU and which process: PodResources, cgroups, and the node's pod list.

:class:`PodAttributor` is the entry point; the rest is what it is built from.
"""

from gpuwarden.agent.attribution.attributor import AllocationSource, PodAttributor, PodDirectory, PodLookup
from gpuwarden.agent.attribution.cgroups import (
    HOST,
    CgroupIdentity,
    CgroupReader,
    parse_cgroup_path,
    parse_proc_cgroup,
)
from gpuwarden.agent.attribution.dra import (
    NVIDIA_DRIVER,
    DraGpu,
    DraResolver,
    MigPlacement,
    ResourceSlices,
    ResourceSlicesError,
    SlicesState,
    UnresolvedReason,
    mig_placement,
    published_devices,
)
from gpuwarden.agent.attribution.kubelet import (
    DEFAULT_SOCKET_PATH,
    Allocations,
    DraDevice,
    PodResourcesClient,
    PodResourcesError,
    PodResourcesState,
    allocations_from_response,
    is_nvidia_gpu_resource,
    physical_device,
)
from gpuwarden.agent.attribution.nodepods import NodePods, NodePodsError

__all__ = [
    "DEFAULT_SOCKET_PATH",
    "HOST",
    "NVIDIA_DRIVER",
    "AllocationSource",
    "Allocations",
    "CgroupIdentity",
    "CgroupReader",
    "DraDevice",
    "DraGpu",
    "DraResolver",
    "MigPlacement",
    "NodePods",
    "NodePodsError",
    "PodAttributor",
    "PodDirectory",
    "PodLookup",
    "PodResourcesClient",
    "PodResourcesError",
    "PodResourcesState",
    "ResourceSlices",
    "ResourceSlicesError",
    "SlicesState",
    "UnresolvedReason",
    "allocations_from_response",
    "is_nvidia_gpu_resource",
    "mig_placement",
    "parse_cgroup_path",
    "parse_proc_cgroup",
    "physical_device",
    "published_devices",
]
