import pytest
import torch

from mpzero import testing

torch.set_num_threads(1)


def pytest_sessionfinish(session, exitstatus):
    testing.close_worlds()


@pytest.fixture
def world():
    """``world(size, fn, *args, **kwargs)`` runs ``fn`` on a cached gloo world of ``size`` ranks."""
    return testing.run_on_world
