"""The text of response tokens, for the log-prob heat map: the policy's own tokenizer, read from its checkpoint.

The checkpoint is the one the run's config names (``rollout.engine.model_path``, else ``train.model_path``),
found where it is now: a run directory that moved has its paths under the old location mapped onto the new
one. Loaded once, on the first trajectory page that needs it. Where no tokenizer can be read (a deployment
whose checkpoint is inside its containers, a path that is gone), the heat map shows token ids and says why.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any


class TokenText:
    """Decodes token ids one by one with the run's tokenizer, or says why it cannot.

    Attributes:
        path: The checkpoint directory (None when the config names none).
        problem: Why tokens are shown as ids (empty while the tokenizer loads or when it loaded).
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.problem = "" if path is not None else "the run's config names no policy checkpoint"
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def texts(self, token_ids: list[int]) -> list[str] | None:
        """Each token's text (special tokens included), or None when no tokenizer can be read."""
        tokenizer = self._load()
        if tokenizer is None:
            return None
        return [tokenizer.decode([token_id], skip_special_tokens=False) for token_id in token_ids]

    def _load(self) -> Any:
        with self._lock:
            if self._tokenizer is None and not self.problem and self.path is not None:
                from dart.policy.loading import load_tokenizer

                try:
                    self._tokenizer = load_tokenizer(self.path)
                except (OSError, ValueError) as exc:
                    self.problem = f"its tokenizer at {self.path} cannot be read here ({exc})"
            return self._tokenizer


def policy_checkpoint(raw: dict[str, Any], run_dir: Path | None) -> Path | None:
    """The checkpoint a run config names, mapped into ``run_dir`` when the run directory has moved."""
    rollout = raw.get("rollout") or {}
    engine = rollout.get("engine") or {} if isinstance(rollout, dict) else {}
    train = raw.get("train") or {}
    named = (engine.get("model_path") if isinstance(engine, dict) else None) or (
        train.get("model_path") if isinstance(train, dict) else None
    )
    if not named:
        return None
    path = Path(str(named))
    recorded = (raw.get("run") or {}).get("run_dir")
    if run_dir is not None and recorded and not path.exists():
        try:
            return run_dir / path.relative_to(str(recorded))
        except ValueError:
            pass
    return path
