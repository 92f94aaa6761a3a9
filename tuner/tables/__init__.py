"""The table lifecycle: fit rules to the store's measurements (`fit`), write and check `configs/*.json` (`emit`,
`emit_notes`, `incumbent`), re-measure close calls (`remeasure`), and check a table against the default on
fresh and held-out shapes (`compare`, `validate`, `heldout`)."""
