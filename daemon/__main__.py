import sys

from loadmesh.daemon.cli import main

sys.exit(main())
