"""Effort routing: a deterministic estimate of how hard a turn is, and who owns the route.

The estimator reads the turn text and nothing else (no model call, no clock, no randomness), so
the same text always routes the same way and an operator can predict it with `relayline plan
--text`. Its telemetry (`EffortDecision.features`) holds counts only, never prompt text.

Features and points (the score is their sum):
- words: > 40: +1, > 120: +2, > 400: +3 (long asks tend to be multi-part)
- code: one or more fenced code blocks: +2
- reasoning terms (analyze, prove, design, refactor, debug, optimize, trade-off, ...): +1 each,
  at most +4 (four such asks make a turn complex on their own)
- lines: more than 20: +1
- questions: three or more question marks: +1
- constraints (must, should, without, ensure, at least, at most): three or more: +1

Levels: score <= 1 is simple, 2-3 standard, >= 4 complex. Simple and standard select the local
hint; complex selects the cloud hint when escalation = "auto" (else local).
"""

from __future__ import annotations

import re
from typing import Literal

import attrs

from .config import Config

Level = Literal["simple", "standard", "complex"]

REASONING_TERMS = frozenset(
    "analyze analyse analysis prove proof derive design architecture architect refactor debug "
    "optimize optimise compare tradeoff trade-off tradeoffs algorithm complexity strategy "
    "step-by-step reason evaluate critique migrate benchmark".split()
)
CONSTRAINT_TERMS = ("must", "should", "without", "ensure", "at least", "at most")
_WORD = re.compile(r"[A-Za-z][A-Za-z'-]*")

SIMPLE_MAX = 1
STANDARD_MAX = 3


@attrs.frozen
class EffortDecision:
    level: Level
    hint: str
    score: int
    features: dict[str, int]  # counts only: safe to log

    def as_json(self) -> dict[str, object]:
        return {"level": self.level, "hint": self.hint, "score": self.score,
                "features": dict(self.features)}


def estimate(text: str) -> tuple[Level, int, dict[str, int]]:
    lowered = text.lower()
    words = _WORD.findall(lowered)
    features = {
        "words": len(text.split()),
        "lines": text.count("\n") + 1 if text else 0,
        "code_blocks": text.count("```") // 2,
        "reasoning_terms": sum(1 for w in words if w in REASONING_TERMS),
        "questions": text.count("?"),
        "constraints": sum(len(re.findall(rf"\b{re.escape(t)}\b", lowered))
                           for t in CONSTRAINT_TERMS),
    }
    n = features["words"]
    score = 3 if n > 400 else 2 if n > 120 else 1 if n > 40 else 0
    score += 2 if features["code_blocks"] else 0
    score += min(features["reasoning_terms"], 4)
    score += 1 if features["lines"] > 20 else 0
    score += 1 if features["questions"] >= 3 else 0
    score += 1 if features["constraints"] >= 3 else 0
    level: Level = ("simple" if score <= SIMPLE_MAX else "standard" if score <= STANDARD_MAX
                    else "complex")
    return level, score, features


def decide(config: Config, text: str) -> EffortDecision | None:
    """The effort decision for a turn, or None when effort routing is not configured."""
    routing = config.effort_routing
    if routing is None:
        return None
    level, score, features = estimate(text)
    cloud = level == "complex" and routing.escalation == "auto"
    return EffortDecision(level=level, hint=routing.cloud_hint if cloud else routing.local_hint,
                          score=score, features=features)


def allowlist(config: Config, decision: EffortDecision | None) -> frozenset[str] | None:
    """The profiles a turn may use. A local decision may only use local profiles, whatever the
    fallback graph says; a cloud decision may use local and cloud profiles. None: unrestricted."""
    if decision is None:
        return None
    routing = config.effort_routing
    if routing is not None and decision.hint == routing.local_hint:
        return frozenset(a for a, p in config.providers.items() if p.locality == "local")
    return frozenset(a for a, p in config.providers.items() if p.locality in ("local", "cloud"))


@attrs.frozen
class RouteSelection:
    """Who owns the route at a scope (a conversation, a channel): automatic effort routing or the
    operator. `model` is the active model at that scope, if any.

    An explicit operator selection disables effort routing at its scope; selecting "auto" gives
    it back. A model-emitted model_switch changes the active model but never the owner.
    """

    owner: Literal["auto", "operator"] = "auto"
    model: str | None = None

    def select(self, model: str) -> RouteSelection:
        if model == "auto":
            return RouteSelection("auto", None)
        return RouteSelection("operator", model)

    def model_switch(self, model: str) -> RouteSelection:
        return attrs.evolve(self, model=model)
