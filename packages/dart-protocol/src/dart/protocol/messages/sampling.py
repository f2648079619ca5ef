"""How a policy's tokens are drawn: the sampling settings a work item carries, and what a step records.

One object owns the sampling distribution from end to end: the data manager puts a :class:`Sampling` on
every work item (its ``data.emission.sampling``; an evaluation request carries its own), the rollout
engine samples with exactly that, and each step records the :class:`SamplingParams` it was drawn under
(the same settings plus the tokens the engine excludes), which the trainer reads back when it recomputes
log-probs. No service reads another's config to learn the distribution.
"""

from __future__ import annotations

from pydantic import Field

from dart.protocol.messages.base import NonNegFloat, TokenId, Value


class Sampling(Value):
    """The sampling settings of a request: temperature and nucleus.

    The distribution at each position is ``softmax(logits / temperature)`` restricted to the smallest set
    of most likely tokens whose mass reaches ``top_p``, renormalized. Temperature 0 is greedy (the argmax;
    ``top_p`` plays no part).
    """

    temperature: NonNegFloat = Field(default=1.0, le=10.0)
    """Sampling temperature; 0 is greedy."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus mass; 1 keeps the whole distribution."""


class SamplingParams(Sampling):
    """How a response's tokens were drawn: the behaviour distribution the recorded log-probs belong to.

    The behaviour distribution at each position is ``softmax(logits / temperature)`` with
    ``excluded_token_ids`` removed, then restricted to the smallest set of most likely tokens whose
    mass reaches ``top_p`` and renormalized. The trainer recomputes log-probs of the same
    distribution (same temperature, exclusions and nucleus rule) so importance weights compare like
    with like. Greedy steps (temperature 0) record the log-probs of the temperature-1 distribution with
    ``excluded_token_ids`` removed, and ``top_p`` 1.
    """

    excluded_token_ids: list[TokenId] = Field(default_factory=list, max_length=1024)
    """Token ids that could never be sampled (vision placeholders, a new turn), masked before sampling."""

    @classmethod
    def drawn(cls, sampling: Sampling, excluded_token_ids: list[int]) -> SamplingParams:
        """What an engine that sampled under ``sampling`` with ``excluded_token_ids`` masked records."""
        greedy = sampling.temperature == 0
        return cls(
            temperature=sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,  # greedy: no nucleus was applied
            excluded_token_ids=list(excluded_token_ids),
        )
