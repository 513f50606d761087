"""``python -m quantkit`` runs the CLI."""

from quantkit.cli.main import main

main()
