"""`python -m streamer` is the `streamer` command."""
import sys

from streamer.cli.main import main

sys.exit(main())
