"""End to end: `dart run` with `run.artifacts: embedded_s3` keeps a run's artifacts on the embedded
S3 server, and a plain S3 client lists and reads them with the layout docs/storage.md gives."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from minio import Minio

from dart.embedded.s3 import EmbeddedS3

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(900)  # a `dart run` on a shared 2-core machine; the run itself is ~2-3 minutes
def test_run_artifacts_on_embedded_s3_are_readable_with_a_plain_s3_client(
    dart_run: Callable[..., tuple[dict[str, Any], Path]],
) -> None:
    # A short run without warm start: what matters is where the artifacts go, not learning. The
    # untrained policy fails every task, so zero-variance groups are kept to get batches, hence weights.
    env = {
        "DART_RUN__ARTIFACTS": "embedded_s3",
        "DART_RUN__RL_DURATION_S": "90",
        "DART_WARM_START__ENABLED": "false",
        "DART_DATA__GROUPING__DROP_ZERO_VARIANCE": "false",
    }
    summary, run_dir = dart_run(ROOT / "examples" / "smoke.yaml", env=env, timeout_s=840)
    assert summary["error"] is None and summary["trajectories_lost"] == 0
    assert summary["trajectories_stored"] > 0
    assert summary["store_uri"] == "s3://dart/artifacts"
    assert summary["store_bytes"] > 0 and summary["store_objects"] > 0
    assert not (run_dir / "artifacts").exists()  # nothing went to the local store

    # The server stopped with the run; its data stays in <run_dir>/s3. Serve it again, new keys.
    with EmbeddedS3(data_dir=run_dir / "s3") as s3:
        client = Minio(s3.endpoint, access_key=s3.access_key, secret_key=s3.secret_key, secure=False)
        keys = [o.object_name for o in client.list_objects("dart", prefix="artifacts/", recursive=True)]
        trajectories = [k for k in keys if k.startswith("artifacts/trajectories/") and k.endswith(".json")]
        manifests = sorted(k for k in keys if k.startswith("artifacts/weights/v") and k.endswith("/manifest.json"))
        assert trajectories and manifests, keys[:20]
        assert (
            sum(o.size or 0 for o in client.list_objects("dart", prefix="artifacts/", recursive=True))
            == (summary["store_bytes"])
        )
        response = client.get_object("dart", manifests[-1])
        try:
            manifest = json.loads(response.read())
        finally:
            response.close()
            response.release_conn()
        assert manifest["weights_uri"].startswith("s3://dart/artifacts/weights/v")
        assert manifest["weights_uri"].removeprefix("s3://dart/") in keys
        response = client.get_object("dart", trajectories[0])
        try:
            trajectory = json.loads(response.read())
        finally:
            response.close()
            response.release_conn()
        shot = trajectory["steps"][0]["observation"]["screenshot"]
        assert (
            shot["uri"].startswith("s3://dart/artifacts/trajectories/")
            and shot["uri"].removeprefix("s3://dart/") in keys
        )
