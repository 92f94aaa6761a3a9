"""Upkeep of a results database: drop the Optuna studies no sweep can open any more (`superseded_studies`), and
write the kept subset that ships as `results.db` (`kept_subset`)."""
