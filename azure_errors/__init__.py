"""Azure SDK exceptions, read once for the coordinator and for trainers.

Both sides call Azure Storage through its SDKs (the coordinator's storage adapters, a
trainer's transfers through SAS URLs), and both must read a failure alike: Azure's error
code first, then azure-core's exception class, then the HTTP status. :func:`classify` is
that one table; it answers with the codes both sides share already
(:mod:`rallypoint.client.codes`). Each side states once which of its exceptions each code
becomes, and wraps its SDK calls in :func:`translated`.

azure-core is imported only when :func:`translated` is entered or :func:`classify` is
called, so importing this package costs nothing and the base install can import it.

Example::

    from rallypoint.azure_errors import Failure, translated

    def transfer_error(what: str, failure: Failure) -> TransferError:
        return BY_CODE.get(failure.code, TransferError)(f"{what}: {failure.detail}")

    with translated(url_without_sas, transfer_error):
        blob.upload_blob(data, overwrite=True)
"""

from ._translate import CODES, Failure, azure_code, classify, lease_failure, translated

__all__ = ["CODES", "Failure", "azure_code", "classify", "lease_failure", "translated"]
