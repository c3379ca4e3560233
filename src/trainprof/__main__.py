"""``python -m trainprof`` is the ``trainprof`` command."""

import sys

from trainprof.cli import main

sys.exit(main())
