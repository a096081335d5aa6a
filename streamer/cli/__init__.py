"""The `streamer` command: one module per subcommand; main.py parses and dispatches."""
