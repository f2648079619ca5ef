"""Exceptions raised by dart-protocol.

Every exception derives from :class:`DartError` and carries structured fields, so callers can
branch on them without parsing messages. Messages say what went wrong and what to do next.
"""

from __future__ import annotations

from typing import Any


class DartError(Exception):
    """Base class of every error raised by DART code."""


class MessageValidationError(DartError):
    """A message on the wire could not be decoded into the expected schema.

    Attributes:
        expected: Name of the schema (or union) that was expected.
        detail: Human-readable reason, e.g. pydantic's error summary.
        errors: Structured pydantic errors, when available.
    """

    def __init__(self, expected: str, detail: str, errors: list[dict[str, Any]] | None = None) -> None:
        self.expected = expected
        self.detail = detail
        self.errors = errors or []
        super().__init__(f"invalid {expected} message: {detail}")


class ConfigError(DartError):
    """A configuration file or override is invalid.

    Attributes:
        source: File path or ``env`` the bad value came from.
        field: Dotted path of the offending field (``bus.url``), or ``""`` for file-level errors.
    """

    def __init__(self, source: str, field: str, detail: str) -> None:
        self.source = source
        self.field = field
        self.detail = detail
        where = f" field '{field}'" if field else ""
        super().__init__(f"invalid config in {source}{where}: {detail}")


class SuiteError(DartError):
    """A task suite file is missing or invalid.

    Attributes:
        path: The suite file.
        detail: What is wrong with it (naming the task and field).
    """

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        self.detail = detail
        super().__init__(f"task suite {path}: {detail}")


class SubjectError(DartError, ValueError):
    """A subject prefix or token is not a valid NATS subject fragment."""


class BusError(DartError):
    """Base class of messaging errors."""


class BusConnectionError(BusError):
    """Could not connect to (or lost) the NATS server.

    Attributes:
        servers: The server URLs that were tried.
    """

    def __init__(self, servers: list[str], detail: str) -> None:
        self.servers = servers
        super().__init__(
            f"cannot reach NATS at {', '.join(servers)}: {detail}. "
            "Start one with `dart nats` or point bus.url / DART_BUS__URL at a running server."
        )


class BusAuthError(BusConnectionError):
    """The NATS server refused the connection's credentials (authorization violation).

    Attributes:
        servers: The server URLs that were tried.
        user: The user that was refused, or None when the client presented no credentials.
    """

    def __init__(self, servers: list[str], user: str | None, detail: str) -> None:
        self.servers = servers
        self.user = user
        who = f"user {user!r}" if user else "a client without credentials"
        BusError.__init__(
            self,
            f"NATS at {', '.join(servers)} refused {who}: {detail}. Check bus.user and bus.password_file / "
            "bus.password_env (or bus.token_env, bus.creds_file) against the server's users.",
        )


class PermissionDeniedError(BusError):
    """The NATS server refused a publish or subscription outside the user's permissions.

    Attributes:
        user: The connection's user (None without credentials).
        operation: ``publish`` or ``subscribe``.
        subject: The refused subject.
    """

    def __init__(self, user: str | None, operation: str, subject: str) -> None:
        self.user = user
        self.operation = operation
        self.subject = subject
        super().__init__(
            f"NATS refused to let {f'user {user!r}' if user else 'this client'} {operation} {subject!r}: "
            "the subject is outside its permissions (see dart.protocol.permissions)"
        )


class RequestTimeoutError(BusError):
    """A request got no reply within its timeout.

    Attributes:
        subject: The subject the request was sent to.
        timeout_s: The timeout that elapsed, in seconds.
    """

    def __init__(self, subject: str, timeout_s: float) -> None:
        self.subject = subject
        self.timeout_s = timeout_s
        super().__init__(
            f"no reply on '{subject}' within {timeout_s:.3g}s: is a service subscribed, and is it overloaded?"
        )


class NoRespondersError(BusError):
    """A request was sent to a subject with no subscriber."""

    def __init__(self, subject: str) -> None:
        self.subject = subject
        super().__init__(f"no service is listening on '{subject}'")


class RemoteError(BusError):
    """A service answered a request with a typed error reply.

    Attributes:
        subject: The subject of the request.
        code: The error code from the reply (see :class:`dart.protocol.messages.ErrorCode`).
        message: The service's explanation.
        details: Structured details from the reply.
        retryable: Whether the service said the same request may succeed later.
    """

    def __init__(
        self,
        subject: str,
        code: str,
        message: str,
        details: dict[str, Any] | None = None,
        retryable: bool = False,
    ) -> None:
        self.subject = subject
        self.code = code
        self.message = message
        self.details = details or {}
        self.retryable = retryable
        super().__init__(f"'{subject}' answered {code}: {message}")


class StoreError(DartError):
    """Base class of artifact store errors."""


class ArtifactNotFoundError(StoreError, KeyError):
    """The artifact does not exist.

    Attributes:
        uri: The URI that was looked up.
    """

    def __init__(self, uri: str) -> None:
        self.uri = uri
        super().__init__(f"artifact not found: {uri}")

    def __str__(self) -> str:
        return str(self.args[0])


class IntegrityError(StoreError):
    """An artifact's content does not match its recorded sha256.

    Attributes:
        uri: The artifact URI.
        expected: The sha256 recorded at put time (or passed by the caller).
        actual: The sha256 of the bytes read.
    """

    def __init__(self, uri: str, expected: str, actual: str) -> None:
        self.uri = uri
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"artifact {uri} is corrupted: sha256 {actual} != expected {expected}. Re-publish it from its source."
        )


class InvalidURIError(StoreError, ValueError):
    """An artifact URI is malformed or uses an unsupported scheme."""


