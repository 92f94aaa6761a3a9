"""The `normtune` commands, one module each; `cli.py` registers them on the Typer app, `common.py` holds the
options they share and their one-line error handling."""
