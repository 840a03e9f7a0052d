import sys

from nexus.cli import main

sys.exit(main())
