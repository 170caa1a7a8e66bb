import sys

from flylocal.cli import main

sys.exit(main())
