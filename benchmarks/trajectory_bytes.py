"""What a run's trajectories cost the bus: each stored trajectory's message as it travelled (every image above
its inline threshold by reference, compressed as the codec compresses a large message) against the same message
as plain JSON (what it weighed before large messages travelled compressed), with the images its prompts were fed
inline (before resized prompt images went by reference; screenshots above ``env.inline_max_bytes`` went by
reference then too) and with every image inline.

Reads the run's index (``<run_dir>/data.sqlite3``) and its stored trajectories (the artifact store the index
names: a local store, or S3 with the environment's credentials). A stored trajectory holds every image by
reference (dart-data stores inline ones at ingestion), so "by reference" counts the images that were below
the thresholds inline again, as they travelled.

Usage::

    python benchmarks/trajectory_bytes.py RUN_DIR [--limit N]

Prints one line per figure; the last line is one JSON object: trajectories read, mean and largest bytes per
trajectory for each form, how many would exceed the bus's message limit (8 MiB by default), the steps per
trajectory and the prompt images per step.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
from pathlib import Path
from typing import Any

from dart.cli.stack.config import load_run_config
from dart.protocol.messages import Image, ImageRef, InlineImage, Trajectory
from dart.protocol.messages.codec import decode, encode, pack, to_json
from dart.runtime.store import resolve_uri

BUS_LIMIT_BYTES = 8 * 1024 * 1024
"""nats-server's largest message by default (``max_payload``), which ``dart run``'s embedded server keeps."""
UNBOUNDED = 1 << 62
"""An inline threshold no image reaches."""


class Images:
    """PNG bytes by URI, each read once."""

    def __init__(self) -> None:
        self._bytes: dict[str, bytes] = {}

    def png(self, ref: ImageRef) -> bytes:
        if ref.uri not in self._bytes:
            store, key = resolve_uri(ref.uri)
            with store:
                self._bytes[ref.uri] = store.get(key)
        return self._bytes[ref.uri]

    @property
    def read(self) -> int:
        """Distinct images read so far."""
        return len(self._bytes)


def forms(trajectory: Trajectory, images: Images, thresholds: tuple[int, int]) -> dict[str, int]:
    """Encoded bytes of ``trajectory`` as it travelled, as plain JSON, with its prompt images inline, and all
    inline; ``thresholds``: (screenshots', prompt images') largest inline size, bytes."""

    def inline_upto(image: Image | None, limit: int) -> Image | None:
        if isinstance(image, ImageRef) and len(png := images.png(image)) <= limit:
            return InlineImage(png=png, width=image.width, height=image.height)
        return image

    def rebuilt(inline_screens: int, inline_prompt: int) -> Trajectory:
        steps = [
            step.model_copy(
                update={
                    "observation": step.observation.model_copy(
                        update={"screenshot": inline_upto(step.observation.screenshot, inline_screens)}
                    ),
                    "prompt_images": [inline_upto(i, inline_prompt) for i in step.prompt_images],
                }
            )
            for step in trajectory.steps
        ]
        return trajectory.model_copy(update={"steps": steps})

    screens, prompt = thresholds
    as_sent = to_json(rebuilt(screens, prompt))
    return {
        "by_reference": len(pack(as_sent)),
        "by_reference_json": len(as_sent),
        "prompt_images_inline": len(encode(rebuilt(screens, UNBOUNDED))),
        "all_inline": len(encode(rebuilt(UNBOUNDED, UNBOUNDED))),
    }


def thresholds_of(run_dir: Path) -> tuple[int, int]:
    """(``env.inline_max_bytes``, ``rollout.prompt_images.inline_max_bytes``) of the run's resolved config (None,
    every image inline, as unbounded)."""
    config = load_run_config(run_dir / "config.yaml")
    screens, prompt = config.env.inline_max_bytes, config.rollout.prompt_images.inline_max_bytes
    return (UNBOUNDED if screens is None else screens, UNBOUNDED if prompt is None else prompt)


def stored_trajectories(run_dir: Path, limit: int | None = None) -> list[Trajectory]:
    """The run's stored trajectories (every image by reference), in order of finish; the first ``limit``."""
    con = sqlite3.connect(f"file:{run_dir / 'data.sqlite3'}?mode=ro", uri=True)
    try:
        uris = [r[0] for r in con.execute("SELECT blob_uri FROM trajectories ORDER BY finished_at")]
    finally:
        con.close()
    out = []
    for uri in uris[:limit] if limit else uris:
        store, key = resolve_uri(uri)
        with store:
            out.append(decode(store.get(key), Trajectory))
    return out


def measure(run_dir: Path, limit: int | None = None) -> dict[str, Any]:
    """The figures of the module docstring for the run in ``run_dir``."""
    trajectories = stored_trajectories(run_dir, limit)
    if not trajectories:
        raise SystemExit(f"no stored trajectory in {run_dir}")
    thresholds = thresholds_of(run_dir)
    images = Images()
    rows = [forms(t, images, thresholds) for t in trajectories]
    out: dict[str, Any] = {"run_dir": str(run_dir), "trajectories": len(rows), "bus_limit_bytes": BUS_LIMIT_BYTES}
    for form in rows[0]:
        sizes = [r[form] for r in rows]
        out[form] = {
            "mean_bytes": round(statistics.fmean(sizes)),
            "max_bytes": max(sizes),
            "over_bus_limit": sum(s > BUS_LIMIT_BYTES for s in sizes),
        }
    out["mean_steps"] = round(statistics.fmean(len(t.steps) for t in trajectories), 2)
    out["max_prompt_images_per_step"] = max((len(s.prompt_images) for t in trajectories for s in t.steps), default=0)
    out["distinct_images_read"] = images.read
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--limit", type=int, default=None, help="read only the first N stored trajectories")
    args = parser.parse_args()
    result = measure(args.run_dir, args.limit)
    for form in ("by_reference", "prompt_images_inline", "all_inline"):
        f = result[form]
        print(
            f"{form}: mean {f['mean_bytes']:,} B, largest {f['max_bytes']:,} B per trajectory, "
            f"{f['over_bus_limit']} of {result['trajectories']} over the bus limit"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
