"""The gateway tests' own fixtures."""

import pytest

from helpers import fresh_upstream


@pytest.fixture
def upstream(gw):
    """The recording upstream behind the module's `gw` (a `recording_gateway`), fresh for each
    test. A module whose `gw` is of another kind defines its own `upstream`."""
    return fresh_upstream(gw)
