"""A trainer across machines: two ``dart-train serve`` launchers joined by torchrun's rendezvous on loopback;
and a multi-rank trainer served again after a stop that kept no checkpoint.

Each "machine" runs the package's own command with the same config file except its node rank (given as
``DART_TRAIN__BACKEND__NODE_RANK``, as a deployment would). Both launchers' ranks form one process group,
global rank 0 (node 0) consumes the batches and publishes. The weights it publishes after the same two
batches must equal those of one launcher running every rank itself: FSDP2 with 2 nodes x 1 rank, and
megatron-core with its tensor-parallel group of 2 split across the two nodes. The megatron run across two
launchers has a 15 s collective timeout and no batch for 30 s between its two: the ranks outside rank 0 wait
for its next command on the store, not in a collective, so the idle spell kills nothing. The one-launcher run
it is compared with trains during that spell (the machine would otherwise wait it out); FSDP's, with no spell,
beside the two launchers.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from dart.protocol.messages import ModelVersion, TrainingBatch, TrainingSample
from dart.protocol.topology import LATEST_MODEL_KEY, STATE_BUCKET
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.ports import free_port
from dart.runtime.store import LocalStore
from dart.runtime.topology import ensure_topology
from dart.train.config import FsdpBackendSettings, MegatronBackendSettings
from dart.train.serve import torchrun_argv

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

BACKENDS: dict[str, dict[str, Any]] = {
    "fsdp": {"kind": "fsdp", "nproc": 2},
    "megatron": {"kind": "megatron", "tensor_parallel_size": 2},
}
ACROSS_TWO: dict[str, dict[str, Any]] = {
    "fsdp": {"kind": "fsdp", "nproc": 1},
    "megatron": {"kind": "megatron", "tensor_parallel_size": 2, "collective_timeout_s": 15},
}
IDLE_S = {"megatron": 30.0}
"""Seconds without a batch between the two batches, across two launchers, by backend (twice the timeout)."""


async def _publish_batch_and_wait(
    bus: Bus, samples: list[TrainingSample], index: int, procs: list[subprocess.Popen[bytes]]
) -> None:
    """Publish batch ``b<index>`` and wait until version ``index + 1`` is announced (a launcher dying fails it)."""
    state = await bus.kv(bus.subjects.kv_bucket(STATE_BUCKET))
    batch = TrainingBatch(
        batch_id=f"b{index}",
        samples=samples,
        group_ids=["g"],
        min_policy_version=0,
        max_policy_version=0,
        created_at=1.0,
    )
    await bus.js_publish(bus.subjects.stream_subject("batch"), batch, f"b{index}")
    deadline = time.monotonic() + 400.0
    while True:
        latest = await state.get(LATEST_MODEL_KEY, ModelVersion)
        if latest is not None and latest.version >= index + 1:
            return
        dead = [p.returncode for p in procs if p.poll() is not None]
        assert not dead, f"a launcher exited with {dead} before version {index + 1}"
        assert time.monotonic() < deadline, f"version {index + 1} was not published"
        await asyncio.sleep(0.5)


async def _feed_and_wait(
    url: str,
    run: str,
    samples: list[TrainingSample],
    procs: list[subprocess.Popen[bytes]],
    idle_s: float,
    on_idle: Callable[[], None] | None,
) -> None:
    """Publish a batch, wait until version 1 is announced, leave the trainer ``idle_s`` without a batch (calling
    ``on_idle`` as the spell begins), publish the second and wait until version 2 is announced."""
    async with await Bus.connect(BusConfig(url=url, run=run)) as bus:
        await ensure_topology(bus)
        for i in range(2):
            if i == 1 and idle_s:
                if on_idle is not None:
                    on_idle()
                await _alive_for(procs, idle_s)
            await _publish_batch_and_wait(bus, samples, i, procs)


async def _alive_for(procs: list[subprocess.Popen[bytes]], seconds: float) -> None:
    """Wait ``seconds`` (the idle spell itself), failing as soon as a launcher exits."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        dead = [p.returncode for p in procs if p.poll() is not None]
        assert not dead, f"a launcher exited with {dead} while the trainer had no batch"
        await asyncio.sleep(0.5)


