"""The ``rankscope`` command: thin subcommands that call into the other parts."""
