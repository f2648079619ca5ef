"""One-GPU check: train steps of a 3B-shaped policy per trainer backend, hf engine tokens/s, a `dart run`
of the smoke suite on the GPU, and NVML utilization samples, in under 9 minutes.

Phases (``--phases``, in this order; each in its own process with its own timeout, all within ``--budget-s``):

- ``checkpoint``: a random Qwen2.5-VL of ``--arch`` (default ``qwen2.5-vl-3b``, all 36 layers and 32 vision
  blocks; ``--layers`` / ``--vision-blocks`` cut it) in bf16, written by ``dart.policy.random_init``;
  ``--tiny``: the project's tiny checkpoint instead. ``--model DIR`` uses an existing checkpoint.
- ``train-torch``, ``train-fsdp``, ``train-megatron``: ``--steps`` timed RL updates (after one warm-up) of
  ``--samples`` text samples of ``--prompt-len`` + ``--response-len`` tokens, bf16 on a GPU (float32 on
  CPU): tokens/s, TFLOP/s and MFU (the FLOP formula is in the JSON, ``flop_formula``; the peak is the
  GPU's dense bf16 figure, H100 SXM and H200 989 TFLOP/s). FSDP runs as one torchrun rank (as ``dart
  serve train`` launches ranks), megatron-core at TP 1 under torchrun; megatron is recorded as skipped
  with the reason when megatron-core does not import.
- ``train-screens``: the torch backend on samples that carry ``--screens`` screenshots of ``--screen-size``
  each (default two of 1280x720, random pixels at the processor's own sizing: 1,196 image tokens each), the
  vision tower's FLOPs added to the count; tokens/s and MFU as above.
- ``--levers pack,ckpt,fused,foreach`` switches the trainer's throughput levers on in every train phase
  (``train.packing``, ``train.activation_checkpointing``, ``train.optimizer_impl``); the JSON records them.
- ``generate``: the hf engine, ``--gen-requests`` one-screenshot prompts (1280x720 at the processor's own
  resolution rules), ``--gen-concurrency`` in flight, ``--max-new-tokens`` each: tokens/s.
- ``dart-run``: ``python -m dart.cli run`` of ``examples/smoke.yaml`` with the rollout engine and the
  trainer on ``--device`` (the tiny policy, ``--smoke-rl-s`` seconds of RL): its summary and the
  services' own GPU samples.

GPU utilization: this process samples NVML every second (``dart.runtime.telemetry.gpu.GpuSampler``)
for the whole check; each phase reports the samples of its window (mean / max utilization, the
utilization series, peak memory). With no GPU the reason is recorded instead.

A failed or timed-out phase is recorded (status, exit code, the tail of its log) and the next one runs.
The JSON is rewritten to ``--out`` after every phase (partial results survive a kill), phase logs go
to ``<out>.logs/``, and the last line printed is the same JSON object.

Usage::

    python benchmarks/gpu_check.py --device cuda --out /tmp/gpu_check.json          # the full check
    python benchmarks/gpu_check.py --device cpu --tiny --steps 1 --phases checkpoint,train-torch
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import gpu_check_phases as phases

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("checkpoint", "train-torch", "train-fsdp", "train-megatron", "train-screens", "generate", "dart-run")
TIMEOUTS_S = {
    "checkpoint": 150,
    "train-torch": 120,
    "train-fsdp": 120,
    "train-megatron": 120,
    "train-screens": 150,
    "generate": 90,
    "dart-run": 300,
}
"""Default timeout per phase, seconds (``--timeout PHASE=SECONDS`` overrides)."""


class NvmlSampling:
    """The project's NVML sampler on a thread of its own for the whole check (``gpu.sample`` into a JSONL file)."""

    def __init__(self, jsonl: Path) -> None:
        self.jsonl = jsonl
        self._loop: Any = None
        self._thread: threading.Thread | None = None
        self.unavailable: str | None = None

    def start(self) -> None:
        import asyncio

        from dart.runtime.telemetry.gpu import GpuSampler
        from dart.runtime.telemetry.setup import TelemetryConfig, setup_telemetry

        telemetry = setup_telemetry(
            "gpu-check", version="0", run_id="gpu-check", config=TelemetryConfig(jsonl_path=self.jsonl)
        )
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        sampler = GpuSampler(telemetry, interval_s=1.0, source="gpu-check")

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(sampler.start())
            self.unavailable = sampler.unavailable_reason
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(sampler.stop())
            telemetry.shutdown()

        self._thread = threading.Thread(target=run, name="nvml-sampling", daemon=True)
        self._thread.start()
        ready.wait()

    def stop(self) -> None:
        if self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)

    def window(self, start_ns: int, end_ns: int) -> dict[str, Any]:
        """The samples between two instants: summary and the utilization series (one value a second)."""
        from dart.runtime.telemetry import read_jsonl

        if self.unavailable:
            return {"samples": 0, "unavailable": self.unavailable}
        utils, mem = [], []
        for rec in read_jsonl(self.jsonl, types={"event"}):
            if rec.get("name") == "gpu.sample" and start_ns <= int(rec["ts_unix_ns"]) <= end_ns:
                utils.append(float(rec["attributes"]["util_pct"]))
                mem.append(int(rec["attributes"]["mem_used_bytes"]))
        return {
            "samples": len(utils),
            "mean_util_pct": round(sum(utils) / len(utils), 1) if utils else None,
            "max_util_pct": max(utils) if utils else None,
            "max_mem_used_gib": round(max(mem) / 2**30, 2) if mem else None,
            "util_pct": utils,
        }


