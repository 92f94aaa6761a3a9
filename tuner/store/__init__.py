"""The results database: the `Store` (runs, problems, measurements, peer results), its SQLAlchemy models, the
schema check and in-place upgrades, and the coordination of concurrent sweep workers (heartbeats, trial slots)."""

from .database import Store  # noqa: F401 - the package's entry point
from .models import StoreError  # noqa: F401
