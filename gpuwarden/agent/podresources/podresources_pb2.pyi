# mypy: disable-error-code="type-arg"
from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

DESCRIPTOR: _descriptor.FileDescriptor

class AllocatableResourcesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AllocatableResourcesResponse(_message.Message):
    __slots__ = ("cpu_ids", "devices", "memory")
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    CPU_IDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[ContainerDevices]
    cpu_ids: _containers.RepeatedScalarFieldContainer[int]
    memory: _containers.RepeatedCompositeFieldContainer[ContainerMemory]
    def __init__(
        self,
        devices: _Iterable[ContainerDevices | _Mapping] | None = ...,
        cpu_ids: _Iterable[int] | None = ...,
        memory: _Iterable[ContainerMemory | _Mapping] | None = ...,
    ) -> None: ...

class ListPodResourcesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPodResourcesResponse(_message.Message):
    __slots__ = ("pod_resources",)
    POD_RESOURCES_FIELD_NUMBER: _ClassVar[int]
    pod_resources: _containers.RepeatedCompositeFieldContainer[PodResources]
    def __init__(self, pod_resources: _Iterable[PodResources | _Mapping] | None = ...) -> None: ...

class PodResources(_message.Message):
    __slots__ = ("containers", "cpu_ids", "memory", "name", "namespace")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CONTAINERS_FIELD_NUMBER: _ClassVar[int]
    CPU_IDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    name: str
    namespace: str
    containers: _containers.RepeatedCompositeFieldContainer[ContainerResources]
    cpu_ids: _containers.RepeatedScalarFieldContainer[int]
    memory: _containers.RepeatedCompositeFieldContainer[ContainerMemory]
    def __init__(
        self,
        name: str | None = ...,
        namespace: str | None = ...,
        containers: _Iterable[ContainerResources | _Mapping] | None = ...,
        cpu_ids: _Iterable[int] | None = ...,
        memory: _Iterable[ContainerMemory | _Mapping] | None = ...,
    ) -> None: ...

class ContainerResources(_message.Message):
    __slots__ = ("cpu_ids", "devices", "dynamic_resources", "memory", "name")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    CPU_IDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_RESOURCES_FIELD_NUMBER: _ClassVar[int]
    name: str
    devices: _containers.RepeatedCompositeFieldContainer[ContainerDevices]
    cpu_ids: _containers.RepeatedScalarFieldContainer[int]
    memory: _containers.RepeatedCompositeFieldContainer[ContainerMemory]
    dynamic_resources: _containers.RepeatedCompositeFieldContainer[DynamicResource]
    def __init__(
        self,
        name: str | None = ...,
        devices: _Iterable[ContainerDevices | _Mapping] | None = ...,
        cpu_ids: _Iterable[int] | None = ...,
        memory: _Iterable[ContainerMemory | _Mapping] | None = ...,
        dynamic_resources: _Iterable[DynamicResource | _Mapping] | None = ...,
    ) -> None: ...

class ContainerMemory(_message.Message):
    __slots__ = ("memory_type", "size", "topology")
    MEMORY_TYPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    memory_type: str
    size: int
    topology: TopologyInfo
    def __init__(
        self,
        memory_type: str | None = ...,
        size: int | None = ...,
        topology: TopologyInfo | _Mapping | None = ...,
    ) -> None: ...

class ContainerDevices(_message.Message):
    __slots__ = ("device_ids", "resource_name", "topology")
    RESOURCE_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    resource_name: str
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    topology: TopologyInfo
    def __init__(
        self,
        resource_name: str | None = ...,
        device_ids: _Iterable[str] | None = ...,
        topology: TopologyInfo | _Mapping | None = ...,
    ) -> None: ...

class TopologyInfo(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NUMANode]
    def __init__(self, nodes: _Iterable[NUMANode | _Mapping] | None = ...) -> None: ...

class NUMANode(_message.Message):
    __slots__ = ("ID",)
    ID_FIELD_NUMBER: _ClassVar[int]
    ID: int
    def __init__(self, ID: int | None = ...) -> None: ...

class DynamicResource(_message.Message):
    __slots__ = ("claim_name", "claim_namespace", "claim_resources")
    CLAIM_NAME_FIELD_NUMBER: _ClassVar[int]
    CLAIM_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CLAIM_RESOURCES_FIELD_NUMBER: _ClassVar[int]
    claim_name: str
    claim_namespace: str
    claim_resources: _containers.RepeatedCompositeFieldContainer[ClaimResource]
    def __init__(
        self,
        claim_name: str | None = ...,
        claim_namespace: str | None = ...,
        claim_resources: _Iterable[ClaimResource | _Mapping] | None = ...,
    ) -> None: ...

class ClaimResource(_message.Message):
    __slots__ = ("cdi_devices", "device_name", "driver_name", "pool_name", "share_id")
    CDI_DEVICES_FIELD_NUMBER: _ClassVar[int]
    DRIVER_NAME_FIELD_NUMBER: _ClassVar[int]
    POOL_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    SHARE_ID_FIELD_NUMBER: _ClassVar[int]
    cdi_devices: _containers.RepeatedCompositeFieldContainer[CDIDevice]
    driver_name: str
    pool_name: str
    device_name: str
    share_id: str
    def __init__(
        self,
        cdi_devices: _Iterable[CDIDevice | _Mapping] | None = ...,
        driver_name: str | None = ...,
        pool_name: str | None = ...,
        device_name: str | None = ...,
        share_id: str | None = ...,
    ) -> None: ...

class CDIDevice(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: str | None = ...) -> None: ...

class GetPodResourcesRequest(_message.Message):
    __slots__ = ("pod_name", "pod_namespace")
    POD_NAME_FIELD_NUMBER: _ClassVar[int]
    POD_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    pod_name: str
    pod_namespace: str
    def __init__(self, pod_name: str | None = ..., pod_namespace: str | None = ...) -> None: ...

class GetPodResourcesResponse(_message.Message):
    __slots__ = ("pod_resources",)
    POD_RESOURCES_FIELD_NUMBER: _ClassVar[int]
    pod_resources: PodResources
    def __init__(self, pod_resources: PodResources | _Mapping | None = ...) -> None: ...
