"""What each role may do in the run's artifact store: one table, the store's counterpart of the bus's
permission tables (:mod:`dart.protocol.permissions`).

Each role holds its own key pair and may read, write or delete only under the key prefixes listed here
(relative to the store's own prefix, e.g. ``screenshots/`` under ``s3://dart/artifacts``):

========  ===========================================  =====================================
role      reads                                        writes / deletes
========  ===========================================  =====================================
env       screenshots                                  writes screenshots
rollout   screenshots, weights                         writes screenshots (resized prompt images)
train     screenshots, trajectories, weights           writes and deletes weights (retention)
data      everything                                   writes trajectories; deletes trajectories
                                                       and screenshots (retention)
view      everything                                   nothing
run       everything (held-out evaluation, the         writes screenshots (the held-out
          summary's store usage)                       evaluation's desktops)
========  ===========================================  =====================================

Every role may also list the bucket's key names (S3 answers "does the bucket exist" only to a lister).
:func:`s3_policy` turns a role's grants into the IAM policy document an S3 server enforces (SeaweedFS's
``-s3.config`` policies, or a MinIO user policy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from dart.runtime.store.uri import RESERVED_PREFIX

StoreRole = Literal["env", "rollout", "data", "train", "view", "run"]
"""A holder of its own store key pair: the four services, ``dart view`` and the ``dart run`` supervisor."""
STORE_ROLES: tuple[StoreRole, ...] = get_args(StoreRole)
Access = Literal["read", "write", "delete"]

STAGING_PREFIX = f"{RESERVED_PREFIX}staging"
"""Where a streamed upload of unknown digest is staged before its copy to its key (see
:mod:`dart.runtime.store.s3`); only the trainer streams uploads (weight shards)."""


@dataclass(frozen=True)
class StorePrefixes:
    """The key prefixes a run's services use (each the service's own setting; ``dart run`` fills them
    from the run config)."""

    screenshots: str = "screenshots"
    """``env.screenshot_prefix`` (the rollout's prompt images go there too)."""
    trajectories: str = "trajectories"
    """``data.blob_prefix``: stored trajectories and the images they carried inline."""
    weights: str = "weights"
    """``train.weights_prefix``: published weight versions."""


DEFAULT_PREFIXES = StorePrefixes()
"""Every service's default prefixes."""


@dataclass(frozen=True)
class StoreGrant:
    """One right of a role: ``access`` to every key under ``prefix`` (``""``: every key)."""

    prefix: str
    access: frozenset[Access]


def _grant(prefix: str, *access: Access) -> StoreGrant:
    return StoreGrant(prefix.strip("/"), frozenset(access))


def store_grants(role: StoreRole, prefixes: StorePrefixes = DEFAULT_PREFIXES) -> tuple[StoreGrant, ...]:
    """The rights of ``role`` in the store (the table in this module's docstring)."""
    shots, trajs, weights = prefixes.screenshots, prefixes.trajectories, prefixes.weights
    table: dict[StoreRole, tuple[StoreGrant, ...]] = {
        "env": (_grant(shots, "read", "write"),),
        "rollout": (_grant(shots, "read", "write"), _grant(weights, "read")),
        "train": (
            _grant(shots, "read"),
            _grant(trajs, "read"),
            _grant(weights, "read", "write", "delete"),
            _grant(STAGING_PREFIX, "read", "write", "delete"),
        ),
        "data": (_grant("", "read"), _grant(trajs, "write", "delete"), _grant(shots, "delete")),
        "view": (_grant("", "read"),),
        "run": (_grant("", "read"), _grant(shots, "write")),
    }
    return table[role]


_S3_ACTIONS: dict[Access, tuple[str, ...]] = {
    "read": ("s3:GetObject",),
    "write": ("s3:PutObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"),
    "delete": ("s3:DeleteObject",),
}


def s3_policy(
    role: StoreRole, bucket: str, base_prefix: str, prefixes: StorePrefixes = DEFAULT_PREFIXES
) -> dict[str, Any]:
    """The IAM policy document granting ``role`` its rights in ``bucket`` under ``base_prefix`` (the store
    URI's key prefix, ``""`` for the bucket's root)."""
    base = base_prefix.strip("/")
    statements: list[dict[str, Any]] = [
        {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": [f"arn:aws:s3:::{bucket}"]}
    ]
    for grant in store_grants(role, prefixes):
        where = "/".join(p for p in (base, grant.prefix) if p)
        resource = f"arn:aws:s3:::{bucket}/{where}/*" if where else f"arn:aws:s3:::{bucket}/*"
        actions = [
            action for access in ("read", "write", "delete") if access in grant.access for action in _S3_ACTIONS[access]
        ]
        statements.append({"Effect": "Allow", "Action": actions, "Resource": [resource]})
    return {"Version": "2012-10-17", "Statement": statements}
