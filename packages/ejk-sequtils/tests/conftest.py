"""Shared fixtures."""

import jaxtyping
import pytest


@pytest.fixture
def no_shape_checks():
    """Switch jaxtyping's runtime checks off for one test.

    The test run checks annotations at every call, which rejects a wrongly shaped
    argument before the function's own validation runs; tests of that validation
    (the message a user without the checks sees) use this fixture.
    """
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)
