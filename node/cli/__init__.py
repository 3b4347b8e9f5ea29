"""The `node` command line: typer options, data preparation commands and pre-flight checks."""
