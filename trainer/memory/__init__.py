"""The memory tier: each node's copies of its ranks' checkpoint files in host shared
memory (:class:`NodeMemory`, owned by the agent, written by its workers), and the peer
replicas other nodes hold of them (:class:`ReplicaServer`, :func:`push`,
:func:`read_peer`).

Runs in the agent (the tier's folder, the replica server) and in every worker (its saves
and restores).
"""

from ._peers import ITEMS_HEADER, ReplicaServer, push, read_peer
from ._tier import INDEX, KEEP, KEEP_ENV, MEMORY_ENV, OFF, NodeMemory, default_root, map_file

__all__ = [
    "INDEX",
    "ITEMS_HEADER",
    "KEEP",
    "KEEP_ENV",
    "MEMORY_ENV",
    "OFF",
    "NodeMemory",
    "ReplicaServer",
    "default_root",
    "map_file",
    "push",
    "read_peer",
]
