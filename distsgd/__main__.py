import sys

from distsgd.cli import main

sys.exit(main())
