"""`python -m streamer` is the `streamer` command."""
import sys

from streamer.cli.launch import main

sys.exit(main())
