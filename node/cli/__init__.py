"""The `node` command line: typer options, data preparation commands and pre-flight checks."""

import typer


def command_group(name: str, help: str) -> typer.Typer:
    """A typer group with the settings every ``node`` group shares: plain click help (wraps text and never
    cuts a flag or variable name at 80 columns), no completion installer, no pretty tracebacks."""
    return typer.Typer(name=name, help=help, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                       rich_markup_mode=None)


def env_var(name: str) -> str:
    """The environment variable that sets option ``name`` (``LOCOMESH_<NAME>``)."""
    return "LOCOMESH_" + name.upper()
