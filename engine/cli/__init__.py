"""The `deskfleet` command line and its engine subcommands."""
