"""``dart model``: create and inspect policy checkpoints (local files only, never a model hub)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

model_app = typer.Typer(help="Create and inspect policy checkpoints.", no_args_is_help=True)


@model_app.command("init-tiny")
def init_tiny(
    path: Annotated[Path, typer.Argument(help="Directory to write the checkpoint into.")],
    seed: Annotated[int, typer.Option(help="Seed of the weights and the tokenizer corpus.")] = 0,
    suite: Annotated[
        list[Path] | None,
        typer.Option(help="Task suite file(s) whose instructions extend the tokenizer's training text."),
    ] = None,
    sim_suites: Annotated[bool, typer.Option(help="Also train the tokenizer on the built-in sim suites.")] = True,
) -> None:
    """Write a random tiny Qwen2.5-VL checkpoint with a locally trained tokenizer."""
    from dart.env.sim import BUILTIN_SUITES, load_builtin_suite
    from dart.env.suite import load_suite
    from dart.rollout.model.tiny import DEFAULT_INSTRUCTIONS, write_tiny_checkpoint

    texts = list(DEFAULT_INSTRUCTIONS)
    suites = [load_suite(p) for p in suite or []]
    if sim_suites:
        suites += [load_builtin_suite(name) for name in BUILTIN_SUITES]
    texts += [t.instruction for s in suites for t in s.tasks if t.instruction]
    t0 = time.perf_counter()
    manifest = write_tiny_checkpoint(path, seed=seed, vocab_texts=texts)
    elapsed = time.perf_counter() - t0
    summary = {"path": str(path), "seed": seed, "seconds": round(elapsed, 2), **_manifest_dict(manifest)}
    typer.echo(f"wrote tiny Qwen2.5-VL checkpoint to {path} in {elapsed:.1f}s")
    typer.echo(json.dumps(summary, default=str))


def _manifest_dict(manifest: object) -> dict[str, object]:
    to_dict = getattr(manifest, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    from dataclasses import asdict, is_dataclass

    return asdict(manifest) if is_dataclass(manifest) and not isinstance(manifest, type) else {}


def register(app: typer.Typer) -> None:
    """Add ``dart model`` to the CLI."""
    app.add_typer(model_app, name="model")
