import sys

from larql_desktop.cli import main

sys.exit(main())
