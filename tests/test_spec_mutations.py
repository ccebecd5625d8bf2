"""The specs are load-bearing: every single-transition mutation of every spec (delete it,
redirect its destination, swap its guards), installed in place of the real spec, is caught by
the spec validator, a scenario (shared and own, in process on virtual time), a scenario that
never ends, or the direct tests of the breaker and the walk (test_health.py, test_walk.py). tests/spec_mutations.py generates and applies them.

`make test` runs a deterministic sample and the known survivors; `make fuzz` runs all of them
(about 400, well under a minute in process). A survivor is a transition whose change nothing
observes: each is listed below with why, and the list may only shrink (a listed mutation that
is now caught fails the test until it is removed from the list).
"""

from __future__ import annotations

import os
import random

import pytest
import test_health
import test_walk
from spec_mutations import all_mutations, caught_by

# direct tests of the machines, run against each mutant too (plain functions: they fail by raising)
CHECKS = tuple(getattr(module, name) for module in (test_health, test_walk)
               for name in sorted(dir(module)) if name.startswith("test_"))

# str(mutation) -> why nothing observes it
KNOWN_SURVIVORS: dict[str, str] = {}

MUTATIONS = all_mutations()
SAMPLE = random.Random(14).sample(MUTATIONS, 40)


def _check(mutation) -> None:
    by = caught_by(mutation, CHECKS)
    if str(mutation) in KNOWN_SURVIVORS:
        assert by is None, f"{mutation} is caught now (by {by}): remove it from KNOWN_SURVIVORS"
    else:
        assert by is not None, f"{mutation} survives: no scenario, test or validator observes it"


@pytest.mark.parametrize("mutation", SAMPLE, ids=str)
def test_a_sample_of_spec_mutations_is_caught(mutation):
    _check(mutation)


@pytest.mark.parametrize("name", sorted(KNOWN_SURVIVORS))
def test_the_known_survivors_are_current(name):
    mutation = next(m for m in MUTATIONS if str(m) == name)
    _check(mutation)


@pytest.mark.fuzz
@pytest.mark.skipif(os.environ.get("HYPOTHESIS_PROFILE") != "fuzz", reason="the full sweep runs under make fuzz")
def test_every_spec_mutation_is_caught():
    survivors = []
    for mutation in MUTATIONS:
        by = caught_by(mutation, CHECKS)
        if by is None and str(mutation) not in KNOWN_SURVIVORS:
            survivors.append(str(mutation))
    assert not survivors, f"{len(survivors)} of {len(MUTATIONS)} mutations survive: {survivors}"
