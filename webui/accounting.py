"""In-memory request accounting for this web UI process (the tracker keeps the ledger)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

COMPLETED = "completed"  # the fabric sent its done event
FAILED = "failed"  # the fabric raised an error
CANCELLED = "cancelled"  # the HTTP client went away before done


@dataclass
class UsageTotals:
    requests: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, outcome: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.requests += 1
        setattr(self, outcome, getattr(self, outcome) + 1)
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens


class Accounting:
    """Totals per model and overall; one ``record`` per generation request."""

    def __init__(self) -> None:
        self.total = UsageTotals()
        self.models: dict[str, UsageTotals] = {}

    def record(self, model: str, outcome: str, *, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        if outcome not in (COMPLETED, FAILED, CANCELLED):
            raise ValueError(f"unknown outcome {outcome!r}")
        self.total.add(outcome, prompt_tokens, completion_tokens)
        self.models.setdefault(model, UsageTotals()).add(outcome, prompt_tokens, completion_tokens)

    def snapshot(self) -> dict:
        """``{"total": {...}, "models": {model: {...}}}`` as plain JSON-ready dicts."""
        return {"total": dataclasses.asdict(self.total),
                "models": {m: dataclasses.asdict(t) for m, t in self.models.items()}}
