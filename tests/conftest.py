import logging
import sys
from pathlib import Path

import pytest

from ncclguard.config import configure, get_config

# Worker scripts and the fixtures they share (the reference trainer, synthetic Qwen2.5-VL data)
# live in tests/workers, importable by top-level name, as the ranks import them.
sys.path.insert(0, str(Path(__file__).parent / "workers"))

from netns import pair  # noqa: F401 - the two-host fixture of the netns tests


@pytest.fixture(autouse=True)
def _fresh_config():
    """Each test starts from the configuration in force before it, whatever it configured."""
    saved = get_config().model_dump()
    yield
    configure(**saved)
    logging.getLogger("ncclguard").handlers.clear()