def _run_process(cmd: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None) -> tuple[str, int]:
    """Run ``cmd`` in its own process group; returns (status, exit code). The whole group goes on timeout."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return "timeout", -9
        finally:  # on a timeout, and when this process is stopped: no phase outlives the check
            _stop(proc)
    return ("ok" if code == 0 else "failed"), code


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a phase's process group. SIGTERM first: torchrun starts its ranks in sessions of their own
    and only stops them when it is itself signalled, not killed."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _tail(log: Path, chars: int = 1500) -> str:
    return log.read_text(errors="replace")[-chars:] if log.is_file() else ""


def _worker_cmd(args: argparse.Namespace, phase: str, out: Path) -> list[str]:
    forward = [
        "--device", args.device, "--arch", args.arch, "--model", args.model,
        "--samples", str(args.samples), "--prompt-len", str(args.prompt_len), "--response-len", str(args.response_len),
        "--steps", str(args.steps), "--micro-batch-size", str(args.micro_batch_size),
        "--gen-requests", str(args.gen_requests), "--gen-concurrency", str(args.gen_concurrency),
        "--max-new-tokens", str(args.max_new_tokens), "--worker", phase, "--worker-out", str(out),
        "--screens", str(args.screens), "--screen-size", args.screen_size, "--levers", ",".join(args.levers),
    ]  # fmt: skip
    if args.layers:
        forward += ["--layers", str(args.layers)]
    if args.vision_blocks:
        forward += ["--vision-blocks", str(args.vision_blocks)]
    if args.tiny:
        forward.append("--tiny")
    script = [str(Path(__file__).resolve()), *forward]
    if phase in ("train-fsdp", "train-megatron"):
        # As ``dart serve train`` launches multi-process backends: torchrun, here one rank.
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", *script]
    return [sys.executable, *script]


def _dart_run(args: argparse.Namespace, work: Path, log: Path, timeout_s: float) -> dict[str, Any]:
    config = work / "smoke-gpu.yaml"
    config.write_text(
        json.dumps(
            {
                "extends": str(ROOT / "examples" / "smoke.yaml"),
                # One GPU for the engine and the trainer (the plan gives each process GPUs of its own otherwise).
                "run": {"name": "gpu-check-smoke", "rl_duration_s": args.smoke_rl_s, "share_gpus": True},
                "rollout": {"engine": {"kind": "hf", "model_path": "", "device": args.device}},
                "train": {"device": args.device},
            }
        )
    )
    runs = work / "runs"
    env = {**os.environ, "DART_RUN__RUNS_ROOT": str(runs)}
    status, code = _run_process([sys.executable, "-m", "dart.cli", "run", str(config)], log, timeout_s, env)
    result: dict[str, Any] = {"status": status, "exit_code": code}
    lines = log.read_text(errors="replace").strip().splitlines()
    summary = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    if summary is not None:
        keys = ("versions_published", "trajectories_produced", "trajectories_lost", "error", "wall_s")
        result["summary"] = {k: summary.get(k) for k in keys if k in summary}
    from dart.runtime.telemetry.gpu import gpu_summary

    for telemetry in runs.glob("*/telemetry"):
        for service in ("rollout", "train"):
            s = gpu_summary(telemetry, service=service)
            result[f"gpu_{service}"] = {
                "samples": s.samples,
                "mean_util_pct": None if s.mean_util_pct is None else round(s.mean_util_pct, 1),
                "max_mem_used_gib": None if s.max_mem_used_bytes is None else round(s.max_mem_used_bytes / 2**30, 2),
                "unavailable": list(s.unavailable),
            }
    return result


def _megatron_missing() -> str | None:
    """Why megatron-core cannot be used here, or None. Checked in a child: the import is heavy and may fail late."""
    probe = subprocess.run(
        [sys.executable, "-c", "import megatron.core"], capture_output=True, text=True, timeout=120, check=False
    )
    if probe.returncode == 0:
        return None
    last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
    return f"megatron-core does not import: {last}"


def check(args: argparse.Namespace) -> dict[str, Any]:
    """Run the selected phases; returns the report (also written to ``--out`` after every phase)."""
    import torch
    import transformers

    started = time.monotonic()
    out = Path(args.out) if args.out else None
    logs = Path(f"{out}.logs") if out else Path(tempfile.mkdtemp(prefix="gpu-check-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    if not args.model:
        args.model = str(work / "policy")
    name = phases.gpu_name(args.device)
    report: dict[str, Any] = {
        "benchmark": "gpu_check",
        "device": args.device,
        "gpu_name": name,
        "peak_bf16_tflops": (phases.peak_flops(name) or 0) / 1e12 or None,
        "flop_formula": f"{phases.FLOP_FORMULA}; {phases.VISION_FLOP_FORMULA}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "arch": "tiny" if args.tiny else args.arch,
        "layers": args.layers,
        "vision_blocks": args.vision_blocks,
        "levers": list(args.levers),
        "phases": {},
    }
    sampling = NvmlSampling(work / "gpu.jsonl")
    sampling.start()
    report["gpu_sampling"] = "nvml" if sampling.unavailable is None else f"unavailable: {sampling.unavailable}"
    timeouts = {**TIMEOUTS_S, **dict(args.timeout)}
    try:
        for phase in args.phases:
            left = args.budget_s - (time.monotonic() - started)
            if left < 10:
                report["phases"][phase] = {"status": "skipped", "reason": f"the {args.budget_s} s budget is spent"}
                continue
            missing = _megatron_missing() if phase == "train-megatron" else None
            if missing:
                report["phases"][phase] = {"status": "skipped", "reason": missing}
                continue
            timeout_s = min(timeouts[phase], left)
            log = logs / f"{phase}.log"
            t0, t0_ns = time.monotonic(), time.time_ns()
            if phase == "dart-run":
                result = _dart_run(args, work, log, timeout_s)
            else:
                result_file = work / f"{phase}.json"
                status, code = _run_process(_worker_cmd(args, phase, result_file), log, timeout_s)
                result = {"status": status, "exit_code": code}
                if result_file.is_file():
                    result.update(json.loads(result_file.read_text()))
            result["seconds"] = round(time.monotonic() - t0, 1)
            result["timeout_s"] = round(timeout_s, 1)
            if result["status"] != "ok":
                result["log_tail"] = _tail(log)
            result["gpu"] = sampling.window(t0_ns, time.time_ns())
            report["phases"][phase] = result
            print(f"{phase}: {result['status']} in {result['seconds']} s", file=sys.stderr, flush=True)
            if out:
                out.write_text(json.dumps(report, indent=1) + "\n")
    finally:
        sampling.stop()
        shutil.rmtree(work, ignore_errors=True)  # the checkpoint (7.5 GB at 3B size) and the run directory
    report["seconds"] = round(time.monotonic() - started, 1)
    report["ok"] = all(p["status"] in ("ok", "skipped") for p in report["phases"].values())
    if out:
        out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def _timeout(text: str) -> tuple[str, float]:
    phase, _, seconds = text.partition("=")
    if phase not in PHASES or not seconds:
        raise argparse.ArgumentTypeError(
            f"--timeout {text!r}: expected PHASE=SECONDS with PHASE in {', '.join(PHASES)}"
        )
    return phase, float(seconds)


def _phase_list(text: str) -> list[str]:
    chosen = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in PHASES]
    if unknown:
        raise argparse.ArgumentTypeError(f"--phases: unknown {', '.join(unknown)}; choose from {', '.join(PHASES)}")
    return [p for p in PHASES if p in chosen]


TRAIN_LEVERS = ("pack", "ckpt", "fused", "foreach")
"""Throughput levers the train phases can switch on (``trainer_throughput.LEVERS``)."""


def _lever_list(text: str) -> list[str]:
    chosen = [p for p in text.split(",") if p]
    unknown = [p for p in chosen if p not in TRAIN_LEVERS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"--levers: unknown {', '.join(unknown)}; choose from {', '.join(TRAIN_LEVERS)}"
        )
    return chosen


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda or cpu")
    parser.add_argument(
        "--phases", type=_phase_list, default=list(PHASES), help="comma-separated subset of " + ",".join(PHASES)
    )
    parser.add_argument("--out", default="", help="also write the JSON here (and phase logs to <out>.logs/)")
    parser.add_argument(
        "--budget-s", type=float, default=520, help="whole check, seconds: later phases get what is left"
    )
    parser.add_argument("--timeout", type=_timeout, action="append", default=[], help="PHASE=SECONDS (repeatable)")
    parser.add_argument("--arch", default="qwen2.5-vl-3b")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the architecture's)")
    parser.add_argument("--vision-blocks", type=int, default=None, help="vision blocks (default: the architecture's)")
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoint instead of --arch")
    parser.add_argument("--model", default="", help="an existing checkpoint (the checkpoint phase then overwrites it)")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--response-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed updates per backend, after one warm-up")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--screens", type=int, default=2, help="screenshots per sample in train-screens")
    parser.add_argument("--screen-size", default="1280x720", help="WxH of train-screens' screenshots")
    parser.add_argument(
        "--levers", type=_lever_list, default=[], help="comma-separated trainer levers: " + ",".join(TRAIN_LEVERS)
    )
    parser.add_argument("--gen-requests", type=int, default=16)
    parser.add_argument("--gen-concurrency", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--smoke-rl-s", type=float, default=45, help="seconds of RL in the dart-run phase")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # SIGTERM unwinds like Ctrl-C, so the running phase's process group is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.worker:
        phases.run_worker(args)
        return 0
    report = check(args)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
