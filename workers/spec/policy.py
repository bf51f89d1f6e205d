"""When speculation pays, and per-group speculation figures.

Drafting costs a proposer pass plus k extra positions in the target's forward.
That is nearly free while decoding is memory-bound (small batches) and pure waste
once the batch is large enough to be compute-bound, or for a request whose drafts
keep being rejected. So:
  - no drafts in a step whose running batch exceeds `disable_batch_size`;
  - a request whose acceptance rate stays below `min_acceptance` after
    `min_proposals` drafted tokens stops being drafted for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.workers.core.request import Request


@dataclass
class SpecStats:
    num_steps_with_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verifications: int = 0  # request-steps that verified drafts

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verifying request-step: accepted drafts + the bonus token."""
        if not self.num_verifications:
            return 0.0
        return (self.num_accepted_tokens + self.num_verifications) / self.num_verifications


@dataclass
class SpeculationPolicy:
    disable_batch_size: int = 16
    min_acceptance: float = 0.2
    min_proposals: int = 16
    stats: SpecStats = field(default_factory=SpecStats)
    _per_request: dict[str, list[int]] = field(default_factory=dict)  # id -> [drafted, accepted]
    switched_off: bool = False  # the last step's batch was too large to draft for

    def candidates(self, running: list[Request]) -> list[Request]:
        self.switched_off = len(running) > self.disable_batch_size
        if self.switched_off:
            return []
        out = []
        for req in running:
            if req.is_prefill or not req.sampling_params.use_speculation:
                continue
            drafted, accepted = self._per_request.get(req.request_id, (0, 0))
            if drafted >= self.min_proposals and accepted < self.min_acceptance * drafted:
                continue  # drafts for this request keep missing
            out.append(req)
        return out

    def record(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        counts = self._per_request.setdefault(req_id, [0, 0])
        counts[0] += num_drafted
        counts[1] += num_accepted
        self.stats.num_draft_tokens += num_drafted
        self.stats.num_accepted_tokens += num_accepted
        self.stats.num_verifications += 1

    def figures(self) -> dict[str, float]:
        """Speculation's figures for the engine's stats."""
        return {"spec_num_draft_tokens": self.stats.num_draft_tokens,
                "spec_num_accepted_tokens": self.stats.num_accepted_tokens,
                "spec_acceptance_rate": self.stats.acceptance_rate,
                "spec_mean_accepted_length": self.stats.mean_accepted_length}

    def forget(self, req_id: str) -> tuple[int, int]:
        """Drop a finished request; returns its (drafted, accepted) token counts."""
        drafted, accepted = self._per_request.pop(req_id, (0, 0))
        return drafted, accepted
