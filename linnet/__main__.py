import sys

from linnet.cli import main

sys.exit(main())
