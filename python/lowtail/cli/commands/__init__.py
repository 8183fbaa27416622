"""Subcommands of ``lowtail``: each module's ``register(subparsers)`` adds its own."""
