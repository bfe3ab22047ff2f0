import sys

from ropelab.cli import main

sys.exit(main())
