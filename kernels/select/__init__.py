"""Which backward config runs a problem: the table files (`tables`), the chain of tables a device uses
(`table_chain`), a rule's config made to run another shape or dtype (`adapt`), and the selection (`select`: an
explicit config → a table → the analytic default). It reads the values and the strategies; the call path (`api/`)
reads it. `from normtune.kernels.select import select_config` keeps working (the selection's public names)."""

from .select import Explanation, clear_caches, explain, resolve_config, select_config

__all__ = ["Explanation", "clear_caches", "explain", "resolve_config", "select_config"]
