"""normtune tuning service: measurement, search, storage, tables and reports."""
