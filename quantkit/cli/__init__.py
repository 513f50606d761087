"""The Typer command-line interface: parse flags, call :mod:`quantkit.api`, render the result."""
