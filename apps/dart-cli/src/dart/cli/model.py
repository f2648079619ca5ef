"""``dart model``: create policy checkpoints (local files only, never a model hub)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

model_app = typer.Typer(
    help="Create policy checkpoints (random weights of a named architecture, local files only).", no_args_is_help=True
)


PathArg = Annotated[Path, typer.Argument(help="Directory to write the checkpoint into.")]
SeedOpt = Annotated[int, typer.Option(help="Seed of the weights and the tokenizer corpus.")]
SuiteOpt = Annotated[
    list[Path] | None,
    typer.Option(help="Task suite file(s) whose instructions extend the tokenizer's training text."),
]
SimSuitesOpt = Annotated[bool, typer.Option(help="Also train the tokenizer on the built-in sim suites.")]


@model_app.command("init")
def init(
    path: PathArg,
    arch: Annotated[
        str,
        typer.Option(
            help="Architecture: tiny (Qwen2.5-VL), tiny-FAMILY for any registered model family (tiny-qwen3-vl), or "
            "a published size: qwen2.5-vl-3b/7b/32b, qwen3-vl-2b/4b/8b/32b."
        ),
    ] = "tiny",
    dtype: Annotated[str, typer.Option(help="Weight dtype: bfloat16 or float32 (tiny: float32 only).")] = "",
    layers: Annotated[int | None, typer.Option(help="Decoder layers (default: the architecture's).")] = None,
    vision_blocks: Annotated[int | None, typer.Option(help="Vision blocks (default: the architecture's).")] = None,
    seed: SeedOpt = 0,
    suite: SuiteOpt = None,
    sim_suites: SimSuitesOpt = True,
) -> None:
    """Write a random checkpoint of a named architecture with a locally trained tokenizer.

    The published architectures keep every width, the vocabulary (151,936) and the image processor
    settings when cut with --layers / --vision-blocks; special tokens sit at Qwen's ids.
    """
    from dataclasses import replace

    from dart.policy.architectures import get_architecture
    from dart.policy.errors import ModelInitError
    from dart.policy.random_init import write_checkpoint
    from dart.policy.tiny import write_tiny_checkpoint
    from dart.policy.tiny_spec import TinyModelSpec

    texts = _tokenizer_texts(suite, sim_suites)
    t0 = time.perf_counter()
    try:
        manifest: object
        if arch == "tiny" or arch.startswith("tiny-"):
            if dtype not in ("", "float32"):
                raise ModelInitError(f"dtype={dtype}: the tiny checkpoint is written in float32 only")
            spec = TinyModelSpec(family=_tiny_family(arch))
            spec = replace(spec, num_layers=layers or spec.num_layers, vision_depth=vision_blocks or spec.vision_depth)
            manifest = write_tiny_checkpoint(path, seed=seed, vocab_texts=texts, spec=spec)
        else:
            if dtype not in ("", "bfloat16", "float32"):
                raise ModelInitError(f"dtype={dtype}: choose bfloat16 or float32")
            cut = get_architecture(arch).cut(layers=layers, vision_blocks=vision_blocks)
            manifest = write_checkpoint(
                path, cut, dtype="float32" if dtype == "float32" else "bfloat16", seed=seed, vocab_texts=texts
            )
    except ModelInitError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    elapsed = time.perf_counter() - t0
    summary = {"path": str(path), "seed": seed, "seconds": round(elapsed, 2), **_manifest_dict(manifest)}
    typer.echo(f"wrote {arch} checkpoint to {path} in {elapsed:.1f}s")
    typer.echo(json.dumps(summary, default=str))


def _tiny_family(arch: str) -> str:
    """The family of ``tiny`` (Qwen2.5-VL) or ``tiny-FAMILY``.

    Raises:
        ModelInitError: No family of that name is registered.
    """
    from dart.policy.errors import ModelInitError
    from dart.policy.models import MODEL_FAMILIES

    family = arch.removeprefix("tiny-") if arch != "tiny" else "qwen2.5-vl"
    try:
        return MODEL_FAMILIES.check_name(family)
    except ValueError as exc:
        raise ModelInitError(f"--arch {arch}: {exc}") from None


@model_app.command("merge")
def merge(
    policy: Annotated[str, typer.Argument(help="A run directory, or a published weights URI (with --base).")],
    out: Annotated[Path, typer.Argument(help="Directory to write the checkpoint to.")],
    version: Annotated[int | None, typer.Option(help="Version of a run (default: its newest).")] = None,
    base: Annotated[Path | None, typer.Option(help="The checkpoint a weights URI was trained from.")] = None,
) -> None:
    """Write a published version as a standalone checkpoint: a LoRA adapter merged into its base, or full
    weights over it. Both engines load the result like any checkpoint of its family."""
    import asyncio

    from dart.cli.evaluation import resolve_policy
    from dart.policy.errors import ModelInitError
    from dart.policy.export import export_checkpoint
    from dart.protocol.errors import ConfigError
    from dart.rollout.errors import RolloutError
    from dart.rollout.service.sync import fetch_weights

    t0 = time.perf_counter()
    try:
        chosen, _ = resolve_policy(policy, base=base, version=version)
        if chosen.weights is None:
            raise ConfigError("policy", "version", f"{policy} names version 0, the base checkpoint {chosen.base}")
        weights = asyncio.run(fetch_weights(chosen.weights, store_config=chosen.store))
        exported = export_checkpoint(chosen.base, weights, out)
    except (ConfigError, RolloutError, ModelInitError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    what = f"adapter (rank {exported.adapter.rank}) merged into" if exported.adapter else "full weights over"
    typer.echo(f"wrote version {chosen.version}: {what} {chosen.base} -> {out} in {time.perf_counter() - t0:.1f}s")
    summary = {"path": str(out), "version": chosen.version, "base": str(chosen.base)}
    summary |= {"adapter": exported.adapter is not None, "num_parameters": exported.num_parameters}
    typer.echo(json.dumps(summary))


@model_app.command("init-tiny")
def init_tiny(path: PathArg, seed: SeedOpt = 0, suite: SuiteOpt = None, sim_suites: SimSuitesOpt = True) -> None:
    """Write a random tiny Qwen2.5-VL checkpoint (same as "dart model init --arch tiny")."""
    init(path, arch="tiny", dtype="", layers=None, vision_blocks=None, seed=seed, suite=suite, sim_suites=sim_suites)


def _tokenizer_texts(suite: list[Path] | None, sim_suites: bool) -> list[str]:
    from dart.env.sim import BUILTIN_SUITES, load_builtin_suite
    from dart.env.suite import load_suite
    from dart.policy.tiny import DEFAULT_INSTRUCTIONS

    texts = list(DEFAULT_INSTRUCTIONS)
    suites = [load_suite(p) for p in suite or []]
    if sim_suites:
        suites += [load_builtin_suite(name) for name in BUILTIN_SUITES]
    return texts + [t.instruction for s in suites for t in s.tasks if t.instruction]


def _manifest_dict(manifest: object) -> dict[str, object]:
    to_dict = getattr(manifest, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    from dataclasses import asdict, is_dataclass

    return asdict(manifest) if is_dataclass(manifest) and not isinstance(manifest, type) else {}


def register(app: typer.Typer) -> None:
    """Add ``dart model`` to the CLI."""
    app.add_typer(model_app, name="model")
