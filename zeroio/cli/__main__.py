import sys

from zeroio.cli.main import main

sys.exit(main())
