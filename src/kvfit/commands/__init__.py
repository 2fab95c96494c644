"""One module per `kvfit` subcommand: each has register(subparsers) and a run(args)."""
