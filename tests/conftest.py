import logging

import pytest

from ncclguard.config import configure, get_config


@pytest.fixture(autouse=True)
def _fresh_config():
    """Each test starts from the configuration in force before it, whatever it configured."""
    saved = get_config().model_dump()
    yield
    configure(**saved)
    logging.getLogger("ncclguard").handlers.clear()
