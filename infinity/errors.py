"""The exception hierarchy of Infinity, one class per protocol error code.

Every failure a user can cause raises a subclass of `InfinityError` whose
message says what to do about it. Each class carries a stable `code` string;
the daemon sends that code over the wire and the client raises the same class
again (`error_from_code`), so a caller catches the same exception whether the
failure happened in its own process or in `infinityd`.
"""

from __future__ import annotations

from typing import ClassVar


class InfinityError(Exception):
    """Base of every error Infinity raises on purpose."""

    code: ClassVar[str] = "internal"


# --- configuration -------------------------------------------------------


class ConfigError(InfinityError):
    """A configuration file, environment variable or flag is unknown or invalid."""

    code = "config"


# --- the I/O engine and the NVMe tier ------------------------------------


class IOEngineError(InfinityError):
    """A read or write failed in the native engine (the message names the file and errno)."""

    code = "io"


class AlignmentError(IOEngineError):
    """A buffer, size or offset handed to the O_DIRECT path is not 4 KiB-aligned."""

    code = "alignment"


class ChecksumError(IOEngineError):
    """Data read back does not match its CRC32C: the stored copy is corrupted."""

    code = "checksum"


class DiskFullError(IOEngineError):
    """The file system refused to grow a store file (ENOSPC, EFBIG or a quota)."""

    code = "disk_full"


class StoreDirectoryError(IOEngineError):
    """A store directory is missing, not a directory, or not writable."""

    code = "store_directory"


# --- the store -------------------------------------------------------------


class StoreError(InfinityError):
    """A request to the tensor store was refused."""

    code = "store"


class NotFoundError(StoreError):
    """No tensor of that name exists in that namespace."""

    code = "not_found"


class AlreadyExistsError(StoreError):
    """A tensor of that name already exists and the request does not replace it."""

    code = "exists"


class OutOfRangeError(StoreError):
    """A read or write reaches past the end of a tensor's extent."""

    code = "out_of_range"


class TierFullError(StoreError):
    """The CPU tier has no room left for the request, even after eviction."""

    code = "tier_full"


class StoreFullError(StoreError):
    """The NVMe tier's configured capacity is used up."""

    code = "store_full"


class TooLargeError(StoreError):
    """A tensor is larger than the CPU tier and cannot be made resident as a whole."""

    code = "too_large"


class LeaseError(StoreError):
    """A lease or reservation is unknown, already released, or held by another client."""

    code = "lease"


class ReadOnlyNamespaceError(StoreError):
    """A write (put, reserve, commit, exclusive get, delete, write stream) to a read-only
    namespace from a client that is not its owner, or after the namespace was sealed."""

    code = "read_only_namespace"


class QuotaExceededError(StoreError):
    """A write would take a namespace past the byte quota it was created with."""

    code = "quota_exceeded"


class LimitExceededError(StoreError):
    """A client asked for more than the daemon gives anyone: more sessions than
    `daemon.max_clients`, more open streams than `daemon.max_streams_per_client`, more requests
    waiting for their replies than `daemon.max_pending_requests_per_client`, more tensors than
    `daemon.max_tensors`, more namespace records than `daemon.max_namespaces`, more namespaces
    in one session than `daemon.max_namespaces_per_client`, more tensors held under its leases
    than `daemon.max_leased_per_client`. Bounds that keep one client from growing the daemon's
    memory or open files without limit."""

    code = "limit_exceeded"


class NamespaceAccessError(StoreError):
    """A request names a private namespace (created with a grant token) that this client was
    not granted: it presents the namespace's token first (`Client.grant_namespace`, or
    `connect(namespace_tokens=...)`), or a wrong token was presented."""

    code = "namespace_access"


class InvalidRequestError(StoreError):
    """A request's arguments are of the right form but not acceptable (bad dtype, shape, name)."""

    code = "invalid_request"


class ModelNotFoundError(NotFoundError):
    """A namespace holds no complete imported model: no manifest `__model__` (never imported,
    or an import that did not finish)."""

    code = "model_not_found"


class QuantizedFormNotFoundError(ModelNotFoundError):
    """The model imported into a namespace has no quantized copy of the form asked for (int8,
    int4): it was imported without `--quantize FORM` (raised by the client, never sent)."""

    code = "quantized_form_not_found"


# --- imported models ---------------------------------------------------------


class ModelFormatError(InfinityError):
    """A model folder cannot be imported: config.json or a shard its index names is missing, a
    safetensors file is truncated or its header is not valid, or a file changed while it was
    read. The message names the file."""

    code = "model_format"


class CheckpointError(InvalidRequestError):
    """A checkpoint folder is not one, is incomplete, or holds the state of another model or
    optimizer than the one it is loaded into (raised by the client, never sent)."""

    code = "checkpoint"


# --- protocol and connection -----------------------------------------------


class ProtocolError(InfinityError):
    """A message could not be decoded or does not follow the protocol's schema."""

    code = "protocol"


class VersionMismatchError(ProtocolError):
    """Client and daemon speak different protocol versions."""

    code = "version"


class AuthenticationError(InfinityError):
    """A hello did not carry the daemon's secret (the `infinityd.secret` file of its runtime
    folder, readable only by the daemon's user): the client runs as another user, or reads
    another daemon's folder."""

    code = "authentication"


class DaemonUnavailableError(InfinityError):
    """No daemon answers at the configured runtime folder, or it went away mid-call."""

    code = "unavailable"


class DaemonAlreadyRunningError(InfinityError):
    """Another infinityd already owns this runtime folder."""

    code = "already_running"


class ForkedClientError(InfinityError):
    """A client object was used in a child process after fork()."""

    code = "forked"


_BY_CODE: dict[str, type[InfinityError]] = {}


def _register(cls: type[InfinityError]) -> None:
    if cls.code in _BY_CODE and _BY_CODE[cls.code] is not cls:
        raise RuntimeError(f"error code {cls.code!r} is used twice")
    _BY_CODE[cls.code] = cls
    for sub in cls.__subclasses__():
        _register(sub)


_register(InfinityError)


def error_from_code(code: str, message: str) -> InfinityError:
    """Rebuild the exception the daemon reported; unknown codes become InfinityError."""
    return _BY_CODE.get(code, InfinityError)(message)


def all_codes() -> dict[str, type[InfinityError]]:
    """Every registered code and its class (the protocol documents these)."""
    return dict(_BY_CODE)
