"""The ``parsim`` command line: one module per subcommand."""
