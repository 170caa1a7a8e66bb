import sys

from flylocal.front.cli import main

sys.exit(main())
