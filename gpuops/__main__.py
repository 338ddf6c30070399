import sys

from gpuops.cli import main

sys.exit(main())
