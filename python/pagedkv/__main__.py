"""``python -m pagedkv``: the same command line as the ``pagedkv`` console script."""

import sys

from .cli import main

sys.exit(main())
