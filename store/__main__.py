"""`python -m store`: the store's command line (store/cli.py)."""
import sys

from store.cli import main

sys.exit(main())
