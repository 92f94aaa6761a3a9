"""`normtune tune`: the whole table round in one command, from a bare GPU to a validated, gated table.

One job per module: `plan` (the problems a tune fits and the name that ties it to its database rows), `unseen`
(the held-out shapes it generates to validate on), `journal` (its decisions, kept in the database), `clock`
(the time budget and each phase's share), `context` (what the phases share), `sweeping` (the one call into the
sweep engine), `rounds` (where the next trials go), `warm` (seeds from another table, `--from`), `emission`
(neighbour re-measurement and fitting), `checking` (validation on the held-out shapes), `resweep` (where to sweep
again after a validation), `gate` (no shape slower than the default or the incumbent), `driver` (the phases, in
order, each continued from what the database holds), `finish` (the table to ship, gated and written), `display`
(the live progress line), `report` (report.md and its plots), `runner` (one run of the command).

The held-out preset of `tuner/shapes.py` is never used here: it is kept for measuring a tuned table afterwards.
Nothing else in the tuner imports this package: it sits on top of the sweep, the tables and the store.
"""
