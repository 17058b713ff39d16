import sys

from undying.cli.main import main

sys.exit(main())
