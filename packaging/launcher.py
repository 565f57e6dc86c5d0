"""Entry point of the packaged (PyInstaller) build."""
import sys

from larql_desktop.cli import main

if __name__ == "__main__":
    sys.exit(main())
