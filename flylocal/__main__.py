import sys

from flylocal.launch import main

sys.exit(main())