def _train(
    tmp: Path,
    nats_url: str,
    checkpoint: Path,
    samples: list[TrainingSample],
    store: LocalStore,
    backend: dict[str, Any],
    nnodes: int,
    idle_s: float = 0.0,
    on_idle: Callable[[], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Run the trainer on two batches (``idle_s`` apart, ``on_idle`` called as the spell begins) with ``nnodes``
    launchers; the weights it published as
    version 2. ``store`` holds the samples' screenshots (a trainer reads images in its run's store only); each
    run publishes under a prefix of its own there."""
    run = f"mn-{uuid.uuid4().hex[:8]}"
    nodes = {"nnodes": nnodes}
    if nnodes > 1:
        nodes["rdzv_endpoint"] = f"127.0.0.1:{free_port()}"  # type: ignore[assignment]
    tmp.mkdir(parents=True)
    _write_config(tmp, run, nats_url, checkpoint, store, {**backend, **nodes})
    procs = [_launch(tmp, node) for node in range(nnodes)]
    try:
        try:
            asyncio.run(_feed_and_wait(nats_url, run, samples, procs, idle_s, on_idle))
        except AssertionError as e:
            logs = {n: (tmp / f"node-{n}.log").read_text()[-3000:] for n in range(nnodes)}
            raise AssertionError(f"{e}; logs: {logs}") from None
        for proc in procs:  # node 0's rank 0 stops first and tells every other rank
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(timeout=300) for proc in procs]
        assert codes == [0] * nnodes, {n: (tmp / f"node-{n}.log").read_text()[-3000:] for n in range(nnodes)}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return _published(store, run, 2)


def _write_config(
    tmp: Path, run: str, nats_url: str, checkpoint: Path, store: LocalStore, backend: dict[str, Any]
) -> None:
    """``tmp/run.yaml``: a trainer of ``run`` publishing every step under a weights prefix of its own."""
    config = {
        "run": {"name": run, "run_dir": str(tmp / "run"), "torch_threads": 1},
        "bus": {"url": nats_url},
        "store": {"uri": store.root.as_uri()},
        "train": {
            "weights_prefix": f"weights-{run}",
            "model_path": str(checkpoint),
            "lr": 1e-3,
            "num_threads": 1,
            "publish_every": 1,
            "micro_batch_size": 4,
            "backend": backend,
        },
    }
    (tmp / "run.yaml").write_text(yaml.safe_dump(config))


def _launch(tmp: Path, node: int, log_name: str | None = None) -> subprocess.Popen[bytes]:
    """``dart-train serve`` on ``tmp/run.yaml`` as node ``node``, its output in ``tmp/<log_name>``."""
    command = [sys.executable, "-m", "dart.train.serve", "serve", "--config", str(tmp / "run.yaml")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DART_TRAIN__BACKEND__NODE_RANK": str(node)}
    with (tmp / (log_name or f"node-{node}.log")).open("wb") as log:
        return subprocess.Popen(command, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)


def _published(store: LocalStore, run: str, version: int) -> dict[str, torch.Tensor]:
    """The weights ``run``'s trainer published as ``version`` (every shard)."""
    shards = sorted((store.root / f"weights-{run}" / f"v{version}").glob("*.safetensors"))
    assert shards, f"no published weights for version {version}"
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(str(shard)))
    return weights


@pytest.mark.parametrize("kind", ["fsdp", "megatron"])
def test_two_launchers_train_as_one(
    kind: str,
    nats_url: str,
    tiny_checkpoint: Path,
    rollout_samples: list[TrainingSample],
    shot_store: LocalStore,
    tmp_path: Path,
) -> None:
    samples, store = rollout_samples, shot_store
    args = (nats_url, tiny_checkpoint, samples, store)
    idle = IDLE_S.get(kind, 0.0)
    with ThreadPoolExecutor(max_workers=1) as pool:
        started: list[Future[dict[str, torch.Tensor]]] = []

        def train_one() -> None:
            started.append(pool.submit(_train, tmp_path / "one", *args, BACKENDS[kind], nnodes=1))

        if not idle:  # no idle spell to run it in: the one-launcher baseline runs beside the two launchers
            train_one()
        two = _train(tmp_path / "two", *args, ACROSS_TWO[kind], nnodes=2, idle_s=idle, on_idle=train_one)
        one = started[0].result()
    assert one.keys() == two.keys()
    initial = load_file(str(tiny_checkpoint / "model.safetensors"))
    shared = one.keys() & initial.keys()
    assert shared, "the published weights share no tensor name with the initial checkpoint"
    moved = max((one[k] - initial[k]).abs().max().item() for k in shared)
    assert moved > 1e-4, "the trainer did not move the weights: the comparison would prove nothing"
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst < 1e-6, f"two launchers trained differently from one (max abs difference {worst})"