class ServiceError(BusError):
    """Raised by a request handler to answer with a typed error reply instead of a result.

    The bus turns it into an ``ErrorReply`` carrying the same fields; the caller's
    :meth:`~dart.runtime.bus.Bus.request` then raises :class:`RemoteError` with them.

    Attributes:
        code: An :class:`~dart.protocol.messages.base.ErrorCode` value (``not_found``, ...).
        message: What went wrong and what the caller can do.
        details: Structured context (ids, field errors); JSON values only.
        retryable: Whether repeating the same request later may succeed.
    """

    def __init__(
        self, code: str, message: str, details: dict[str, Any] | None = None, *, retryable: bool = False
    ) -> None:
        self.code = code
        self.message = message
        self.details = details or {}
        self.retryable = retryable
        super().__init__(f"{code}: {message}")


class JetStreamError(BusError):
    """A JetStream operation (stream, consumer, KV bucket or persistent publish) failed.

    Attributes:
        operation: What was attempted, e.g. ``ensure_stream`` or ``js_publish``.
        target: The stream, consumer, bucket or subject it was attempted on.
        detail: The server's or client's reason.
    """

    def __init__(self, operation: str, target: str, detail: str) -> None:
        self.operation = operation
        self.target = target
        self.detail = detail
        super().__init__(f"{operation} on '{target}' failed: {detail}")


class RevisionConflictError(JetStreamError):
    """A compare-and-set KV write lost: the key's revision is not the one the writer read.

    Re-read the key, re-apply the change and retry.

    Attributes:
        key: The KV key.
        expected_revision: The revision the writer expected (0 means "key must not exist").
    """

    def __init__(self, bucket: str, key: str, expected_revision: int) -> None:
        self.key = key
        self.expected_revision = expected_revision
        super().__init__(
            "kv_update",
            f"{bucket}/{key}",
            f"revision is no longer {expected_revision}: another writer changed the key; re-read and retry",
        )


class ConfigValidationError(ConfigError):
    """A config has invalid values or unknown keys; every failing field is listed.

    The first problem fills :attr:`source`, :attr:`field` and :attr:`detail` as for
    :class:`ConfigError`; the message lists the others on following lines.

    Attributes:
        problems: ``(source, field, detail)`` for every failing field, in pydantic's order.
    """

    def __init__(self, problems: list[tuple[str, str, str]]) -> None:
        self.problems = problems
        super().__init__(*problems[0])
        if len(problems) > 1:
            lines = [f"  {len(problems) - 1} more:"]
            for source, field, detail in problems[1:]:
                where = f" (from {source})" if source != self.source else ""
                lines.append(f"  - field '{field}'{where}: {detail}")
            self.args = ("\n".join([str(self.args[0]), *lines]),)


class PayloadTooLargeError(BusError):
    """A message is larger than the bus accepts (``bus.max_message_bytes``, at most the server's ``max_payload``).

    Send large data by reference (put it in the artifact store and send the URI), or raise the
    limit (and the server's ``max_payload`` with it).

    Attributes:
        subject: The subject it was sent to.
        size: The encoded message size, in bytes.
        limit: The limit it exceeds, in bytes.
    """

    def __init__(self, subject: str, size: int, limit: int) -> None:
        self.subject = subject
        self.size = size
        self.limit = limit
        super().__init__(
            f"message of {size} bytes on '{subject}' exceeds the bus limit of {limit} bytes "
            "(bus.max_message_bytes, at most the server's max_payload): send large data by reference "
            "through the artifact store (env.inline_max_bytes for screenshots)"
        )


class StoreAuthError(StoreError):
    """The artifact store rejected the credentials (wrong key, wrong secret, or no permission).

    Attributes:
        endpoint: The store endpoint (``host:port``) that refused the request.
        code: The server's error code, e.g. ``SignatureDoesNotMatch`` or ``AccessDenied``.
    """

    def __init__(self, endpoint: str, code: str, detail: str) -> None:
        self.endpoint = endpoint
        self.code = code
        super().__init__(
            f"artifact store at {endpoint} refused the credentials ({code}: {detail}). Check the access/secret "
            "key (store.access_key_env / store.secret_key_env or the *_file settings) and the bucket policy."
        )


class StoreUnavailableError(StoreError):
    """The artifact store could not be reached (connection refused, timeout, TLS failure).

    Attributes:
        endpoint: The store endpoint that was tried.
    """

    def __init__(self, endpoint: str, detail: str) -> None:
        self.endpoint = endpoint
        super().__init__(
            f"cannot reach the artifact store at {endpoint}: {detail}. Is the S3 server running, and are "
            "store.endpoint and store.secure right?"
        )


class EnvPoolUnreachableError(DartError):
    """No env service of a pool answered the capability query in time.

    Attributes:
        pool: The env pool asked.
        timeout_s: How long it was asked, seconds.
    """

    def __init__(self, pool: str, timeout_s: float, last: str) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        super().__init__(
            f"no env service of pool {pool!r} said what it runs within {timeout_s:g}s ({last}): start the env "
            f"service (dart serve env) on the same bus and prefix, or check data.env_pool"
        )


class NoRunnableTaskError(DartError):
    """An env pool runs none of a suite's tasks.

    Attributes:
        pool: The env pool.
        excluded_by: Requirement -> number of tasks that needed it and the pool lacks.
    """

    def __init__(self, pool: str, provider: str | None, excluded_by: dict[str, int]) -> None:
        self.pool = pool
        self.excluded_by = excluded_by
        top = ", ".join(f"{name} ({n})" for name, n in list(excluded_by.items())[:5])
        where = f" (provider {provider})" if provider else ""
        super().__init__(f"env pool {pool!r}{where} runs none of the suite's tasks; most missing: {top}")
