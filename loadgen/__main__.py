import sys

from loadgen.cli import main

sys.exit(main())