def test_a_restarted_fsdp_trainer_without_a_checkpoint_continues_from_the_published_version(
    nats_url: str,
    tiny_checkpoint: Path,
    rollout_samples: list[TrainingSample],
    shot_store: LocalStore,
    tmp_path: Path,
) -> None:
    """Two FSDP ranks stopped after version 1 with no checkpoint kept, then served again: rank 0 reads version 1
    from the store and has every rank take its shards (fresh moments), so version 2 is version 1 trained on one
    more batch, as one process computes it, and not the initial weights trained on it."""
    from dart.train.backend import TorchBackend
    from dart.train.batching import StoreImageSource
    from dart.train.config import TrainerConfig

    run = f"mn-{uuid.uuid4().hex[:8]}"
    _write_config(tmp_path, run, nats_url, tiny_checkpoint, shot_store, BACKENDS["fsdp"])
    for index in range(2):
        log_name = f"launch-{index}.log"
        proc = _launch(tmp_path, 0, log_name)
        try:
            try:
                asyncio.run(_publish_to(nats_url, run, rollout_samples, index, proc))
            except AssertionError as e:
                raise AssertionError(f"{e}; log: {(tmp_path / log_name).read_text()[-3000:]}") from None
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=300) == 0, (tmp_path / log_name).read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert (
        "no checkpoint, version 1 was published: continuing from its weights" in (tmp_path / "launch-1.log").read_text()
    )
    first, second = _published(shot_store, run, 1), _published(shot_store, run, 2)

    config = TrainerConfig(model_path=str(tiny_checkpoint), lr=1e-3, num_threads=1, micro_batch_size=4)
    continued = TorchBackend.load(config, image_source=StoreImageSource())
    continued.load_published(first)
    continued.train_step(rollout_samples)
    expected = continued.full_state_dict()
    anew = TorchBackend.load(config, image_source=StoreImageSource())
    anew.train_step(rollout_samples)
    from_initial = anew.full_state_dict()

    def mean_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return sum(float((a[k] - b[k]).abs().sum()) for k in b) / sum(t.numel() for t in b.values())

    assert second.keys() == expected.keys()
    assert mean_gap(second, first) > 1e-5, "version 2 did not move from version 1: the check would prove nothing"
    near, far = mean_gap(second, expected), mean_gap(from_initial, expected)
    assert near < 0.01 * far, (
        f"version 2 is {near} from version 1 trained on, {far} from the initial weights trained on"
    )


async def _publish_to(
    url: str, run: str, samples: list[TrainingSample], index: int, proc: subprocess.Popen[bytes]
) -> None:
    async with await Bus.connect(BusConfig(url=url, run=run)) as bus:
        await ensure_topology(bus)
        await _publish_batch_and_wait(bus, samples, index, [proc])


def test_torchrun_command_per_node() -> None:
    """The launcher's torchrun arguments: standalone on one machine, the rendezvous across several."""
    single = torchrun_argv(FsdpBackendSettings(nproc=2))
    assert "--standalone" in single and "--nproc-per-node=2" in single
    static = torchrun_argv(
        MegatronBackendSettings(
            tensor_parallel_size=2, data_parallel_size=2, nnodes=2, node_rank=1, rdzv_endpoint="h:29400"
        )
    )
    assert "--standalone" not in static and "--nproc-per-node=2" in static and "--nnodes=2" in static
    assert {"--rdzv-backend=static", "--rdzv-endpoint=h:29400", "--node-rank=1", "--max-restarts=0"} <= set(static)
    dynamic = torchrun_argv(FsdpBackendSettings(nproc=1, nnodes=2, rdzv_endpoint="h:29400", rdzv_backend="c10d"))
    assert "--rdzv-backend=c10d" in dynamic and not any(a.startswith("--node-rank") for a in dynamic)
    # The endpoint may come later (dart run on Ray sets it per run), but nothing launches without one.
    with pytest.raises(ValueError, match="needs rdzv_endpoint"):
        torchrun_argv(FsdpBackendSettings(nproc=1, nnodes=2))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"kind": "fsdp", "nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}, "not below nnodes"),
        ({"kind": "fsdp", "nnodes": 2, "rdzv_endpoint": "no-port"}, "is not host:port"),
        ({"kind": "megatron", "tensor_parallel_size": 3, "nnodes": 2, "rdzv_endpoint": "h:1"}, "split evenly"),
    ],
)
def test_node_settings_are_checked(settings: dict[str, Any], message: str) -> None:
    from dart.train.config import TrainerConfig

    with pytest.raises(ValueError, match=message):
        TrainerConfig.model_validate({"backend": settings})
