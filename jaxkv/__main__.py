import sys

from jaxkv.cli import main

sys.exit(main())
