"""The store identities of the compose stack (deploy/docker-compose.yml): one per role, each bounded by the
IAM policy its grants (:mod:`dart.runtime.store.grants`) give it in the stack's run config.

The S3 server admits ``dart-<role>`` with the secret ``DART_S3_<ROLE>_SECRET_KEY`` of ``deploy/.env`` and
the policy in ``deploy/s3/policies/<role>.json``; each container gets its own role's secret only. Those
policy files are generated here (a test keeps them equal to the grants)::

    uv run python -m dart.cli.stack.compose_store deploy/dart/run.yaml deploy/s3/policies
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dart.cli.stack.config import RunConfig
from dart.cli.stack.embedded_store import run_store_prefixes
from dart.protocol.config import load_config
from dart.runtime.store.grants import StoreRole, s3_policy
from dart.runtime.store.uri import parse_store_uri

COMPOSE_STORE_ROLES: tuple[StoreRole, ...] = ("env", "rollout", "data", "train", "view")
"""The stack's store identities: its four services and ``dart view`` run against it."""


def access_key(role: StoreRole) -> str:
    """The access key id of ``role`` in the stack (an id, not a secret: the secret key authenticates)."""
    return f"dart-{role}"


def secret_variable(role: StoreRole) -> str:
    """The ``deploy/.env`` variable holding ``role``'s secret key."""
    return f"DART_S3_{role.upper()}_SECRET_KEY"


def compose_store_policies(config: RunConfig) -> dict[StoreRole, dict[str, Any]]:
    """Each stack role's IAM policy in ``config``'s store (its bucket, prefix and services' key prefixes)."""
    if config.store is None:
        raise ValueError("the compose stack's run config names no store (store.uri)")
    location = parse_store_uri(config.store.uri)
    prefixes = run_store_prefixes(config)
    return {role: s3_policy(role, location.root, location.prefix, prefixes) for role in COMPOSE_STORE_ROLES}


def load_compose_run_config(path: Path) -> RunConfig:
    """The stack's run config as any of its services reads it (the bus user does not matter here)."""
    return load_config(RunConfig, path, environ={"DART_BUS__USER": "data"})


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the compose stack's per-role S3 policies.")
    parser.add_argument("config", type=Path, help="the stack's run config (deploy/dart/run.yaml)")
    parser.add_argument("out", type=Path, help="the policies' folder (deploy/s3/policies)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for role, policy in compose_store_policies(load_compose_run_config(args.config)).items():
        (args.out / f"{role}.json").write_text(json.dumps(policy, indent=2) + "\n")


if __name__ == "__main__":
    main()
