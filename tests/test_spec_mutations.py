"""The specs are load-bearing: every single-transition mutation of every spec (delete it,
redirect its destination, swap its guards), installed in place of the real spec, is caught by
the spec validator, a scenario (shared and own, in process on virtual time), a scenario that
never ends, or the direct tests of the breaker and the walk (test_health.py, test_walk.py). tests/spec_mutations.py generates and applies them.

`make test` runs a deterministic sample; `make fuzz` runs all of them (about 400, well under a
minute in process). None may survive: a survivor is a transition whose change nothing observes,
so the diagram would not be what runs; the answer is a scenario or a test that observes it.
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

MUTATIONS = all_mutations()
SAMPLE = random.Random(14).sample(MUTATIONS, 40)


@pytest.mark.parametrize("mutation", SAMPLE, ids=str)
def test_a_sample_of_spec_mutations_is_caught(mutation):
    assert caught_by(mutation, CHECKS) is not None, f"{mutation} survives: no scenario, test or validator observes it"


@pytest.mark.fuzz
@pytest.mark.skipif(os.environ.get("HYPOTHESIS_PROFILE") != "fuzz", reason="the full sweep runs under make fuzz")
def test_every_spec_mutation_is_caught():
    survivors = []
    for mutation in MUTATIONS:
        if caught_by(mutation, CHECKS) is None:
            survivors.append(str(mutation))
    assert not survivors, f"{len(survivors)} of {len(MUTATIONS)} mutations survive: {survivors}"
