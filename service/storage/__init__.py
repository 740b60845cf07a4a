"""Storage ports of the coordinator and their adapters.

Two narrow ports — :class:`Table` (entities, partition queries, ETag compare-and-swap,
small batches) and :class:`BlobStore` (objects, prefix listing, signed URLs) — each with
an Azure adapter and an embedded local one. :func:`open_storage` picks the backend.
"""

from ._blob import Access, BlobInfo, BlobStore, Data
from ._budget import Health, each_try_within, remaining, within
from ._names import check_blob_name, check_blob_prefix, check_entity, check_key
from ._shared_batch import SharedBatches
from ._storage import DEFAULT_STORAGE, AzureStorage, LocalStorage, Storage, open_storage
from ._table import BatchOp, Cond, Entity, Page, Table, Value


def use_batch_path() -> bool:
    """Makes azure-core send table transactions by the in-order batch path, on the
    releases it was tested on (process-wide: ``rallypoint serve`` calls it at start);
    whether it is in use. See ``_azure_batch``."""
    from ._azure_batch import install

    return install()


__all__ = [
    "DEFAULT_STORAGE",
    "Access",
    "AzureStorage",
    "BatchOp",
    "BlobInfo",
    "BlobStore",
    "Cond",
    "Data",
    "Entity",
    "Health",
    "LocalStorage",
    "Page",
    "SharedBatches",
    "Storage",
    "Table",
    "Value",
    "check_blob_name",
    "check_blob_prefix",
    "check_entity",
    "check_key",
    "each_try_within",
    "open_storage",
    "remaining",
    "use_batch_path",
    "within",
]
